/*
 * Our receive area as a whole (docs/region-layout.md): the queue and the
 * fast channels together, emptied when we join, swept for channels left
 * behind, searched for messages a co-tenant hid (rx_area.c).
 */
#ifndef IVSHM_RX_AREA_H
#define IVSHM_RX_AREA_H

#include "attachment.h"

/* Empty our own receive area (queue, descriptors, fast rings) while our
   slot is CLAIMING. */
IVSHM_INTERNAL void ivshm_rx_area_reset(ivshm *h);
/* Free descriptors of senders that took a channel and went away before
   using it; adopt channels of live senders whose OPEN was lost. */
IVSHM_INTERNAL void ivshm_fast_sweep(ivshm *h);
/* ivshm_ring_heal for every live sender on a fast channel of ours. */
IVSHM_INTERNAL void ivshm_rx_heal_hidden(ivshm *h);
/* Tests only (test_hostile_repair): called by the sweep between its look
   at the queue and its second one, where an honest sender's OPEN may be
   taking its queue position; NULL otherwise. Not exported by the shared
   library. */
extern IVSHM_INTERNAL void (*ivshm_sweep_test_hook)(ivshm *h);

#endif
