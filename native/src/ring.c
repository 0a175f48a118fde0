/*
 * Messages: one single-producer single-consumer ring per ordered pair of
 * peers. ring(i->j) is written only by i and consumed only by j.
 *
 * Positions are 64-bit counters that never wrap in practice; position p
 * lives in slot p & (ring_slots - 1).
 *
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
 *  - A sender that left or died keeps its generation until its slot is
 *    claimed again (the claimer empties the rings), so whatever it
 *    published before going is still delivered.
 *
 * The producer may be hostile: every header field is loaded once into a
 * local copy and validated before it sizes a copy. Shared ctrl->head is
 * informational only and never read here.
 *
 * Zero-copy variants of a single-slot message: send_reserve hands out the
 * payload of the slot at tx_head (nothing moves) and send_commit publishes
 * it exactly like a copying send; recv_peek validates the slot at rx_tail
 * exactly like a copying receive and hands out its payload, recv_release
 * consumes it. Neither side keeps extra state: a reservation is "the slot
 * at tx_head while the ring has room", a peek is "the valid slot at
 * rx_tail", so misuse is caught only as far as the ring shows it.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(struct ivshm_slot) == IVSHM_SLOT_HDR,
               "slot header is IVSHM_SLOT_HDR bytes");

/* While streaming a large message, ring a sleeping receiver at least
   every this many fragments instead of only when we run out of space. */
#define KICK_EVERY 8

/* Drops of stale slots in one receive call: a producer that keeps
   writing stale slots must not hold us in the loop. */
#define MAX_DROPS_PER_CALL(h) ((h)->ring_slots)

static inline uint32_t slot_payload(const ivshm *h)
{
    return h->slot_size - IVSHM_SLOT_HDR;
}

static inline struct ivshm_slot *slot_at(const ivshm *h, uint8_t *ring,
                                         uint64_t pos)
{
    return (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                 (pos & (h->ring_slots - 1)) *
                                     (uint64_t)h->slot_size);
}

static inline uint8_t *slot_data(struct ivshm_slot *s)
{
    return (uint8_t *)s + IVSHM_SLOT_HDR;
}

/* ------------------------------------------------------------------ */
/* sending                                                            */
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

/* Room for `need` positions from tx_head: 0, -EAGAIN, or an error.
   Invariant kept: tx_tail_cache <= tx_head and tx_head - tx_tail_cache <=
   ring_slots, so positions [tx_head, tx_tail_cache + ring_slots) hold
   nothing the consumer has yet to read. The shared tail is loaded once
   into `tail`; only that copy is checked and kept. */
static int tx_reserve(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                      uint64_t need)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->tx_head - p->tx_tail_cache + need <= h->ring_slots)
        return 0;
    /* acquire: the consumer is done reading the slots it released */
    uint64_t tail = atomic_load_explicit(&ctrl->tail, memory_order_acquire);
    /* Within one incarnation the tail only moves forward: one below what
       we saw before was rewound by somebody else. */
    if (tail < p->tx_tail_cache || tail > p->tx_head ||
        p->tx_head - tail > h->ring_slots)
        return tail_error(h, slot);
    p->tx_tail_cache = tail;
    return p->tx_head - tail + need <= h->ring_slots ? 0 : -EAGAIN;
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
    /* garbage counts as ready: tx_reserve re-reads and reports it */
    return tail > w->head || w->head - tail + w->need <= w->ring_slots;
}

/* Milliseconds left until `deadline` (UINT64_MAX: -1, forever), or
   -ETIMEDOUT once it has passed. */
static int ms_left(uint64_t deadline)
{
    if (deadline == UINT64_MAX)
        return -1;
    uint64_t now = ivshm_now_ns();
    if (now >= deadline)
        return -ETIMEDOUT;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
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
    atomic_store_explicit(&ctrl->head, p->tx_head, memory_order_relaxed);
    ivshm_kick(h, slot);
    struct space_wait w = {ctrl, p->tx_head, need, h->ring_slots};
    for (;;) {
        int ms = ms_left(deadline);
        if (ms == -ETIMEDOUT)
            return ms;
        int rc = ivshm_wait(h, space_ready, &w, slot, p->gen, ms);
        if (rc < 0)
            return rc;
        rc = tx_reserve(h, slot, ctrl, need);
        if (rc != -EAGAIN)
            return rc;
    }
}

