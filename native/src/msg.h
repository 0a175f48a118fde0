/*
 * Messages (docs/region-layout.md, "Messages"). Every peer j owns one
 * receive area, so the region grows linearly with the peers:
 *
 *  - Q(j), a bounded multi-producer queue of queue_slots cells: every
 *    peer may append, only j consumes;
 *  - fast_channels single-producer rings, each taken over on demand by
 *    one busy sender (a CAS on the channel's descriptor).
 *
 * A sender sends its first fast_after messages to j through Q(j), then
 * tries to take a free channel of j; it announces it with an OPEN cell in
 * Q(j) and from then on sends on that ring only. j switches to the ring
 * when it consumes the OPEN cell, so whatever the sender queued before is
 * delivered first: per-pair order holds without sequence numbers, and
 * after the switch the hot path is the plain SPSC ring (ring.c).
 *
 * Producers may be hostile: every header field is loaded once into a
 * local copy and validated before it sizes a copy, every shared position
 * is checked against local state, and every wait ends by the caller's
 * deadline.
 *
 * One file per concern: ring.c the fast SPSC rings; queue.c the
 * multi-producer queue (claim words, skipping, the waiter bitmap);
 * channel.c the fast-channel descriptors (claim and OPEN, sweep, free);
 * send.c the sending API and its choice of path; recv.c the receiving
 * API, the per-sender backlogs and reassembly. What more than one of
 * them needs on a hot path is static inline here, so the split added no
 * call to those paths.
 */
#ifndef IVSHM_MSG_H
#define IVSHM_MSG_H

#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <string.h>

/* Shared between the message files only: not exported from libivshm.so,
   and a direct call (no PLT) like the file-local call it was. */
#define IVSHM_MSG_FN __attribute__((visibility("hidden")))
/* A helper of a hot path folded into its callers, whose constant
   arguments then remove most of its branches. */
#define IVSHM_HOT_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------ */
/* slots, rings, deadlines                                            */
/* ------------------------------------------------------------------ */

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

