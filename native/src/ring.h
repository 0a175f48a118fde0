/*
 * A fast channel's ring (docs/region-layout.md, "Fast channels"): one
 * single-producer, single-consumer ring of slots, both ends. The hot
 * paths of both ends are static inline here, so that the files that
 * choose the path (send.c, recv.c) make no extra call; the protocol and
 * the repairs are in ring.c.
 */
#ifndef IVSHM_RING_H
#define IVSHM_RING_H

#include "attachment.h"
#include "doorbell.h"

#include <string.h>

static inline struct ivshm_slot *slot_at(const ivshm *h, uint8_t *ring,
                                         uint64_t pos)
{
    return (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                 (pos & (h->ring_slots - 1)) *
                                     (uint64_t)h->slot_size);
}

/* Our fast ring into `slot`'s area / its fast ring into ours. */
static inline uint8_t *tx_ring(const ivshm *h, int slot)
{
    return h->peers[slot].tx_ring;
}

static inline uint8_t *rx_ring(const ivshm *h, int slot)
{
    return h->peers[slot].rx_ring;
}

/* How far ahead of its position a consumer taking messages in a row
   fetches the ring (ring_take): far enough that the line has arrived
   when it gets there, near enough that a sender that is ahead at all has
   written it. */
#define RX_AHEAD 4

/* How far ahead of its position a producer sending messages in a row
   takes the line of a free slot for writing (ring_put_small). */
#define TX_AHEAD 4

/* A prefetch for writing: the line comes in owned, as a store would take
   it, but without holding up the stores behind it. GCC emits x86's
   prefetchw for __builtin_prefetch(p, 1, ...) only with -mprfchw, and a
   read prefetch otherwise, which would only share the line. */
static inline void prefetch_for_write(const void *p)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 1, 3);
#endif
}

/* The farthest one end of a fast ring follows the other at once when a
   co-tenant's writes put them apart (ring.c, tail_ahead and
   ivshm_ring_heal): beyond any lag an honest pair can build up while
   they are apart, far below a wrap of the 64-bit positions. */
#define RING_JUMP_MAX (1ull << 40)

/* ------------------------------------------------------------------ */
/* producer                                                           */
/* ------------------------------------------------------------------ */

/* Room for `need` positions from tx_head: 0, -EAGAIN, or an error (the
   tail failed validation). */
IVSHM_INTERNAL int ivshm_tx_reserve(ivshm *h, int slot,
                                    struct ivshm_ring_ctrl *ctrl,
                                    uint64_t need);
/* One message on our ring to `slot`. timeout_ms: 0 all-or-nothing
   without waiting (try_send); -1 wait as long as the consumer lives,
   fragment by fragment (send); > 0 wait until `deadline`, for the whole
   message at once if it fits the ring. */
IVSHM_INTERNAL int ivshm_ring_send(ivshm *h, int slot, uint32_t tag,
                                   const void *buf, size_t len,
                                   int timeout_ms, uint64_t deadline);

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

/* A copy of a few bytes from private memory into a slot without a call:
   a protocol header or a small payload (up to 32 bytes: overlapping
   word moves, no loop); anything larger goes to memcpy. */
static inline void copy_small(uint8_t *dst, const uint8_t *src, size_t n)
{
    uint64_t w0, w1, w2, w3;
    uint32_t v0, v1;
    if (n >= 8 && n <= 16) {
        memcpy(&w0, src, 8);
        memcpy(&w1, src + n - 8, 8);
        memcpy(dst, &w0, 8);
        memcpy(dst + n - 8, &w1, 8);
    } else if (n > 16 && n <= 32) {
        memcpy(&w0, src, 8);
        memcpy(&w1, src + 8, 8);
        memcpy(&w2, src + n - 16, 8);
        memcpy(&w3, src + n - 8, 8);
        memcpy(dst, &w0, 8);
        memcpy(dst + 8, &w1, 8);
        memcpy(dst + n - 16, &w2, 8);
        memcpy(dst + n - 8, &w3, 8);
    } else if (n >= 4 && n < 8) {
        memcpy(&v0, src, 4);
        memcpy(&v1, src + n - 4, 4);
        memcpy(dst, &v0, 4);
        memcpy(dst + n - 4, &v1, 4);
    } else if (n > 32) {
        memcpy(dst, src, n);
    } else {
        for (size_t i = 0; i < n; i++)
            dst[i] = src[i];
    }
}

