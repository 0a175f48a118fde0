/*
 * Our receive area as a whole: emptied at join; swept (at most every
 * 200 ms of empty receives, and at every reap) for fast channel
 * descriptors that senders took and left, and for channels of live
 * senders whose OPEN cell never reached us; searched for messages a
 * co-tenant hid in our rings (docs/security.md, "libivshm").
 */
#define _GNU_SOURCE
#include "rx_area.h"

#include "channel.h"
#include "peer_local.h"
#include "queue.h"
#include "registry.h"
#include "ring.h"

void ivshm_rx_area_reset(ivshm *h)
{
    ivshm_q_reset(h);
    for (uint32_t k = 0; k < h->fast_channels; k++) {
        ivshm_chan_reset(h, k);
        h->chan_user[k] = -1;
    }
    h->n_act = 0;
    h->rr_next = 0;
    h->rx_hot = -1;
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
        !ivshm_listened(h, s, g))
        return false;
    if (!ivshm_chan_in_use(h, k, g))
        return false;
    /* Again after that acquire load: an honest sender takes its OPEN's
       queue position before it publishes position 0, so an OPEN enqueued
       since the caller's look shows here and is waited for */
    return q_empty(h);
}

void (*ivshm_sweep_test_hook)(ivshm *h);

/* Only while our queue and backlogs are empty, so no OPEN of theirs can
   still be on its way. */
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
            if (chan_orphaned(h, k, (int)s, g)) {
                ivshm_chan_adopt(h, (int)s, k);
                if (ivshm_ring_heal(h, (int)s)) /* a hidden position 0 */
                    ivshm_rx_lost(&h->peers[s]);
            }
            continue; /* else its OPEN may still come */
        }
        ivshm_chan_reset(h, k);
    }
}

void ivshm_rx_heal_hidden(ivshm *h)
{
    for (int x = 0; x < h->n_act; x++) {
        int slot = h->act[x];
        struct ivshm_peer_local *p = &h->peers[slot];
        /* rx_chan again: a new incarnation seen by ivshm_peer_current
           frees the channel (and moves act[], so one entry may be
           skipped this round) */
        if (p->rx_chan < 0 || !ivshm_peer_current(h, slot) || p->rx_chan < 0)
            continue;
        if (ivshm_ring_heal(h, slot))
            ivshm_rx_lost(p);
    }
}
