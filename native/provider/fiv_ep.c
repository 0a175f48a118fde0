/*
 * Endpoints: attaching to the region (one registry slot per endpoint),
 * opening the core provider beside it, the name (fi_getname), bindings,
 * and resolving every AV entry to its path: ourselves, the region (same
 * region: the slot is live at the generation and random name the entry
 * names), or the core provider.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <unistd.h>

#include "fiv.h"

#define FIV_LINGER_NS 2000000000ull /* close: queued sends get this long */

static uint64_t random_nonce(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
        v = fiv_now_ns() ^ ((uint64_t)getpid() << 32);
    return v ? v : 1;
}

static bool grow_peers(struct fiv_ep *ep, size_t n)
{
    if (n <= ep->npeers)
        return true;
    size_t cap = ep->npeers ? ep->npeers : 16;
    while (cap < n)
        cap *= 2;
    struct fiv_peer *p = realloc(ep->peers, cap * sizeof *p);
    if (!p)
        return false;
    memset(p + ep->npeers, 0, (cap - ep->npeers) * sizeof *p);
    ep->peers = p;
    ep->npeers = cap;
    return true;
}

/* Is the peer named by `a` the holder of its slot in our region? A peer
   that has left already counts too, while nobody has claimed its slot
   since: what it published before it went is still delivered
   (ivshm_peer_last), e.g. a last message of a sender that exited before
   we inserted it (fiv_conform_test, "departed"). */
static bool in_our_region(struct fiv_ep *ep, const struct fiv_addr *a)
{
    return fiv_region_holds(ep, a->slot, a->generation,
                            (uint64_t)a->nonce[1] << 32 | a->nonce[0], false);
}

void fiv_ep_resolve(struct fiv_ep *ep, size_t index)
{
    if (!ep->av || !grow_peers(ep, index + 1))
        return;
    const struct fiv_addr *a = fiv_av_addr(ep->av, index);
    struct fiv_peer *p = &ep->peers[index];
    memset(p, 0, sizeof *p);
    p->slot = -1;
    p->path = PATH_NONE;
    if (!a)
        return;
    uint64_t nonce = (uint64_t)a->nonce[1] << 32 | a->nonce[0];
    if (nonce == ep->nonce && a->slot == (ep->h ? ep->self_slot : -1)) {
        p->path = PATH_SELF;
        return;
    }
    if (in_our_region(ep, a)) {
        /* a peer we already hear through its introduction: this entry
           takes over what it had under way */
        if (fiv_intro_adopt(ep, index, a))
            return;
        p->path = PATH_REGION;
        p->slot = a->slot;
        p->generation = a->generation;
        p->nonce = nonce;
        memcpy(p->key, a->key, FIV_KEY_LEN);
        ep->by_slot[a->slot] = index;
        ep->gen_by_slot[a->slot] = a->generation;
        return;
    }
    int rc = -FI_ENODATA;
    if (a->core_len && ep->core &&
        (rc = fiv_core_insert(ep, a->core, index, &p->core_addr)) == 0) {
        p->path = PATH_CORE;
        p->sw_core = true; /* should the pair move to a region and back */
        return;
    }
    FIV_WARN("peer %zu (slot %d) is neither in our region nor reachable by "
             "a core provider (%s)\n", index, a->slot,
             !a->core_len ? "its name has no core address"
             : !ep->core ? "we have no core provider" : fi_strerror(-rc));
}

void fiv_ep_forget(struct fiv_ep *ep, size_t index)
{
    struct fiv_peer *p = fiv_peer(ep, index);
    if (!p)
        return;
    /* nothing of it is heard from now on: what it was sending us and
       what we wait on from it end here (fiv.h, "Lifetimes") */
    fiv_asm_fail(ep, index, p, FI_ECANCELED);
    fiv_rma_fail_peer(ep, index, FI_ECANCELED);
    fiv_tx_fail_peer(ep, p, FI_ECANCELED);
    if (p->path == PATH_REGION && ep->by_slot[p->slot] == index)
        ep->by_slot[p->slot] = FI_ADDR_NOTAVAIL;
    /* a core peer whose BACK we took is heard at its new slot already
       (fiv_drain.c): that mapping goes with it */
    if (p->path == PATH_CORE && p->bk_rx && ep->by_slot && p->rg_slot >= 0 &&
        p->rg_slot < ep->max_peers && ep->by_slot[p->rg_slot] == index)
        ep->by_slot[p->rg_slot] = FI_ADDR_NOTAVAIL;
    if (p->path == PATH_CORE)
        fiv_core_forget(ep, p->core_addr);
    fiv_core_release_peer(p);
    p->path = PATH_NONE;
}