/* A whole message is out: show it and wake the consumer if it sleeps. */
static inline void tx_done(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                           size_t len)
{
    /* release: a consumer that sees this head sees every slot below it
       published (ivshm_ring_heal); a plain store on x86 */
    atomic_store_explicit(&ctrl->head, h->peers[slot].tx_head,
                          memory_order_release);
    if (ivshm_peer_may_sleep(h, slot)) /* else no wake is owed (doorbell.c) */
        ivshm_kick(h, slot);
    count_sent(h, len);
}

/* A wake after the message is out, as a tail call, so that nothing of
   the hot path of ivshm_send_small is kept across a call. */
static __attribute__((noinline, unused)) int ring_kick_sent(ivshm *h,
                                                           int slot)
{
    ivshm_kick(h, slot);
    return 0;
}

/* Whether the message `a` + `b` may go on our fast ring to `slot` at once
   (ring_put_small); false when the general path must look: the peer is
   not the incarnation we know, no ring yet, our cached tail says full,
   bad arguments. `tiny`: only parts of up to 32 bytes, copied without a
   call. Invariants: the peer's registry entry is read on every call
   (state and generation, as ivshm_peer_current: a new incarnation
   emptied the ring we would write to, and the general path resets our
   view); the shared tail is never read here, only our cached copy (the
   general path has ivshm_tx_reserve load, check and keep it); the whole
   message fits the slot or nothing is written. */
IVSHM_HOT_INLINE bool ring_small_ready(const ivshm *h, int slot,
                                       const struct ivshm_peer_entry *e,
                                       const void *a, size_t alen,
                                       const void *b, size_t blen, bool tiny)
{
    const struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);
    const bool fits = tiny ? alen <= 32 && blen <= 32 && alen + blen <= payload
                           : alen <= payload && blen <= payload - alen;
    return fits && (a || !alen) && (b || !blen) &&
           atomic_load_explicit(&e->state, memory_order_acquire) == PEER_ACTIVE &&
           atomic_load_explicit(&e->gen, memory_order_relaxed) == p->gen &&
           p->tx_chan >= 0 && p->tx_head - p->tx_tail_cache < h->ring_slots;
}

/* The message `a` + `b` into the slot at tx_head, published, once
   ring_small_ready said yes (copy_small: no call for parts of up to 32
   bytes). What tx_publish + tx_done do, from locals loaded before the
   copies (which may alias anything, so the compiler would load again),
   except the wake: true if one is owed (the receiver may sleep;
   doorbell.c), for the caller to ring last. */
IVSHM_HOT_INLINE bool ring_put_small(ivshm *h, int slot,
                                     const struct ivshm_peer_entry *e,
                                     uint32_t tag, const void *a, size_t alen,
                                     const void *b, size_t blen)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint8_t *ring = p->tx_ring;
    const uint64_t pos = p->tx_head;
    const uint32_t len = (uint32_t)(alen + blen);
    const uint32_t self_gen = h->self_gen;
    struct ivshm_slot *s = slot_at(h, ring, pos);
    p->reserved = false; /* we publish that slot: an open reservation ends */
    p->tx_head = pos + 1;
    copy_small(slot_data(s), a, alen);
    copy_small(slot_data(s) + alen, b, blen);
    s->len = len;
    s->tag = tag;
    s->gen = self_gen;
    s->flags = SLOT_FIRST | SLOT_LAST;
    s->total = len;
    /* Publication point: header and payload are visible before seq is;
       then the head, as tx_done shows it (ivshm_ring_heal). */
    atomic_store_explicit(&s->seq, pos + 1, memory_order_release);
    atomic_store_explicit(&((struct ivshm_ring_ctrl *)ring)->head, pos + 1,
                          memory_order_release);
    count_sent(h, len);
    /* In a run of sends of one line each, the line of the slot TX_AHEAD
       on: the consumer read it one lap ago and shares it, and our store
       would have to take it back, holding up every store behind it
       (docs/fast-path.md, "The sender's line"). Only a slot our cached
       tail says is free, so never a line the consumer has still to read;
       only in a run (no message from this peer taken since our last
       small send to it), so a ping-pong or an exchange, whose next send
       waits for a receive, pays nothing; only messages that fit the
       slot's first line, since for longer ones it measured slower. The
       address is our own position in our own ring: nothing is read from
       the region. */
    if (len <= IVSHM_CACHELINE - IVSHM_SLOT_HDR && p->tx_streak &&
        pos + TX_AHEAD - p->tx_tail_cache < h->ring_slots)
        prefetch_for_write(slot_at(h, ring, pos + TX_AHEAD));
    p->tx_streak = true;
    return atomic_load_explicit(&e->may_sleep, memory_order_relaxed) != 0;
}

