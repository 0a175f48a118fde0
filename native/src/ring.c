/*
 * Fast rings (the pair rings of layout v1). Positions are 64-bit counters
 * that never wrap in practice; position p lives in slot p & (ring_slots-1).
 *  - The producer keeps its head in local memory (peers[j].tx_head) and
 *    may write position p once p - tail < ring_slots. It reads the
 *    consumer's tail (acquire) only when its cached copy says "full".
 *  - A slot is published by the release store seq = p + 1, after its
 *    header and payload. The consumer polls the seq of the slot at its own
 *    position, so an 8-byte message costs one cache-line transfer and no
 *    shared index is touched on the fast path.
 *  - The consumer keeps its tail locally (peers[i].rx_tail) and publishes
 *    it (release) after copying a slot out: only then may the producer
 *    overwrite that slot.
 *  - A message longer than one slot's payload occupies consecutive
 *    positions FIRST..LAST. The producer streams them as space frees up
 *    while the consumer drains, so a message may be larger than the ring.
 *  - Wake-ups: after publishing, the producer kicks the consumer (a fence
 *    and a look at its `sleeping` flag); the consumer kicks the producer
 *    only when the ring was full, the one case in which it can be blocked
 *    on us.
 */
#define _GNU_SOURCE
#include "msg.h"

_Static_assert(sizeof(struct ivshm_slot) == IVSHM_SLOT_HDR,
               "slot header is IVSHM_SLOT_HDR bytes");

/* While streaming a large message, ring a sleeping receiver at least
   every this many fragments instead of only when we run out of space. */
#define KICK_EVERY 8

/* ------------------------------------------------------------------ */
/* sending on a fast ring (its hot path is in msg.h)                  */
/* ------------------------------------------------------------------ */

/* The tail failed validation. A new incarnation of the consumer resets
   it to 0 under us, which looks like garbage: tell the two apart. */
static int tail_error(ivshm *h, int slot)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE ||
        atomic_load_explicit(&e->gen, memory_order_relaxed) !=
            h->peers[slot].gen)
        return IVSHM_EPEERDEAD;
    return IVSHM_ECORRUPT;
}

/* The consumer's tail is ahead of our head: it consumed positions we
   never published. Honestly that cannot happen; it does when a co-tenant
   wrote "full" into their slots before we wrote them (the consumer
   reported them as corrupt or took them as messages), forged our head
   (rx_heal_hidden), or forged the tail itself. Publishing below the tail
   would be lost, and the tail would stay ahead: every send after it
   would fail, also after the co-tenant stopped. So continue from the
   tail (the ring is empty from there) when
   - each slot of [tx_head, tail) says "full" for its position (loaded
     once each; we never wrote those values, so somebody forged them and
     the consumer may have taken them): at once;
   - or the same tail has stood for TAIL_STANDS_NS: a tail the consumer
     does not hold is put back by it within a 20 ms wait slice or its
     next receive (rx_heal_tail), so one that stands is its position (it
     may have passed forged slots whose values were rewritten since).
   A tail more than RING_JUMP_MAX ahead is never followed. Following a
   forged tail only skips positions: the consumer takes what lies there
   as forgeries or is shown our head (rx_heal_hidden), so the pair gets
   back in step either way. Only the consumer incarnation we know is
   followed (the caller checks): a new one resets the ring, and another
   sender may fill it. */
#define TAIL_STANDS_NS 200000000ull

static bool tail_ahead(ivshm *h, struct ivshm_peer_local *p,
                       struct ivshm_ring_ctrl *ctrl, uint64_t tail)
{
    uint64_t ahead = tail - p->tx_head;
    bool forged = ahead <= h->ring_slots;
    uint8_t *ring = (uint8_t *)ctrl;
    for (uint64_t pos = p->tx_head; forged && pos < tail; pos++)
        forged = atomic_load_explicit(&slot_at(h, ring, pos)->seq,
                                      memory_order_relaxed) == pos + 1;
    if (!forged) {
        uint64_t now = ivshm_now_ns();
        if (ahead > RING_JUMP_MAX)
            return false;
        if (!p->tx_odd_since || p->tx_odd_tail != tail) {
            p->tx_odd_tail = tail;
            p->tx_odd_since = now;
            return false;
        }
        if (now - p->tx_odd_since < TAIL_STANDS_NS)
            return false;
    }
    p->tx_odd_since = 0;
    p->tx_head = tail;
    p->tx_tail_cache = tail;
    return true;
}

/* The tail failed validation: reported (tail_error). To the known
   consumer we publish our head, which a co-tenant may have forged:
   the consumer's repairs (rx_heal_hidden) work from it, and an idle
   or refused sender would otherwise leave the forgery standing. */
static int tail_refused(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl)
{
    int rc = tail_error(h, slot);
    if (rc == IVSHM_ECORRUPT)
        atomic_store_explicit(&ctrl->head, h->peers[slot].tx_head,
                              memory_order_release);
    return rc;
}

/* The cached tail says "no room": load the shared one. Out of line, so
   that the repairs above do not make the fast check pay for a larger
   frame (ivshm_tx_reserve is called for every message). */
