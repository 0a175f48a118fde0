/*
 * The region attached, let go of and taken again, and a pair's path
 * changed at run time (docs/migration.md): the host asks a rank, through
 * its registry entry, to let go of the region; the rank moves each
 * co-resident peer to the core provider with one SWITCH message each
 * way, acknowledges and leaves. A peer that receives a SWITCH moves that
 * pair the same way. Afterwards the rank looks for a region again; once
 * attached it tells each core peer where it is (OFFER, over the core),
 * and a peer found in the same region is moved back with a BACK over the
 * core each way and a BACK as the first region message.
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
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "fiv.h"

#define FIV_REATTACH_NS 250000000ull /* after a drain: a region again? */

static void name_of(uint64_t nonce, char *out, size_t cap)
{
    snprintf(out, cap, "fi.%016" PRIx64, nonce);
}

bool fiv_region_holds(struct fiv_ep *ep, int slot, uint32_t gen,
                      uint64_t nonce, bool live)
{
    if (!ep->h || slot < 0 || slot >= ep->max_peers)
        return false;
    ivshm_peer_info info;
    if ((live ? ivshm_peer(ep->h, slot, &info)
              : ivshm_peer_last(ep->h, slot, &info)) < 0)
        return false;
    char want[32];
    name_of(nonce, want, sizeof want);
    info.name[sizeof info.name - 1] = 0;
    return info.generation == gen && info.job_id == FIV_JOB_TAG &&
           strcmp(info.name, want) == 0;
}

/* What we keep per slot of a region: dropped with it. Peers heard only
   through their introduction go with the region they were heard in. */
static void region_tables_free(struct fiv_ep *ep)
{
    /* a peer still on the region path (failed in a drain) names a slot
       of the region these tables were for: none of the next one's */
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id)) && id < FIV_HIDDEN;)
        if (p->path == PATH_REGION) {
            if (!p->dead)
                fiv_peer_failed(ep, id, p, FI_EHOSTUNREACH);
            p->path = PATH_NONE;
            p->slot = -1;
        }
    if (ep->hidden)
        for (int s = 0; s < ep->max_peers; s++) {
            struct fiv_peer *h = &ep->hidden[s];
            fiv_tx_fail_peer(ep, h, FI_ECANCELED);
            fiv_asm_fail(ep, FIV_HIDDEN + (fi_addr_t)s, h, 0);
            fiv_core_release_peer(h);
        }
    free(ep->by_slot);
    free(ep->gen_by_slot);
    free(ep->hidden);
    free(ep->pairs);
    ep->by_slot = NULL;
    ep->gen_by_slot = NULL;
    ep->hidden = NULL;
    ep->pairs = NULL;
}