/* Fill the slot of position `pos` and publish it. The caller reserved
   the position, so the consumer is not reading this slot. src NULL: the
   payload was written in place (send_reserve). */
static inline void tx_publish(ivshm *h, uint8_t *ring, uint64_t pos,
                              uint32_t tag, uint32_t flags, uint64_t total,
                              const uint8_t *src, uint32_t n)
{
    struct ivshm_slot *s = slot_at(h, ring, pos);
    s->len = n;
    s->tag = tag;
    s->gen = h->self_gen;
    s->flags = flags;
    s->total = total;
    if (n && src)
        memcpy(slot_data(s), src, n);
    /* Publication point: everything above is visible before seq is. */
    atomic_store_explicit(&s->seq, pos + 1, memory_order_release);
}

/* Checks every send starts with. */
static int tx_begin(ivshm *h, int slot, size_t len)
{
    if (!h || h->self < 0 || !ivshm_slot_ok(h, slot) || slot == h->self)
        return -EINVAL;
    if (len > (size_t)SSIZE_MAX) /* recv reports the length as ssize_t */
        return -EMSGSIZE;
    /* also resets our positions if a new incarnation took the slot */
    if (!ivshm_peer_current(h, slot))
        return IVSHM_EPEERDEAD;
    return 0;
}

/* A whole message is out: show it and wake the consumer if it sleeps. */
static void tx_done(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                    size_t len)
{
    atomic_store_explicit(&ctrl->head, h->peers[slot].tx_head,
                          memory_order_relaxed);
    ivshm_kick(h, slot);
    h->stats.sends++;
    h->stats.bytes_sent += len;
}

/* Fast path of a small message: validated arguments, the registry says
   the peer is the one we know, the cached tail says there is room, one
   slot written, one release store, a fence and a look at `sleeping`.
   timeout_ms: 0 all-or-nothing without waiting (try_send); -1 wait as
   long as the consumer lives, fragment by fragment (send); > 0 wait at
   most that long, for the whole message at once if it fits the ring. */
