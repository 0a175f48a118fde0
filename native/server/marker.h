/*
 * Marking leavers' registry entries DEAD, off the event loop
 * (docs/server-protocol.md, "Leaving").
 *
 * ivshm_admin_mark_dead costs what the leaver's co-tenants wrote into
 * the region: every registry entry carrying its id is marked, and each
 * mark clears the leaver from every window (up to max_peers x
 * max_windows x max_peers atomic operations per leave). The event loop
 * only queues the id (O(1)); one thread at a lower priority marks, in
 * queue order, and reports each id back through an eventfd, so accepting
 * and greeting clients never waits for it.
 */
#ifndef IVS_MARKER_H
#define IVS_MARKER_H

#include "ivshm_admin.h"

#include <stddef.h>
#include <stdint.h>

struct ivs_marker;

struct ivs_marked {
    int32_t id;
    int entries; /* registry entries marked DEAD */
};

/* Start the thread for `region` (not owned); at most `capacity` ids are
   ever queued or done-but-unread at once (the id space). 0 or -errno. */
int ivs_marker_start(ivshm_admin *region, uint32_t capacity,
                     struct ivs_marker **out);
/* Readable while marked ids wait to be read with ivs_marker_done. */
int ivs_marker_fd(const struct ivs_marker *m);
/* Queue `id` (a client that left). */
void ivs_marker_push(struct ivs_marker *m, int32_t id);
/* Up to `cap` ids whose marking is done, in queue order. */
size_t ivs_marker_done(struct ivs_marker *m, struct ivs_marked *out,
                       size_t cap);
/* Mark what is still queued, then stop the thread and free. NULL is
   ignored. */
void ivs_marker_stop(struct ivs_marker *m);

#endif