static inline uint8_t *slot_data(void *s)
{
    return (uint8_t *)s + IVSHM_SLOT_HDR;
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

/* The farthest one end of a fast ring follows the other at once when a
   co-tenant's writes put them apart (ring.c tail_ahead, recv.c
   rx_heal_ring): beyond any lag an honest pair can build up while they
   are apart, far below a wrap of the 64-bit positions. */
#define RING_JUMP_MAX (1ull << 40)

/* Milliseconds left until `deadline` (UINT64_MAX: -1, forever), or
   -ETIMEDOUT once it has passed. */
static inline int ms_left(uint64_t deadline)
{
    if (deadline == UINT64_MAX)
        return -1;
    uint64_t now = ivshm_now_ns();
    if (now >= deadline)
        return -ETIMEDOUT;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* ------------------------------------------------------------------ */
/* fast rings: the hot path of both ends (protocol: ring.c)           */
/* ------------------------------------------------------------------ */

/* Which incarnation of a sender we read from. */
enum rx_view {
    RX_NONE, /* nobody: free since we joined, or being claimed */
    RX_LIVE, /* ACTIVE: we free slots and wake it */
    RX_GONE, /* left or died: drain what it published, read-only */
};

/* One snapshot of a slot or cell header: the producer may rewrite it
   while we look, so each field is read exactly once and only the copy
   is used. */
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

static inline bool slot_full(const struct ivshm_slot *s, uint64_t pos)
{
    /* acquire pairs with the producer's publication store */
    return atomic_load_explicit(&s->seq, memory_order_acquire) == pos + 1;
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

static inline void count_sent(ivshm *h, size_t len)
{
    h->stats.sends++;
    h->stats.bytes_sent += len;
}

/* A whole message is out: show it and wake the consumer if it sleeps. */
static inline void tx_done(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                           size_t len)
{
    /* release: a consumer that sees this head sees every slot below it
       published (rx_heal_hidden); a plain store on x86 */
    atomic_store_explicit(&ctrl->head, h->peers[slot].tx_head,
                          memory_order_release);
    if (ivshm_peer_may_sleep(h, slot)) /* else no wake is owed (wait.c) */
        ivshm_kick(h, slot);
    count_sent(h, len);
}

/* Consume position rx_tail of `slot`'s ring. */
static inline void rx_consume(ivshm *h, int slot, uint8_t *ring,
                              enum rx_view view)
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
       sleeps for another reason (waiting for our reply). A producer
       that never blocks needs neither (wait.c, "blocking announced"). */
    if (!ivshm_peer_may_sleep(h, slot))
        return;
    atomic_thread_fence(memory_order_seq_cst);
    const struct ivshm_slot *last = slot_at(h, ring, pos + h->ring_slots - 1);
    if (atomic_load_explicit(&last->seq, memory_order_relaxed) ==
        pos + h->ring_slots)
        ivshm_kick(h, slot);
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

/* ------------------------------------------------------------------ */
/* the queue: what its producers and its consumer share (queue.c)     */
/* ------------------------------------------------------------------ */

enum { Q_EMPTY, Q_WAIT, Q_FULL };

/* A cell at q_head, validated as far as the queue goes. */
struct qhead {
    int src;
    struct frag f;
    const uint8_t *data;
};

/* Our queue's head cell is free and no sender holds a position at or
   past it: nothing, an OPEN included, is on its way to us. */
static inline bool q_empty(const ivshm *h)
{
    uint64_t pos = h->q_head;
    return atomic_load_explicit(&ivshm_my_qcell(h, pos)->seq,
                                memory_order_acquire) == pos &&
           atomic_load_explicit(&h->my_qctrl->enqueue_pos,
                                memory_order_relaxed) == pos;
}

/* Is the cell of enqueue_pos + n - 1 free, that is, could n cells be
   taken now? Two loads; a garbled enqueue_pos looks like "no room". */
static inline bool q_room(const ivshm *h, int j, uint32_t n)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, j);
    uint64_t e = atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
    uint64_t seq = atomic_load_explicit(&ivshm_qcell(h, j, e + n - 1)->seq,
                                        memory_order_acquire);
    return seq == e + n - 1;
}

/* ------------------------------------------------------------------ */
/* between the files: calls that were out of line before the split    */
/* ------------------------------------------------------------------ */

/* ring.c */
IVSHM_MSG_FN int ivshm_tx_reserve(ivshm *h, int slot,
                                  struct ivshm_ring_ctrl *ctrl, uint64_t need);
IVSHM_MSG_FN int ivshm_ring_send(ivshm *h, int slot, uint32_t tag,
                                 const void *buf, size_t len, int timeout_ms,
                                 uint64_t deadline);
/* queue.c */
IVSHM_MSG_FN int ivshm_q_send(ivshm *h, int j, uint32_t tag, const void *buf,
                              size_t len, uint16_t ctl, uint64_t ctl_total,
                              int timeout_ms, uint64_t deadline);
IVSHM_MSG_FN void ivshm_q_wake_waiters(ivshm *h);
IVSHM_MSG_FN int ivshm_q_front(ivshm *h, struct qhead *out);
/* channel.c */
IVSHM_MSG_FN void ivshm_tx_try_open(ivshm *h, int j, int timeout_ms,
                                    uint64_t deadline);
IVSHM_MSG_FN void ivshm_chan_reset(ivshm *h, uint32_t k);
IVSHM_MSG_FN void ivshm_chan_free(ivshm *h, int slot);
/* recv.c */
IVSHM_MSG_FN enum rx_view ivshm_rx_view_slow(ivshm *h, int slot);
IVSHM_MSG_FN void ivshm_rx_adopt(ivshm *h, int slot, uint32_t k);

/* Which incarnation of `slot` we read from: the live one on every
   message (inline), anything else out of line. */
static inline enum rx_view ivshm_rx_view(ivshm *h, int slot)
{
    return ivshm_peer_current(h, slot) ? RX_LIVE : ivshm_rx_view_slow(h, slot);
}

/* ------------------------------------------------------------------ */
/* the queue, consumer side: the hot path of a queued message         */
/* ------------------------------------------------------------------ */

/* The cell at q_head is done with (consumed or dropped; `seq` is what we
   saw there, for the CAS of a cell somebody else may still write). */
static inline bool q_advance(ivshm *h, uint64_t seq, bool cas)
{
    struct ivshm_cell *c = ivshm_my_qcell(h, h->q_head);
    uint64_t next = h->q_head + h->queue_slots;
    /* release: our reads of the cell are done before a producer may
       claim it again */
    if (cas) {
        if (!atomic_compare_exchange_strong_explicit(&c->seq, &seq, next,
                                                     memory_order_release,
                                                     memory_order_relaxed))
            return false;
    } else {
        atomic_store_explicit(&c->seq, next, memory_order_release);
    }
    h->q_head++;
    atomic_store_explicit(&h->my_qctrl->head, h->q_head,
                          memory_order_relaxed);
    h->q_stuck_since = 0;
    if (h->q_peek_src >= 0) {
        h->peers[h->q_peek_src].peeked = false;
        h->q_peek_src = -1;
    }
    ivshm_q_wake_waiters(h);
    return true;
}

#endif