/* ---- fid ops ---- */

/* Sends waiting for room, or handed to the core provider and not yet
   out (with manual progress it moves them only when called). */
static bool anything_queued(struct fiv_ep *ep)
{
    return ep->txq_peers > 0 || fiv_core_sending(ep);
}

static int ep_close(struct fid *fid)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    bool aliased = ep->aliases > 0;
    fiv_unlock(d);
    if (aliased)
        return -FI_EBUSY; /* an alias would call into it (fiv_alias.c) */
    /* what is queued still goes out (an MPI's last messages before it
       closes), within a bound: a dead peer must not hold us */
    uint64_t end = fiv_now_ns() + FIV_LINGER_NS;
    fiv_lock(d);
    while (anything_queued(ep) && fiv_now_ns() < end) {
        fiv_progress(ep);
        if (fiv_core_sending(ep))
            (void)fiv_core_progress(ep);
        fiv_unlock(d);
        fiv_lock(d);
    }
    /* triggered operations still waiting on their counters end as the
       queued sends do: no counter keeps a pointer to us */
    fiv_trigger_drop(ep, FI_ECANCELED);
    fi_addr_t id = FI_ADDR_NOTAVAIL;
    for (struct fiv_peer *p; (p = fiv_peer_next(ep, &id));) {
        fiv_tx_fail_peer(ep, p, FI_ECANCELED);
        fiv_asm_fail(ep, id, p, 0);
        fiv_core_release_peer(p);
    }
    fiv_unlock(d);
    fiv_domain_del_ep(d, ep);
    fiv_lock(d);
    if (ep->av)
        fiv_av_del_ep(ep->av, ep);
    if (ep->tx_cq)
        fiv_cq_del_ep(ep->tx_cq, ep);
    if (ep->rx_cq && ep->rx_cq != ep->tx_cq)
        fiv_cq_del_ep(ep->rx_cq, ep);
    struct fiv_cntr *cs[] = {ep->cntr_send, ep->cntr_recv, ep->cntr_read,
                             ep->cntr_write, ep->cntr_rread, ep->cntr_rwrite};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        bool seen = false;
        for (size_t k = 0; k < i; k++)
            seen |= cs[k] == cs[i];
        if (cs[i] && !seen)
            fiv_cntr_del_ep(cs[i], ep);
    }
    fiv_rx_free_all(ep);
    while (ep->waiting) {
        struct fiv_op_req *r = ep->waiting;
        ep->waiting = r->next;
        fiv_req_free(r);
    }
    d->refs--;
    fiv_unlock(d);
    fiv_core_close(ep);
    ivshm_detach(ep->h);
    fiv_unregister_ep(ep);
    fiv_report(ep);
    free(ep->by_slot);
    free(ep->gen_by_slot);
    free(ep->hidden);
    free(ep->pairs);
    free(ep->peers);
    free(ep);
    return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    struct fiv_domain *d = ep->dom;
    int rc = 0;
    fiv_lock(d);
    switch (bfid->fclass) {
    case FI_CLASS_AV: {
        struct fiv_av *av = container_of(bfid, struct fiv_av, av.fid);
        if (ep->av || av->dom != d) {
            rc = -FI_EINVAL;
            break;
        }
        ep->av = av;
        fiv_av_add_ep(av, ep);
        for (size_t i = 0; i < av->count; i++)
            fiv_ep_resolve(ep, i);
        break;
    }
    case FI_CLASS_CQ: {
        struct fiv_cq *cq = container_of(bfid, struct fiv_cq, cq.fid);
        /* filled under this domain's lock: another's would not be held */
        if (cq->dom != d) {
            rc = -FI_EINVAL;
            break;
        }
        if (flags & FI_TRANSMIT) {
            ep->tx_cq = cq;
            ep->tx_cq_flags = flags;
        }
        if (flags & FI_RECV) {
            ep->rx_cq = cq;
            ep->rx_cq_flags = flags;
        }
        fiv_cq_add_ep(cq, ep);
        break;
    }
    case FI_CLASS_CNTR: {
        struct fiv_cntr *c = container_of(bfid, struct fiv_cntr, cntr.fid);
        if (c->dom != d) {
            rc = -FI_EINVAL;
            break;
        }
        if (flags & FI_SEND)
            ep->cntr_send = c;
        if (flags & FI_RECV)
            ep->cntr_recv = c;
        if (flags & FI_READ)
            ep->cntr_read = c;
        if (flags & FI_WRITE)
            ep->cntr_write = c;
        if (flags & FI_REMOTE_READ)
            ep->cntr_rread = c;
        if (flags & FI_REMOTE_WRITE)
            ep->cntr_rwrite = c;
        fiv_cntr_add_ep(c, ep);
        break;
    }
    case FI_CLASS_EQ:
        break; /* nothing to report on an RDM endpoint */
    default:
        rc = -FI_EINVAL;
    }
    fiv_unlock(d);
    return rc;
}

