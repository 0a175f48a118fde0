/*
 * Alias endpoints (fi_ep_alias, fi_endpoint(3)): the same endpoint,
 * reached through a second fid whose calls without a flags argument
 * take the alias's operation flags instead of the endpoint's. fabtests'
 * fi_rdm_rma_trigger makes its triggered writes through one
 * (FI_TRANSMIT | FI_TRIGGER). Each call is its endpoint's *msg call with
 * those flags; the *msg calls pass through as they are. An alias of
 * FI_TRANSMIT changes only the sends, RMA and atomics, one of FI_RECV
 * only the receives. The endpoint does not close while an alias is
 * open (-FI_EBUSY): an alias never calls into a closed endpoint.
 */
#include <stdlib.h>

#include "fiv.h"

struct fiv_alias {
    struct fid_ep ep;
    struct fiv_ep *base;
    bool tx;              /* FI_TRANSMIT (else FI_RECV)                   */
    uint64_t flags;       /* its operation flags                          */
};

#define AL(e) container_of(e, struct fiv_alias, ep)
#define BASE(e) (&AL(e)->base->ep)

/* The flags a call without a flags argument takes on this side, or
   none: the endpoint's own call then serves it. */
static bool takes(struct fid_ep *e, bool tx, uint64_t *flags)
{
    struct fiv_alias *a = AL(e);
    *flags = a->flags | FI_COMPLETION;
    return a->tx == tx;
}

/* An inject names no context, so it cannot be triggered. */
static bool no_inject(struct fid_ep *e)
{
    return AL(e)->tx && AL(e)->flags & FI_TRIGGER;
}

/* ---- fid ---- */

static int alias_close(struct fid *fid)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    struct fiv_domain *d = a->base->dom;
    fiv_lock(d);
    a->base->aliases--;
    fiv_unlock(d);
    free(a);
    return 0;
}

/* What an alias's flags may be, at its opening and at FI_SETOPSFLAG:
   its side's operation flags, and FI_TRIGGER on the transmit side of
   an endpoint that offers it. */
static bool flags_allowed(const struct fiv_ep *ep, bool tx, uint64_t ops)
{
    uint64_t allowed = tx ? FIV_TX_OP_FLAGS | FI_TRIGGER : FIV_RX_OP_FLAGS;
    return !(ops & ~allowed) && !(ops & FI_TRIGGER && !(ep->caps & FI_TRIGGER));
}

static int alias_control(struct fid *fid, int cmd, void *arg)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    if (cmd == FI_GETOPSFLAG || cmd == FI_SETOPSFLAG) {
        uint64_t *f = arg;
        if (!(*f & FI_TRANSMIT) != !a->tx)
            return a->base->ep.fid.ops->control(&a->base->ep.fid, cmd, arg);
        if (cmd == FI_GETOPSFLAG) {
            *f = a->flags;
            return 0;
        }
        uint64_t want = *f & ~(FI_TRANSMIT | FI_RECV);
        if (!flags_allowed(a->base, a->tx, want))
            return -FI_EINVAL;
        a->flags = want;
        return 0;
    }
    return -FI_ENOSYS;
}

static struct fi_ops alias_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = alias_close,
    .bind = fiv_no_bind,
    .control = alias_control,
    .ops_open = fiv_no_ops_open,
};

static ssize_t al_cancel(fid_t fid, void *context)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    return fi_cancel(&a->base->ep.fid, context);
}

static int al_getopt(fid_t fid, int level, int name, void *val, size_t *len)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    return fi_getopt(&a->base->ep.fid, level, name, val, len);
}

static int al_setopt(fid_t fid, int level, int name, const void *val,
                     size_t len)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    return fi_setopt(&a->base->ep.fid, level, name, val, len);
}

static int al_no_ctx(struct fid_ep *sep, int index, void *attr,
                     struct fid_ep **out, void *context)
{
    (void)sep; (void)index; (void)attr; (void)out; (void)context;
    return -FI_ENOSYS;
}

static ssize_t al_rx_left(struct fid_ep *e)
{
    return BASE(e)->ops->rx_size_left(BASE(e));
}

static ssize_t al_tx_left(struct fid_ep *e)
{
    return BASE(e)->ops->tx_size_left(BASE(e));
}