static int send_msg(ivshm *h, int slot, uint32_t tag, const void *buf,
                    size_t len, int timeout_ms)
{
    if (len && !buf)
        return -EINVAL;
    int rc = tx_begin(h, slot, len);
    if (rc < 0)
        return rc;

    struct ivshm_peer_local *p = &h->peers[slot];
    p->reserved = false; /* we publish that slot: an open reservation ends */
    uint8_t *ring = ivshm_ring(h, h->self, slot);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint32_t payload = slot_payload(h);
    const uint64_t nfrag = len <= payload ? 1 : (len - 1) / payload + 1;
    /* no clock read on the try_send / send fast paths */
    const uint64_t deadline =
        timeout_ms < 0    ? UINT64_MAX
        : timeout_ms == 0 ? 0
                          : ivshm_now_ns() + (uint64_t)timeout_ms * 1000000ull;

    /* Streaming: reserve (and wait for) one position per fragment. */
    bool stream = timeout_ms < 0 || nfrag > h->ring_slots;
    if (timeout_ms == 0 && nfrag > h->ring_slots)
        return -EMSGSIZE; /* could never fit: -EAGAIN would lie */
    if (!stream) {
        /* All or nothing: a deadline passing leaves no trace. */
        rc = tx_reserve(h, slot, ctrl, nfrag);
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
            rc = tx_reserve(h, slot, ctrl, 1);
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

int ivshm_send(ivshm *h, int slot, uint32_t tag, const void *buf, size_t len)
{
    return send_msg(h, slot, tag, buf, len, -1);
}

int ivshm_try_send(ivshm *h, int slot, uint32_t tag, const void *buf,
                   size_t len)
{
    return send_msg(h, slot, tag, buf, len, 0);
}

int ivshm_send_timeout(ivshm *h, int slot, uint32_t tag, const void *buf,
                       size_t len, int timeout_ms)
{
    return send_msg(h, slot, tag, buf, len, timeout_ms < 0 ? -1 : timeout_ms);
}

/* The payload of the slot at tx_head, if the ring has room for it: the
   caller fills it in place, then send_commit publishes it. tx_head does
   not move, so an abandoned reservation costs nothing. */
void *ivshm_send_reserve(ivshm *h, int slot, size_t len, int *err)
{
    int rc = tx_begin(h, slot, len);
    if (rc == 0 && len > slot_payload(h))
        rc = -EMSGSIZE;
    uint8_t *ring = rc == 0 ? ivshm_ring(h, h->self, slot) : NULL;
    if (rc == 0)
        rc = tx_reserve(h, slot, (struct ivshm_ring_ctrl *)ring, 1);
    if (err)
        *err = rc;
    if (rc < 0)
        return NULL;
    h->peers[slot].reserved = true;
    return slot_data(slot_at(h, ring, h->peers[slot].tx_head));
}

/* Publish the reserved slot as one message of `len` bytes: the same
   release store and kick as a copying send. The reservation proved the
   room (tail only moves forward), so it is not checked again. */
int ivshm_send_commit(ivshm *h, int slot, uint32_t tag, size_t len)
{
    int rc = tx_begin(h, slot, len);
    if (rc < 0)
        return rc;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (!p->reserved || len > slot_payload(h))
        return -EINVAL;
    uint8_t *ring = ivshm_ring(h, h->self, slot);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    p->reserved = false;
    tx_publish(h, ring, p->tx_head, tag, SLOT_FIRST | SLOT_LAST, len, NULL,
               (uint32_t)len);
    p->tx_head++;
    tx_done(h, slot, ctrl, len);
    return 0;
}

/* ------------------------------------------------------------------ */
/* receiving                                                          */
/* ------------------------------------------------------------------ */

/* Which incarnation of a sender we read from. */
enum rx_view {
    RX_NONE, /* nobody: free since we joined, or being claimed */
    RX_LIVE, /* ACTIVE: we free slots and wake it */
    RX_GONE, /* left or died: drain what it published, read-only */
};

/* Refresh our local view of the sender in `slot`. A sender that left or
   died keeps its generation in the registry until the slot is claimed
   again, and the claimer empties the rings: so what sits in the ring
   still belongs to that generation and may be delivered. We never write
   the tail of a departed sender's ring, so a claimer that is resetting
   it cannot be undone by us. */
static enum rx_view rx_view(ivshm *h, int slot)
{
    if (ivshm_peer_current(h, slot))
        return RX_LIVE;
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    uint32_t st = atomic_load_explicit(&e->state, memory_order_acquire);
    if (st != PEER_FREE && st != PEER_DEAD)
        return RX_NONE;
    uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (gen == 0)
        return RX_NONE;
    /* an incarnation we never talked to: its positions began at 0 */
    if (h->peers[slot].gen != gen)
        ivshm_peer_local_reset(h, slot, gen);
    return RX_GONE;
}

static inline bool slot_full(const struct ivshm_slot *s, uint64_t pos)
{
    /* acquire pairs with the producer's publication store */
    return atomic_load_explicit(&s->seq, memory_order_acquire) == pos + 1;
}

/* Consume position rx_tail of `slot`'s ring. */
static void rx_consume(ivshm *h, int slot, uint8_t *ring, enum rx_view view)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint64_t pos = p->rx_tail++;
    p->peeked = false; /* whatever was peeked at is gone now */
    if (view != RX_LIVE)
        return;
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    /* release: our reads of the slot are done before it may be reused */
    atomic_store_explicit(&ctrl->tail, p->rx_tail, memory_order_release);
    /* The producer only ever blocks on a full ring, that is after it
       published position pos + ring_slots - 1. Dekker with the producer
       (store seq ... fence, load tail in its wait): if we do not see that
       seq, its next look at the tail sees ours, so a wake is only owed
       when we do see it. This spares a futex wake to a producer that
       sleeps for another reason (waiting for our reply). */
    atomic_thread_fence(memory_order_seq_cst);
    const struct ivshm_slot *last = slot_at(h, ring, pos + h->ring_slots - 1);
    if (atomic_load_explicit(&last->seq, memory_order_relaxed) ==
        pos + h->ring_slots)
        ivshm_kick(h, slot);
}

/* One snapshot of a slot header: the producer may rewrite it while we
   look, so each field is read exactly once and only the copy is used. */
struct frag {
    uint32_t len, tag, gen, flags;
    uint64_t total;
};

static inline void frag_read(const struct ivshm_slot *s, struct frag *f)
{
    f->len = __atomic_load_n(&s->len, __ATOMIC_RELAXED);
    f->tag = __atomic_load_n(&s->tag, __ATOMIC_RELAXED);
    f->gen = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
    f->flags = __atomic_load_n(&s->flags, __ATOMIC_RELAXED);
    f->total = __atomic_load_n(&s->total, __ATOMIC_RELAXED);
}

/* Store what fits of a validated fragment (len <= payload) below `keep`. */
static inline void copy_out(void *buf, uint64_t keep, uint64_t *stored,
                            struct ivshm_slot *s, uint32_t len)
{
    if (*stored >= keep || len == 0)
        return;
    uint64_t n = keep - *stored < len ? keep - *stored : len;
    memcpy((uint8_t *)buf + *stored, slot_data(s), n);
    *stored += n;
}

static inline bool flags_bad(uint32_t flags)
{
    return (flags & ~(uint32_t)(SLOT_FIRST | SLOT_LAST)) != 0;
}

/* The message in progress from `slot` is given up (error, or a new
   incarnation): what was staged goes, the ring moves on from rx_tail. */
static void rx_abandon(struct ivshm_peer_local *p)
{
    free(p->rx_stage);
    p->rx_stage = NULL;
    p->rx_stage_cap = 0;
    p->rx_partial = false;
    p->rx_nomem = false;
    p->rx_kept = 0;
}

/* Room for `n` staged bytes (n <= rx_keep). Grows by doubling, so the
   memory follows the bytes actually received, not a forged total, and
   never exceeds rx_keep (at most the caller's cap). False (and rx_nomem) when out of
   memory: the message is then drained and reported as -ENOMEM. */
static bool stage_room(struct ivshm_peer_local *p, uint64_t n)
{
    if (n <= p->rx_stage_cap)
        return true;
    if (p->rx_nomem)
        return false;
    uint64_t cap = p->rx_stage_cap ? p->rx_stage_cap : 4096;
    while (cap < n)
        cap *= 2;
    if (cap > p->rx_keep)
        cap = p->rx_keep;
    uint8_t *st = realloc(p->rx_stage, cap);
    if (!st) {
        p->rx_nomem = true;
        return false;
    }
    p->rx_stage = st;
    p->rx_stage_cap = cap;
    return true;
}

/* Append what fits of a validated fragment to the stage. */
static void stage_append(struct ivshm_peer_local *p, struct ivshm_slot *s,
                         uint32_t len)
{
    if (p->rx_kept >= p->rx_keep || len == 0)
        return;
    uint64_t n = p->rx_keep - p->rx_kept < len ? p->rx_keep - p->rx_kept : len;
    if (!stage_room(p, p->rx_kept + n))
        return;
    memcpy(p->rx_stage + p->rx_kept, slot_data(s), n);
    p->rx_kept += n;
}

struct frag_wait {
    const struct ivshm_slot *s;
    uint64_t pos;
};

static bool frag_ready(ivshm *h, void *arg)
{
    (void)h;
    const struct frag_wait *w = arg;
    return slot_full(w->s, w->pos);
}

/* Mid-message: wait for the next fragment until `deadline` (0: not at
   all), spinning on the slot as a receive between messages would. 0 when
   it is there, -ETIMEDOUT, IVSHM_EPEERDEAD once a dead sender's last
   published fragment is gone (a death turns *view into RX_GONE). */
static int rx_wait_fragment(ivshm *h, int slot, const struct ivshm_slot *s,
                            enum rx_view *view, uint64_t deadline)
{
    struct frag_wait w = {s, h->peers[slot].rx_tail};
    if (*view == RX_LIVE) {
        int ms = deadline == 0 ? -ETIMEDOUT : ms_left(deadline);
        if (ms == -ETIMEDOUT)
            return -ETIMEDOUT;
        int rc = ivshm_wait(h, frag_ready, &w, slot, h->peers[slot].gen, ms);
        if (rc != IVSHM_EPEERDEAD)
            return rc;
        *view = RX_GONE;
    }
    /* gone: what it published before dying is still ours */
    return frag_ready(h, &w) ? 0 : IVSHM_EPEERDEAD;
}

/* The ring from `slot` is empty as far as we know, so the shared tail
   must equal our position (only we write it). A co-tenant that rewound
   it would leave the producer waiting for a release that never comes:
   put ours back and wake the producer in case it already sleeps. */
static void rx_heal_tail(ivshm *h, int slot, uint8_t *ring)
{
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    uint64_t mine = h->peers[slot].rx_tail;
    if (atomic_load_explicit(&ctrl->tail, memory_order_relaxed) == mine)
        return;
    atomic_store_explicit(&ctrl->tail, mine, memory_order_release);
    ivshm_kick(h, slot);
}

/* Consume the continuation fragments of the message in progress from
   `slot` (p->rx_partial: its FIRST fragment is consumed). A fresh message
   (!staged) is stored straight into buf after the `stored` bytes there; a
   resumed one goes to the stage and is copied to buf once complete.
   Waits for late fragments until `deadline` (0: never; UINT64_MAX:
   forever); when it passes -- checked also between runs of ring_slots
   fragments, so a sender streaming without end cannot hold us -- the
   message stays in progress (the stored prefix staged) and the call
   returns -EAGAIN. Invariant: rx_left = bytes not consumed yet. */
static ssize_t rx_fragments(ivshm *h, int slot, uint8_t *ring,
                            enum rx_view view, uint32_t *tag, void *buf,
                            size_t cap, uint64_t stored, uint64_t deadline,
                            bool staged)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);
    uint32_t run = 0;
    while (p->rx_left) {
        struct ivshm_slot *s = slot_at(h, ring, p->rx_tail);
        int rc = 0;
        if (!slot_full(s, p->rx_tail)) {
            run = 0;
            rc = rx_wait_fragment(h, slot, s, &view, deadline);
            if (rc == IVSHM_EPEERDEAD) {
                rx_abandon(p);
                return rc;
            }
        } else if (++run == h->ring_slots) {
            run = 0;
            if (deadline != UINT64_MAX && ivshm_now_ns() >= deadline)
                rc = -ETIMEDOUT;
        }
        if (rc < 0) {
            /* cut: keep what this call stored, for the next one */
            if (!staged && stored && stage_room(p, stored)) {
                memcpy(p->rx_stage, buf, stored);
                p->rx_kept = stored;
            }
            return rc == -ETIMEDOUT ? -EAGAIN : rc;
        }
        struct frag c;
        frag_read(s, &c);
        if (c.gen != p->gen) {
            rx_abandon(p);
            if (c.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                              memory_order_relaxed))
                return IVSHM_EPEERDEAD; /* new incarnation; leave its slot */
            rx_consume(h, slot, ring, view);
            return IVSHM_ECORRUPT;
        }
        if (c.flags == SLOT_FIRST || c.flags == (SLOT_FIRST | SLOT_LAST)) {
            /* the sender gave up on this message (send deadline): leave
               the slot, it may start a good message */
            rx_abandon(p);
            return IVSHM_ECORRUPT;
        }
        bool is_last = c.flags & SLOT_LAST;
        if (flags_bad(c.flags) || c.len == 0 || c.len > payload ||
            c.len > p->rx_left || is_last != (c.len == p->rx_left) ||
            c.tag != p->rx_tag || c.total != p->rx_total) {
            rx_abandon(p);
            rx_consume(h, slot, ring, view);
            return IVSHM_ECORRUPT;
        }
        if (staged)
            stage_append(p, s, c.len);
        else
            copy_out(buf, p->rx_keep, &stored, s, c.len);
        rx_consume(h, slot, ring, view);
        p->rx_left -= c.len;
    }
    bool nomem = p->rx_nomem;
    /* An earlier call with a smaller cap dropped bytes this caller would
       expect: returning the length would pass stale buffer bytes off as
       the message's. */
    bool lost = p->rx_keep < p->rx_total && p->rx_keep < cap;
    if (staged && !nomem && !lost) {
        uint64_t n = p->rx_kept < p->rx_keep ? p->rx_kept : p->rx_keep;
        if (n)
            memcpy(buf, p->rx_stage, n);
    }
    rx_abandon(p); /* complete: nothing in progress any more */
    if (nomem)
        return -ENOMEM;
    if (lost)
        return -EMSGSIZE;
    *tag = p->rx_tag;
    return (ssize_t)p->rx_total;
}