static __attribute__((noinline)) int tx_reserve_slow(
    ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl, uint64_t need)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    /* acquire: the consumer is done reading the slots it released */
    uint64_t tail = atomic_load_explicit(&ctrl->tail, memory_order_acquire);
    if (tail > p->tx_head) {
        if (tail_error(h, slot) != IVSHM_EPEERDEAD &&
            tail_ahead(h, p, ctrl, tail))
            return need <= h->ring_slots ? 0 : -EAGAIN;
        return tail_refused(h, slot, ctrl);
    }
    /* a tail at or below our head: a past sighting of one beyond it no
       longer stands (the next must stand its own 200 ms, tail_ahead) */
    p->tx_odd_since = 0;
    if (p->tx_head - tail > h->ring_slots)
        return tail_refused(h, slot, ctrl);
    /* Within one incarnation the tail only moves forward: one below what
       we saw before was rewound by somebody else (or what we saw was
       written forward: then the consumer's own tail passes it once it
       has read what we published, rx_heal_ring). */
    if (tail < p->tx_tail_cache)
        return tail_refused(h, slot, ctrl);
    p->tx_tail_cache = tail;
    return p->tx_head - tail + need <= h->ring_slots ? 0 : -EAGAIN;
}

/* Room for `need` positions from tx_head: 0, -EAGAIN, or an error.
   Invariant kept: tx_tail_cache <= tx_head and tx_head - tx_tail_cache <=
   ring_slots, so positions [tx_head, tx_tail_cache + ring_slots) hold
   nothing the consumer has yet to read -- as far as the tail tells: one
   a co-tenant wrote forward within that range cannot be told from the
   consumer's and makes us overwrite what it had not read (the consumer
   notices, rx_heal_ring). The shared tail is loaded once into `tail`;
   only that copy is checked and kept. */
int ivshm_tx_reserve(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                     uint64_t need)
{
    const struct ivshm_peer_local *p = &h->peers[slot];
    if (p->tx_head - p->tx_tail_cache + need <= h->ring_slots)
        return 0;
    return tx_reserve_slow(h, slot, ctrl, need);
}

struct space_wait {
    struct ivshm_ring_ctrl *ctrl;
    uint64_t head, need;
    uint32_t ring_slots;
};

static bool space_ready(ivshm *h, void *arg)
{
    (void)h;
    struct space_wait *w = arg;
    uint64_t tail = atomic_load_explicit(&w->ctrl->tail, memory_order_relaxed);
    /* garbage counts as ready: ivshm_tx_reserve re-reads and reports it */
    return tail > w->head || w->head - tail + w->need <= w->ring_slots;
}

/* The ring is short of `need` free positions: show the consumer what we
   have published so far (it drains while we wait: that is the
   pipelining) and wait for them until `deadline`. Ends early if the
   consumer dies; -ETIMEDOUT at the deadline, also when a co-tenant keeps
   the tail from moving (a rewound tail that still looks plausible). */
static int tx_wait_space(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                         uint64_t need, uint64_t deadline)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    atomic_store_explicit(&ctrl->head, p->tx_head, memory_order_release);
    ivshm_kick(h, slot);
    struct space_wait w = {ctrl, p->tx_head, need, h->ring_slots};
    for (;;) {
        int ms = ms_left(deadline);
        if (ms == -ETIMEDOUT)
            return ms;
        int rc = ivshm_wait(h, space_ready, &w, slot, p->gen, ms);
        if (rc < 0)
            return rc;
        rc = ivshm_tx_reserve(h, slot, ctrl, need);
        if (rc != -EAGAIN)
            return rc;
    }
}

/* A message on our fast ring to `slot`: validated arguments, the
   registry says the peer is the one we know, the cached tail says there
   is room, one slot written, one release store, a fence and a look at
   `sleeping`. timeout_ms: 0 all-or-nothing without waiting (try_send);
   -1 wait as long as the consumer lives, fragment by fragment (send);
   > 0 wait until `deadline`, for the whole message at once if it fits
   the ring. */
int ivshm_ring_send(ivshm *h, int slot, uint32_t tag, const void *buf,
                    size_t len, int timeout_ms, uint64_t deadline)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint8_t *ring = tx_ring(h, slot);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint32_t payload = slot_payload(h);
    const uint64_t nfrag = len <= payload ? 1 : (len - 1) / payload + 1;

    /* Streaming: reserve (and wait for) one position per fragment. */
    bool stream = timeout_ms < 0 || nfrag > h->ring_slots;
    if (timeout_ms == 0 && nfrag > h->ring_slots)
        return -EMSGSIZE; /* could never fit: -EAGAIN would lie */
    int rc;
    if (!stream) {
        /* All or nothing: a deadline passing leaves no trace. */
        rc = ivshm_tx_reserve(h, slot, ctrl, nfrag);
        if (rc == -EAGAIN && timeout_ms > 0)
            rc = tx_wait_space(h, slot, ctrl, nfrag, deadline);
        if (rc < 0)
            return rc;
    }

    const uint8_t *src = buf;
    size_t left = len;
    uint32_t flags = SLOT_FIRST;
    unsigned since_kick = 0;
    for (;;) {
        if (stream) {
            rc = ivshm_tx_reserve(h, slot, ctrl, 1);
            if (rc == -EAGAIN)
                rc = tx_wait_space(h, slot, ctrl, 1, deadline);
            /* Giving up mid-message leaves a truncated FIRST..; the
               receiver reports it as corrupt and keeps the next FIRST. */
            if (rc < 0)
                return rc;
        }
        uint32_t n = left < payload ? (uint32_t)left : payload;
        if (n == left)
            flags |= SLOT_LAST;
        tx_publish(h, ring, p->tx_head, tag, flags, len, src, n);
        p->tx_head++;
        left -= n;
        if (!left)
            break;
        src += n;
        flags = 0;
        if (++since_kick == KICK_EVERY) {
            since_kick = 0;
            ivshm_kick(h, slot);
        }
    }
    tx_done(h, slot, ctrl, len);
    return 0;
}