int fiv_region_attach(struct fiv_ep *ep, bool quiet)
{
    const char *what = fiv_cfg.socket ? fiv_cfg.socket : fiv_cfg.region;
    if (!what)
        return -FI_ENODATA;
    char name[32];
    name_of(ep->nonce, name, sizeof name);
    ivshm_config cfg = {
        .job_id = FIV_JOB_TAG,
        /* (job, rank) names one attachment: an MPI may open several
           endpoints per process (Open MPI: the mtl and the btl) */
        .rank = (uint32_t)ep->nonce,
        .name = name,
        /* Never block: every wait of ours spins in the caller's progress
           loop (fi_cq_sread yields, there is no wait object to hand out),
           so nothing ever rings us. Saying so in our entry spares each
           sender the fence and the look at `sleeping` on every message
           (native/src/doorbell.c, "Blocking announced"). */
        .spin_ns = -1,
        .uio_dev = fiv_cfg.uio_dev,
        .bar0_path = fiv_cfg.bar0,
        .doorbell_id = fiv_cfg.position,
    };
    int rc;
    ivshm *h = NULL;
    if (fiv_cfg.socket) {
        /* one eventfd per peer comes through the socket (docs/btl.md,
           "Limits"); a job starting at once may keep the server from
           answering everybody within one attach's deadline */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            (void)setrlimit(RLIMIT_NOFILE, &rl);
        }
        rc = ivshm_attach_server(fiv_cfg.socket, &cfg, &h);
        for (int tries = 1; rc == -ETIMEDOUT && tries < 4; tries++)
            rc = ivshm_attach_server(fiv_cfg.socket, &cfg, &h);
    } else {
        rc = ivshm_attach_path(fiv_cfg.region, &cfg, &h);
    }
    if (rc < 0) {
        if (!quiet)
            fprintf(stderr, "fi_ivshm: pid %d cannot attach to %s: %s; every "
                    "peer goes through the core provider\n", (int)getpid(),
                    what, ivshm_strerror(rc));
        return rc;
    }
    region_tables_free(ep);
    ep->h = h;
    ivshm_geometry g;
    ivshm_get_geometry(ep->h, &g);
    ep->self_slot = ivshm_self(ep->h);
    ep->max_peers = ivshm_max_peers(ep->h);
    ep->frag = g.slot_size - 32;
    ivshm_peer_info me;
    ep->by_slot = malloc((size_t)ep->max_peers * sizeof *ep->by_slot);
    ep->gen_by_slot = calloc((size_t)ep->max_peers, sizeof *ep->gen_by_slot);
    ep->hidden = calloc((size_t)ep->max_peers, sizeof *ep->hidden);
    ep->pairs = calloc((size_t)ep->max_peers, sizeof *ep->pairs);
    if (ivshm_peer(ep->h, ep->self_slot, &me) < 0 || !ep->by_slot ||
        !ep->gen_by_slot || !ep->hidden || !ep->pairs ||
        ep->frag < 2 * sizeof(struct fiv_rma_hdr)) {
        if (!quiet)
            fprintf(stderr, "fi_ivshm: pid %d: region %s is unusable; every "
                    "peer goes through the core provider\n", (int)getpid(),
                    what);
        ivshm_detach(ep->h);
        ep->h = NULL;
        ep->self_slot = -1;
        region_tables_free(ep);
        return -FI_EINVAL;
    }
    for (int i = 0; i < ep->max_peers; i++)
        ep->by_slot[i] = FI_ADDR_NOTAVAIL;
    ep->self_gen = me.generation;
    return 0;
}

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
        /* an answer has a deadline of its own: one that cannot go (the
           peer left, its ring stays full) must not hold the pair, which
           the looks for departed peers skip while it switches */
        peer->sw_end_ns = fiv_now_ns() +
                          (uint64_t)fiv_cfg.drain_ms * 1000000ull;
        ep->switching++;
    }
    /* what it sent over the core meanwhile, in its order */
    fiv_core_release_held(ep, a, peer);
    if (peer->sw_sent)
        flip(ep, peer);
    else
        switch_out(ep, a, peer);
}

/* A region peer of a rank that drains is to switch (or fail, with no
   core path). */
static void drain_peer(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (p->path != PATH_REGION || p->dead || p->sw_want)
        return;
    if (core_attach(ep, id, p) < 0) {
        FIV_WARN("drain: peer %d (slot %d) has no core path: it fails\n",
                 id >= FIV_HIDDEN ? -1 : (int)id, p->slot);
        fiv_peer_failed(ep, id, p, FI_EHOSTUNREACH);
        ep->drain_status = -EHOSTUNREACH;
        return;
    }
    p->sw_want = p->sw_pause = true;
    p->sw_end_ns = ep->drain_end_ns;
    switch_out(ep, id, p);
}

/* A peer of our AV on the region path that no core path reaches. */
static bool lacks_core(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (p->path != PATH_REGION || p->dead || id >= FIV_HIDDEN || p->sw_core)
        return false;
    const struct fiv_addr *a = ep->av ? fiv_av_addr(ep->av, id) : NULL;
    return !ep->core || !a || !a->core_len || a->core_len > FIV_CORE_ADDR_MAX;
}

/* A host's request read: every region peer is to switch; those that
   come later (inserted, introduced) join at the next tick. A rank with
   a peer of its AV that only the region reaches refuses, keeping every
   pair: the request word is in the region, where any co-tenant may
   write it, and a host that goes on without us breaks those pairs no
   later than a drain would (docs/migration.md). */
static void start_drain(struct fiv_ep *ep, uint32_t req)
{
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));)
        if (lacks_core(ep, id, p)) {
            FIV_WARN("drain %u refused: peer %d (slot %d) has no core "
                     "path; staying in the region\n", req, (int)id, p->slot);
            ivshm_drain_ack(ep->h, req, -EHOSTUNREACH);
            return;
        }
    ep->drain_req = req;
    ep->drain_status = 0;
    ep->drain_end_ns = fiv_now_ns() + (uint64_t)fiv_cfg.drain_ms * 1000000ull;
    FIV_INFO("drain %u: moving region peers to the core\n", req);
    id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));)
        drain_peer(ep, id, p);
}