/* ------------------------------------------------------------------ */
/* consumer                                                           */
/* ------------------------------------------------------------------ */

static inline void frag_read(const struct ivshm_slot *s, struct frag *f)
{
    f->len = __atomic_load_n(&s->len, __ATOMIC_RELAXED);
    f->tag = __atomic_load_n(&s->tag, __ATOMIC_RELAXED);
    f->gen = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
    f->flags = __atomic_load_n(&s->flags, __ATOMIC_RELAXED);
    f->total = __atomic_load_n(&s->total, __ATOMIC_RELAXED);
}

static inline bool slot_full(const struct ivshm_slot *s, uint64_t pos)
{
    /* acquire pairs with the producer's publication store */
    return atomic_load_explicit(&s->seq, memory_order_acquire) == pos + 1;
}

/* The wake a producer that may sleep is owed once we freed position
   `pos` of its ring (rx_free). The producer only ever blocks on a full
   ring, that is after it published position pos + ring_slots - 1.
   Dekker with the producer (store seq ... fence, load tail in its
   wait): if we do not see that seq, its next look at the tail sees
   ours, so a wake is only owed when we do see it. This spares a futex
   wake to a producer that sleeps for another reason (waiting for our
   reply). Out of line: a producer that never blocks costs the consumer
   one load per slot (doorbell.c, "blocking announced"). */
static __attribute__((noinline, unused)) void rx_wake_owed(ivshm *h, int slot,
                                                           uint8_t *ring,
                                                           uint64_t pos)
{
    atomic_thread_fence(memory_order_seq_cst);
    const struct ivshm_slot *last = slot_at(h, ring, pos + h->ring_slots - 1);
    if (atomic_load_explicit(&last->seq, memory_order_relaxed) ==
        pos + h->ring_slots)
        ivshm_kick(h, slot);
}

/* Give position `pos` of the ring of the sender whose registry entry is
   `e` back to it: publish our tail past it, and wake the sender if it
   may sleep on a full ring. */
static inline void rx_free(ivshm *h, int slot, uint8_t *ring, uint64_t pos,
                           const struct ivshm_peer_entry *e)
{
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    /* release: our reads of the slot are done before it may be reused */
    atomic_store_explicit(&ctrl->tail, pos + 1, memory_order_release);
    if (atomic_load_explicit(&e->may_sleep, memory_order_relaxed))
        rx_wake_owed(h, slot, ring, pos);
}

/* Consume position rx_tail of `slot`'s ring. */
static inline void rx_consume(ivshm *h, int slot, uint8_t *ring,
                              enum rx_view view)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint64_t pos = p->rx_tail++;
    p->peeked = false; /* whatever was peeked at is gone now */
    p->tx_streak = false;
    if (view == RX_LIVE)
        rx_free(h, slot, ring, pos, ivshm_entry(h, slot));
}

/* The ring from `slot` is empty as far as we know, so the shared tail
   must equal our position (only we write it). A co-tenant that rewound
   it would leave the producer waiting for a release that never comes:
   put ours back and wake the producer in case it already sleeps. */
static inline void rx_heal_tail(ivshm *h, int slot, uint8_t *ring)
{
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    uint64_t mine = h->peers[slot].rx_tail;
    if (atomic_load_explicit(&ctrl->tail, memory_order_relaxed) == mine)
        return;
    atomic_store_explicit(&ctrl->tail, mine, memory_order_release);
    ivshm_kick(h, slot);
}

/* What one co-tenant write can leave in the ring of `slot` (a live
   sender we read from), repaired from the producer's head: a message
   hidden is shown again, messages overwritten are skipped. True if it
   skipped: the caller then reports them (ivshm_rx_lost). */
IVSHM_INTERNAL bool ivshm_ring_heal(ivshm *h, int slot);
/* A departed sender's ring looks empty at our position: true if its last
   head says the position was published (a co-tenant hid the message,
   which is then shown again). */
