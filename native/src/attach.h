/*
 * An attachment's life (attach.c): joining the region's registry with
 * everything that goes with it, and leaving it.
 */
#ifndef IVSHM_ATTACH_H
#define IVSHM_ATTACH_H

#include "attachment.h"

/* Join the registry of a mapped region (ivshm_region_map) as cfg's (job,
   rank), reachable through `doorbell_id` of kind `backend` (DB_*): the
   settings from the environment, a free slot claimed (dead peers reaped
   if there is none), our views of every peer and our receive area
   emptied, then the slot published ACTIVE. 0, -ENAMETOOLONG, -EEXIST (a
   live duplicate of the pair), IVSHM_EFULL. */
IVSHM_INTERNAL int ivshm_join(ivshm *h, const ivshm_config *cfg,
                              int32_t doorbell_id, int backend);

#endif