/* The counts so far close a phase of the report line. */
static void phase(struct fiv_ep *ep)
{
    if (ep->nphase < FIV_PHASES) {
        ep->phase_sent[ep->nphase] = ep->sent;
        ep->phase_deleg[ep->nphase] = ep->delegated;
        ep->nphase++;
    }
}

/* Acknowledged, left, unmapped: from here every peer is a core peer and
   our name carries no slot, until we find a region again. */
static void finish_drain(struct fiv_ep *ep)
{
    /* nothing stays on a path through the mapping that goes now: a
       region peer left here fails (its sends and probes would use it) */
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));)
        if (p->path == PATH_REGION && !p->dead) {
            fiv_peer_failed(ep, id, p, FI_EHOSTUNREACH);
            if (!ep->drain_status)
                ep->drain_status = -EHOSTUNREACH;
        }
    ivshm_drain_ack(ep->h, ep->drain_req, ep->drain_status);
    FIV_INFO("drain %u done (status %d): leaving the region\n",
             ep->drain_req, ep->drain_status);
    ivshm_detach(ep->h);
    ep->h = NULL;
    ep->self_slot = -1;
    ep->drain_req = 0;
    ep->drained++;
    ep->reattach_ns = fiv_now_ns() + FIV_REATTACH_NS;
    phase(ep);
}

/* ---- back to a region ---- */

static uint64_t av_nonce(struct fiv_ep *ep, fi_addr_t id)
{
    const struct fiv_addr *a = id < FIV_HIDDEN && ep->av ?
                               fiv_av_addr(ep->av, id) : NULL;
    return a ? (uint64_t)a->nonce[1] << 32 | a->nonce[0] : 0;
}

static void offer_out(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p,
                      uint16_t flags)
{
    struct fiv_offer o = {.slot = (int16_t)ep->self_slot, .flags = flags,
                          .generation = ep->self_gen,
                          .nonce = {(uint32_t)ep->nonce,
                                    (uint32_t)(ep->nonce >> 32)}};
    ssize_t rc = fiv_core_send(ep, p, FIV_OP_OFFER, &o, sizeof o, NULL, 0);
    if (rc == -EAGAIN)
        return; /* no core buffer free: the next tick */
    if (rc < 0) {
        fiv_send_failed(ep, id, p, FI_EIO);
        return;
    }
    if (flags & FIV_OFFER_HEARD)
        p->rg_told = true;
    else
        p->of_due = false;
}

/* A region taken again: every core peer hears where we are. */
static void rejoin(struct fiv_ep *ep)
{
    ep->rejoined++;
    phase(ep);
    FIV_INFO("a region again (slot %d): offering it to our core peers\n",
             ep->self_slot);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        if (id >= FIV_HIDDEN || p->path != PATH_CORE || p->dead ||
            !av_nonce(ep, id))
            continue;
        p->rg_ok = p->rg_told = p->rg_heard = false;
        p->of_due = true;
        ep->switching++;
        offer_out(ep, id, p, 0);
    }
}

/* The pair is on the region again, at the peer's slot there; our region
   BACK goes first when `mark`. */
static void flip_back(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p,
                      bool mark)
{
    p->path = PATH_REGION;
    p->slot = p->rg_slot;
    p->generation = p->rg_gen;
    p->nonce = av_nonce(ep, id);
    p->introduced = true; /* it heard us by our OFFER */
    p->sw_want = p->sw_sent = p->sw_rx = false;
    p->bk_want = p->bk_sent = p->bk_rx = p->bk_end = false;
    p->rg_ok = p->rg_told = p->rg_heard = false;
    p->bk_mark = mark;
    p->sw_pause = mark;
    /* the pair's sends wait behind our region BACK: a peer whose queue
       stays full (it reads nothing, or a co-tenant fills it) must not
       hold them past the drain's deadline */
    if (mark)
        p->bk_end_ns = fiv_now_ns() + (uint64_t)fiv_cfg.drain_ms * 1000000ull;
    ep->switched++;
}

static void mark_out(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    struct fiv_pair *pr = fiv_tx_pair(ep, p->slot, p->generation);
    struct fiv_switch m = {.region_sent = pr->tx + 1,
                           .core_seq = p->core_tx_seq};
    int rc = fiv_region_send(ep, p->slot, p->generation, FIV_OP_BACK, &m,
                             sizeof m, NULL, 0);
    if (rc == -EAGAIN)
        return;
    if (rc < 0) {
        fiv_send_failed(ep, id, p, rc == IVSHM_EPEERDEAD ? FI_EHOSTUNREACH
                                                         : FI_EIO);
        return;
    }
    p->bk_mark = false;
    p->sw_pause = false;
}

