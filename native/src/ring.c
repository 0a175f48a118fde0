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
 * after the switch the hot path is the plain SPSC ring below.
 *
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
 *
 * The queue (bounded, sequence-numbered cells). Cell of position pos:
 * seq == pos free for the producer of pos; CLAIM(pos, slot, gen) while
 * that producer writes it; pos + 1 full; the consumer frees it with
 * seq = pos + queue_slots. A producer of an n-cell batch reads
 * enqueue_pos e, checks that the cell of e + n - 1 is free (the consumer
 * frees in order, so all n are), takes [e, e + n) with a CAS on
 * enqueue_pos, claims each cell with a CAS seq: pos -> CLAIM, fills it and
 * publishes it with a release CAS CLAIM -> pos + 1. A batch is contiguous,
 * so a message that fits the queue is never interleaved with another
 * sender's cells; a longer one streams in batches and the receiver
 * reassembles it per sender. The claim word names the claimer, so the
 * consumer can skip the cell of a producer that died holding it; a free
 * cell behind enqueue_pos for QUEUE_SKIP_NS (its producer died between
 * its two CASes) is skipped too. A late producer whose CAS fails knows
 * its cell was skipped: it publishes what it still holds as padding and
 * sends the message again.
 *
 * The consumer keeps its position locally (q_head). A receive from one
 * sender that finds other senders' cells at the head moves them to
 * per-sender backlogs in local memory (bounded), delivered later in
 * order. IVSHM_ANY polls the backlogs, the active fast channels and the
 * queue head round robin: O(backlogs + channels), never O(peers).
 *
 * Producers may be hostile: every header field is loaded once into a
 * local copy and validated before it sizes a copy, every shared position
 * is checked against local state, and every wait ends by the caller's
 * deadline.
 *
 * Zero-copy: on a fast ring send_reserve hands out the payload of the
 * slot at tx_head (nothing moves) and send_commit publishes it; through
 * the queue a reservation is staged in local memory and the commit
 * copies it into a cell (claiming a cell early would block the queue for
 * everybody while the caller fills it). recv_peek hands out the payload
 * of the message where it lies (ring slot, queue cell or backlog) and
 * recv_release consumes it.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(struct ivshm_slot) == IVSHM_SLOT_HDR,
               "slot header is IVSHM_SLOT_HDR bytes");
_Static_assert(sizeof(struct ivshm_cell) == IVSHM_SLOT_HDR,
               "cell header is IVSHM_SLOT_HDR bytes");
_Static_assert(sizeof(struct ivshm_queue_ctrl) == IVSHM_QUEUE_CTRL,
               "queue ctrl size");
_Static_assert(sizeof(struct ivshm_fast_desc) == IVSHM_FAST_DESC,
               "descriptor size");
_Static_assert(IVSHM_MAX_PEERS <= 1024, "CLAIM holds 10 bits of slot");

/* While streaming a large message, ring a sleeping receiver at least
   every this many fragments instead of only when we run out of space. */
#define KICK_EVERY 8

/* Drops of stale cells in one receive call: a producer that keeps
   writing stale slots must not hold us in the loop. */
#define MAX_DROPS_PER_CALL(h) ((h)->ring_slots + (h)->queue_slots)

/* A free cell behind enqueue_pos this long: its producer died (or was
   descheduled) between taking the position and claiming the cell. Its
   claim CAS fails afterwards, so skipping never loses a live message. */
#define QUEUE_SKIP_NS 2000000000ull
/* A cell claimed this long gets its claimer's liveness probed (and again
   after as long): a dead claimer's cell is skipped. */
#define CLAIM_PROBE_NS 1000000ull
/* Bound on what the backlogs hold (payload + record headers). */
#define BACKLOG_MAX_BYTES (64ull << 20)
/* No channel was free: queue sends before we look again. */
#define OPEN_RETRY 64
/* Empty receive polls between two looks at the clock for a sweep of
   descriptors left by departed senders. */
#define SWEEP_POLLS 4096
#define SWEEP_EVERY_NS 200000000ull

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
    return ivshm_fring(h, slot, (uint32_t)h->peers[slot].tx_chan);
}

static inline uint8_t *rx_ring(const ivshm *h, int slot)
{
    return ivshm_fring(h, h->self, (uint32_t)h->peers[slot].rx_chan);
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

/* ------------------------------------------------------------------ */
/* sending on a fast ring                                             */
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
    /* also resets our view if a new incarnation took the slot */
    if (!ivshm_peer_current(h, slot))
        return IVSHM_EPEERDEAD;
    return 0;
}

static void count_sent(ivshm *h, size_t len)
{
    h->stats.sends++;
    h->stats.bytes_sent += len;
}

/* A whole message is out: show it and wake the consumer if it sleeps. */
static void tx_done(ivshm *h, int slot, struct ivshm_ring_ctrl *ctrl,
                    size_t len)
{
    atomic_store_explicit(&ctrl->head, h->peers[slot].tx_head,
                          memory_order_relaxed);
    ivshm_kick(h, slot);
    count_sent(h, len);
}

/* A message on our fast ring to `slot`: validated arguments, the
   registry says the peer is the one we know, the cached tail says there
   is room, one slot written, one release store, a fence and a look at
   `sleeping`. timeout_ms: 0 all-or-nothing without waiting (try_send);
   -1 wait as long as the consumer lives, fragment by fragment (send);
   > 0 wait until `deadline`, for the whole message at once if it fits
   the ring. */
static int ring_send(ivshm *h, int slot, uint32_t tag, const void *buf,
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

/* ------------------------------------------------------------------ */
/* sending through the receiver's queue                               */
/* ------------------------------------------------------------------ */

/* Is the cell of enqueue_pos + n - 1 free, that is, could n cells be
   taken now? Two loads; a garbled enqueue_pos looks like "no room". */
static bool q_room(const ivshm *h, int j, uint32_t n)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, j);
    uint64_t e = atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
    uint64_t seq = atomic_load_explicit(&ivshm_qcell(h, j, e + n - 1)->seq,
                                        memory_order_acquire);
    return seq == e + n - 1;
}

/* Take positions [*pos, *pos + n) of Q(j): 0, or -EAGAIN when there is
   no room for n cells (also while a co-tenant garbles enqueue_pos: the
   queue then looks full until its consumer puts it back). Bounded: a
   writer that keeps moving enqueue_pos cannot hold us here. */