static struct fi_ops_ep alias_ep_ops = {
    .size = sizeof(struct fi_ops_ep),
    .cancel = al_cancel,
    .getopt = al_getopt,
    .setopt = al_setopt,
    .tx_ctx = (void *)al_no_ctx,
    .rx_ctx = (void *)al_no_ctx,
    .rx_size_left = al_rx_left,
    .tx_size_left = al_tx_left,
};

/* The name is the endpoint's; the connection calls answer as its do. */
static int al_getname(fid_t fid, void *addr, size_t *addrlen)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    return fi_getname(&a->base->ep.fid, addr, addrlen);
}

static int al_setname(fid_t fid, void *addr, size_t addrlen)
{
    struct fiv_alias *a = container_of(fid, struct fiv_alias, ep.fid);
    return fi_setname(&a->base->ep.fid, addr, addrlen);
}

static int al_getpeer(struct fid_ep *e, void *addr, size_t *addrlen)
{
    return fi_getpeer(BASE(e), addr, addrlen);
}

static int al_connect(struct fid_ep *e, const void *addr, const void *param,
                      size_t paramlen)
{
    return fi_connect(BASE(e), addr, param, paramlen);
}

static int al_listen(struct fid_pep *pep)
{
    (void)pep;
    return -FI_ENOSYS;
}

static int al_accept(struct fid_ep *e, const void *param, size_t paramlen)
{
    return fi_accept(BASE(e), param, paramlen);
}

static int al_reject(struct fid_pep *pep, fid_t handle, const void *param,
                     size_t paramlen)
{
    (void)pep; (void)handle; (void)param; (void)paramlen;
    return -FI_ENOSYS;
}

static int al_shutdown(struct fid_ep *e, uint64_t flags)
{
    return fi_shutdown(BASE(e), flags);
}

static int al_join(struct fid_ep *e, const void *addr, uint64_t flags,
                   struct fid_mc **mc, void *context)
{
    return fi_join(BASE(e), addr, flags, mc, context);
}

static struct fi_ops_cm alias_cm_ops = {
    .size = sizeof(struct fi_ops_cm),
    .setname = al_setname,
    .getname = al_getname,
    .getpeer = al_getpeer,
    .connect = al_connect,
    .listen = al_listen,
    .accept = al_accept,
    .reject = al_reject,
    .shutdown = al_shutdown,
    .join = al_join,
};

/* ---- msg ---- */

static ssize_t al_recvv(struct fid_ep *e, const struct iovec *iov, void **desc,
                        size_t count, fi_addr_t src, void *ctx)
{
    uint64_t f;
    if (!takes(e, false, &f))
        return fi_recvv(BASE(e), iov, desc, count, src, ctx);
    struct fi_msg m = {.msg_iov = iov, .desc = desc, .iov_count = count,
                       .addr = src, .context = ctx};
    return fi_recvmsg(BASE(e), &m, f);
}

static ssize_t al_recv(struct fid_ep *e, void *buf, size_t len, void *desc,
                       fi_addr_t src, void *ctx)
{
    struct iovec v = {buf, len};
    return al_recvv(e, &v, &desc, 1, src, ctx);
}

static ssize_t al_recvmsg(struct fid_ep *e, const struct fi_msg *m,
                          uint64_t flags)
{
    return fi_recvmsg(BASE(e), m, flags);
}

static ssize_t al_senddatav(struct fid_ep *e, const struct iovec *iov,
                            void **desc, size_t count, uint64_t data,
                            fi_addr_t dest, void *ctx, uint64_t more)
{
    uint64_t f;
    (void)takes(e, true, &f);
    struct fi_msg m = {.msg_iov = iov, .desc = desc, .iov_count = count,
                       .addr = dest, .context = ctx, .data = data};
    return fi_sendmsg(BASE(e), &m, f | more);
}

static ssize_t al_send(struct fid_ep *e, const void *buf, size_t len,
                       void *desc, fi_addr_t dest, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_send(BASE(e), buf, len, desc, dest, ctx);
    struct iovec v = {(void *)buf, len};
    return al_senddatav(e, &v, &desc, 1, 0, dest, ctx, 0);
}

static ssize_t al_sendv(struct fid_ep *e, const struct iovec *iov, void **desc,
                        size_t count, fi_addr_t dest, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_sendv(BASE(e), iov, desc, count, dest, ctx);
    return al_senddatav(e, iov, desc, count, 0, dest, ctx, 0);
}

static ssize_t al_sendmsg(struct fid_ep *e, const struct fi_msg *m,
                          uint64_t flags)
{
    return fi_sendmsg(BASE(e), m, flags);
}