/* Our core BACK, at a message boundary: our last core message to it. */
static void back_out(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (!p->bk_want || p->bk_sent || p->dead || p->path != PATH_CORE)
        return;
    if (p->txq && p->txq->started)
        return;
    struct fiv_switch m = {.region_sent = 0, .core_seq = p->core_tx_seq};
    ssize_t rc = fiv_core_send(ep, p, FIV_OP_BACK, &m, sizeof m, NULL, 0);
    if (rc == -EAGAIN)
        return;
    if (rc < 0) {
        fiv_send_failed(ep, id, p, FI_EIO);
        return;
    }
    p->bk_sent = true;
}

/* Each side found the other in its region and told it so: the pair
   moves back. One side begins, the one with the lower nonce: two BACKs
   that crossed would each let a side send on the region before the
   other took its core BACK, and what it sent there would be unheard. */
static void begin_back(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    if (p->rg_ok && p->rg_told && p->rg_heard && !p->bk_want &&
        !p->dead && p->path == PATH_CORE && ep->nonce < av_nonce(ep, id)) {
        p->bk_want = p->sw_pause = true;
        p->bk_end_ns = fiv_now_ns() + (uint64_t)fiv_cfg.drain_ms * 1000000ull;
    }
}

/* What its OFFER says, checked against our own region. */
static void offer_in(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    struct fiv_offer o = p->of; /* copied once on arrival */
    p->of_new = false;
    if (!ep->h || p->path != PATH_CORE || p->dead || p->bk_want)
        return; /* we offer ourselves when we attach */
    uint64_t nonce = av_nonce(ep, id);
    if (!nonce || ((uint64_t)o.nonce[1] << 32 | o.nonce[0]) != nonce) {
        fiv_path_broken(ep, id, p, "its offer names another endpoint");
        return;
    }
    /* where it is now: a live holder of that slot. A holder that left
       (fiv_region_holds' last holder) is where it was: each region counts
       its slots' generations from 1, so a rank that moved on offers a
       (slot, generation) of its new region that may name its own
       departed entry in ours. Taken for a place it is at, the pair would
       wait for a back switch that never comes; and our answer to the
       place it has now would not go (rg_told). */
    if (!fiv_region_holds(ep, o.slot, o.generation, nonce, true)) {
        p->rg_ok = p->rg_told = p->rg_heard = false;
        return; /* not in our region (or no longer) */
    }
    if (p->rg_ok && (o.slot != p->rg_slot || o.generation != p->rg_gen))
        p->rg_told = p->rg_heard = false; /* it came back elsewhere */
    p->rg_ok = true;
    p->rg_slot = o.slot;
    p->rg_gen = o.generation;
    if (o.flags & FIV_OFFER_HEARD)
        p->rg_heard = true;
    if (!p->rg_told)
        offer_out(ep, id, p, FIV_OFFER_HEARD);
    begin_back(ep, id, p);
}

/* Its core BACK, in its core order: its last core message. */
static void back_in(struct fiv_ep *ep, fi_addr_t id, struct fiv_peer *p)
{
    struct fiv_switch m = p->bk; /* copied once on arrival */
    p->bk_new = false;
    if (p->dead)
        return;
    if (!ep->h || p->path != PATH_CORE || !p->rg_ok || !p->rg_told) {
        fiv_path_broken(ep, id, p, "a back switch we never offered");
        return;
    }
    if (m.core_seq != p->bk_seq || m.region_sent || m.flags) {
        fiv_path_broken(ep, id, p, "its back switch counts wrong");
        return;
    }
    p->bk_rx = true;  /* we hear it on the region from here */
    p->sw_rx = false;
    ep->by_slot[p->rg_slot] = id;
    ep->gen_by_slot[p->rg_slot] = p->rg_gen;
    if (p->bk_sent) {
        /* it took ours before it sent its own: the region now */
        flip_back(ep, id, p, true);
        mark_out(ep, id, p);
    } else {
        p->bk_want = p->sw_pause = true; /* ours answers; its region BACK
                                            then says it took ours */
        p->bk_end_ns = fiv_now_ns() + (uint64_t)fiv_cfg.drain_ms * 1000000ull;
        back_out(ep, id, p);
    }
}