static int q_take(ivshm *h, int j, uint32_t n, uint64_t *pos)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, j);
    uint64_t e = atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
    for (unsigned tries = 0; tries < 4096; tries++) {
        /* acquire: the consumer's reads of the cell are done */
        uint64_t seq = atomic_load_explicit(
            &ivshm_qcell(h, j, e + n - 1)->seq, memory_order_acquire);
        if (seq != e + n - 1) {
            uint64_t again =
                atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
            if (again == e)
                return -EAGAIN;
            e = again; /* another producer took positions: look again */
            continue;
        }
        if (atomic_compare_exchange_weak_explicit(&qc->enqueue_pos, &e, e + n,
                                                  memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *pos = e;
            return 0;
        }
    }
    return -EAGAIN;
}

/* What a batch of cells carries: the next bytes of a message, or one
   control cell (ctl = CELL_OPEN, total = the channel). */
struct q_batch {
    uint32_t tag;
    uint16_t ctl;
    bool starts;         /* the first cell is the message's FIRST */
    uint64_t total;
    const uint8_t *src;  /* bytes not sent yet */
    size_t left;
};

/* Write a cell we hold (claimed) and publish it: CAS, because the
   consumer may have skipped it as abandoned. False if it did. */
static bool q_publish(ivshm *h, int j, uint64_t pos, uint32_t len,
                      uint32_t tag, uint16_t flags, uint64_t total,
                      const uint8_t *src)
{
    struct ivshm_cell *c = ivshm_qcell(h, j, pos);
    c->len = len;
    c->tag = tag;
    c->gen = h->self_gen;
    c->flags = flags;
    c->src = (uint16_t)h->self;
    c->total = total;
    if (len)
        memcpy(slot_data(c), src, len);
    uint64_t mine = ivshm_claim_word(pos, h->self, h->self_gen);
    /* release: the header and payload are visible before seq says full */
    return atomic_compare_exchange_strong_explicit(
        &c->seq, &mine, pos + 1, memory_order_release, memory_order_relaxed);
}

static bool q_claim(ivshm *h, int j, uint64_t pos)
{
    uint64_t want = pos;
    /* acquire: the consumer's last reads of the cell happen before ours */
    return atomic_compare_exchange_strong_explicit(
        &ivshm_qcell(h, j, pos)->seq, &want,
        ivshm_claim_word(pos, h->self, h->self_gen), memory_order_acquire,
        memory_order_relaxed);
}

/* Claim, fill and publish the n cells from `pos` (taken by q_take).
   0, or -ESTALE when a cell was taken from us (skipped by the consumer
   as abandoned, or written by a co-tenant): every cell we still held is
   then published as padding, which the consumer drops, and *b is left
   where the batch started. */
static int q_fill(ivshm *h, int j, uint64_t pos, uint32_t n, struct q_batch *b)
{
    uint32_t held = 0;
    while (held < n && q_claim(h, j, pos + held))
        held++;
    bool lost = held < n;
    /* cells after a lost one: claimed only to be padded, so the consumer
       does not wait QUEUE_SKIP_NS for each */
    for (uint32_t i = held + 1; lost && i < n; i++)
        if (q_claim(h, j, pos + i))
            q_publish(h, j, pos + i, 0, 0, CELL_PAD, 0, NULL);
    const uint32_t payload = slot_payload(h);
    struct q_batch start = *b;
    for (uint32_t i = 0; i < held; i++) {
        bool ok;
        if (lost) {
            ok = q_publish(h, j, pos + i, 0, 0, CELL_PAD, 0, NULL);
        } else if (b->ctl) {
            ok = q_publish(h, j, pos + i, 0, b->tag, b->ctl, b->total, NULL);
        } else {
            uint32_t m = b->left < payload ? (uint32_t)b->left : payload;
            uint16_t fl = (b->starts && i == 0 ? SLOT_FIRST : 0) |
                          (m == b->left ? SLOT_LAST : 0);
            ok = q_publish(h, j, pos + i, m, b->tag, fl, b->total, b->src);
            b->src += m;
            b->left -= m;
        }
        lost |= !ok;
    }
    if (lost)
        *b = start;
    return lost ? -ESTALE : 0;
}

struct qspace_wait {
    int j;
    uint32_t n;
};

/* Room for n cells in Q(j)? If not, put our bit in its waiters and look
   again: the consumer frees a cell, fences and reads waiters_any; we set
   waiters_any, fence and read the cell (Dekker), so one of us sees the
   other and a wake-up cannot be lost. */
static bool q_space_ready(ivshm *h, void *arg)
{
    const struct qspace_wait *w = arg;
    if (q_room(h, w->j, w->n))
        return true;
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, w->j);
    _Atomic uint64_t *word = &qc->waiters[h->self / 64];
    uint64_t bit = 1ull << (h->self % 64);
    if (!(atomic_load_explicit(word, memory_order_relaxed) & bit))
        atomic_fetch_or(word, bit);
    if (!atomic_load_explicit(&qc->waiters_any, memory_order_relaxed))
        atomic_store(&qc->waiters_any, 1);
    atomic_thread_fence(memory_order_seq_cst);
    return q_room(h, w->j, w->n);
}

/* Send one message (or one control cell) through Q(j). timeout_ms as in
   ring_send. A message of at most queue_slots cells is one batch, all or
   nothing; a longer one streams in batches of half the queue, so other
   senders get turns in between. */
