/*
 * FI_MSG and FI_TAGGED as the application calls them: the sends, and
 * the tables whose receive entries post to fiv_msg.c. A send that fails
 * fails its peer (fiv_probe.c), which is why the sends sit above the
 * matching and the failure handling that fiv_msg.c's receives do not
 * need.
 */
#include <errno.h>
#include <string.h>

#include "fiv_complete.h"
#include "fiv_tx.h"

static bool want_tx(struct fiv_ep *ep, uint64_t flags)
{
    return !(ep->tx_cq_flags & FI_SELECTIVE_COMPLETION) ||
           (flags & FI_COMPLETION);
}

/* ---- sending ---- */

/* A send as a request of its own, which waits on p's queue (or, with
   FI_TRIGGER, for its counter): under the domain's lock. */
static ssize_t queue_msg(struct fiv_ep *ep, struct fiv_peer *p,
                         const struct iovec *iov, size_t count, fi_addr_t dest,
                         const struct fiv_msg_hdr *h, uint32_t op,
                         void *context, uint64_t cflags, bool want,
                         uint64_t flags)
{
    if (p && p->queued >= fiv_cfg.peer_queue)
        return -FI_EAGAIN; /* a peer that drains nothing: try again later */
    struct fiv_op_req *r = fiv_req_new();
    if (!r)
        return -FI_ENOMEM;
    r->kind = REQ_SEND;
    r->peer = dest;
    r->context = context;
    r->flags = cflags;
    r->complete_ev = want;
    r->op = op;
    memcpy(r->hdr, h, sizeof *h);
    r->hlen = sizeof *h;
    if (fiv_req_payload(r, iov, count, flags & FI_INJECT) < 0) {
        fiv_req_free(r);
        return -FI_ENOMEM;
    }
    return flags & FI_TRIGGER ? fiv_trigger_post(ep, r) : fiv_tx_start(ep, r);
}

static ssize_t send_msg(struct fiv_ep *ep, const struct iovec *iov, size_t count,
                        fi_addr_t dest, uint64_t tag, uint64_t data,
                        void *context, uint64_t flags, bool tagged)
{
    if (count > FIV_IOV_LIMIT)
        return -FI_EINVAL;
    size_t len = fiv_iov_total(iov, count);
    if (len > ep->max_msg)
        return -FI_EMSGSIZE;
    bool inject = flags & FI_INJECT;
    if (inject && len > FIV_INJECT)
        return -FI_EMSGSIZE;
    struct fiv_msg_hdr h = {.tag = tag, .len = len, .data = data};
    uint32_t op = FIV_OP_MSG | (tagged ? FIV_F_TAGGED : 0) |
                  (flags & FI_REMOTE_CQ_DATA ? FIV_F_DATA : 0);
    uint64_t cflags = FI_SEND | (tagged ? FI_TAGGED : FI_MSG);
    bool want = !(flags & FIV_NO_EVENT) && want_tx(ep, flags);
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    struct fiv_peer *p = fiv_peer(ep, dest);
    if (p && count <= 1 && (p->path == PATH_REGION || p->path == PATH_CORE)) {
        ssize_t rc = fiv_tx_small(ep, p, op, &h, sizeof h,
                                  count ? iov[0].iov_base : NULL, len);
        if (rc == 0) {
            fiv_complete_sent(ep, context, cflags, want);
            fiv_unlock(d);
            return 0;
        }
        if (rc != -EAGAIN) {
            fiv_send_failed(ep, dest, p, (int)-rc);
            fiv_complete_tx(ep, context, cflags, want, (int)-rc);
            fiv_unlock(d);
            return 0;
        }
    }
    ssize_t rc = queue_msg(ep, p, iov, count, dest, &h, op, context, cflags,
                           want, flags);
    fiv_unlock(d);
    return rc;
}

/* A send with FI_TRIGGER (a *msg call's flag, fiv.h): checked as any
   send, started once its counter says so (fiv_trigger.c). */