IVSHM_INTERNAL bool ivshm_ring_unhide_gone(ivshm *h, int slot);
/* Empty a ring: positions 0, every slot free. */
IVSHM_INTERNAL void ivshm_ring_reset(ivshm *h, uint8_t *ring);

/* ------------------------------------------------------------------ */
/* consumer: the fast path's take (recv.c, ivshm_recv_each)          */
/* ------------------------------------------------------------------ */

/* Up to `max` (>= 1) whole single-slot messages at the head of the
   ring of `slot`, each handed to `fn` where it lies and consumed when fn
   returns. How many; *elsewhere set when the head holds what only the
   general path takes, or the sender is not the incarnation we read from.
   Per message: the slot's seq (the word its producer stored last), one
   copy of its header, the checks a peek makes of a FIRST|LAST message of
   this incarnation, the caller, our tail. No line but the slot's moves
   between the two sides (docs/fast-path.md). Before the first message:
   the registry says the sender is still the incarnation we read from
   (one load each of its state and generation; a departed or new one is
   the general path's, which delivers what a departed one left and
   resets our view of a new one). A header that is anything else
   (fragments, another generation, a length out of bounds) is left where
   it is for the general path, which reports or repairs it. While fn
   runs the message counts as peeked (SRC_RING), so fn may even release
   it or receive it itself; it is consumed here only if nobody did and
   our view of its sender is unchanged when fn returns. */
IVSHM_HOT_INLINE int ring_take(ivshm *h, int slot, ivshm_recv_fn fn,
                               void *arg, int max, bool *elsewhere)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t gen = p->gen;
    const struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE ||
        atomic_load_explicit(&e->gen, memory_order_relaxed) != gen) {
        *elsewhere = true;
        return 0;
    }
    const uint32_t payload = slot_payload(h);
    uint8_t *const ring = p->rx_ring;
    /* slot_at's terms, kept across the calls of fn */
    uint8_t *const slots = ring + IVSHM_RING_CTRL;
    const uint64_t mask = h->ring_slots - 1, stride = h->slot_size;
    const uint64_t ahead = RX_AHEAD * stride;
    int n = 0;
    do {
        const uint64_t pos = p->rx_tail;
        struct ivshm_slot *s =
            (struct ivshm_slot *)(slots + (pos & mask) * stride);
        if (!slot_full(s, pos))
            break;
        struct frag f;
        frag_read(s, &f);
        if (f.gen != gen || f.flags != (SLOT_FIRST | SLOT_LAST) ||
            f.len > payload || f.total != f.len) {
            *elsewhere = true;
            break;
        }
        /* The lines of the next slot and of the slot RX_AHEAD positions
           on, while fn runs: a sender ahead of us has written them, and
           our load would otherwise wait for their transfer from the
           sender's core. The next one serves a sender of two messages at
           once (HPCC's ring latency with two ranks: an Isend to the left
           and one to the right, the same peer), whose second line then
           moves during ob1's work on the first instead of after it; a
           sender that has not written it yet loses nothing, since our
           next poll loads that line anyway (docs/fast-path.md, "Two
           messages at once"). Hints only: nothing is read from them
           here. Their addresses are this slot's plus one and RX_AHEAD
           strides, without the wrap: near the ring's end they name a
           line past it, a wasted hint (a prefetch never faults), and
           the wrap's mask and multiply are saved on every message. */
        __builtin_prefetch((const void *)((uintptr_t)s + stride), 0, 3);
        __builtin_prefetch((const void *)((uintptr_t)s + ahead), 0, 3);
        /* handed out as a peek is, while fn runs: whatever keeps a
           peeked message in place keeps this one */
        p->peeked = true;
        p->peek_kind = SRC_RING;
        fn(arg, slot, gen, f.tag, slot_data(s), f.len);
        n++;
        h->stats.recvs++;
        h->stats.bytes_recv += f.len;
        if (p->rx_tail != pos || p->rx_ring != ring || p->gen != gen ||
            !p->peeked || p->rx_partial) {
            /* fn took it itself (a receive or a release) or our view of
               the sender changed: not ours to consume */
            if (p->rx_tail == pos && p->rx_ring == ring && p->gen == gen)
                p->peeked = false;
            break;
        }
        p->rx_tail = pos + 1; /* rx_consume, with what we hold */
        p->peeked = false;
        p->tx_streak = false;
        rx_free(h, slot, ring, pos, e);
    } while (n < max);
    return n;
}

#endif