static ssize_t al_inject(struct fid_ep *e, const void *buf, size_t len,
                         fi_addr_t dest)
{
    return no_inject(e) ? -FI_EINVAL : fi_inject(BASE(e), buf, len, dest);
}

static ssize_t al_senddata(struct fid_ep *e, const void *buf, size_t len,
                           void *desc, uint64_t data, fi_addr_t dest,
                           void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_senddata(BASE(e), buf, len, desc, data, dest, ctx);
    struct iovec v = {(void *)buf, len};
    return al_senddatav(e, &v, &desc, 1, data, dest, ctx, FI_REMOTE_CQ_DATA);
}

static ssize_t al_injectdata(struct fid_ep *e, const void *buf, size_t len,
                             uint64_t data, fi_addr_t dest)
{
    return no_inject(e) ? -FI_EINVAL
                        : fi_injectdata(BASE(e), buf, len, data, dest);
}

static struct fi_ops_msg alias_msg_ops = {
    .size = sizeof(struct fi_ops_msg),
    .recv = al_recv,
    .recvv = al_recvv,
    .recvmsg = al_recvmsg,
    .send = al_send,
    .sendv = al_sendv,
    .sendmsg = al_sendmsg,
    .inject = al_inject,
    .senddata = al_senddata,
    .injectdata = al_injectdata,
};

/* ---- tagged ---- */

static ssize_t al_trecvv(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t src,
                         uint64_t tag, uint64_t ignore, void *ctx)
{
    uint64_t f;
    if (!takes(e, false, &f))
        return fi_trecvv(BASE(e), iov, desc, count, src, tag, ignore, ctx);
    struct fi_msg_tagged m = {.msg_iov = iov, .desc = desc,
                              .iov_count = count, .addr = src, .tag = tag,
                              .ignore = ignore, .context = ctx};
    return fi_trecvmsg(BASE(e), &m, f);
}

static ssize_t al_trecv(struct fid_ep *e, void *buf, size_t len, void *desc,
                        fi_addr_t src, uint64_t tag, uint64_t ignore,
                        void *ctx)
{
    struct iovec v = {buf, len};
    return al_trecvv(e, &v, &desc, 1, src, tag, ignore, ctx);
}

static ssize_t al_trecvmsg(struct fid_ep *e, const struct fi_msg_tagged *m,
                           uint64_t flags)
{
    return fi_trecvmsg(BASE(e), m, flags);
}

static ssize_t al_tsenddatav(struct fid_ep *e, const struct iovec *iov,
                             void **desc, size_t count, uint64_t data,
                             fi_addr_t dest, uint64_t tag, void *ctx,
                             uint64_t more)
{
    uint64_t f;
    (void)takes(e, true, &f);
    struct fi_msg_tagged m = {.msg_iov = iov, .desc = desc,
                              .iov_count = count, .addr = dest, .tag = tag,
                              .context = ctx, .data = data};
    return fi_tsendmsg(BASE(e), &m, f | more);
}

static ssize_t al_tsend(struct fid_ep *e, const void *buf, size_t len,
                        void *desc, fi_addr_t dest, uint64_t tag, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_tsend(BASE(e), buf, len, desc, dest, tag, ctx);
    struct iovec v = {(void *)buf, len};
    return al_tsenddatav(e, &v, &desc, 1, 0, dest, tag, ctx, 0);
}

static ssize_t al_tsendv(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t dest,
                         uint64_t tag, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_tsendv(BASE(e), iov, desc, count, dest, tag, ctx);
    return al_tsenddatav(e, iov, desc, count, 0, dest, tag, ctx, 0);
}

static ssize_t al_tsendmsg(struct fid_ep *e, const struct fi_msg_tagged *m,
                           uint64_t flags)
{
    return fi_tsendmsg(BASE(e), m, flags);
}

static ssize_t al_tinject(struct fid_ep *e, const void *buf, size_t len,
                          fi_addr_t dest, uint64_t tag)
{
    return no_inject(e) ? -FI_EINVAL : fi_tinject(BASE(e), buf, len, dest, tag);
}

static ssize_t al_tsenddata(struct fid_ep *e, const void *buf, size_t len,
                            void *desc, uint64_t data, fi_addr_t dest,
                            uint64_t tag, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_tsenddata(BASE(e), buf, len, desc, data, dest, tag, ctx);
    struct iovec v = {(void *)buf, len};
    return al_tsenddatav(e, &v, &desc, 1, data, dest, tag, ctx,
                         FI_REMOTE_CQ_DATA);
}

