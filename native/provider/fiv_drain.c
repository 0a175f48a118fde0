/*
 * A region pair moved to the core path at run time (docs/migration.md):
 * the host asks a rank, through its registry entry, to let go of the
 * region; the rank moves each co-resident peer to the core provider with
 * one SWITCH message each way, acknowledges and leaves. A peer that
 * receives a SWITCH moves that pair the same way.
 *
 * Order and exactly-once: a SWITCH is the last region message of its
 * direction and names the first core message of it; the receiver holds
 * the core messages of that peer until the SWITCH (fiv_delegate.c,
 * in_order) and refuses its region messages after it. A SWITCH goes only
 * at a message boundary (nothing of a message straddles the paths), and
 * after it we send the peer nothing until its SWITCH says that it hears
 * our core address.
 *
 * Everything in a SWITCH is the writer's word, read once and checked
 * against what we counted ourselves: a false one breaks its pair, never
 * more (docs/migration.md, "Security"). Every wait is bounded by the
 * drain's deadline (FI_IVSHM_DRAIN_MS), whatever peers do.
 */
#include <errno.h>
#include <string.h>

#include "fiv.h"

/* Our core provider learns `p`'s core address (its AV entry's name): what
   it sends there is attributed to it from now on. */
static int core_attach(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (p->sw_core)
        return 0;
    if (id >= FIV_HIDDEN || !ep->core || !ep->av)
        return -FI_EHOSTUNREACH; /* heard by introduction: no core address */
    const struct fiv_addr *a = fiv_av_addr(ep->av, id);
    if (!a || !a->core_len || a->core_len > FIV_CORE_ADDR_MAX)
        return -FI_EHOSTUNREACH;
    int rc = fiv_core_insert(ep, a->core, id, &p->core_addr);
    if (rc)
        return rc;
    p->sw_core = true;
    return 0;
}

/* The pair moves: what waits on its queue goes out over the core. */
static void flip(struct fiv_ep *ep, struct fiv_peer *p)
{
    p->path = PATH_CORE;
    p->sw_pause = false;
    ep->switched++;
}

/* Our SWITCH to `p`, at a message boundary: not while the message at the
   front of its queue is partly out. */
static void switch_out(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (!p->sw_want || p->sw_sent || p->dead || p->path != PATH_REGION)
        return;
    if (p->txq && p->txq->started)
        return;
    int rc = fiv_introduce(ep, p);
    struct fiv_pair *pr = fiv_tx_pair(ep, p->slot, p->generation);
    struct fiv_switch m = {.region_sent = pr->tx + 1,
                           .core_seq = p->core_tx_seq};
    if (rc == 0)
        rc = fiv_region_send(ep, p->slot, p->generation, FIV_OP_SWITCH, &m,
                             sizeof m, NULL, 0);
    if (rc == -EAGAIN)
        return; /* no room: the next tick */
    if (rc < 0) {
        fiv_send_failed(ep, id, p, rc == IVSHM_EPEERDEAD ? FI_EHOSTUNREACH
                                                         : FI_EIO);
        return;
    }
    p->sw_sent = true;
    if (p->sw_rx)
        flip(ep, p); /* else nothing goes until its SWITCH says it hears us */
}

void fiv_switch_receive(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                        int slot, int64_t gen, const uint8_t *p, size_t n)
{
    struct fiv_switch m;
    if (n != sizeof m || peer->sw_rx || peer->as.kind != ASM_NONE) {
        /* a second one, or one inside a message of several fragments */
        fiv_path_broken(ep, a, peer, "a switch out of place");
        return;
    }
    memcpy(&m, p, sizeof m); /* once: the region is shared */
    /* a writer that left since wrote it as the holder we know */
    uint32_t g = gen < 0 ? peer->generation : (uint32_t)gen;
    const struct fiv_pair *pr = &ep->pairs[slot];
    uint64_t got = pr->rx_gen == g ? pr->rx : 0;
    if (m.region_sent != got) {
        fiv_path_broken(ep, a, peer, "its switch counts messages we never "
                        "received");
        return;
    }
    if (m.core_seq != peer->core_rx_seq || m.flags) {
        fiv_path_broken(ep, a, peer, "its switch names a core message out "
                        "of order");
        return;
    }
    if (core_attach(ep, a, peer) < 0) {
        fiv_path_broken(ep, a, peer, "it switched to a core path we lack");
        return;
    }
    peer->sw_rx = true;
    if (!peer->sw_want) {
        peer->sw_want = peer->sw_pause = true; /* its drain: ours answers */
        ep->switching++;
    }
    /* what it sent over the core meanwhile, in its order */
    fiv_core_release_held(ep, a, peer);
    if (peer->sw_sent)
        flip(ep, peer);
    else
        switch_out(ep, a, peer);
}

/* A host's request read: every region peer is to switch. */
static void start_drain(struct fiv_ep *ep, uint32_t req)
{
    ep->drain_req = req;
    ep->drain_status = 0;
    ep->drain_end_ns = fiv_now_ns() + (uint64_t)fiv_cfg.drain_ms * 1000000ull;
    FIV_INFO("drain %u: moving region peers to the core\n", req);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        if (p->path != PATH_REGION || p->dead || p->sw_want)
            continue;
        if (core_attach(ep, id, p) < 0) {
            FIV_WARN("drain: peer %d (slot %d) has no core path: it fails\n",
                     id >= FIV_HIDDEN ? -1 : (int)id, p->slot);
            fiv_peer_failed(ep, id, p, FI_EHOSTUNREACH);
            ep->drain_status = -EHOSTUNREACH;
            continue;
        }
        p->sw_want = p->sw_pause = true;
        switch_out(ep, id, p);
    }
}

/* Acknowledged, left, unmapped: from here every peer is a core peer and
   our name carries no slot. */
static void finish_drain(struct fiv_ep *ep)
{
    ivshm_drain_ack(ep->h, ep->drain_req, ep->drain_status);
    FIV_INFO("drain %u done (status %d): leaving the region\n",
             ep->drain_req, ep->drain_status);
    ivshm_detach(ep->h);
    ep->h = NULL;
    ep->self_slot = -1;
    ep->drain_req = 0;
    ep->drained++;
}

void fiv_drain_tick(struct fiv_ep *ep)
{
    if (!ep->h)
        return;
    if (!ep->drain_req) {
        uint32_t req = ivshm_drain_requested(ep->h);
        if (req)
            start_drain(ep, req);
    }
    bool late = ep->drain_req && fiv_now_ns() > ep->drain_end_ns;
    int pending = 0;
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        if (!p->sw_want)
            continue;
        if (p->dead && ep->drain_req && !ep->drain_status)
            ep->drain_status = -EIO; /* a pair failed on the way */
        if (p->dead || p->path != PATH_REGION)
            continue;
        switch_out(ep, id, p);
        if (p->dead || p->path != PATH_REGION)
            continue;
        if (late) {
            fiv_path_broken(ep, id, p, "it did not answer our switch");
            ep->drain_status = -ETIMEDOUT;
            continue;
        }
        pending++;
    }
    ep->switching = pending;
    if (ep->drain_req && !pending)
        finish_drain(ep);
}