void fiv_back_receive(struct fiv_ep *ep, fi_addr_t a, struct fiv_peer *peer,
                      int slot, int64_t gen, const uint8_t *p, size_t n)
{
    struct fiv_switch m;
    if (n != sizeof m) {
        fiv_path_broken(ep, a, peer, "a region back switch out of place");
        return;
    }
    memcpy(&m, p, sizeof m); /* once: the region is shared */
    uint32_t g = gen < 0 ? peer->generation : (uint32_t)gen;
    if (peer->path == PATH_CORE)
        g = peer->rg_gen;
    const struct fiv_pair *pr = &ep->pairs[slot];
    uint64_t got = pr->rx_gen == g ? pr->rx : 0;
    /* we answered its core BACK with ours and wait for this */
    bool waiting = peer->path == PATH_CORE && peer->bk_rx && peer->bk_sent;
    if (!waiting || m.region_sent != got || m.core_seq != peer->core_rx_seq ||
        m.flags) {
        fiv_path_broken(ep, a, peer, "a region back switch out of place");
        return;
    }
    flip_back(ep, a, peer, false);
}

void fiv_drain_tick(struct fiv_ep *ep)
{
    if (!ep->h && ep->drained && fiv_now_ns() >= ep->reattach_ns) {
        ep->reattach_ns = fiv_now_ns() + FIV_REATTACH_NS;
        /* a guest's device (BAR0 given, no socket) as bound now */
        bool guest = fiv_cfg.bar0 && !fiv_cfg.socket;
        if ((!guest || fiv_guest_defaults(true)) &&
            fiv_region_attach(ep, true) == 0)
            rejoin(ep);
    }
    if (ep->h && !ep->drain_req) {
        uint32_t req = ivshm_drain_requested(ep->h);
        if (req)
            start_drain(ep, req);
    }
    /* the peers only while something is under way: a job of many peers
       pays nothing for this look */
    if (!ep->drain_req && !ep->switching)
        return;
    uint64_t now = fiv_now_ns();
    int pending = 0;
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        /* back to the region: what the core brought, what is to go */
        if (p->of_due && !p->dead && p->path == PATH_CORE && ep->h)
            offer_out(ep, id, p, 0);
        if (p->of_new)
            offer_in(ep, id, p);
        if (p->bk_new)
            back_in(ep, id, p);
        if (p->rg_ok && !p->rg_told && !p->dead && p->path == PATH_CORE) {
            offer_out(ep, id, p, FIV_OFFER_HEARD); /* it found no room */
            begin_back(ep, id, p);
        }
        back_out(ep, id, p);
        if (p->bk_mark && !p->dead) {
            mark_out(ep, id, p);
            if (p->bk_mark && !p->dead && fiv_now_ns() > p->bk_end_ns)
                /* the peer took our core BACK and hears us on the region
                   only: no way on for the pair */
                fiv_path_broken(ep, id, p, "our back switch could not go "
                                "to it");
        }
        if (p->bk_want && p->path == PATH_CORE && !p->dead &&
            fiv_now_ns() > p->bk_end_ns)
            /* our core stream may have ended with our BACK: no way on */
            fiv_path_broken(ep, id, p, "it did not answer our back switch");
        if (!p->dead && (p->of_due || p->bk_mark || p->of_new ||
                         (p->rg_ok && !p->rg_told) ||
                         (p->bk_want && p->path == PATH_CORE)))
            pending++;
        /* to the core */
        if (ep->drain_req && ep->h)
            drain_peer(ep, id, p); /* one that came during the drain */
        if (!p->sw_want)
            continue;
        if (p->dead && ep->drain_req && !ep->drain_status)
            ep->drain_status = -EIO; /* a pair failed on the way */
        if (p->dead || p->path != PATH_REGION)
            continue;
        switch_out(ep, id, p);
        if (p->dead || p->path != PATH_REGION)
            continue;
        if (now > p->sw_end_ns) {
            fiv_path_broken(ep, id, p, p->sw_sent ?
                            "it did not answer our switch" :
                            "our switch could not go to it");
            if (ep->drain_req)
                ep->drain_status = -ETIMEDOUT;
            continue;
        }
        pending++;
    }
    ep->switching = pending;
    if (ep->drain_req && ep->h) {
        int left = 0;
        id = FI_ADDR_NOTAVAIL;
        for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));)
            left += p->sw_want && !p->dead && p->path == PATH_REGION;
        if (!left)
            finish_drain(ep);
    }
}
