/*
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
 */
#define _GNU_SOURCE
#include "queue.h"

#include "clock.h"
#include "doorbell.h"
#include "peer_local.h"
#include "registry.h"

#include <string.h>

/* A free cell behind enqueue_pos this long: its producer died (or was
   descheduled) between taking the position and claiming the cell. Its
   claim CAS fails afterwards, so skipping never loses a live message. */
#define QUEUE_SKIP_NS 2000000000ull

/* A cell claimed this long gets its claimer's liveness probed (and again
   after as long): a dead claimer's cell is skipped. */
#define CLAIM_PROBE_NS 1000000ull

/* ------------------------------------------------------------------ */
/* producer side: sending through the receiver's queue                */
/* ------------------------------------------------------------------ */

/* Take positions [*pos, *pos + n) of Q(j): 0, or -EAGAIN when there is
   no room for n cells (also while a co-tenant garbles enqueue_pos: the
   queue then looks full until its consumer puts it back). Bounded: a
   writer that keeps moving enqueue_pos cannot hold us here. */
static int q_take(ivshm *h, int j, uint32_t n, uint64_t *pos)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, j);
    uint64_t e = atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
    for (;;) {
        /* acquire: the consumer's reads of the cell are done */
        uint64_t seq = atomic_load_explicit(
            &ivshm_qcell(h, j, e + n - 1)->seq, memory_order_acquire);
        if (seq != e + n - 1) {
            uint64_t again =
                atomic_load_explicit(&qc->enqueue_pos, memory_order_relaxed);
            if (again == e)
                return -EAGAIN;
            e = again; /* another producer took positions: look again */
        } else if (atomic_compare_exchange_weak_explicit(
                       &qc->enqueue_pos, &e, e + n, memory_order_relaxed,
                       memory_order_relaxed)) {
            *pos = e;
            return 0;
        }
        /* again: a unit (a co-tenant can keep moving enqueue_pos) */
        if (!ivshm_work(h))
            return -EAGAIN;
    }
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

int ivshm_q_send(ivshm *h, int j, uint32_t tag, const void *buf, size_t len,
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
                return ms; /* mid-stream: a cut message, see ivshm_ring_send */
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
            ivshm_work_start(h); /* looked at the clock: time is left */
            continue; /* nothing of it was delivered: again */
        }
        b.starts = false;
        left -= n;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* consumer side: our own queue                                       */
/* ------------------------------------------------------------------ */

/* Producers woken after one freed cell, at most: the work of a freed
   cell stays small whatever the waiter bitmap says. */
#define WAKES_PER_FREE 64u

/* See q_space_ready for the pairing. */
void ivshm_q_wake_waiters(ivshm *h)
{
    struct ivshm_queue_ctrl *qc = h->my_qctrl;
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(&qc->waiters_any, memory_order_relaxed))
        return;
    atomic_store(&qc->waiters_any, 0);
    uint32_t words = (h->max_peers + 63) / 64, kicks = 0;
    ivshm_work_count(h, words);
    for (uint32_t w = 0; w < words; w++) {
        if (!atomic_load_explicit(&qc->waiters[w], memory_order_relaxed))
            continue;
        uint64_t m = atomic_exchange(&qc->waiters[w], 0);
        for (; m; m &= m - 1) {
            if (kicks++ == WAKES_PER_FREE) {
                /* A co-tenant can set every bit at every freed cell: the
                   rest are put back for the next freed cell (ours, or a
                   waiter's own look), so no waiter loses its wake. */
                atomic_fetch_or(&qc->waiters[w], m);
                atomic_store(&qc->waiters_any, 1);
                return;
            }
            ivshm_work_count(h, 1);
            uint32_t s = w * 64 + (uint32_t)__builtin_ctzll(m);
            if (s < h->max_peers && (int)s != h->self)
                ivshm_kick(h, (int)s);
        }
    }
}

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

/* Padding, stale cells, cells of dead claimers and garbage are dropped
   on the way; the loop is bounded by the queue's size. */
int ivshm_q_front(ivshm *h, struct qhead *out)
{
    /* a unit a round after the first: the cells dropped on the way are
       peers' doing (each `continue` below) */
    for (uint32_t round = 0; round < h->queue_slots; round++) {
        if (round && !ivshm_work(h))
            break;
        const uint64_t pos = h->q_head;
        struct ivshm_cell *c = ivshm_my_qcell(h, pos);
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
                drop = ivshm_rx_view(h, src) == RX_NONE ||
                       out->f.gen != h->peers[src].gen;
                if (!drop && h->listen_mode == IVSHM_LISTEN_LISTED &&
                    !ivshm_listened(h, src, out->f.gen)) {
                    drop = true;
                    /* its request for a channel is kept (the record is
                       this incarnation's, just checked): a sender that
                       asks before we listen sends on that ring after, and
                       ivshm_listen adopts it then */
                    if (flags & CELL_OPEN)
                        h->peers[src].open_refused =
                            out->f.total < h->fast_channels
                                ? (uint16_t)(out->f.total + 1)
                                : 0;
                }
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
            struct ivshm_queue_ctrl *qc = h->my_qctrl;
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
                ivshm_q_wake_waiters(h);
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
            &h->my_qctrl->enqueue_pos, memory_order_relaxed);
        if (!q_advance(h, seq, true))
            continue;
        if (e - pos <= h->queue_slots && e > h->q_skip_until)
            h->q_skip_until = e;
        h->stats.dropped++;
    }
    return Q_WAIT;
}

bool ivshm_q_holds(const ivshm *h, int src)
{
    const uint64_t head = h->q_head;
    uint64_t end = atomic_load_explicit(&h->my_qctrl->enqueue_pos,
                                        memory_order_relaxed);
    /* a garbled enqueue_pos cannot make the look longer than the queue */
    if (end - head > h->queue_slots)
        end = head + h->queue_slots;
    const uint32_t gen = h->peers[src].gen;
    for (uint64_t pos = head; pos != end; pos++) {
        const struct ivshm_cell *c = ivshm_my_qcell(h, pos);
        /* published in this lap: its header is the producer's, final
           until we free the cell (acquire: read after the seq) */
        if (atomic_load_explicit(&c->seq, memory_order_acquire) != pos + 1)
            continue;
        uint16_t from = __atomic_load_n(&c->src, __ATOMIC_RELAXED);
        uint16_t flags = __atomic_load_n(&c->flags, __ATOMIC_RELAXED);
        uint32_t g = __atomic_load_n(&c->gen, __ATOMIC_RELAXED);
        if (from == (uint32_t)src && g == gen && !(flags & CELL_PAD))
            return true;
    }
    return false;
}

void ivshm_q_reset(ivshm *h)
{
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, h->self);
    h->my_qctrl = qc;
    h->my_cells = ivshm_rx_area(h, h->self) + IVSHM_QUEUE_CTRL;
    atomic_store_explicit(&qc->enqueue_pos, 0, memory_order_relaxed);
    atomic_store_explicit(&qc->head, 0, memory_order_relaxed);
    atomic_store_explicit(&qc->waiters_any, 0, memory_order_relaxed);
    for (uint32_t w = 0; w < IVSHM_MAX_PEERS / 64; w++)
        atomic_store_explicit(&qc->waiters[w], 0, memory_order_relaxed);
    for (uint64_t pos = 0; pos < h->queue_slots; pos++)
        atomic_store_explicit(&ivshm_my_qcell(h, pos)->seq, pos,
                              memory_order_relaxed);
    h->q_head = 0;
    h->q_skip_until = 0;
    h->q_stuck_since = 0;
    h->q_peek_src = -1;
}
