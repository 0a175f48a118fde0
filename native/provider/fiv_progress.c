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

/* Messages per progress call: an MPI's window of non-blocking receives
   (osu's 64) completes in one call when it has all arrived. Fewer made
   an MPI_Testall over the window come back, and scan its requests, once
   per batch (docs/fast-path.md); mtl ofi reads up to 100 entries a call,
   and a read takes no more than the CQ has room for (poll_region). */
#define FIV_BATCH 64
#define FIV_CHECK_NS 100000000ull         /* liveness look every 100 ms   */

/* ---- introductions (fiv_intro.c): the receiver ---- */

void fiv_intro_receive(struct fiv_ep *ep, int slot, int64_t gen,
                       const uint8_t *p, size_t n)
{
    struct fiv_intro in;
    if (n != sizeof in || !ep->hidden)
        return;
    if (gen < 0) {
        /* its writer has left since (a sender that exits after its last
           message): the slot's last holder, while nobody claimed it */
        ivshm_peer_info last;
        if (ivshm_peer_last(ep->h, slot, &last) != 1)
            return;
        gen = last.generation;
    }
    memcpy(&in, p, sizeof in); /* once: the region is shared */
    if (in.slot != slot || in.generation != (uint32_t)gen ||
        in.mac != fiv_intro_mac(ep->key, &in))
        return; /* not from a holder of our name, or not for this slot */
    fi_addr_t had = ep->by_slot[slot];
    if (had != FI_ADDR_NOTAVAIL && ep->gen_by_slot[slot] == in.generation)
        return; /* heard already (inserted, or introduced before) */
    struct fiv_peer *old = fiv_peer(ep, had);
    if (old && old->path == PATH_REGION && !old->dead)
        fiv_peer_failed(ep, had, old, FI_EIO); /* its slot changed hands */
    struct fiv_peer *h = &ep->hidden[slot];
    fiv_core_release_peer(h);
    *h = (struct fiv_peer){.path = PATH_REGION, .slot = slot,
                           .generation = in.generation,
                           /* it holds our name: it hears us already */
                           .introduced = true,
                           .nonce = (uint64_t)in.nonce[1] << 32 | in.nonce[0]};
    ep->by_slot[slot] = FIV_HIDDEN + (fi_addr_t)slot;
    ep->gen_by_slot[slot] = in.generation;
}

/* Is `peer`, the one we know at `src`, the writer of a message of that
   slot's holder at generation `g` (negative: the slot is free now, so
   its last holder wrote it)? */
static bool hears(const struct fiv_ep *ep, const struct fiv_peer *peer,
                  int src, int64_t g)
{
    /* bk_rx: a core peer whose BACK said its region messages follow
       (fiv_drain.c) */
    return peer && (peer->path == PATH_REGION || peer->bk_rx) &&
           (g < 0 || g == (int64_t)ep->gen_by_slot[src]);
}

/* `peer` (at `a`) broke our protocol (fiv_peer.violated): its path
   breaks, with the cap it passed if that was the reason. */
static void broken_by(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer)
{
    const char *why = peer->over ? peer->over : "it broke our protocol";
    peer->violated = false;
    peer->over = NULL;
    fiv_path_broken(ep, a, peer, why);
}

/* One whole message of `src`, written by its holder at generation `g`,
   at `data` in the region until the caller consumes it: nothing here keeps
   the pointer (the handlers copy what they keep, each header once).
   Both receive paths end here, so admission is decided in one place;
   the fast path's expected receive (fiv_msg_expected) admits only what
   passes here, a subset it tests before anything else.
   Nothing reachable from here receives on ep->h or makes progress (the
   handlers only send, never wait, and queue what finds no room), which
   is what ivshm_recv_each asks of its upcall: no re-entrancy guard.
   False if the message is to stay where it lies (only when `may_wait`,
   the general path's peek): a remote write with CQ data while the CQ is
   full (fiv_cq_full), decided on the tag libivshm copied and our own
   state, nothing of the message read or kept; it is taken whole, read
   afresh, by a later peek once the application has read its CQ. Its
   writer's later messages wait behind it, no other peer's do (but a
   write at the head of the shared queue: the queue's cells behind it,
   until then). */