static ssize_t send_triggered(struct fiv_ep *ep, const struct iovec *iov,
                              size_t count, fi_addr_t dest, uint64_t tag,
                              uint64_t data, void *context, uint64_t flags,
                              bool tagged)
{
    if (count > FIV_IOV_LIMIT)
        return -FI_EINVAL;
    size_t len = fiv_iov_total(iov, count);
    if (len > ep->max_msg)
        return -FI_EMSGSIZE;
    if (flags & FI_INJECT && len > FIV_INJECT)
        return -FI_EMSGSIZE;
    struct fiv_msg_hdr h = {.tag = tag, .len = len, .data = data};
    uint32_t op = FIV_OP_MSG | (tagged ? FIV_F_TAGGED : 0) |
                  (flags & FI_REMOTE_CQ_DATA ? FIV_F_DATA : 0);
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    ssize_t rc = queue_msg(ep, fiv_peer(ep, dest), iov, count, dest, &h, op,
                           context, FI_SEND | (tagged ? FI_TAGGED : FI_MSG),
                           want_tx(ep, flags), flags);
    fiv_unlock(d);
    return rc;
}

/* The send every MPI makes per small message (mtl ofi's fi_tinjectdata,
   MPICH's fi_tinjectdata and fi_tsenddata): one buffer of at most
   FIV_INJECT bytes to a peer of the AV on the region, introduced, with
   nothing queued to it, neither failed nor switching paths, the message
   in one slot. send_msg would then only build the header and put it
   into the peer's ring; this does that without its general cases (the
   iovec, the queue, the core path, the introduction), all branched off
   by one check, each of them one of send_msg's own conditions for that
   path. A ring without room or a failed send falls to send_msg, which
   decides afresh: a send that failed wrote nothing and counted nothing
   (fiv_region_send), so the second try is the only one that counts. */
static inline __attribute__((always_inline)) ssize_t
send_plain(struct fiv_ep *ep, const void *buf, size_t len, fi_addr_t dest,
           uint64_t tag, uint64_t data, void *context, uint64_t flags,
           bool tagged)
{
    struct fiv_domain *d = ep->dom;
    fiv_lock(d);
    struct fiv_peer *p = dest < ep->npeers ? &ep->peers[dest] : NULL;
    if (p && !((len > FIV_INJECT) | (len > ep->max_msg) |
               (sizeof(struct fiv_msg_hdr) + len > ep->frag) |
               (p->path != PATH_REGION) | (p->txq != NULL) | p->dead |
               p->sw_pause | !p->introduced)) {
        struct fiv_msg_hdr h = {.tag = tag, .len = len, .data = data};
        uint32_t op = FIV_OP_MSG | (tagged ? FIV_F_TAGGED : 0) |
                      (flags & FI_REMOTE_CQ_DATA ? FIV_F_DATA : 0);
        if (fiv_region_send_msg(ep, p->slot, p->generation, op, &h, buf,
                                len) == 0) {
            ep->sent++;
            fiv_complete_sent(ep, context,
                              FI_SEND | (tagged ? FI_TAGGED : FI_MSG),
                              !(flags & FIV_NO_EVENT) && want_tx(ep, flags));
            fiv_unlock(d);
            return 0;
        }
    }
    fiv_unlock(d);
    struct iovec v = {(void *)buf, len};
    return send_msg(ep, &v, 1, dest, tag, data, context, flags, tagged);
}

#define EP(e) container_of(e, struct fiv_ep, ep)

static ssize_t m_send(struct fid_ep *e, const void *buf, size_t len, void *desc,
                      fi_addr_t dest, void *context)
{
    (void)desc;
    return send_plain(EP(e), buf, len, dest, 0, 0, context,
                      EP(e)->tx_op_flags | FI_COMPLETION, false);
}