static ssize_t al_tinjectdata(struct fid_ep *e, const void *buf, size_t len,
                              uint64_t data, fi_addr_t dest, uint64_t tag)
{
    return no_inject(e) ? -FI_EINVAL
                        : fi_tinjectdata(BASE(e), buf, len, data, dest, tag);
}

static struct fi_ops_tagged alias_tagged_ops = {
    .size = sizeof(struct fi_ops_tagged),
    .recv = al_trecv,
    .recvv = al_trecvv,
    .recvmsg = al_trecvmsg,
    .send = al_tsend,
    .sendv = al_tsendv,
    .sendmsg = al_tsendmsg,
    .inject = al_tinject,
    .senddata = al_tsenddata,
    .injectdata = al_tinjectdata,
};

/* ---- RMA ---- */

static ssize_t al_readv(struct fid_ep *e, const struct iovec *iov, void **desc,
                        size_t count, fi_addr_t src, uint64_t addr,
                        uint64_t key, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_readv(BASE(e), iov, desc, count, src, addr, key, ctx);
    struct fi_rma_iov r = {.addr = addr, .len = fiv_iov_total(iov, count),
                           .key = key};
    struct fi_msg_rma m = {.msg_iov = iov, .desc = desc, .iov_count = count,
                           .addr = src, .rma_iov = &r, .rma_iov_count = 1,
                           .context = ctx};
    return fi_readmsg(BASE(e), &m, f);
}

static ssize_t al_read(struct fid_ep *e, void *buf, size_t len, void *desc,
                       fi_addr_t src, uint64_t addr, uint64_t key, void *ctx)
{
    struct iovec v = {buf, len};
    return al_readv(e, &v, &desc, 1, src, addr, key, ctx);
}

static ssize_t al_readmsg(struct fid_ep *e, const struct fi_msg_rma *m,
                          uint64_t flags)
{
    return fi_readmsg(BASE(e), m, flags);
}

static ssize_t al_writedatav(struct fid_ep *e, const struct iovec *iov,
                             void **desc, size_t count, uint64_t data,
                             fi_addr_t dest, uint64_t addr, uint64_t key,
                             void *ctx, uint64_t more)
{
    uint64_t f;
    (void)takes(e, true, &f);
    struct fi_rma_iov r = {.addr = addr, .len = fiv_iov_total(iov, count),
                           .key = key};
    struct fi_msg_rma m = {.msg_iov = iov, .desc = desc, .iov_count = count,
                           .addr = dest, .rma_iov = &r, .rma_iov_count = 1,
                           .context = ctx, .data = data};
    return fi_writemsg(BASE(e), &m, f | more);
}

static ssize_t al_write(struct fid_ep *e, const void *buf, size_t len,
                        void *desc, fi_addr_t dest, uint64_t addr,
                        uint64_t key, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_write(BASE(e), buf, len, desc, dest, addr, key, ctx);
    struct iovec v = {(void *)buf, len};
    return al_writedatav(e, &v, &desc, 1, 0, dest, addr, key, ctx, 0);
}

static ssize_t al_writev(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t dest,
                         uint64_t addr, uint64_t key, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_writev(BASE(e), iov, desc, count, dest, addr, key, ctx);
    return al_writedatav(e, iov, desc, count, 0, dest, addr, key, ctx, 0);
}

static ssize_t al_writemsg(struct fid_ep *e, const struct fi_msg_rma *m,
                           uint64_t flags)
{
    return fi_writemsg(BASE(e), m, flags);
}

static ssize_t al_rinject(struct fid_ep *e, const void *buf, size_t len,
                          fi_addr_t dest, uint64_t addr, uint64_t key)
{
    return no_inject(e) ? -FI_EINVAL
                        : fi_inject_write(BASE(e), buf, len, dest, addr, key);
}

static ssize_t al_writedata(struct fid_ep *e, const void *buf, size_t len,
                            void *desc, uint64_t data, fi_addr_t dest,
                            uint64_t addr, uint64_t key, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_writedata(BASE(e), buf, len, desc, data, dest, addr, key,
                            ctx);
    struct iovec v = {(void *)buf, len};
    return al_writedatav(e, &v, &desc, 1, data, dest, addr, key, ctx,
                         FI_REMOTE_CQ_DATA);
}

