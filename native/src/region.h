/*
 * The region as a whole: its layout computed from the geometry,
 * formatting, and mapping with validation (docs/region-layout.md). A
 * mapped region gives a handle with no registry slot yet (self = -1).
 */
#ifndef IVSHM_REGION_H
#define IVSHM_REGION_H

#include "attachment.h"

/* ivshm_format for memory known to be all zero (a file or memfd just
   grown from empty): the receive areas are not written, so a large
   region's pages are only allocated as peers use them. */
IVSHM_INTERNAL int ivshm_format_fresh(void *base, uint64_t size,
                                      const ivshm_geometry *g);
/* Map `fd` (size from fstat), validate the header, copy the geometry
   into a new handle with no registry slot (self = -1). Used by the
   attach paths and by the server. Owns `fd` on success. */
IVSHM_INTERNAL int ivshm_region_map(int fd, ivshm **out);
/* The same, formatting a blank region first (IVSHM_F_FORMAT). */
IVSHM_INTERNAL int ivshm_region_map_or_format(int fd, ivshm **out);
/* Unmap, close the fd and free the handle (local memory only). */
IVSHM_INTERNAL void ivshm_region_unmap(ivshm *h);

#endif
