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
#include "ring.h"

#include "clock.h"

/* While streaming a large message, ring a sleeping receiver at least
   every this many fragments instead of only when we run out of space. */
#define KICK_EVERY 8

/* ------------------------------------------------------------------ */
/* producer (its hot path is in ring.h)                               */
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
   (ivshm_ring_heal), or forged the tail itself. Publishing below the tail
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
   as forgeries or is shown our head (ivshm_ring_heal), so the pair gets
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
   the consumer's repairs (ivshm_ring_heal) work from it, and an idle
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
       has read what we published, ivshm_ring_heal). */
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
   notices, ivshm_ring_heal). The shared tail is loaded once into `tail`;
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
   `sleeping`. */
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

/* ------------------------------------------------------------------ */
/* consumer (its hot path is in ring.h)                               */
/* ------------------------------------------------------------------ */

/* What one co-tenant write can leave in `slot`'s fast ring (a live
   sender we read from), repaired by the producer's `head` (stored with
   release after the publication of every position below it). Off the
   hot paths: it costs a load of the producer's line, which would bounce
   on every message. Two repairs:
   - A message hidden: a co-tenant rewrote the seq of a slot the
     producer had published, so the slot looks empty, we wait at it for
     good and the producer, once the ring is full, too. When the head
     says our position is published, a seq loaded after it must say
     "full" unless somebody else wrote it, and we put that value back
     (the header and payload are then validated as for any slot). A
     forged head makes us take what lies in a slot the producer has not
     written yet: a stale or half-written message, reported or delivered
     as a forgery would be, and the producer follows our tail
     (tail_ahead).
   - Messages overwritten: a head more than a ring ahead of us means the
     producer believed a tail written forward by a co-tenant and wrote
     over positions we had not read (an honest producer never gets that
     far ahead), if the slot at our position holds such a later lap.
     Those are gone: we go on from head - ring_slots, the oldest
     position the ring can still hold, and the caller reports them
     (ivshm_rx_lost: the next receive from that sender returns
     IVSHM_ECORRUPT for them, a message of theirs in progress goes too;
     counted in stats.dropped). A forged head makes us skip what we had
     not read, and the producer then follows our tail.
   Not while a peeked message lies at our position (its pointer must
   stay good). True if it skipped. */
bool ivshm_ring_heal(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)p->rx_ring;
    uint64_t pos = p->rx_tail;
    uint64_t head = atomic_load_explicit(&ctrl->head, memory_order_acquire);
    if (head <= pos || p->peeked)
        return false;
    bool skipped = false;
    if (head - pos > h->ring_slots) {
        if (head - pos > RING_JUMP_MAX)
            return false;
        /* Evidence beyond the head, which a co-tenant can forge and a
           sender that passed its checks before this ring was reset for
           us (descheduled across our incarnation) can store stale: the
           slot at our position holds a later lap, below the head.
           Without it, no jump (a hidden slot is still shown below). */
        uint64_t lap = atomic_load_explicit(
            &slot_at(h, p->rx_ring, pos)->seq, memory_order_acquire);
        if (lap <= pos + 1 || lap > head || (lap - 1 - pos) % h->ring_slots)
            goto heal_hidden;
        uint64_t to = head - h->ring_slots;
        h->stats.dropped += to - pos;
        p->rx_tail = pos = to;
        atomic_store_explicit(&ctrl->tail, to, memory_order_release);
        ivshm_kick(h, slot);
        skipped = true;
    }
heal_hidden:;
    struct ivshm_slot *s = slot_at(h, p->rx_ring, pos);
    uint64_t seq = atomic_load_explicit(&s->seq, memory_order_acquire);
    if (seq != pos + 1)
        atomic_compare_exchange_strong(&s->seq, &seq, pos + 1);
    return skipped;
}

/* The repair of a hidden message (ivshm_ring_heal) for a sender that
   left: so that what it sent before it left is still delivered. False
   if the position was not published (or a co-tenant's head says so: we
   then take what lies there, validated, as for a live sender). */
bool ivshm_ring_unhide_gone(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)p->rx_ring;
    const uint64_t pos = p->rx_tail;
    uint64_t head = atomic_load_explicit(&ctrl->head, memory_order_acquire);
    if (head <= pos || head - pos > h->ring_slots)
        return false;
    struct ivshm_slot *s = slot_at(h, p->rx_ring, pos);
    uint64_t seq = atomic_load_explicit(&s->seq, memory_order_acquire);
    return seq == pos + 1 ||
           atomic_compare_exchange_strong(&s->seq, &seq, pos + 1);
}

void ivshm_ring_reset(ivshm *h, uint8_t *ring)
{
    struct ivshm_ring_ctrl *c = (struct ivshm_ring_ctrl *)ring;
    atomic_store_explicit(&c->head, 0, memory_order_relaxed);
    atomic_store_explicit(&c->tail, 0, memory_order_relaxed);
    for (uint32_t i = 0; i < h->ring_slots; i++)
        atomic_store_explicit(&slot_at(h, ring, i)->seq, 0,
                              memory_order_relaxed);
}