static ssize_t al_rinjectdata(struct fid_ep *e, const void *buf, size_t len,
                              uint64_t data, fi_addr_t dest, uint64_t addr,
                              uint64_t key)
{
    return no_inject(e) ? -FI_EINVAL
                        : fi_inject_writedata(BASE(e), buf, len, data, dest,
                                              addr, key);
}

static struct fi_ops_rma alias_rma_ops = {
    .size = sizeof(struct fi_ops_rma),
    .read = al_read,
    .readv = al_readv,
    .readmsg = al_readmsg,
    .write = al_write,
    .writev = al_writev,
    .writemsg = al_writemsg,
    .inject = al_rinject,
    .writedata = al_writedata,
    .injectdata = al_rinjectdata,
};

/* ---- atomics ---- */

static ssize_t al_atomicv(struct fid_ep *e, const struct fi_ioc *iov,
                          void **desc, size_t count, fi_addr_t dest,
                          uint64_t addr, uint64_t key, enum fi_datatype dt,
                          enum fi_op op, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_atomicv(BASE(e), iov, desc, count, dest, addr, key, dt, op,
                          ctx);
    struct fi_rma_ioc r = {.addr = addr, .count = count ? iov[0].count : 0,
                           .key = key};
    struct fi_msg_atomic m = {.msg_iov = iov, .desc = desc,
                              .iov_count = count, .addr = dest, .rma_iov = &r,
                              .rma_iov_count = 1, .datatype = dt, .op = op,
                              .context = ctx};
    return fi_atomicmsg(BASE(e), &m, f);
}

static ssize_t al_atomic(struct fid_ep *e, const void *buf, size_t count,
                         void *desc, fi_addr_t dest, uint64_t addr,
                         uint64_t key, enum fi_datatype dt, enum fi_op op,
                         void *ctx)
{
    struct fi_ioc v = {(void *)buf, count};
    return al_atomicv(e, &v, &desc, 1, dest, addr, key, dt, op, ctx);
}

static ssize_t al_atomicmsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                            uint64_t flags)
{
    return fi_atomicmsg(BASE(e), m, flags);
}

static ssize_t al_ainject(struct fid_ep *e, const void *buf, size_t count,
                          fi_addr_t dest, uint64_t addr, uint64_t key,
                          enum fi_datatype dt, enum fi_op op)
{
    return no_inject(e) ? -FI_EINVAL
                        : fi_inject_atomic(BASE(e), buf, count, dest, addr,
                                           key, dt, op);
}

static ssize_t al_fetchv(struct fid_ep *e, const struct fi_ioc *iov,
                         void **desc, size_t count, struct fi_ioc *resultv,
                         void **result_desc, size_t result_count,
                         fi_addr_t dest, uint64_t addr, uint64_t key,
                         enum fi_datatype dt, enum fi_op op, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_fetch_atomicv(BASE(e), iov, desc, count, resultv,
                                result_desc, result_count, dest, addr, key,
                                dt, op, ctx);
    struct fi_rma_ioc r = {.addr = addr,
                           .count = result_count ? resultv[0].count : 0,
                           .key = key};
    struct fi_msg_atomic m = {.msg_iov = iov, .desc = desc,
                              .iov_count = count, .addr = dest, .rma_iov = &r,
                              .rma_iov_count = 1, .datatype = dt, .op = op,
                              .context = ctx};
    return fi_fetch_atomicmsg(BASE(e), &m, resultv, result_desc, result_count,
                              f);
}

static ssize_t al_fetch(struct fid_ep *e, const void *buf, size_t count,
                        void *desc, void *result, void *result_desc,
                        fi_addr_t dest, uint64_t addr, uint64_t key,
                        enum fi_datatype dt, enum fi_op op, void *ctx)
{
    /* a read (FI_ATOMIC_READ) may have no operand: none is passed on */
    struct fi_ioc v = {(void *)buf, count}, res = {result, count};
    return al_fetchv(e, buf ? &v : NULL, &desc, buf ? 1 : 0, &res,
                     &result_desc, 1, dest, addr, key, dt, op, ctx);
}

static ssize_t al_fetchmsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                           struct fi_ioc *resultv, void **result_desc,
                           size_t result_count, uint64_t flags)
{
    return fi_fetch_atomicmsg(BASE(e), m, resultv, result_desc, result_count,
                              flags);
}