/* Receive one whole message from `slot` if its first fragment is there.
   Returns the message length, -EAGAIN if there is none (or it is still
   incomplete at `deadline`, see rx_fragments), or an error. A malformed
   slot is consumed and reported as IVSHM_ECORRUPT, so a scribbled ring
   costs the scribbler's messages, not a stuck receiver. peek non-NULL: a
   valid single-slot message is left in place and *peek points at its
   payload; a longer one (or one in progress) is left: -EMSGSIZE. */
static ssize_t rx_message(ivshm *h, int slot, uint32_t *tag, void *buf,
                          size_t cap, const void **peek, uint64_t deadline)
{
    enum rx_view view = rx_view(h, slot);
    if (view == RX_NONE)
        return -EAGAIN;
    struct ivshm_peer_local *p = &h->peers[slot];
    uint8_t *ring = ivshm_ring(h, slot, h->self);
    const uint32_t payload = slot_payload(h);

    if (p->rx_partial) {
        if (peek)
            return -EMSGSIZE;
        /* Resume into the stage. The bytes delivered never grow past an
           earlier call's cap: those beyond it are gone. */
        if (p->rx_keep > cap)
            p->rx_keep = cap;
        return rx_fragments(h, slot, ring, view, tag, buf, cap, 0, deadline,
                            true);
    }

    struct ivshm_slot *s;
    struct frag f;
    for (uint32_t drops = 0;; drops++) {
        if (drops == MAX_DROPS_PER_CALL(h))
            return -EAGAIN;
        s = slot_at(h, ring, p->rx_tail);
        if (!slot_full(s, p->rx_tail)) {
            if (view == RX_LIVE)
                rx_heal_tail(h, slot, ring);
            return -EAGAIN;
        }
        frag_read(s, &f);
        if (f.gen == p->gen)
            break;
        if (f.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                          memory_order_relaxed))
            return -EAGAIN; /* the slot changed hands just now: our next
                               call sees the new generation */
        /* written by an earlier incarnation of the sender */
        rx_consume(h, slot, ring, view);
        h->stats.dropped++;
    }

    /* FIRST fragment: the whole message is described here. */
    bool last = f.flags & SLOT_LAST;
    if (flags_bad(f.flags) || !(f.flags & SLOT_FIRST) || f.len > payload ||
        f.total > (uint64_t)SSIZE_MAX ||
        (last ? f.total != f.len : (f.len == 0 || f.total <= f.len))) {
        rx_consume(h, slot, ring, view);
        return IVSHM_ECORRUPT;
    }
    if (peek) {
        if (!last)
            return -EMSGSIZE;
        *peek = slot_data(s);
        *tag = f.tag;
        return (ssize_t)f.len;
    }
    p->rx_partial = true;
    p->rx_tag = f.tag;
    p->rx_total = f.total;
    p->rx_keep = f.total < cap ? f.total : cap;
    p->rx_kept = 0;
    uint64_t stored = 0;
    copy_out(buf, p->rx_keep, &stored, s, f.len);
    rx_consume(h, slot, ring, view);
    p->rx_left = f.total - f.len;
    return rx_fragments(h, slot, ring, view, tag, buf, cap, stored, deadline,
                        false);
}