static int q_send(ivshm *h, int j, uint32_t tag, const void *buf, size_t len,
                  uint16_t ctl, uint64_t ctl_total, int timeout_ms,
                  uint64_t deadline)
{
    const uint32_t payload = slot_payload(h);
    const uint64_t nfrag =
        ctl || len <= payload ? 1 : (len - 1) / payload + 1;
    const bool whole = nfrag <= h->queue_slots;
    if (!whole && timeout_ms == 0)
        return -EMSGSIZE;
    const uint32_t batch_max =
        whole ? (uint32_t)nfrag
              : (h->queue_slots / 2 ? h->queue_slots / 2 : 1);
    struct q_batch b = {.tag = tag, .ctl = ctl, .starts = true,
                        .total = ctl ? ctl_total : len, .src = buf,
                        .left = len};
    uint64_t left = nfrag;
    while (left) {
        uint32_t n = left < batch_max ? (uint32_t)left : batch_max;
        uint64_t pos;
        int rc = q_take(h, j, n, &pos);
        if (rc == -EAGAIN) {
            if (timeout_ms == 0)
                return -EAGAIN;
            int ms = ms_left(deadline);
            if (ms == -ETIMEDOUT)
                return ms; /* mid-stream: a cut message, see ring_send */
            struct qspace_wait w = {j, n};
            rc = ivshm_wait(h, q_space_ready, &w, j, h->peers[j].gen, ms);
            if (rc < 0)
                return rc;
            continue;
        }
        rc = q_fill(h, j, pos, n, &b);
        ivshm_kick(h, j);
        if (rc == -ESTALE) {
            if (!b.starts)
                return IVSHM_ECORRUPT; /* cut after earlier batches */
            if (timeout_ms == 0)
                return -EAGAIN;
            if (ms_left(deadline) == -ETIMEDOUT)
                return -ETIMEDOUT;
            continue; /* nothing of it was delivered: again */
        }
        b.starts = false;
        left -= n;
    }
    return 0;
}

/* Take a free fast channel of `j`'s area: its index, or -1. */
static int chan_claim(ivshm *h, int j)
{
    const uint64_t mine =
        (uint64_t)(h->self + 1) | (uint64_t)h->self_gen << 32;
    for (uint32_t k = 0; k < h->fast_channels; k++) {
        struct ivshm_fast_desc *d = ivshm_fdesc(h, j, k);
        uint64_t cur = atomic_load_explicit(&d->owner, memory_order_relaxed);
        /* acquire: the receiver's reset of the ring happened before it
           freed the descriptor (release) */
        if (cur == 0 &&
            atomic_compare_exchange_strong_explicit(&d->owner, &cur, mine,
                                                    memory_order_acquire,
                                                    memory_order_relaxed))
            return (int)k;
    }
    return -1;
}

/* Enough messages went to `j` through its queue: take one of its fast
   channels and announce it with an OPEN cell. From then on everything
   goes on that ring; the OPEN cell orders it after what we queued. */
static void tx_try_open(ivshm *h, int j, int timeout_ms, uint64_t deadline)
{
    struct ivshm_peer_local *p = &h->peers[j];
    if (p->tx_retry) {
        p->tx_retry--;
        return;
    }
    int k = chan_claim(h, j);
    if (k < 0) {
        p->tx_retry = OPEN_RETRY;
        return;
    }
    int rc = q_send(h, j, 0, NULL, 0, CELL_OPEN, (uint64_t)k, timeout_ms,
                    deadline);
    if (rc < 0) {
        /* not announced: give it back (CAS: a reset by the receiver
           meanwhile made it somebody else's business) */
        uint64_t mine = (uint64_t)(h->self + 1) | (uint64_t)h->self_gen << 32;
        atomic_compare_exchange_strong(&ivshm_fdesc(h, j, (uint32_t)k)->owner,
                                       &mine, 0);
        p->tx_retry = 8;
        return;
    }
    p->tx_chan = (int16_t)k;
    p->tx_head = 0;
    p->tx_tail_cache = 0;
}

static inline bool want_channel(const ivshm *h, const struct ivshm_peer_local *p)
{
    return p->tx_chan < 0 && h->fast_channels && p->tx_queued >= h->fast_after;
}

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
    /* no clock read on the try_send / send fast paths */
    const uint64_t deadline =
        timeout_ms < 0    ? UINT64_MAX
        : timeout_ms == 0 ? 0
                          : ivshm_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    /* Hot path once the channel is open: one compare, then the ring. */
    if (p->tx_chan >= 0)
        return ring_send(h, slot, tag, buf, len, timeout_ms, deadline);
    if (want_channel(h, p)) {
        tx_try_open(h, slot, timeout_ms, deadline);
        if (p->tx_chan >= 0)
            return ring_send(h, slot, tag, buf, len, timeout_ms, deadline);
    }
    rc = q_send(h, slot, tag, buf, len, 0, 0, timeout_ms, deadline);
    if (rc == 0) {
        if (p->tx_queued != UINT32_MAX)
            p->tx_queued++;
        count_sent(h, len);
    }
    return rc;
}

int ivshm_fast_open(ivshm *h, int slot)
{
    int rc = tx_begin(h, slot, 0);
    if (rc < 0 || !h->fast_channels)
        return rc < 0 ? rc : -ENOTSUP;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->tx_chan < 0) {
        p->tx_retry = 0;
        tx_try_open(h, slot, -1, UINT64_MAX);
    }
    return p->tx_chan >= 0 ? 0 : -EAGAIN;
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

/* On a fast ring: the payload of the slot at tx_head, if the ring has
   room for it; tx_head does not move, so an abandoned reservation costs
   nothing. Through the queue: a local stage, if the queue has room now. */
void *ivshm_send_reserve(ivshm *h, int slot, size_t len, int *err)
{
    int rc = tx_begin(h, slot, len);
    if (rc == 0 && len > slot_payload(h))
        rc = -EMSGSIZE;
    struct ivshm_peer_local *p = rc == 0 ? &h->peers[slot] : NULL;
    void *out = NULL;
    if (rc == 0 && want_channel(h, p))
        tx_try_open(h, slot, 0, 0);
    if (rc == 0 && p->tx_chan >= 0) {
        uint8_t *ring = tx_ring(h, slot);
        rc = tx_reserve(h, slot, (struct ivshm_ring_ctrl *)ring, 1);
        if (rc == 0) {
            p->reserve_kind = SRC_RING;
            out = slot_data(slot_at(h, ring, p->tx_head));
        }
    } else if (rc == 0) {
        if (!q_room(h, slot, 1))
            rc = -EAGAIN;
        else if (!p->tx_stage && !(p->tx_stage = malloc(slot_payload(h))))
            rc = -ENOMEM;
        p->reserve_kind = SRC_QUEUE;
        out = p->tx_stage;
    }
    if (err)
        *err = rc;
    if (rc < 0)
        return NULL;
    p->reserved = true;
    return out;
}

/* Publish the reservation as one message of `len` bytes: the same
   release store and kick as a copying send. On a ring the reservation
   proved the room (the tail only moves forward); through the queue the
   staged bytes are copied into a cell, and if other senders took the
   room meanwhile it is -EAGAIN with the reservation kept. */