static ssize_t m_sendv(struct fid_ep *e, const struct iovec *iov, void **desc,
                       size_t count, fi_addr_t dest, void *context)
{
    (void)desc;
    return send_msg(EP(e), iov, count, dest, 0, 0, context,
                    EP(e)->tx_op_flags | FI_COMPLETION, false);
}

static ssize_t m_sendmsg(struct fid_ep *e, const struct fi_msg *msg,
                         uint64_t flags)
{
    if (flags & FI_TRIGGER)
        return send_triggered(EP(e), msg->msg_iov, msg->iov_count, msg->addr,
                              0, msg->data, msg->context, flags, false);
    return send_msg(EP(e), msg->msg_iov, msg->iov_count, msg->addr, 0,
                    msg->data, msg->context, flags & ~FIV_NO_EVENT, false);
}

static ssize_t m_inject(struct fid_ep *e, const void *buf, size_t len,
                        fi_addr_t dest)
{
    return send_plain(EP(e), buf, len, dest, 0, 0, NULL,
                      FI_INJECT | FIV_NO_EVENT, false);
}

static ssize_t m_senddata(struct fid_ep *e, const void *buf, size_t len,
                          void *desc, uint64_t data, fi_addr_t dest,
                          void *context)
{
    (void)desc;
    return send_plain(EP(e), buf, len, dest, 0, data, context,
                      EP(e)->tx_op_flags | FI_COMPLETION | FI_REMOTE_CQ_DATA,
                      false);
}

static ssize_t m_injectdata(struct fid_ep *e, const void *buf, size_t len,
                            uint64_t data, fi_addr_t dest)
{
    return send_plain(EP(e), buf, len, dest, 0, data, NULL,
                      FI_INJECT | FIV_NO_EVENT | FI_REMOTE_CQ_DATA, false);
}

struct fi_ops_msg fiv_msg_ops = {
    .size = sizeof(struct fi_ops_msg),
    .recv = fiv_msg_recv,
    .recvv = fiv_msg_recvv,
    .recvmsg = fiv_msg_recvmsg,
    .send = m_send,
    .sendv = m_sendv,
    .sendmsg = m_sendmsg,
    .inject = m_inject,
    .senddata = m_senddata,
    .injectdata = m_injectdata,
};

/* A peek (FI_PEEK, MPI's probes) looks at what has arrived by now:
   progress first, then the look (fiv_msg.c). */
static ssize_t t_recvmsg(struct fid_ep *e, const struct fi_msg_tagged *msg,
                         uint64_t flags)
{
    if (flags & FI_PEEK) {
        struct fiv_ep *ep = EP(e);
        fiv_lock(ep->dom);
        fiv_progress(ep);
        fiv_unlock(ep->dom);
    }
    return fiv_tagged_recvmsg(e, msg, flags);
}

static ssize_t t_send(struct fid_ep *e, const void *buf, size_t len, void *desc,
                      fi_addr_t dest, uint64_t tag, void *context)
{
    (void)desc;
    return send_plain(EP(e), buf, len, dest, tag, 0, context,
                      EP(e)->tx_op_flags | FI_COMPLETION, true);
}

static ssize_t t_sendv(struct fid_ep *e, const struct iovec *iov, void **desc,
                       size_t count, fi_addr_t dest, uint64_t tag,
                       void *context)
{
    (void)desc;
    return send_msg(EP(e), iov, count, dest, tag, 0, context,
                    EP(e)->tx_op_flags | FI_COMPLETION, true);
}

static ssize_t t_sendmsg(struct fid_ep *e, const struct fi_msg_tagged *msg,
                         uint64_t flags)
{
    if (flags & FI_TRIGGER)
        return send_triggered(EP(e), msg->msg_iov, msg->iov_count, msg->addr,
                              msg->tag, msg->data, msg->context, flags, true);
    return send_msg(EP(e), msg->msg_iov, msg->iov_count, msg->addr, msg->tag,
                    msg->data, msg->context, flags & ~FIV_NO_EVENT, true);
}

