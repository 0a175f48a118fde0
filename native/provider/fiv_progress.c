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
        /* generations only grow: a slot live at g now was at g when
           libivshm took the message; a free slot's last holder wrote it */
        int64_t g = ivshm_peer_generation(ep->h, src);
        bool heard = peer && peer->path == PATH_REGION &&
                     (g < 0 || g == (int64_t)ep->gen_by_slot[src]);
        if (n == -EMSGSIZE) {
            /* we never send multi-slot messages: not ours to read */
            static uint8_t sink[1 << 16];
            (void)ivshm_recv(ep->h, src, NULL, NULL, sink, sizeof sink, 0);
            fiv_pair_received(ep, src, g, 0);
            if (heard)
                fiv_path_broken(ep, a, peer, "a message we never send");
            continue;
        }
        if (n < 0) {
            /* a slot libivshm could not validate: a message of its writer
               is lost */
            if (heard && n == IVSHM_ECORRUPT)
                fiv_path_broken(ep, a, peer, "libivshm found its message "
                                "corrupt");
            continue;
        }
        found++;
        uint32_t op = tag & FIV_WIRE_OP;
        fiv_pair_received(ep, src, g, op);
        /* the check reads bytes the handlers copy again: it finds what
           was garbled before it, as a check, not a defence */
        if (fiv_wire_tag(op, data, (size_t)n) != tag) {
            if (heard)
                fiv_path_broken(ep, a, peer, "a message failed its check");
            else
                ep->unheard++;
        } else if ((op & FIV_OP_MASK) == FIV_OP_PROBE ||
                   (op & FIV_OP_MASK) == FIV_OP_PROBE_ACK) {
            fiv_probe_receive(ep, src, g, a, heard ? peer : NULL, op, data,
                              (size_t)n);
        } else if (heard && !peer->dead) {
            if ((op & FIV_OP_MASK) != FIV_OP_MORE &&
                (op & FIV_OP_MASK) != FIV_OP_INTRO)
                ep->received++;
            fiv_deliver(ep, a, peer, op, data, (size_t)n);
            if (peer->violated) {
                peer->violated = false;
                fiv_path_broken(ep, a, peer, "it broke our protocol");
            }
        } else if (heard) {
            ep->unheard++; /* nothing more is taken from a failed peer */
        } else {
            if (peer && peer->path == PATH_REGION && !peer->dead)
                /* the slot changed hands: the peer we knew is gone */
                fiv_path_broken(ep, a, peer, "its slot changed hands");
            if ((op & FIV_OP_MASK) == FIV_OP_INTRO)
                fiv_intro_receive(ep, src, g, data, (size_t)n);
            else
                ep->unheard++;
        }
        if (peer && peer->violated) /* dead already: nothing to break */
            peer->violated = false;
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
    /* every ~100 ms: is a peer we wait on gone, or silent for long
       enough to ask it (fiv_probe.c)? Only once our receive area is
       drained: a departed peer's last messages still arrive. */
    if ((ep->idle_calls & 255) == 0) {
        uint64_t now = fiv_now_ns();
        if (now - ep->last_check_ns >= FIV_CHECK_NS) {
            ep->last_check_ns = now;
            (void)ivshm_reap(ep->h);
            fiv_probe_tick(ep, now);
        }
    }
}

void fiv_progress_eps(struct fiv_ep **eps, size_t n)
{
    for (size_t i = 0; i < n; i++)
        fiv_progress(eps[i]);
}