static bool take_message(struct fiv_ep *ep, int src, int64_t g, uint32_t tag,
                         const uint8_t *data, size_t n, bool may_wait)
{
    fi_addr_t a = ep->by_slot[src];
    struct fiv_peer *peer = fiv_peer(ep, a);
    bool heard = hears(ep, peer, src, g);
    uint32_t op = tag & FIV_WIRE_OP;
    if (may_wait && (op & (FIV_OP_MASK | FIV_F_DATA)) ==
                        (FIV_OP_WRITE | FIV_F_DATA) &&
        fiv_cq_full(ep->rx_cq) && heard && !peer->dead &&
        peer->path == PATH_REGION && !peer->sw_rx)
        return false;
    fiv_pair_received(ep, src, g, op);
    /* the check reads bytes the handlers copy again: it finds what
       was garbled before it, as a check, not a defence */
    if (fiv_wire_tag(op, data, n) != tag) {
        if (heard)
            fiv_path_broken(ep, a, peer, "a message failed its check");
        else
            ep->unheard++;
    } else if ((op & FIV_OP_MASK) == FIV_OP_PROBE ||
               (op & FIV_OP_MASK) == FIV_OP_PROBE_ACK) {
        fiv_probe_receive(ep, src, g, a, heard ? peer : NULL, op, data, n);
    } else if (heard && !peer->dead && peer->sw_rx) {
        /* its SWITCH was its last region message (fiv_drain.c) */
        fiv_path_broken(ep, a, peer, "a region message after its switch");
    } else if (heard && !peer->dead && (op & FIV_OP_MASK) == FIV_OP_SWITCH) {
        fiv_switch_receive(ep, a, peer, src, g, data, n);
    } else if (heard && !peer->dead && (op & FIV_OP_MASK) == FIV_OP_BACK) {
        fiv_back_receive(ep, a, peer, src, g, data, n);
    } else if (heard && !peer->dead && peer->path != PATH_REGION) {
        /* a core peer's first region message is its BACK */
        fiv_path_broken(ep, a, peer, "a region message before its back "
                        "switch");
    } else if (heard && !peer->dead) {
        if ((op & FIV_OP_MASK) != FIV_OP_MORE &&
            (op & FIV_OP_MASK) != FIV_OP_INTRO)
            ep->received++;
        fiv_deliver(ep, a, peer, op, data, n);
        if (peer->violated)
            broken_by(ep, a, peer);
    } else if (heard) {
        ep->unheard++; /* nothing more is taken from a failed peer */
    } else {
        if (peer && peer->path == PATH_REGION && !peer->dead)
            /* the slot changed hands: the peer we knew is gone */
            fiv_path_broken(ep, a, peer, "its slot changed hands");
        if ((op & FIV_OP_MASK) == FIV_OP_INTRO)
            fiv_intro_receive(ep, src, g, data, n);
        else
            ep->unheard++;
    }
    if (peer && peer->violated) {
        /* a violation found outside fiv_deliver's branch above: a core
           message its SWITCH released (fiv_switch_receive), a malformed
           probe; the path breaks as on the core (fiv_core_progress),
           unless the peer is dead already */
        broken_by(ep, a, peer);
    }
    return true;
}

/* ivshm_recv_each's upcall. `gen` is the incarnation libivshm read the
   message from (it hands out only a live sender's), so the registry is
   not asked again; `src` is one of libivshm's own slot indices, below
   ivshm_max_peers. Inline wherever its call is direct: optimized as one
   module (with fiv_msg_expected, fiv_msg.c), that is libivshm's walk,
   which then saves its registers and frame once for both. */