static ssize_t t_inject(struct fid_ep *e, const void *buf, size_t len,
                        fi_addr_t dest, uint64_t tag)
{
    return send_plain(EP(e), buf, len, dest, tag, 0, NULL,
                      FI_INJECT | FIV_NO_EVENT, true);
}

static ssize_t t_senddata(struct fid_ep *e, const void *buf, size_t len,
                          void *desc, uint64_t data, fi_addr_t dest,
                          uint64_t tag, void *context)
{
    (void)desc;
    return send_plain(EP(e), buf, len, dest, tag, data, context,
                      EP(e)->tx_op_flags | FI_COMPLETION | FI_REMOTE_CQ_DATA,
                      true);
}

static ssize_t t_injectdata(struct fid_ep *e, const void *buf, size_t len,
                            uint64_t data, fi_addr_t dest, uint64_t tag)
{
    return send_plain(EP(e), buf, len, dest, tag, data, NULL,
                      FI_INJECT | FIV_NO_EVENT | FI_REMOTE_CQ_DATA, true);
}

struct fi_ops_tagged fiv_tagged_ops = {
    .size = sizeof(struct fi_ops_tagged),
    .recv = fiv_tagged_recv,
    .recvv = fiv_tagged_recvv,
    .recvmsg = t_recvmsg,
    .send = t_send,
    .sendv = t_sendv,
    .sendmsg = t_sendmsg,
    .inject = t_inject,
    .senddata = t_senddata,
    .injectdata = t_injectdata,
};

/* A datagram endpoint's: no tagged call (docs/provider.md, "Datagram
   endpoints"), refused here so that the RDM path tests nothing for it. */
static ssize_t no_trecv(struct fid_ep *e, void *buf, size_t len, void *desc,
                        fi_addr_t src, uint64_t tag, uint64_t ignore, void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)src; (void)tag;
    (void)ignore; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_trecvv(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t src,
                         uint64_t tag, uint64_t ignore, void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)src; (void)tag;
    (void)ignore; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_tmsg(struct fid_ep *e, const struct fi_msg_tagged *msg,
                       uint64_t flags)
{
    (void)e; (void)msg; (void)flags;
    return -FI_ENOSYS;
}

static ssize_t no_tsend(struct fid_ep *e, const void *buf, size_t len,
                        void *desc, fi_addr_t dest, uint64_t tag, void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)dest; (void)tag;
    (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_tsendv(struct fid_ep *e, const struct iovec *iov,
                         void **desc, size_t count, fi_addr_t dest,
                         uint64_t tag, void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)dest; (void)tag;
    (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_tinject(struct fid_ep *e, const void *buf, size_t len,
                          fi_addr_t dest, uint64_t tag)
{
    (void)e; (void)buf; (void)len; (void)dest; (void)tag;
    return -FI_ENOSYS;
}

static ssize_t no_tsenddata(struct fid_ep *e, const void *buf, size_t len,
                            void *desc, uint64_t data, fi_addr_t dest,
                            uint64_t tag, void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)data; (void)dest;
    (void)tag; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_tinjectdata(struct fid_ep *e, const void *buf, size_t len,
                              uint64_t data, fi_addr_t dest, uint64_t tag)
{
    (void)e; (void)buf; (void)len; (void)data; (void)dest; (void)tag;
    return -FI_ENOSYS;
}

struct fi_ops_tagged fiv_no_tagged_ops = {
    .size = sizeof(struct fi_ops_tagged),
    .recv = no_trecv,
    .recvv = no_trecvv,
    .recvmsg = no_tmsg,
    .send = no_tsend,
    .sendv = no_tsendv,
    .sendmsg = no_tmsg,
    .inject = no_tinject,
    .senddata = no_tsenddata,
    .injectdata = no_tinjectdata,
};
