/*
 * Fast channel descriptors. Each receive area holds fast_channels
 * single-producer rings, each with a descriptor: owner 0 when free, else
 * the sender's (slot + 1) | gen << 32. A sender takes one with a CAS on
 * the owner word and announces it with an OPEN cell in the receiver's
 * queue (send.c); the receiver accepts it when it consumes that cell
 * (recv.c), empties the ring and frees the descriptor when the sender is
 * gone and drained, or a new incarnation takes its slot, and sweeps
 * descriptors taken by senders that went away before their OPEN arrived
 * (rx_area.c).
 */
#define _GNU_SOURCE
#include "channel.h"

#include "ring.h"

/* ------------------------------------------------------------------ */
/* sender                                                             */
/* ------------------------------------------------------------------ */

static uint64_t owner_word(const ivshm *h)
{
    return (uint64_t)(h->self + 1) | (uint64_t)h->self_gen << 32;
}

int ivshm_chan_claim(ivshm *h, int j)
{
    const uint64_t mine = owner_word(h);
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

void ivshm_chan_giveback(ivshm *h, int j, uint32_t k)
{
    /* CAS: a reset by the receiver meanwhile made it somebody else's
       business */
    uint64_t mine = owner_word(h);
    atomic_compare_exchange_strong(&ivshm_fdesc(h, j, k)->owner, &mine, 0);
}

void ivshm_chan_use(ivshm *h, int j, uint32_t k)
{
    struct ivshm_peer_local *p = &h->peers[j];
    p->tx_chan = (int16_t)k;
    p->tx_ring = ivshm_fring(h, j, k);
    p->tx_head = 0;
    p->tx_tail_cache = 0;
    p->tx_odd_since = 0;
}

/* ------------------------------------------------------------------ */
/* receiver: the channels of our area                                 */
/* ------------------------------------------------------------------ */

void ivshm_chan_reset(ivshm *h, uint32_t k)
{
    ivshm_ring_reset(h, ivshm_fring(h, h->self, k));
    /* release: a claimer (acquire) finds the ring empty */
    atomic_store_explicit(&ivshm_fdesc(h, h->self, k)->owner, 0,
                          memory_order_release);
}

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

void ivshm_chan_adopt(ivshm *h, int slot, uint32_t k)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    p->rx_chan = (int16_t)k;
    p->rx_ring = ivshm_fring(h, h->self, k);
    p->rx_tail = 0;
    h->chan_user[k] = slot;
    h->act[h->n_act++] = slot;
}

bool ivshm_chan_accept(ivshm *h, int slot, uint64_t k)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    uint64_t want = (uint64_t)(slot + 1) | (uint64_t)p->gen << 32;
    bool ok = k < h->fast_channels && p->rx_chan < 0 &&
              h->chan_user[k] < 0 &&
              atomic_load_explicit(&ivshm_fdesc(h, h->self, (uint32_t)k)->owner,
                                   memory_order_acquire) == want;
    if (ok)
        ivshm_chan_adopt(h, slot, (uint32_t)k);
    return ok;
}

bool ivshm_chan_in_use(ivshm *h, uint32_t k, uint32_t g)
{
    uint8_t *ring = ivshm_fring(h, h->self, k);
    const struct ivshm_slot *first = slot_at(h, ring, 0);
    /* the producer's head (stored after position 0 was published) says
       so as well as that seq does: a co-tenant that rewrote the seq (hid
       the message) would otherwise keep the channel unread for good */
    uint64_t head = atomic_load_explicit(
        &((struct ivshm_ring_ctrl *)ring)->head, memory_order_acquire);
    uint64_t seq = atomic_load_explicit(&first->seq, memory_order_acquire);
    return (seq == 1 || (head >= 1 && head <= h->ring_slots)) &&
           __atomic_load_n(&first->gen, __ATOMIC_RELAXED) == g;
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
