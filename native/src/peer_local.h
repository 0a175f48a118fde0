/*
 * What one attachment keeps about each peer, in local memory
 * (struct ivshm_peer_local, attachment.h): which incarnation of it we
 * talk to, the cells of it we took out of our queue ahead of their turn
 * (backlogs), and a message of it received in part (the stage). A new
 * incarnation of a peer resets all of it (peer_local.c).
 */
#ifndef IVSHM_PEER_LOCAL_H
#define IVSHM_PEER_LOCAL_H

#include "attachment.h"

#include <stdlib.h>

/* ---- incarnations ---- */

/* Forget everything we know about `slot` (positions, a half-received
   message, its backlog, the fast channel it used in our area, which is
   freed) and start over with generation `gen`. */
IVSHM_INTERNAL void ivshm_peer_local_reset(ivshm *h, int slot, uint32_t gen);
/* Free the local memory kept for `slot` (detach: shared memory untouched). */
IVSHM_INTERNAL void ivshm_peer_local_free(ivshm *h, int slot);

/* Is `slot` ACTIVE? On every send and receive, hence inline. A new
   incarnation emptied our rings with it at join: our view of the old
   one is reset (out of line, rare). */
static inline bool ivshm_peer_current(ivshm *h, int slot)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
        return false;
    uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (__builtin_expect(h->peers[slot].gen != gen, 0))
        ivshm_peer_local_reset(h, slot, gen);
    return true;
}

/* A sender that is not ACTIVE: RX_GONE if it left or died (what it
   published is still delivered), RX_NONE if nobody holds its slot. */
IVSHM_INTERNAL enum rx_view ivshm_rx_view_slow(ivshm *h, int slot);

/* Which incarnation of `slot` we read from: the live one on every
   message (inline), anything else out of line. */
static inline enum rx_view ivshm_rx_view(ivshm *h, int slot)
{
    return ivshm_peer_current(h, slot) ? RX_LIVE : ivshm_rx_view_slow(h, slot);
}

/* ---- backlogs ---- */

/* Append a copy of a queue cell of `src` (its header `f`, its payload
   `data`) to src's backlog: 0, -ENOBUFS at the backlogs' bound, -ENOMEM.
   A length beyond a cell's payload is kept as a marker, reported as
   corrupt when delivered. */
IVSHM_INTERNAL int ivshm_bl_push(ivshm *h, int src, const struct frag *f,
                                 const uint8_t *data);
/* Drop the oldest record of `slot`'s backlog (delivered). A record a
   peek handed out is only unlinked: ivshm_peek_end frees it. */
IVSHM_INTERNAL void ivshm_bl_pop(ivshm *h, int slot);

/* ---- what a peek handed out ---- */

/* A peek of `slot` hands out `rec` (a backlog record) or a pointer into
   the region (NULL): the record an earlier peek of it handed out is the
   caller's no more. Rare (a backlog record, or one left over): the hot
   paths test p->peek_rec first. */
IVSHM_INTERNAL void ivshm_peek_begin(struct ivshm_peer_local *p,
                                     struct ivshm_backlog *rec);
/* The caller released what the last peek of `p` handed out (or gave it
   up): a record that already left the backlog is freed. */
static inline void ivshm_peek_end(struct ivshm_peer_local *p)
{
    if (__builtin_expect(p->peek_rec != NULL, 0)) {
        if (p->peek_orphan)
            free(p->peek_rec);
        p->peek_rec = NULL;
        p->peek_orphan = false;
    }
}

/* ---- a message in progress (the stage) ---- */

/* The message in progress from `p` is given up (error, or a new
   incarnation) or complete: what was staged goes, its stream moves on.
   Inline: every completed receive ends with it. */
static inline void rx_abandon(struct ivshm_peer_local *p)
{
    free(p->rx_stage);
    p->rx_stage = NULL;
    p->rx_stage_cap = 0;
    p->rx_partial = false;
    p->rx_nomem = false;
    p->rx_lost = false;
    p->rx_kept = 0;
}

/* Messages of `p` were overwritten before we read them (ivshm_ring_heal
   skipped them): the one in progress goes too, and the next receive
   from it reports IVSHM_ECORRUPT once. */
static inline void ivshm_rx_lost(struct ivshm_peer_local *p)
{
    rx_abandon(p);
    p->rx_partial = p->rx_lost = true;
}

/* Room for `n` staged bytes (n <= rx_keep); false (and rx_nomem) when
   out of memory: the message is then drained and reported as -ENOMEM. */
IVSHM_INTERNAL bool ivshm_stage_room(struct ivshm_peer_local *p, uint64_t n);
/* Append what fits of a validated fragment to the stage. */
IVSHM_INTERNAL void ivshm_stage_append(struct ivshm_peer_local *p,
                                       const uint8_t *data, uint32_t len);

#endif
