/*
 * Fast channels. Each receive area holds fast_channels single-producer
 * rings, each with a descriptor: owner 0 when free, else the sender's
 * (slot + 1) | gen << 32. A sender takes one with a CAS on the owner
 * word and announces it with an OPEN cell in the receiver's queue (the
 * receiver accepts it in recv.c, rx_open); the receiver empties the ring
 * and frees the descriptor when the sender is gone and drained, or a new
 * incarnation takes its slot, and sweeps descriptors taken by senders
 * that went away before their OPEN arrived.
 */
#define _GNU_SOURCE
#include "msg.h"

_Static_assert(sizeof(struct ivshm_fast_desc) == IVSHM_FAST_DESC,
               "descriptor size");

/* No channel was free: queue sends before we look again. */
#define OPEN_RETRY 64

/* ------------------------------------------------------------------ */
/* sender side: taking a channel                                      */
/* ------------------------------------------------------------------ */

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
void ivshm_tx_try_open(ivshm *h, int j, int timeout_ms, uint64_t deadline)
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
    int rc = ivshm_q_send(h, j, 0, NULL, 0, CELL_OPEN, (uint64_t)k, timeout_ms,
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
    p->tx_ring = ivshm_fring(h, j, (uint32_t)k);
    p->tx_head = 0;
    p->tx_tail_cache = 0;
    p->tx_odd_since = 0;
}

/* ------------------------------------------------------------------ */
/* receiver side: the channels of our area                            */
/* ------------------------------------------------------------------ */

/* Empty fast ring k and free its descriptor for the next sender. */
void ivshm_chan_reset(ivshm *h, uint32_t k)
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
void ivshm_chan_free(ivshm *h, int slot)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint32_t k = (uint32_t)p->rx_chan;
    ivshm_chan_reset(h, k);
    p->rx_chan = -1;
    p->rx_ring = NULL;
    h->chan_user[k] = -1;
    for (int x = 0; x < h->n_act; x++)
        if (h->act[x] == slot) {
            h->act[x] = h->act[--h->n_act];
            break;
        }
}

/* A live sender's channel whose OPEN we never saw, though the sender
   writes to the ring: a co-tenant took the OPEN cell out of our queue
   (or garbled it). A sender publishes on the ring only after its OPEN
   is in the queue, so with the queue empty (the caller's check) the
   OPEN will not come, and without this the pair would stall for good:
   the sender on a ring we never read. Evidence, each loaded once: the
   descriptor names the sender in its current incarnation, the slot of
   position 0 says "full" in that incarnation. Forged, it makes us read
   a ring the sender does not use, as a forged OPEN cell would. */
static bool chan_orphaned(ivshm *h, uint32_t k, int s, uint32_t g)
{
    struct ivshm_peer_local *p = &h->peers[s];
    if (!ivshm_peer_current(h, s) || p->gen != g || p->rx_chan >= 0 ||
        p->rx_partial || p->bl_head ||
        (h->listen_only && h->listen_gen[s] != g))
        return false;
    const struct ivshm_slot *first = slot_at(h, ivshm_fring(h, h->self, k), 0);
    if (atomic_load_explicit(&first->seq, memory_order_acquire) != 1 ||
        __atomic_load_n(&first->gen, __ATOMIC_RELAXED) != g)
        return false;
    /* Again after that acquire load: an honest sender takes its OPEN's
       queue position before it publishes position 0, so an OPEN enqueued
       since the caller's look shows here and is waited for */
    return q_empty(h);
}

/* Tests only (test_hostile): called by the sweep between its look at
   the queue and chan_orphaned's, where an honest sender's OPEN may be
   taking its queue position; NULL otherwise. */
void (*ivshm_sweep_test_hook)(ivshm *h);

/* Descriptors taken by senders that left or died before their OPEN
   arrived (or scribbled on): free them; those of live senders whose
   OPEN was lost: adopt them. Only while our queue and backlogs are
   empty, so no OPEN of theirs can still be on its way. */
void ivshm_fast_sweep(ivshm *h)
{
    if (h->self < 0 || h->n_bl || !q_empty(h))
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
            ivshm_peer_alive(h, (int)s, g)) {
            if (ivshm_sweep_test_hook)
                ivshm_sweep_test_hook(h);
            if (chan_orphaned(h, k, (int)s, g))
                ivshm_rx_adopt(h, (int)s, k);
            continue; /* else its OPEN may still come */
        }
        ivshm_chan_reset(h, k);
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
