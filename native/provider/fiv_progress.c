/*
 * Progress: what arrived over the region and the core provider, the sends
 * that wait for room, and now and then the liveness of the peers we wait
 * on. Called from every CQ/counter read (FI_PROGRESS_MANUAL) or by the
 * domain's thread (FI_PROGRESS_AUTO), always under the domain's
 * serialization.
 *
 * Admission (docs/security.md, "The libfabric provider"): a region
 * message is delivered only if its sender's slot belongs to an address
 * the application inserted, at that address's generation. A slot we do
 * not know yet (a peer that inserted us and sent before we inserted it)
 * is stashed, bounded, and delivered in order once its address is
 * inserted; never otherwise.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

#define FIV_BATCH 16                      /* messages per call            */
#define FIV_CHECK_NS 100000000ull         /* liveness look every 100 ms   */
#define FIV_STASH_MSGS 4096               /* unknown senders: messages    */
#define FIV_STASH_BYTES (64u << 20)       /* ... and bytes, in all        */

static void stash_put(struct fiv_ep *ep, int slot, int64_t gen, uint32_t op,
                      const void *data, size_t len)
{
    if (gen < 0 || ep->stash_msgs >= FIV_STASH_MSGS ||
        ep->stash_bytes + len > FIV_STASH_BYTES) {
        ep->stash_dropped++;
        return;
    }
    struct fiv_stash *s = malloc(sizeof *s + len);
    if (!s) {
        ep->stash_dropped++;
        return;
    }
    s->next = NULL;
    s->slot = slot;
    s->generation = (uint32_t)gen;
    s->op = op;
    s->len = len;
    memcpy(s->data, data, len);
    if (ep->stash_tail)
        ep->stash_tail->next = s;
    else
        ep->stash = s;
    ep->stash_tail = s;
    ep->stash_msgs++;
    ep->stash_bytes += len;
}

/* The address of `slot` was inserted: its stashed messages of that
   generation are delivered in arrival order; other generations' dropped. */
void fiv_stash_replay(struct fiv_ep *ep, int slot)
{
    struct fiv_stash **pp = &ep->stash, *prev = NULL;
    fi_addr_t a = ep->by_slot[slot];
    struct fiv_peer *peer = fiv_peer(ep, a);
    while (*pp) {
        struct fiv_stash *s = *pp;
        if (s->slot != slot) {
            prev = s;
            pp = &s->next;
            continue;
        }
        *pp = s->next;
        if (ep->stash_tail == s)
            ep->stash_tail = prev;
        ep->stash_msgs--;
        ep->stash_bytes -= s->len;
        if (peer && s->generation == ep->gen_by_slot[slot]) {
            if ((s->op & FIV_OP_MASK) != FIV_OP_MORE)
                ep->received++;
            fiv_deliver(ep, a, peer, s->op, s->data, s->len);
        }
        free(s);
    }
}

/* Our trusted senders that are gone: what we wait from them fails. Only
   once their queue is drained (a departed peer's last messages still
   arrive), so this runs after a poll that found nothing. */
static void check_peers(struct fiv_ep *ep)
{
    (void)ivshm_reap(ep->h);
    for (size_t i = 0; i < ep->npeers; i++) {
        struct fiv_peer *p = &ep->peers[i];
        if (p->path != PATH_REGION || p->dead)
            continue;
        bool waits = p->as.kind != ASM_NONE || p->txq;
        for (struct fiv_op_req *r = ep->waiting; r && !waits; r = r->next)
            waits = r->peer == i;
        if (!waits)
            continue;
        int64_t g = ivshm_peer_generation(ep->h, p->slot);
        if (g != (int64_t)p->generation)
            fiv_peer_failed(ep, i, p, FI_EIO);
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
        if (peer && peer->path == PATH_REGION) {
            if (g < 0 || g == (int64_t)ep->gen_by_slot[src]) {
                if ((tag & FIV_OP_MASK) != FIV_OP_MORE)
                    ep->received++;
                fiv_deliver(ep, a, peer, tag, data, (size_t)n);
            } else if (!peer->dead) {
                /* the slot changed hands: the peer we knew is gone */
                fiv_peer_failed(ep, a, peer, FI_EIO);
            }
        } else {
            stash_put(ep, src, g, tag, data, (size_t)n);
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