/* Round-robin over every other slot from rr_next, so one busy sender
   cannot starve the others. */
static ssize_t rx_any(ivshm *h, int *src, uint32_t *tag, void *buf,
                      size_t cap, const void **peek, uint64_t deadline)
{
    int n = (int)h->max_peers;
    int i = h->rr_next >= 0 && h->rr_next < n ? h->rr_next : 0;
    for (int k = 0; k < n; k++, i = i + 1 == n ? 0 : i + 1) {
        if (i == h->self)
            continue;
        ssize_t rc = rx_message(h, i, tag, buf, cap, peek, deadline);
        if (rc != -EAGAIN) {
            h->rr_next = i + 1 == n ? 0 : i + 1;
            *src = i;
            return rc;
        }
    }
    return -EAGAIN;
}

/* Is there a fragment at our position in `slot`'s ring? An empty ring
   of a live sender gets its tail checked (rx_heal_tail). */
static bool rx_has_message(ivshm *h, int slot)
{
    enum rx_view view = rx_view(h, slot);
    if (view == RX_NONE)
        return false;
    uint64_t pos = h->peers[slot].rx_tail;
    uint8_t *ring = ivshm_ring(h, slot, h->self);
    if (slot_full(slot_at(h, ring, pos), pos))
        return true;
    if (view == RX_LIVE)
        rx_heal_tail(h, slot, ring);
    return false;
}