static int ep_control(struct fid *fid, int cmd, void *arg)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    switch (cmd) {
    case FI_ENABLE:
        if (!ep->rx_cq && !ep->tx_cq && !ep->cntr_send && !ep->cntr_recv)
            return -FI_ENOCQ;
        if (!ep->av)
            return -FI_ENOAV;
        ep->enabled = true;
        return 0;
    case FI_GETOPSFLAG: {
        uint64_t *f = arg;
        *f = *f & FI_TRANSMIT ? ep->tx_op_flags : ep->rx_op_flags;
        return 0;
    }
    case FI_SETOPSFLAG: {
        uint64_t *f = arg;
        /* FI_TRIGGER belongs to a call or an alias (fiv.h) */
        if (*f & FI_TRIGGER)
            return -FI_EINVAL;
        if (*f & FI_TRANSMIT)
            ep->tx_op_flags = *f & ~FI_TRANSMIT;
        else
            ep->rx_op_flags = *f & ~FI_RECV;
        return 0;
    }
    case FI_ALIAS:
        return fiv_alias_open(ep, arg);
    default:
        return -FI_ENOSYS;
    }
}

static struct fi_ops ep_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = ep_close,
    .bind = ep_bind,
    .control = ep_control,
    .ops_open = fiv_no_ops_open,
};

static ssize_t ep_cancel(fid_t fid, void *context);

static int ep_getopt(fid_t fid, int level, int optname, void *optval,
                     size_t *optlen)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    if (level != FI_OPT_ENDPOINT)
        return -FI_ENOPROTOOPT;
    if (optname == FI_OPT_MIN_MULTI_RECV) {
        if (*optlen < sizeof(size_t))
            return -FI_ETOOSMALL;
        *(size_t *)optval = ep->min_multi_recv;
        *optlen = sizeof(size_t);
        return 0;
    }
    if (optname == FI_OPT_CM_DATA_SIZE) {
        if (*optlen < sizeof(size_t))
            return -FI_ETOOSMALL;
        *(size_t *)optval = 0;
        *optlen = sizeof(size_t);
        return 0;
    }
    return -FI_ENOPROTOOPT;
}

static int ep_setopt(fid_t fid, int level, int optname, const void *optval,
                     size_t optlen)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    if (level != FI_OPT_ENDPOINT)
        return -FI_ENOPROTOOPT;
    if (optname == FI_OPT_MIN_MULTI_RECV && optlen >= sizeof(size_t)) {
        ep->min_multi_recv = *(const size_t *)optval;
        return 0;
    }
    /* CUDA and shared-memory permissions (2.x option numbers) change
       nothing for us */
    if (optname >= 19 && optname <= 30)
        return -FI_ENOPROTOOPT;
    return -FI_ENOPROTOOPT;
}