int ivshm_send_commit(ivshm *h, int slot, uint32_t tag, size_t len)
{
    int rc = tx_begin(h, slot, len);
    if (rc < 0)
        return rc;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (!p->reserved || len > slot_payload(h))
        return -EINVAL;
    if (p->reserve_kind == SRC_QUEUE) {
        if (!p->tx_stage)
            return -EINVAL;
        rc = q_send(h, slot, tag, p->tx_stage, len, 0, 0, 0, 0);
        if (rc == -EAGAIN)
            return rc;
        p->reserved = false;
        if (rc == 0) {
            if (p->tx_queued != UINT32_MAX)
                p->tx_queued++;
            count_sent(h, len);
        }
        return rc;
    }
    if (p->tx_chan < 0)
        return -EINVAL;
    uint8_t *ring = tx_ring(h, slot);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    p->reserved = false;
    tx_publish(h, ring, p->tx_head, tag, SLOT_FIRST | SLOT_LAST, len, NULL,
               (uint32_t)len);
    p->tx_head++;
    tx_done(h, slot, ctrl, len);
    return 0;
}

/* ------------------------------------------------------------------ */
/* receiving: our area                                                */
/* ------------------------------------------------------------------ */

/* Which incarnation of a sender we read from. */
enum rx_view {
    RX_NONE, /* nobody: free since we joined, or being claimed */
    RX_LIVE, /* ACTIVE: we free slots and wake it */
    RX_GONE, /* left or died: drain what it published, read-only */
};

/* Refresh our local view of the sender in `slot`. A sender that left or
   died keeps its generation in the registry until the slot is claimed
   again: so what it published is still that generation's and may be
   delivered. We never write the tail of a departed sender's ring. */
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

/* The next cell of one sender, wherever it lies. */
struct cref {
    int kind;            /* SRC_* */
    struct frag f;       /* validated by the caller before use */
    const uint8_t *data; /* payload: backlog record, ring slot or cell */
};

/* ---- fast channels of our area ---- */

/* Empty fast ring k and free its descriptor for the next sender. */
static void chan_reset(ivshm *h, uint32_t k)
{
    uint8_t *ring = ivshm_fring(h, h->self, k);
    struct ivshm_ring_ctrl *c = (struct ivshm_ring_ctrl *)ring;
    atomic_store_explicit(&c->head, 0, memory_order_relaxed);
    atomic_store_explicit(&c->tail, 0, memory_order_relaxed);
    for (uint32_t i = 0; i < h->ring_slots; i++)
        atomic_store_explicit(&slot_at(h, ring, i)->seq, 0,
                              memory_order_relaxed);
    /* release: a claimer (acquire) finds the ring empty */
    atomic_store_explicit(&ivshm_fdesc(h, h->self, k)->owner, 0,
                          memory_order_release);
}

/* Sender `slot` no longer uses its channel (gone and drained, or a new
   incarnation): free it. */
static void chan_free(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint32_t k = (uint32_t)p->rx_chan;
    chan_reset(h, k);
    p->rx_chan = -1;
    h->chan_user[k] = -1;
    for (int x = 0; x < h->n_act; x++)
        if (h->act[x] == slot) {
            h->act[x] = h->act[--h->n_act];
            break;
        }
}

/* Descriptors taken by senders that left or died before their OPEN
   arrived (or scribbled on): free them. Only while our queue and
   backlogs are empty, so no OPEN of theirs can still be on its way. */
void ivshm_fast_sweep(ivshm *h)
{
    if (h->self < 0 || h->n_bl)
        return;
    uint64_t pos = h->q_head;
    struct ivshm_cell *c = ivshm_qcell(h, h->self, pos);
    if (atomic_load_explicit(&c->seq, memory_order_acquire) != pos ||
        atomic_load_explicit(&ivshm_qctrl(h, h->self)->enqueue_pos,
                             memory_order_relaxed) != pos)
        return;
    for (uint32_t k = 0; k < h->fast_channels; k++) {
        if (h->chan_user[k] >= 0)
            continue;
        uint64_t owner = atomic_load_explicit(
            &ivshm_fdesc(h, h->self, k)->owner, memory_order_relaxed);
        if (!owner)
            continue;
        uint32_t s = (uint32_t)owner - 1, g = (uint32_t)(owner >> 32);
        if (s < h->max_peers && (int)s != h->self && g != 0 &&
            ivshm_peer_alive(h, (int)s, g))
            continue; /* its OPEN may still come */
        chan_reset(h, k);
    }
}

uint8_t *ivshm_fast_ring_of(const ivshm *h, int from, int to)
{
    if (!ivshm_slot_ok(h, from) || !ivshm_slot_ok(h, to))
        return NULL;
    for (uint32_t k = 0; k < h->fast_channels; k++) {
        uint64_t owner = atomic_load_explicit(&ivshm_fdesc(h, to, k)->owner,
                                              memory_order_relaxed);
        if (owner && (uint32_t)owner == (uint32_t)from + 1)
            return ivshm_fring(h, to, k);
    }
    return NULL;
}

/* ---- backlogs ---- */

static void bl_pop(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    struct ivshm_backlog *b = p->bl_head;
    if (!b)
        return;
    p->bl_head = b->next;
    if (!p->bl_head)
        p->bl_tail = NULL;
    h->bl_bytes -= sizeof *b + b->len;
    free(b);
    if (--p->bl_count == 0)
        for (int x = 0; x < h->n_bl; x++)
            if (h->bl_list[x] == slot) {
                h->bl_list[x] = h->bl_list[--h->n_bl];
                break;
            }
}

static void bl_clear(ivshm *h, int slot)
{
    while (h->peers[slot].bl_head)
        bl_pop(h, slot);
}

/* ---- our queue, consumer side ---- */

/* Producers waiting for room in our queue: wake them (see q_space_ready
   for the pairing). Called after we freed cells. */
static void q_wake_waiters(ivshm *h)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, h->self);
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(&qc->waiters_any, memory_order_relaxed))
        return;
    atomic_store(&qc->waiters_any, 0);
    uint32_t words = (h->max_peers + 63) / 64;
    for (uint32_t w = 0; w < words; w++) {
        if (!atomic_load_explicit(&qc->waiters[w], memory_order_relaxed))
            continue;
        uint64_t m = atomic_exchange(&qc->waiters[w], 0);
        for (; m; m &= m - 1) {
            uint32_t s = w * 64 + (uint32_t)__builtin_ctzll(m);
            if (s < h->max_peers && (int)s != h->self)
                ivshm_kick(h, (int)s);
        }
    }
}

