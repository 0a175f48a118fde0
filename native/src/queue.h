/*
 * The receive queue (docs/region-layout.md, "The queue"): Q(j), a
 * bounded multi-producer queue of cells in j's receive area that every
 * peer may append to and only j consumes. Both sides and the repairs
 * are in queue.c; what the hot paths need is static inline here.
 */
#ifndef IVSHM_QUEUE_H
#define IVSHM_QUEUE_H

#include "attachment.h"

enum { Q_EMPTY, Q_WAIT, Q_FULL };

/* A cell at q_head, validated as far as the queue goes. */
struct qhead {
    int src;
    struct frag f;
    const uint8_t *data;
};

/* ---- producer ---- */

/* Send one message (or one control cell: ctl = CELL_OPEN, ctl_total =
   the channel) through Q(j). timeout_ms as in ivshm_ring_send. A message
   of at most queue_slots cells is one batch, all or nothing; a longer
   one streams in batches of half the queue, so other senders get turns
   in between. */
IVSHM_INTERNAL int ivshm_q_send(ivshm *h, int j, uint32_t tag,
                                const void *buf, size_t len, uint16_t ctl,
                                uint64_t ctl_total, int timeout_ms,
                                uint64_t deadline);

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

/* ---- consumer: our own queue ---- */

/* Look at the head of our queue: Q_FULL with *out filled (a message
   cell of a sender we know, in the generation we know), Q_EMPTY, or
   Q_WAIT (a producer is still writing the head cell). */
IVSHM_INTERNAL int ivshm_q_front(ivshm *h, struct qhead *out);
/* Producers waiting for room in our queue: wake them. Called after we
   freed cells. */
IVSHM_INTERNAL void ivshm_q_wake_waiters(ivshm *h);
/* Does our queue hold, past its head, a published cell of `src` in the
   generation we deliver from? A receive from a departed sender asks
   this before it answers "nothing more of it": a cell at the head that
   another producer is still writing (Q_WAIT) hides the cells behind it
   from ivshm_q_front, and the departed sender's last ones may be there.
   Looks at most queue_slots cells and changes nothing. */
IVSHM_INTERNAL bool ivshm_q_holds(const ivshm *h, int src);
/* Empty our queue (our slot is CLAIMING: nobody sends to it). */
IVSHM_INTERNAL void ivshm_q_reset(ivshm *h);

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