static int no_ctx(struct fid_ep *sep, int index, void *attr,
                  struct fid_ep **out, void *context)
{
    (void)sep; (void)index; (void)attr; (void)out; (void)context;
    return -FI_ENOSYS;
}

static ssize_t rx_size_left(struct fid_ep *ep) { (void)ep; return 1024; }
static ssize_t tx_size_left(struct fid_ep *ep) { (void)ep; return 1024; }

static struct fi_ops_ep ep_ops = {
    .size = sizeof(struct fi_ops_ep),
    .cancel = ep_cancel,
    .getopt = ep_getopt,
    .setopt = ep_setopt,
    .tx_ctx = (void *)no_ctx,
    .rx_ctx = (void *)no_ctx,
    .rx_size_left = rx_size_left,
    .tx_size_left = tx_size_left,
};

static int ep_getname(fid_t fid, void *addr, size_t *addrlen)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    struct fiv_addr a;
    memset(&a, 0, sizeof a);
    a.magic = FIV_ADDR_MAGIC;
    a.version = FIV_ADDR_VERSION;
    memcpy(a.key, ep->key, FIV_KEY_LEN);
    a.slot = ep->h ? (int16_t)ep->self_slot : -1;
    a.generation = ep->h ? ep->self_gen : 0;
    a.nonce[0] = (uint32_t)ep->nonce;
    a.nonce[1] = (uint32_t)(ep->nonce >> 32);
    a.core_len = (uint8_t)fiv_core_name(ep, a.core, sizeof a.core);
    size_t cap = *addrlen;
    *addrlen = FIV_ADDR_LEN;
    if (cap < FIV_ADDR_LEN)
        return -FI_ETOOSMALL;
    memcpy(addr, &a, FIV_ADDR_LEN);
    return 0;
}

static int no_setname(fid_t fid, void *addr, size_t addrlen)
{
    (void)fid; (void)addr; (void)addrlen;
    return -FI_ENOSYS;
}

/* An RDM endpoint has no connection: what fi_cm(3) reserves for
   connection-oriented endpoints (and multicast, which we lack) answers
   -FI_ENOSYS, never a NULL the core would call through. */
static int no_getpeer(struct fid_ep *ep, void *addr, size_t *addrlen)
{
    (void)ep; (void)addr; (void)addrlen;
    return -FI_ENOSYS;
}

static int no_connect(struct fid_ep *ep, const void *addr, const void *param,
                      size_t paramlen)
{
    (void)ep; (void)addr; (void)param; (void)paramlen;
    return -FI_ENOSYS;
}

static int no_listen(struct fid_pep *pep)
{
    (void)pep;
    return -FI_ENOSYS;
}

static int no_accept(struct fid_ep *ep, const void *param, size_t paramlen)
{
    (void)ep; (void)param; (void)paramlen;
    return -FI_ENOSYS;
}

static int no_reject(struct fid_pep *pep, fid_t handle, const void *param,
                     size_t paramlen)
{
    (void)pep; (void)handle; (void)param; (void)paramlen;
    return -FI_ENOSYS;
}

static int no_shutdown(struct fid_ep *ep, uint64_t flags)
{
    (void)ep; (void)flags;
    return -FI_ENOSYS;
}

static int no_join(struct fid_ep *ep, const void *addr, uint64_t flags,
                   struct fid_mc **mc, void *context)
{
    (void)ep; (void)addr; (void)flags; (void)mc; (void)context;
    return -FI_ENOSYS;
}

static struct fi_ops_cm cm_ops = {
    .size = sizeof(struct fi_ops_cm),
    .setname = no_setname,
    .getname = ep_getname,
    .getpeer = no_getpeer,
    .connect = no_connect,
    .listen = no_listen,
    .accept = no_accept,
    .reject = no_reject,
    .shutdown = no_shutdown,
    .join = no_join,
};