/* The cell at q_head is done with (consumed or dropped; `seq` is what we
   saw there, for the CAS of a cell somebody else may still write). */
static bool q_advance(ivshm *h, uint64_t seq, bool cas)
{
    struct ivshm_cell *c = ivshm_qcell(h, h->self, h->q_head);
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
    atomic_store_explicit(&ivshm_qctrl(h, h->self)->head, h->q_head,
                          memory_order_relaxed);
    h->q_stuck_since = 0;
    if (h->q_peek_src >= 0) {
        h->peers[h->q_peek_src].peeked = false;
        h->q_peek_src = -1;
    }
    q_wake_waiters(h);
    return true;
}

enum { Q_EMPTY, Q_WAIT, Q_FULL };

/* A cell at q_head, validated as far as the queue goes. */
struct qhead {
    int src;
    struct frag f;
    const uint8_t *data;
};

/* Has the cell at q_head shown `seq` for `ns` already? Starts the clock
   the first time a value is seen. */
static bool q_stuck_for(ivshm *h, uint64_t seq, uint64_t ns)
{
    uint64_t now = ivshm_now_ns();
    if (h->q_stuck_since == 0 || h->q_stuck_seq != seq) {
        h->q_stuck_seq = seq;
        h->q_stuck_since = now;
        return false;
    }
    if (now - h->q_stuck_since < ns)
        return false;
    h->q_stuck_since = now; /* probed: the next probe after ns again */
    return true;
}

/* Look at the head of our queue: Q_FULL with *out filled (a message
   cell of a sender we know, in the generation we know), Q_EMPTY, or
   Q_WAIT (a producer is still writing the head cell). Padding, stale
   cells, cells of dead claimers and garbage are dropped on the way; the
   loop is bounded by the queue's size. */
static int q_front(ivshm *h, struct qhead *out)
{
    for (uint32_t round = 0; round < h->queue_slots; round++) {
        const uint64_t pos = h->q_head;
        struct ivshm_cell *c = ivshm_qcell(h, h->self, pos);
        uint64_t seq = atomic_load_explicit(&c->seq, memory_order_acquire);
        if (seq == pos + 1) {
            uint16_t src = __atomic_load_n(&c->src, __ATOMIC_RELAXED);
            uint16_t flags = __atomic_load_n(&c->flags, __ATOMIC_RELAXED);
            out->f.len = __atomic_load_n(&c->len, __ATOMIC_RELAXED);
            out->f.tag = __atomic_load_n(&c->tag, __ATOMIC_RELAXED);
            out->f.gen = __atomic_load_n(&c->gen, __ATOMIC_RELAXED);
            out->f.total = __atomic_load_n(&c->total, __ATOMIC_RELAXED);
            out->f.flags = flags;
            bool drop = src >= h->max_peers || (int)src == h->self ||
                        (flags & CELL_PAD);
            if (!drop) {
                /* stale: a generation of the sender that is not the one
                   we deliver from (an earlier one, or a slot being
                   claimed) */
                drop = rx_view(h, src) == RX_NONE ||
                       out->f.gen != h->peers[src].gen ||
                       (h->listen_only && h->listen_gen[src] != out->f.gen);
                h->stats.dropped += drop;
            }
            if (drop) {
                q_advance(h, seq, false);
                continue;
            }
            out->src = src;
            out->data = slot_data(c);
            return Q_FULL;
        }
        if (seq == pos) {
            struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, h->self);
            uint64_t e =
                atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
            if (e == pos) {
                h->q_stuck_since = 0;
                return Q_EMPTY;
            }
            if (e - pos > h->queue_slots) {
                /* No producer can take a position beyond a cell we have
                   not freed: garbage. Put ours back, wake the producers
                   it made wait. */
                atomic_compare_exchange_strong(&qc->enqueue_pos, &e, pos);
                q_wake_waiters(h);
                return Q_EMPTY;
            }
            /* Taken, not claimed yet: wait, unless for QUEUE_SKIP_NS.
               The producer that took it took the cells after it in the
               same CAS: those (up to the enqueue_pos seen now) go without
               another wait. A live producer among them finds its claim
               failing and sends again. */
            if (pos >= h->q_skip_until && !q_stuck_for(h, seq, QUEUE_SKIP_NS))
                return Q_WAIT;
            if (!q_advance(h, seq, true))
                return Q_WAIT;
            if (pos >= h->q_skip_until)
                h->q_skip_until = e;
            h->stats.dropped++;
            continue;
        }
        if ((seq & CELL_CLAIM) && (uint32_t)seq == (uint32_t)pos) {
            uint32_t who = (uint32_t)(seq >> 53) & 0x3ffu;
            uint32_t g = (uint32_t)(seq >> 32) & CLAIM_GEN_MASK;
            if (who < h->max_peers && (int)who != h->self) {
                if (!q_stuck_for(h, seq, CLAIM_PROBE_NS))
                    return Q_WAIT;
                struct ivshm_peer_entry *e = ivshm_entry(h, (int)who);
                uint32_t eg = atomic_load_explicit(&e->gen, memory_order_relaxed);
                if ((eg & CLAIM_GEN_MASK) == g &&
                    ivshm_peer_alive(h, (int)who, eg))
                    return Q_WAIT; /* a live producer is writing it */
            }
        }
        /* A dead claimer's cell, or a value no producer writes: skip it.
           CAS: a producer may be claiming or publishing right now. The
           rest of a dead claimer's batch (free cells up to the
           enqueue_pos seen now) goes without the QUEUE_SKIP_NS wait. */
        uint64_t e = atomic_load_explicit(
            &ivshm_qctrl(h, h->self)->enqueue_pos, memory_order_relaxed);
        if (!q_advance(h, seq, true))
            continue;
        if (e - pos <= h->queue_slots && e > h->q_skip_until)
            h->q_skip_until = e;
        h->stats.dropped++;
    }
    return Q_WAIT;
}

/* Move the head cell (of q->src) to its sender's backlog. Refused while
   a peeked message lies at the head (its pointer must stay good), when
   the backlogs are at their bound, or out of memory. */