static ssize_t al_compv(struct fid_ep *e, const struct fi_ioc *iov,
                        void **desc, size_t count,
                        const struct fi_ioc *comparev, void **compare_desc,
                        size_t compare_count, struct fi_ioc *resultv,
                        void **result_desc, size_t result_count,
                        fi_addr_t dest, uint64_t addr, uint64_t key,
                        enum fi_datatype dt, enum fi_op op, void *ctx)
{
    uint64_t f;
    if (!takes(e, true, &f))
        return fi_compare_atomicv(BASE(e), iov, desc, count, comparev,
                                  compare_desc, compare_count, resultv,
                                  result_desc, result_count, dest, addr, key,
                                  dt, op, ctx);
    struct fi_rma_ioc r = {.addr = addr, .count = count ? iov[0].count : 0,
                           .key = key};
    struct fi_msg_atomic m = {.msg_iov = iov, .desc = desc,
                              .iov_count = count, .addr = dest, .rma_iov = &r,
                              .rma_iov_count = 1, .datatype = dt, .op = op,
                              .context = ctx};
    return fi_compare_atomicmsg(BASE(e), &m, comparev, compare_desc,
                                compare_count, resultv, result_desc,
                                result_count, f);
}

static ssize_t al_comp(struct fid_ep *e, const void *buf, size_t count,
                       void *desc, const void *compare, void *compare_desc,
                       void *result, void *result_desc, fi_addr_t dest,
                       uint64_t addr, uint64_t key, enum fi_datatype dt,
                       enum fi_op op, void *ctx)
{
    struct fi_ioc v = {(void *)buf, count}, c = {(void *)compare, count},
                  res = {result, count};
    return al_compv(e, &v, &desc, 1, &c, &compare_desc, 1, &res, &result_desc,
                    1, dest, addr, key, dt, op, ctx);
}

static ssize_t al_compmsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                          const struct fi_ioc *comparev, void **compare_desc,
                          size_t compare_count, struct fi_ioc *resultv,
                          void **result_desc, size_t result_count,
                          uint64_t flags)
{
    return fi_compare_atomicmsg(BASE(e), m, comparev, compare_desc,
                                compare_count, resultv, result_desc,
                                result_count, flags);
}

static int al_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                    size_t *count)
{
    return fi_atomicvalid(BASE(e), dt, op, count);
}

static int al_fetch_valid(struct fid_ep *e, enum fi_datatype dt,
                          enum fi_op op, size_t *count)
{
    return fi_fetch_atomicvalid(BASE(e), dt, op, count);
}

static int al_comp_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                         size_t *count)
{
    return fi_compare_atomicvalid(BASE(e), dt, op, count);
}

static struct fi_ops_atomic alias_atomic_ops = {
    .size = sizeof(struct fi_ops_atomic),
    .write = al_atomic,
    .writev = al_atomicv,
    .writemsg = al_atomicmsg,
    .inject = al_ainject,
    .readwrite = al_fetch,
    .readwritev = al_fetchv,
    .readwritemsg = al_fetchmsg,
    .compwrite = al_comp,
    .compwritev = al_compv,
    .compwritemsg = al_compmsg,
    .writevalid = al_valid,
    .readwritevalid = al_fetch_valid,
    .compwritevalid = al_comp_valid,
};

int fiv_alias_open(struct fiv_ep *ep, const struct fi_alias *alias)
{
    if (!alias || !alias->fid)
        return -FI_EINVAL;
    uint64_t f = alias->flags;
    bool tx = f & FI_TRANSMIT, rx = f & FI_RECV;
    uint64_t ops = f & ~(FI_TRANSMIT | FI_RECV);
    if (tx == rx || !flags_allowed(ep, tx, ops))
        return -FI_EINVAL;
    struct fiv_alias *a = calloc(1, sizeof *a);
    if (!a)
        return -FI_ENOMEM;
    a->base = ep;
    a->tx = tx;
    a->flags = ops;
    a->ep.fid.fclass = FI_CLASS_EP;
    a->ep.fid.context = ep->ep.fid.context;
    a->ep.fid.ops = &alias_fi_ops;
    a->ep.ops = &alias_ep_ops;
    a->ep.cm = &alias_cm_ops;
    a->ep.msg = &alias_msg_ops;
    a->ep.tagged = &alias_tagged_ops;
    a->ep.rma = &alias_rma_ops;
    a->ep.atomic = &alias_atomic_ops;
    fiv_lock(ep->dom);
    ep->aliases++;
    fiv_unlock(ep->dom);
    *alias->fid = &a->ep.fid;
    return 0;
}