static inline __attribute__((always_inline)) void
take_in_place(void *arg, int src, uint32_t gen, uint32_t tag, const void *data,
              size_t len)
{
    struct fiv_ep *ep = arg;
    /* the expected receive first, all its cases decided by one check
       there; whatever it leaves, take_message's admission and dispatch
       take as they would have */
    int taken = fiv_msg_expected(ep, src, gen, tag, data, len);
    if (__builtin_expect(taken > 0, 1))
        return;
    if (taken == 0) {
        (void)take_message(ep, src, gen, tag, data, len, false);
        return;
    }
    fi_addr_t a = ep->by_slot[src];
    struct fiv_peer *peer = fiv_peer(ep, a);
    if (taken == -2)
        fiv_path_broken(ep, a, peer, "a message failed its check");
    else
        broken_by(ep, a, peer);
}

/* The general path: what the fast path leaves (the queue, backlogs,
   multi-slot or malformed messages, a departed or new incarnation),
   with the peek's validation and reports. */
static int peek_region(struct fiv_ep *ep)
{
    int found = 0;
    int left[FIV_BATCH], nleft = 0; /* senders whose head waits (CQ full) */
    bool all = false;                /* every sender's head seen           */
    for (int i = 0; i < FIV_BATCH; i++) {
        /* after a message most often nothing follows: a few loads say
           so (ivshm_recv_idle), cheaper than a peek that finds nothing.
           Not before the first peek: the fast path has just answered
           for this call, and its "look elsewhere" may be the one in 64
           that exists only so that the full peek's checks run (a
           rewound tail, a hidden slot, a new incarnation's ring); the
           two share one count, so an idle look here would answer
           "nothing" and skip them for good. */
        if (i > 0 && ivshm_recv_idle(ep->h)) {
            all = true; /* every head empty: none waits either */
            break;
        }
        int src = -1;
        uint32_t tag = 0;
        const void *data = NULL;
        ssize_t n = ivshm_recv_peek(ep->h, IVSHM_ANY, &src, &tag, &data);
        if (n == -EAGAIN) {
            all = true; /* (a peek not released is returned again) */
            break;
        }
        if (src < 0 || src >= ep->max_peers)
            break; /* an error about no sender in particular */
        /* generations only grow: a slot live at g now was at g when
           libivshm took the message; a free slot's last holder wrote it */
        int64_t g = ivshm_peer_generation(ep->h, src);
        if (n < 0) {
            fi_addr_t a = ep->by_slot[src];
            struct fiv_peer *peer = fiv_peer(ep, a);
            bool heard = hears(ep, peer, src, g);
            if (n == -EMSGSIZE) {
                /* we never send multi-slot messages: not ours to read */
                static uint8_t sink[1 << 16];
                (void)ivshm_recv(ep->h, src, NULL, NULL, sink, sizeof sink, 0);
                fiv_pair_received(ep, src, g, 0);
                if (heard)
                    fiv_path_broken(ep, a, peer, "a message we never send");
            } else if (heard && n == IVSHM_ECORRUPT) {
                /* a slot libivshm could not validate: a message of its
                   writer is lost */
                fiv_path_broken(ep, a, peer, "libivshm found its message "
                                "corrupt");
            }
            continue;
        }
        int k = 0;
        while (k < nleft && left[k] != src)
            k++;
        if (k < nleft)
            break; /* round robin came back to it: the others are empty */
        if (!take_message(ep, src, g, tag, data, (size_t)n, true)) {
            left[nleft++] = src; /* peeked, not released: it stays */
            continue;
        }
        found++;
        (void)ivshm_recv_release(ep->h, src);
    }
    if (nleft)
        ep->writes_wait = true;
    else if (all)
        ep->writes_wait = false;
    return found;
}

/* The fast path first (docs/fast-path.md), as the BTL's progress: most
   calls find nothing, and ivshm_recv_each says so in a few loads; whole
   messages at the heads of our fast channels are taken where they lie,
   without a peek and release each. Only when it points elsewhere does
   the general path run. Bounded by FIV_BATCH either way: what is left
   waits for the next call. */