static int q_to_backlog(ivshm *h, const struct qhead *q)
{
    if (h->q_peek_src >= 0)
        return -EAGAIN;
    struct frag f = q->f;
    if (f.len > slot_payload(h)) {
        f.len = 0;        /* kept as a marker: reported as corrupt */
        f.flags = 0xffff;
    }
    if (h->bl_bytes + sizeof(struct ivshm_backlog) + f.len > BACKLOG_MAX_BYTES)
        return -ENOBUFS;
    struct ivshm_backlog *b = malloc(sizeof *b + f.len);
    if (!b)
        return -ENOMEM;
    b->next = NULL;
    b->len = f.len;
    b->tag = f.tag;
    b->gen = f.gen;
    b->flags = f.flags;
    b->total = f.total;
    if (f.len)
        memcpy(b->data, q->data, f.len);
    struct ivshm_peer_local *p = &h->peers[q->src];
    if (p->bl_tail)
        p->bl_tail->next = b;
    else
        p->bl_head = b;
    p->bl_tail = b;
    if (p->bl_count++ == 0)
        h->bl_list[h->n_bl++] = q->src;
    h->bl_bytes += sizeof *b + f.len;
    q_advance(h, 0, false);
    return 0;
}

/* The next cell of sender `slot`: its backlog first, then its fast ring
   if it has one, else our queue's head if it is that sender's. `drain`:
   other senders' cells at the head are moved to their backlogs to get
   at this sender's. 1 with *c filled, 0 if there is none (yet). A ring
   found empty gets its tail checked (rx_heal_tail); a departed sender's
   drained ring is freed. */
static void rx_heal_tail(ivshm *h, int slot, uint8_t *ring);
static int next_cell(ivshm *h, int slot, enum rx_view view, bool drain,
                     struct cref *c)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->bl_head) {
        const struct ivshm_backlog *b = p->bl_head;
        c->kind = SRC_BACKLOG;
        c->f = (struct frag){b->len, b->tag, b->gen, b->flags, b->total};
        c->data = b->data;
        return 1;
    }
    if (p->rx_chan >= 0) {
        uint8_t *ring = rx_ring(h, slot);
        struct ivshm_slot *s = slot_at(h, ring, p->rx_tail);
        if (slot_full(s, p->rx_tail)) {
            c->kind = SRC_RING;
            frag_read(s, &c->f);
            c->data = slot_data(s);
            return 1;
        }
        if (view == RX_LIVE) {
            rx_heal_tail(h, slot, ring);
            return 0;
        }
        chan_free(h, slot);
    }
    for (;;) {
        struct qhead q;
        if (q_front(h, &q) != Q_FULL)
            return 0;
        if (q.src == slot) {
            c->kind = SRC_QUEUE;
            c->f = q.f;
            c->data = q.data;
            return 1;
        }
        if (!drain || q_to_backlog(h, &q) < 0)
            return 0;
    }
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

/* The cell next_cell returned is done with. */
static void consume_cell(ivshm *h, int slot, const struct cref *c,
                         enum rx_view view)
{
    h->peers[slot].peeked = false;
    switch (c->kind) {
    case SRC_BACKLOG:
        bl_pop(h, slot);
        break;
    case SRC_RING:
        rx_consume(h, slot, rx_ring(h, slot), view);
        break;
    case SRC_QUEUE:
        q_advance(h, 0, false);
        break;
    }
}

/* An OPEN cell of `slot`: from now on it sends on fast channel k of our
   area. Accepted only if the descriptor says so (loaded once): the
   sender took it with its slot and generation. */
static int rx_open(ivshm *h, int slot, const struct cref *c, enum rx_view view)
{
    uint64_t k = c->f.total;
    consume_cell(h, slot, c, view);
    struct ivshm_peer_local *p = &h->peers[slot];
    uint64_t want = (uint64_t)(slot + 1) | (uint64_t)p->gen << 32;
    bool ok = k < h->fast_channels && p->rx_chan < 0 &&
              h->chan_user[k] < 0 &&
              atomic_load_explicit(&ivshm_fdesc(h, h->self, (uint32_t)k)->owner,
                                   memory_order_acquire) == want;
    if (!ok) {
        /* a departed sender's descriptor may have been swept already */
        h->stats.dropped++;
        return view == RX_LIVE ? IVSHM_ECORRUPT : 0;
    }
    p->rx_chan = (int16_t)k;
    p->rx_tail = 0;
    h->chan_user[k] = slot;
    h->act[h->n_act++] = slot;
    return 0;
}

/* Store what fits of a validated fragment (len <= payload) below `keep`. */
static inline void copy_out(void *buf, uint64_t keep, uint64_t *stored,
                            const uint8_t *data, uint32_t len)
{
    if (*stored >= keep || len == 0)
        return;
    uint64_t n = keep - *stored < len ? keep - *stored : len;
    memcpy((uint8_t *)buf + *stored, data, n);
    *stored += n;
}

static inline bool flags_bad(uint32_t flags)
{
    return (flags & ~(uint32_t)(SLOT_FIRST | SLOT_LAST)) != 0;
}

/* The message in progress from `slot` is given up (error, or a new
   incarnation): what was staged goes, its stream moves on. */
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
static void stage_append(struct ivshm_peer_local *p, const uint8_t *data,
                         uint32_t len)
{
    if (p->rx_kept >= p->rx_keep || len == 0)
        return;
    uint64_t n = p->rx_keep - p->rx_kept < len ? p->rx_keep - p->rx_kept : len;
    if (!stage_room(p, p->rx_kept + n))
        return;
    memcpy(p->rx_stage + p->rx_kept, data, n);
    p->rx_kept += n;
}

struct cell_wait {
    int slot;
    enum rx_view view;
};

static bool cell_ready(ivshm *h, void *arg)
{
    const struct cell_wait *w = arg;
    struct cref c;
    return next_cell(h, w->slot, w->view, true, &c) > 0;
}

/* Mid-message: wait for the next fragment until `deadline` (0: not at
   all), spinning as a receive between messages would. 0 when it is
   there, -ETIMEDOUT, IVSHM_EPEERDEAD once a dead sender's last published
   fragment is gone (a death turns *view into RX_GONE). */