static ssize_t ep_cancel(fid_t fid, void *context)
{
    struct fiv_ep *ep = container_of(fid, struct fiv_ep, ep.fid);
    fiv_lock(ep->dom);
    ssize_t rc = -FI_ENOENT;
    struct fiv_rx **lists[] = {&ep->trecv, &ep->recv};
    struct fiv_rx **tails[] = {&ep->trecv_tail, &ep->recv_tail};
    for (int l = 0; l < 2 && rc; l++) {
        struct fiv_rx *prev = NULL;
        for (struct fiv_rx *r = *lists[l]; r; prev = r, r = r->next) {
            if (r->context != context)
                continue;
            if (prev)
                prev->next = r->next;
            else
                *lists[l] = r->next;
            if (*tails[l] == r)
                *tails[l] = prev;
            struct fiv_cqe e = {.context = context, .flags = r->flags &
                                (FI_TAGGED | FI_MSG | FI_RECV | FI_MULTI_RECV),
                                .err = FI_ECANCELED, .src = FI_ADDR_NOTAVAIL};
            fiv_complete_rx(ep, &e, true);
            /* the buffer is the application's again: a message still
               filling it (multi-receive) is cut off */
            fiv_rx_cut(ep, r);
            fiv_rx_put(ep, r);
            rc = 0;
            break;
        }
    }
    if (rc)
        rc = fiv_trigger_cancel(ep, context);
    fiv_unlock(ep->dom);
    return rc;
}

int fiv_ep_open(struct fid_domain *domain, struct fi_info *info,
                struct fid_ep **ep_fid, void *context)
{
    struct fiv_domain *d = container_of(domain, struct fiv_domain, dom);
    enum fi_ep_type type = info && info->ep_attr ? info->ep_attr->type
                                                 : FI_EP_UNSPEC;
    if (type != FI_EP_RDM && type != FI_EP_DGRAM && type != FI_EP_UNSPEC)
        return -FI_EINVAL;
    struct fiv_ep *ep = calloc(1, sizeof *ep);
    if (!ep)
        return -FI_ENOMEM;
    ep->dom = d;
    ep->dgram = type == FI_EP_DGRAM;
    ep->max_msg = ep->dgram ? FIV_DGRAM_MAX_MSG : FIV_MAX_MSG;
    ep->caps = info && info->caps ? info->caps : FIV_CAPS;
    if (ep->dgram) /* whatever the info says: a datagram's subset */
        ep->caps &= FIV_DGRAM_CAPS;
    ep->tx_op_flags = info && info->tx_attr ? info->tx_attr->op_flags : 0;
    ep->tx_op_flags &= ~FI_TRIGGER; /* a call's or an alias's (fiv.h) */
    ep->rx_op_flags = info && info->rx_attr ? info->rx_attr->op_flags : 0;
    ep->min_multi_recv = 64;
    ep->nonce = random_nonce();
    fiv_new_key(ep->key);
    ep->self_slot = -1;
    ep->next_id = 1;
    (void)fiv_region_attach(ep, false);
    if (fiv_core_open(ep) < 0)
        FIV_INFO("no core provider: only peers in the region are reachable\n");
    ep->ep.fid.fclass = FI_CLASS_EP;
    ep->ep.fid.context = context;
    ep->ep.fid.ops = &ep_fi_ops;
    ep->ep.ops = &ep_ops;
    ep->ep.cm = &cm_ops;
    ep->ep.msg = &fiv_msg_ops;
    ep->ep.tagged = ep->dgram ? &fiv_no_tagged_ops : &fiv_tagged_ops;
    ep->ep.rma = ep->dgram ? &fiv_no_rma_ops : &fiv_rma_ops;
    ep->ep.atomic = ep->dgram ? &fiv_no_atomic_ops : &fiv_atomic_ops;
    fiv_domain_ref(d, 1);
    fiv_domain_add_ep(d, ep);
    fiv_register_ep(ep);
    *ep_fid = &ep->ep;
    return 0;
}