static int poll_region(struct fiv_ep *ep)
{
    /* The fast path consumes what it hands up, so a remote write with CQ
       data could not wait there: it takes no more messages than the CQ
       has room for (a message adds one entry, a multi-receive's last
       two), none while the CQ is full. */
    int max = FIV_BATCH;
    const struct fiv_cq *cq = ep->rx_cq;
    if (cq && cq->count + FIV_BATCH > cq->size)
        max = cq->count >= cq->size ? 0 : (int)(cq->size - cq->count);
    /* A write waiting at a sender's head (a peek that was not released)
       is the general path's: the fast path skips that sender but takes
       the others', which would take the room the application makes
       before the general path ever came back to the waiting one. So
       while one waits, only the general path's round robin runs. */
    if (!max || ep->writes_wait)
        return peek_region(ep);
    int taken = ivshm_recv_each(ep->h, take_in_place, ep, max);
    if (taken == -EAGAIN)
        return 0;
    if (taken > 0)
        return taken;
    return peek_region(ep);
}

/* A message to ourselves, off our own queue: handed to our own receive
   side whole. */
void fiv_loopback(struct fiv_ep *ep, struct fiv_op_req *r, fi_addr_t self)
{
    size_t n = r->hlen + r->total;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) {
        fiv_tx_done(ep, r, FI_ENOMEM);
        return;
    }
    memcpy(buf, r->hdr, r->hlen);
    if (r->from_mr) {
        /* a large READ of our own memory: handled within this call, the
           registration looked up as push() does */
        uint8_t *src = NULL;
        if (!fiv_mr_target(ep->dom, r->mr_key, r->mr_addr, r->total,
                           FI_REMOTE_READ, &src, NULL)) {
            free(buf);
            fiv_tx_done(ep, r, FI_EACCES);
            return;
        }
        memcpy(buf + r->hlen, src, r->total);
    } else {
        fiv_iov_read(r->iov, r->iov_count, 0, buf + r->hlen, r->total);
    }
    r->started = true;
    r->sent = r->total;
    uint32_t op = r->op;
    /* the sender's side completes first (r may be gone after): an answer
       (RMA) finds it waiting */
    fiv_tx_done(ep, r, 0);
    fiv_deliver(ep, self, &ep->self_peer_dummy, op, buf, n);
    free(buf);
}

/* Triggered operations ready to start (fiv_trigger.c), then the sends
   that wait for room, peer by peer (fiv_tx.c); one that fails
   fails its peer, and what is left on its queue is tried again. Our
   messages to ourselves wait there too, for their delivery. Out of
   line: the rare case stays out of the code of every progress call. */
__attribute__((noinline)) static void tx_progress(struct fiv_ep *ep)
{
    /* triggered operations whose counters reached them, in that order,
       ahead of what they queue behind */
    if (ep->trig_ready)
        fiv_trigger_start(ep);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; ep->txq_peers && (p = fiv_peer_next(ep, &id));) {
        if (p->path == PATH_SELF) {
            /* messages to ourselves (fiv_tx_start): what they answer
               joins the queue, and goes in this loop too */
            while (p->txq) {
                struct fiv_op_req *r = fiv_tx_dequeue(ep, p);
                fiv_loopback(ep, r, r->peer);
            }
            continue;
        }
        int err;
        while ((err = fiv_tx_drain(ep, p)))
            fiv_send_failed(ep, id, p, err);
    }
}

void fiv_progress(struct fiv_ep *ep)
{
    int found = 0;
    if (ep->h && (!fiv_cfg.test_slow ||
                  ++ep->slow_turn % fiv_cfg.test_slow == 0))
        found += poll_region(ep);
    /* the core provider only once a peer of ours is there: polling it
       (ofi_rxm over tcp polls its sockets) costs more than a region
       message; with region traffic flowing, every 16th call */
    if (fiv_core_active(ep) && (!found || (++ep->core_turn & 15) == 0))
        found += fiv_core_progress(ep);
    if (ep->txq_peers)
        tx_progress(ep);
    /* a host's drain request, now and then; every call while pairs
       switch (fiv_drain.c) */
    if ((ep->h || ep->drained) && (ep->switching || ep->drain_req ||
                                   (++ep->drain_turn & 63) == 0))
        fiv_drain_tick(ep);
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