static int rx_wait_fragment(ivshm *h, int slot, enum rx_view *view,
                            uint64_t deadline)
{
    struct cell_wait w = {slot, *view};
    if (*view == RX_LIVE) {
        int ms = deadline == 0 ? -ETIMEDOUT : ms_left(deadline);
        if (ms == -ETIMEDOUT)
            return -ETIMEDOUT;
        int rc = ivshm_wait(h, cell_ready, &w, slot, h->peers[slot].gen, ms);
        if (rc != IVSHM_EPEERDEAD)
            return rc;
        *view = w.view = RX_GONE;
    }
    /* gone: what it published before dying is still ours */
    return cell_ready(h, &w) ? 0 : IVSHM_EPEERDEAD;
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
   forever); when it passes -- checked also between long runs of
   fragments, so a sender streaming without end cannot hold us -- the
   message stays in progress (the stored prefix staged) and the call
   returns -EAGAIN. Invariant: rx_left = bytes not consumed yet. */
static ssize_t rx_fragments(ivshm *h, int slot, enum rx_view view,
                            uint32_t *tag, void *buf, size_t cap,
                            uint64_t stored, uint64_t deadline, bool staged)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);
    const uint32_t run_max = h->ring_slots + h->queue_slots;
    uint32_t run = 0;
    while (p->rx_left) {
        struct cref c;
        int rc = 0;
        if (!next_cell(h, slot, view, true, &c)) {
            run = 0;
            rc = rx_wait_fragment(h, slot, &view, deadline);
            if (rc == IVSHM_EPEERDEAD) {
                rx_abandon(p);
                return rc;
            }
            if (rc == 0)
                continue; /* there now: take it through next_cell */
        } else if (++run == run_max) {
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
        if (c.kind == SRC_RING && c.f.gen != p->gen) {
            rx_abandon(p);
            if (c.f.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                                memory_order_relaxed))
                return IVSHM_EPEERDEAD; /* new incarnation; leave its slot */
            consume_cell(h, slot, &c, view);
            return IVSHM_ECORRUPT;
        }
        if (c.f.flags & (SLOT_FIRST | CELL_OPEN)) {
            /* the sender gave up on this message (send deadline): leave
               the cell, it may start a good message */
            rx_abandon(p);
            return IVSHM_ECORRUPT;
        }
        bool is_last = c.f.flags & SLOT_LAST;
        if (flags_bad(c.f.flags) || c.f.len == 0 || c.f.len > payload ||
            c.f.len > p->rx_left || is_last != (c.f.len == p->rx_left) ||
            c.f.tag != p->rx_tag || c.f.total != p->rx_total) {
            rx_abandon(p);
            consume_cell(h, slot, &c, view);
            return IVSHM_ECORRUPT;
        }
        if (staged)
            stage_append(p, c.data, c.f.len);
        else
            copy_out(buf, p->rx_keep, &stored, c.data, c.f.len);
        consume_cell(h, slot, &c, view);
        p->rx_left -= c.f.len;
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
   cell is consumed and reported as IVSHM_ECORRUPT, so a scribbled ring
   costs the scribbler's messages, not a stuck receiver. peek non-NULL: a
   valid single-slot message is left in place and *peek points at its
   payload; a longer one (or one in progress) is left: -EMSGSIZE. `drain`
   as in next_cell. */
static ssize_t rx_message(ivshm *h, int slot, uint32_t *tag, void *buf,
                          size_t cap, const void **peek, uint64_t deadline,
                          bool drain)
{
    enum rx_view view = rx_view(h, slot);
    if (view == RX_NONE)
        return -EAGAIN;
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);

    if (p->rx_partial) {
        if (peek)
            return -EMSGSIZE;
        /* Resume into the stage. The bytes delivered never grow past an
           earlier call's cap: those beyond it are gone. */
        if (p->rx_keep > cap)
            p->rx_keep = cap;
        return rx_fragments(h, slot, view, tag, buf, cap, 0, deadline, true);
    }

    struct cref c;
    for (uint32_t drops = 0;; drops++) {
        if (drops == MAX_DROPS_PER_CALL(h))
            return -EAGAIN;
        if (!next_cell(h, slot, view, drain, &c))
            return -EAGAIN;
        if (c.kind == SRC_RING && c.f.gen != p->gen) {
            if (c.f.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                                memory_order_relaxed))
                return -EAGAIN; /* the slot changed hands just now: our
                                   next call sees the new generation */
            /* written by an earlier incarnation of the sender */
            consume_cell(h, slot, &c, view);
            h->stats.dropped++;
            continue;
        }
        if (c.kind != SRC_RING && (c.f.flags & CELL_OPEN)) {
            int rc = rx_open(h, slot, &c, view);
            if (rc < 0)
                return rc;
            continue; /* its next message is on the ring */
        }
        break;
    }

    /* FIRST fragment: the whole message is described here. */
    bool last = c.f.flags & SLOT_LAST;
    if (flags_bad(c.f.flags) || !(c.f.flags & SLOT_FIRST) ||
        c.f.len > payload || c.f.total > (uint64_t)SSIZE_MAX ||
        (last ? c.f.total != c.f.len
              : (c.f.len == 0 || c.f.total <= c.f.len))) {
        consume_cell(h, slot, &c, view);
        return IVSHM_ECORRUPT;
    }
    if (peek) {
        if (!last)
            return -EMSGSIZE;
        *peek = c.data;
        *tag = c.f.tag;
        p->peek_kind = (uint8_t)c.kind;
        if (c.kind == SRC_QUEUE)
            h->q_peek_src = slot;
        return (ssize_t)c.f.len;
    }
    p->rx_partial = true;
    p->rx_tag = c.f.tag;
    p->rx_total = c.f.total;
    p->rx_keep = c.f.total < cap ? c.f.total : cap;
    p->rx_kept = 0;
    uint64_t stored = 0;
    copy_out(buf, p->rx_keep, &stored, c.data, c.f.len);
    consume_cell(h, slot, &c, view);
    p->rx_left = c.f.total - c.f.len;
    return rx_fragments(h, slot, view, tag, buf, cap, stored, deadline, false);
}

/* Round robin over the sources of IVSHM_ANY, from rr_next: the senders
   with a backlog, the senders with a fast channel, and the queue head
   (whose sender's older messages, in its backlog, go first). A busy
   sender cannot starve the others, and the cost is O(backlogs +
   channels), not O(peers). */