static bool any_ready(ivshm *h, void *arg)
{
    (void)arg;
    for (int i = 0; i < (int)h->max_peers; i++)
        if (i != h->self && rx_has_message(h, i))
            return true;
    return false;
}

static bool one_ready(ivshm *h, void *arg)
{
    return rx_has_message(h, *(const int *)arg);
}

/* A sender whose message we hold half-received, or -1: an IVSHM_ANY
   wait watches its liveness, so its death ends the wait and is reported. */
static int partial_sender(const ivshm *h)
{
    for (int i = 0; i < (int)h->max_peers; i++)
        if (h->peers[i].rx_partial)
            return i;
    return -1;
}

ssize_t ivshm_recv(ivshm *h, int from, int *src, uint32_t *tag, void *buf,
                   size_t cap, int timeout_ms)
{
    if (!h || h->self < 0 || (cap && !buf))
        return -EINVAL;
    if (from != IVSHM_ANY && (!ivshm_slot_ok(h, from) || from == h->self))
        return -EINVAL;
    /* 0: poll, the deadline has passed already; UINT64_MAX: forever */
    const uint64_t deadline =
        timeout_ms < 0 ? UINT64_MAX
        : timeout_ms == 0 ? 0
                          : ivshm_now_ns() + (uint64_t)timeout_ms * 1000000ull;

    for (;;) {
        int got_src = from;
        uint32_t got_tag = 0;
        ssize_t rc =
            from == IVSHM_ANY
                ? rx_any(h, &got_src, &got_tag, buf, cap, NULL, deadline)
                : rx_message(h, from, &got_tag, buf, cap, NULL, deadline);
        if (rc != -EAGAIN && src)
            *src = got_src; /* on ECORRUPT too: says who scribbled */
        if (rc >= 0) {
            if (tag)
                *tag = got_tag;
            h->stats.recvs++;
            h->stats.bytes_recv += (uint64_t)rc;
            return rc;
        }
        if (rc != -EAGAIN)
            return rc;
        int peer = -1;
        uint32_t peer_gen = 0;
        if (from != IVSHM_ANY) {
            if (rx_view(h, from) != RX_LIVE) {
                /* it may have published and left since rx_message looked */
                if (rx_has_message(h, from))
                    continue;
                rx_abandon(&h->peers[from]);
                return IVSHM_EPEERDEAD;
            }
            peer = from;
        } else {
            peer = partial_sender(h);
        }
        if (peer >= 0)
            peer_gen = h->peers[peer].gen;
        if (timeout_ms == 0)
            return -EAGAIN;
        int wait_ms = ms_left(deadline);
        if (wait_ms == -ETIMEDOUT)
            return -ETIMEDOUT;
        int w = ivshm_wait(h, from == IVSHM_ANY ? any_ready : one_ready, &from,
                           peer, peer_gen, wait_ms);
        if (w == -ETIMEDOUT)
            return -ETIMEDOUT;
        if (w < 0 && w != IVSHM_EPEERDEAD)
            return w;
        /* A partial sender whose slot is being claimed again (or whose
           state a co-tenant keeps at CLAIMING) will never continue that
           message: drop it, or this loop would spin on its "death". */
        if (w == IVSHM_EPEERDEAD && from == IVSHM_ANY && peer >= 0 &&
            rx_view(h, peer) == RX_NONE)
            rx_abandon(&h->peers[peer]);
        /* ready or dead: the next round drains what is left, then the
           view check above reports the death */
    }
}

