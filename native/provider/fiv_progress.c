/*
 * Progress: what arrived over the region and the core provider, the sends
 * that wait for room, and now and then the liveness of the peers we wait
 * on. Called from every CQ/counter read (FI_PROGRESS_MANUAL) or by the
 * domain's thread (FI_PROGRESS_AUTO), always under the domain's
 * serialization.
 *
 * Admission (docs/security.md, "The libfabric provider"): a region
 * message is delivered only if its sender's slot belongs to a peer we
 * hear, at that peer's generation: an address the application inserted,
 * or a sender that introduced itself with our key (fiv_intro.c). Anything
 * else is dropped unread.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

#define FIV_BATCH 16                      /* messages per call            */
#define FIV_CHECK_NS 100000000ull         /* liveness look every 100 ms   */

/* Our trusted senders that are gone: what we wait from them fails. Only
   once their queue is drained (a departed peer's last messages still
   arrive), so this runs after a poll that found nothing. */
static void check_peers(struct fiv_ep *ep)
{
    (void)ivshm_reap(ep->h);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        if (p->path != PATH_REGION || p->dead)
            continue;
        bool waits = p->as.kind != ASM_NONE || p->txq;
        for (struct fiv_op_req *r = ep->waiting; r && !waits; r = r->next)
            waits = r->peer == id;
        if (!waits)
            continue;
        int64_t g = ivshm_peer_generation(ep->h, p->slot);
        if (g != (int64_t)p->generation)
            fiv_peer_failed(ep, id, p, FI_EIO);
    }
}

static int poll_region(struct fiv_ep *ep)
{
    int found = 0;
    for (int i = 0; i < FIV_BATCH; i++) {
        /* most calls find nothing, and after a message most often nothing
           follows: a few loads say so (ivshm_recv_idle), cheaper than a
           peek that finds nothing */
        if (ivshm_recv_idle(ep->h))
            break;
        int src = -1;
        uint32_t tag = 0;
        const void *data = NULL;
        ssize_t n = ivshm_recv_peek(ep->h, IVSHM_ANY, &src, &tag, &data);
        if (n == -EAGAIN)
            break;
        if (src < 0 || src >= ep->max_peers)
            break; /* an error about no sender in particular */
        fi_addr_t a = ep->by_slot[src];
        struct fiv_peer *peer = fiv_peer(ep, a);
        if (n == -EMSGSIZE) {
            /* we never send multi-slot messages: not ours to read */
            static uint8_t sink[1 << 16];
            (void)ivshm_recv(ep->h, src, NULL, NULL, sink, sizeof sink, 0);
            if (peer && peer->as.kind != ASM_NONE)
                fiv_peer_failed(ep, a, peer, FI_EIO);
            continue;
        }
        if (n < 0) {
            /* a trusted sender's data is lost: what it was sending fails */
            if (peer && peer->path == PATH_REGION && peer->as.kind != ASM_NONE)
                fiv_peer_failed(ep, a, peer, FI_EIO);
            continue;
        }
        found++;
        /* generations only grow: a slot live at g now was at g when
           libivshm took the message; a free slot's last holder wrote it */
        int64_t g = ivshm_peer_generation(ep->h, src);
        bool heard = peer && peer->path == PATH_REGION &&
                     (g < 0 || g == (int64_t)ep->gen_by_slot[src]);
        uint32_t op = tag & FIV_OP_MASK;
        if (heard) {
            if (op != FIV_OP_MORE && op != FIV_OP_INTRO)
                ep->received++;
            fiv_deliver(ep, a, peer, tag, data, (size_t)n);
        } else {
            if (peer && peer->path == PATH_REGION && !peer->dead)
                /* the slot changed hands: the peer we knew is gone */
                fiv_peer_failed(ep, a, peer, FI_EIO);
            if (op == FIV_OP_INTRO)
                fiv_intro_receive(ep, src, g, data, (size_t)n);
            else
                ep->unheard++;
        }
        (void)ivshm_recv_release(ep->h, src);
    }
    return found;
}

void fiv_progress(struct fiv_ep *ep)
{
    int found = 0;
    if (ep->h)
        found += poll_region(ep);
    /* the core provider only once a peer of ours is there: polling it
       (ofi_rxm over tcp polls its sockets) costs more than a region
       message; with region traffic flowing, every 16th call */
    if (fiv_core_active(ep) && (!found || (++ep->core_turn & 15) == 0))
        found += fiv_core_progress(ep);
    if (ep->txq_peers)
        fiv_tx_progress(ep);
    if (found) {
        ep->idle_calls = 0;
        return;
    }
    /* Nothing came for 256 calls in a row (several µs): give the CPU to
       whoever shares it, the peer we wait on perhaps. A rank on a core of
       its own gets it straight back; on a shared one this is what lets
       a ring drain (sender and receiver take turns, not time slices). */
    if ((++ep->idle_calls & 255) == 0)
        sched_yield();
    if (!ep->h)
        return;
    /* every ~100 ms, see whether a peer we wait on died */
    if ((ep->idle_calls & 255) == 0) {
        uint64_t now = fiv_now_ns();
        if (now - ep->last_check_ns >= FIV_CHECK_NS) {
            ep->last_check_ns = now;
            check_peers(ep);
        }
    }
}

void fiv_progress_eps(struct fiv_ep **eps, size_t n)
{
    for (size_t i = 0; i < n; i++)
        fiv_progress(eps[i]);
}