static ssize_t rx_any(ivshm *h, int *src, uint32_t *tag, void *buf,
                      size_t cap, const void **peek, uint64_t deadline)
{
    int n = h->n_bl + h->n_act + 1;
    int i = h->rr_next >= 0 && h->rr_next < n ? h->rr_next : 0;
    for (int k = 0; k < n; k++, i = i + 1 >= n ? 0 : i + 1) {
        /* the lists may shrink while we go (a backlog emptied, a
           departed sender's channel freed): what is out of range waits
           for the next call */
        int who;
        if (i < h->n_bl) {
            who = h->bl_list[i];
        } else if (i < h->n_bl + h->n_act) {
            who = h->act[i - h->n_bl];
        } else if (i == n - 1) {
            struct qhead q;
            if (q_front(h, &q) != Q_FULL)
                continue;
            who = q.src;
            /* A queue cell of a sender on a fast channel is out of order
               (only a co-tenant writes one): through the backlog it is
               validated and delivered, and the queue moves on. */
            if (h->peers[who].rx_chan >= 0 && q_to_backlog(h, &q) < 0)
                continue;
        } else {
            continue;
        }
        ssize_t rc = rx_message(h, who, tag, buf, cap, peek, deadline, false);
        if (rc != -EAGAIN) {
            h->rr_next = i + 1;
            *src = who;
            return rc;
        }
    }
    return -EAGAIN;
}

/* Is there a message (or fragment) of `slot` for us? */
static bool rx_has_message(ivshm *h, int slot)
{
    enum rx_view view = rx_view(h, slot);
    if (view == RX_NONE)
        return false;
    struct cref c;
    return next_cell(h, slot, view, true, &c) > 0;
}

static bool any_ready(ivshm *h, void *arg)
{
    (void)arg;
    if (h->n_bl)
        return true;
    for (int x = 0; x < h->n_act; x++)
        if (rx_has_message(h, h->act[x]))
            return true;
    struct qhead q;
    return q_front(h, &q) == Q_FULL;
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

/* Now and then, when a receive finds nothing: free descriptors of
   senders that took one and went away before using it. */
static void maybe_sweep(ivshm *h)
{
    if (++h->sweep_polls % SWEEP_POLLS)
        return;
    uint64_t now = ivshm_now_ns();
    if (now < h->next_sweep_ns)
        return;
    h->next_sweep_ns = now + SWEEP_EVERY_NS;
    ivshm_fast_sweep(h);
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
                : rx_message(h, from, &got_tag, buf, cap, NULL, deadline,
                             true);
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
        maybe_sweep(h);
        if (from != IVSHM_ANY && rx_view(h, from) != RX_LIVE) {
            /* it may have published and left since rx_message looked */
            if (rx_has_message(h, from))
                continue;
            rx_abandon(&h->peers[from]);
            return IVSHM_EPEERDEAD;
        }
        if (timeout_ms == 0)
            return -EAGAIN;
        int peer = from != IVSHM_ANY ? from : partial_sender(h);
        uint32_t peer_gen = peer >= 0 ? h->peers[peer].gen : 0;
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

int ivshm_listen_only(ivshm *h, int on)
{
    if (!h)
        return -EINVAL;
    h->listen_only = on != 0;
    return 0;
}

int ivshm_listen(ivshm *h, int slot, uint32_t generation)
{
    if (!h || !ivshm_slot_ok(h, slot))
        return -EINVAL;
    h->listen_gen[slot] = generation;
    return 0;
}

int ivshm_wait_message(ivshm *h, int timeout_ms)
{
    if (!h || h->self < 0)
        return -EINVAL;
    return ivshm_wait(h, any_ready, NULL, -1, 0, timeout_ms);
}

/* Never waits. Stale cells of an earlier incarnation are dropped and a
   malformed one is consumed (-IVSHM_ECORRUPT), as in ivshm_recv; a valid
   message stays where it is until ivshm_recv_release. */
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
        ssize_t rc =
            from == IVSHM_ANY
                ? rx_any(h, &got_src, &got_tag, NULL, 0, data, 0)
                : rx_message(h, from, &got_tag, NULL, 0, data, 0, true);
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
        if (rc == -EAGAIN)
            maybe_sweep(h);
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
    struct cref c = {.kind = p->peek_kind};
    if ((c.kind == SRC_QUEUE && h->q_peek_src != src) ||
        (c.kind == SRC_RING && p->rx_chan < 0) ||
        (c.kind == SRC_BACKLOG && !p->bl_head)) {
        p->peeked = false;
        return -EINVAL;
    }
    consume_cell(h, src, &c, view);
    return 0;
}

/* ------------------------------------------------------------------ */
/* local state                                                        */
/* ------------------------------------------------------------------ */

void ivshm_rx_area_reset(ivshm *h)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, h->self);
    atomic_store_explicit(&qc->enqueue_pos, 0, memory_order_relaxed);
    atomic_store_explicit(&qc->head, 0, memory_order_relaxed);
    atomic_store_explicit(&qc->waiters_any, 0, memory_order_relaxed);
    for (uint32_t w = 0; w < IVSHM_MAX_PEERS / 64; w++)
        atomic_store_explicit(&qc->waiters[w], 0, memory_order_relaxed);
    for (uint64_t pos = 0; pos < h->queue_slots; pos++)
        atomic_store_explicit(&ivshm_qcell(h, h->self, pos)->seq, pos,
                              memory_order_relaxed);
    for (uint32_t k = 0; k < h->fast_channels; k++) {
        chan_reset(h, k);
        h->chan_user[k] = -1;
    }
    h->n_act = 0;
    h->q_head = 0;
    h->q_skip_until = 0;
    h->q_stuck_since = 0;
    h->q_peek_src = -1;
    h->rr_next = 0;
}

void ivshm_peer_local_free(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    bl_clear(h, slot);
    free(p->rx_stage);
    free(p->tx_stage);
    p->rx_stage = p->tx_stage = NULL;
}

void ivshm_peer_local_reset(ivshm *h, int slot, uint32_t gen)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->rx_chan >= 0 && h->self >= 0)
        chan_free(h, slot);
    if (h->q_peek_src == slot)
        h->q_peek_src = -1;
    ivshm_peer_local_free(h, slot);
    memset(p, 0, sizeof *p);
    p->gen = gen;
    p->tx_chan = p->rx_chan = -1;
}