int ivshm_wait_message(ivshm *h, int timeout_ms)
{
    if (!h || h->self < 0)
        return -EINVAL;
    return ivshm_wait(h, any_ready, NULL, -1, 0, timeout_ms);
}

/* Never waits. Stale slots of an earlier incarnation are dropped and a
   malformed one is consumed (-IVSHM_ECORRUPT), as in ivshm_recv; a valid
   message stays in the ring until ivshm_recv_release. */
ssize_t ivshm_recv_peek(ivshm *h, int from, int *src, uint32_t *tag,
                        const void **data)
{
    if (!h || h->self < 0 || !data)
        return -EINVAL;
    if (from != IVSHM_ANY && (!ivshm_slot_ok(h, from) || from == h->self))
        return -EINVAL;
    /* two rounds: a sender may publish and leave between them */
    for (int round = 0; round < 2; round++) {
        int got_src = from;
        uint32_t got_tag = 0;
        ssize_t rc = from == IVSHM_ANY
                         ? rx_any(h, &got_src, &got_tag, NULL, 0, data, 0)
                         : rx_message(h, from, &got_tag, NULL, 0, data, 0);
        if (rc != -EAGAIN && src)
            *src = got_src;
        if (rc >= 0) {
            if (tag)
                *tag = got_tag;
            h->peers[got_src].peeked = true;
            h->stats.recvs++;
            h->stats.bytes_recv += (uint64_t)rc;
            return rc;
        }
        if (rc != -EAGAIN || from == IVSHM_ANY)
            return rc;
        if (rx_view(h, from) == RX_LIVE)
            return -EAGAIN;
        if (!rx_has_message(h, from))
            return IVSHM_EPEERDEAD;
    }
    return -EAGAIN;
}

/* Consume the message ivshm_recv_peek returned for `src`. Decided on
   local state only: a co-tenant rewriting the slot meanwhile cannot make
   the release fail and the message stick. */
int ivshm_recv_release(ivshm *h, int src)
{
    if (!h || h->self < 0 || !ivshm_slot_ok(h, src) || src == h->self)
        return -EINVAL;
    enum rx_view view = rx_view(h, src); /* a new incarnation drops it */
    struct ivshm_peer_local *p = &h->peers[src];
    if (view == RX_NONE || !p->peeked)
        return -EINVAL;
    rx_consume(h, src, ivshm_ring(h, src, h->self), view);
    return 0;
}
