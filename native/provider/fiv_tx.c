/*
 * Sending to one peer over its path. A message is its first fragment
 * (operation header + leading bytes) and raw continuations, each at most
 * one region slot (or one core buffer). Region fragments go straight
 * from the caller's buffer into the ring slot: ivshm_send_small for a
 * header + contiguous bytes, ivshm_try_send for a contiguous
 * continuation, reserve + gather + commit otherwise (one copy each).
 * What does not fit now waits, in order, on the peer's queue: nothing
 * overtakes it, and progress retries it (fiv_progress.c, which also
 * fails a peer whose send failed, and delivers what we sent ourselves).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fiv_tx.h"

struct fiv_op_req *fiv_req_new(void)
{
    return calloc(1, sizeof(struct fiv_op_req));
}

void fiv_req_free(struct fiv_op_req *r)
{
    if (r) {
        free(r->own);
        free(r);
    }
}

/* What r sends after its header: the caller's buffers, or (inject) a
   copy of them, so that the caller may reuse them at once. */
int fiv_req_payload(struct fiv_op_req *r, const struct iovec *iov,
                    size_t count, bool copy)
{
    r->total = fiv_iov_total(iov, count);
    if (!copy) {
        memcpy(r->iov, iov, count * sizeof *iov);
        r->iov_count = count;
        return 0;
    }
    r->own = malloc(r->total ? r->total : 1);
    if (!r->own)
        return -FI_ENOMEM;
    fiv_iov_read(iov, count, 0, r->own, r->total);
    r->iov[0] = (struct iovec){r->own, r->total};
    r->iov_count = 1;
    return 0;
}

/* Copy between `buf` and the bytes of iov from offset `off`, never past
   iov's end: into iov when `into`, out of it otherwise. */
static size_t iov_copy(const struct iovec *iov, size_t n, size_t off,
                       uint8_t *buf, size_t len, bool into)
{
    size_t done = 0;
    for (size_t i = 0; i < n && done < len; i++) {
        if (off >= iov[i].iov_len) {
            off -= iov[i].iov_len;
            continue;
        }
        size_t k = iov[i].iov_len - off;
        if (k > len - done)
            k = len - done;
        uint8_t *at = (uint8_t *)iov[i].iov_base + off;
        if (into)
            memcpy(at, buf + done, k);
        else
            memcpy(buf + done, at, k);
        done += k;
        off = 0;
    }
    return done;
}

size_t fiv_iov_write(const struct iovec *iov, size_t n, size_t off,
                     const void *src, size_t len)
{
    return iov_copy(iov, n, off, (uint8_t *)src, len, true);
}

size_t fiv_iov_read(const struct iovec *iov, size_t n, size_t off, void *dst,
                    size_t len)
{
    return iov_copy(iov, n, off, dst, len, false);
}

/* The bytes [off, off+len) of iov if they lie in one element, else NULL. */
static const void *contiguous(const struct iovec *iov, size_t n, size_t off,
                              size_t len)
{
    for (size_t i = 0; i < n; i++) {
        if (off >= iov[i].iov_len) {
            off -= iov[i].iov_len;
            continue;
        }
        return iov[i].iov_len - off >= len ? (const uint8_t *)iov[i].iov_base + off
                                           : NULL;
    }
    return len == 0 ? "" : NULL;
}

/* One fragment to a region peer: 0, -EAGAIN, or an -FI_E* error. */
static int region_frag(struct fiv_ep *ep, struct fiv_peer *p, uint32_t op,
                       const void *hdr, size_t hlen, const struct iovec *iov,
                       size_t iovn, size_t off, size_t n)
{
    int rc = fiv_introduce(ep, p);
    if (rc < 0)
        return fiv_tx_err(rc);
    const void *flat = contiguous(iov, iovn, off, n);
    if (flat) {
        rc = fiv_region_send(ep, p->slot, p->generation, op, hdr, hlen, flat, n);
    } else {
        /* gathered straight into the slot */
        int err = 0;
        uint8_t *dst = ivshm_send_reserve(ep->h, p->slot, hlen + n, &err);
        if (!dst)
            return fiv_tx_err(err);
        memcpy(dst, hdr, hlen);
        fiv_iov_read(iov, iovn, off, dst + hlen, n);
        struct fiv_pair *pr = fiv_tx_pair(ep, p->slot, p->generation);
        if (fiv_lost_on_purpose(pr, op)) {
            pr->tx++;
            return 0; /* the reservation lapses */
        }
        rc = ivshm_send_commit(ep->h, p->slot, fiv_wire_tag(op, dst, hlen + n),
                               hlen + n);
        if (rc == 0)
            pr->tx++;
    }
    return rc < 0 ? fiv_tx_err(rc) : 0;
}

static int send_frag(struct fiv_ep *ep, struct fiv_peer *p, uint32_t op,
                     const void *hdr, size_t hlen, const struct iovec *iov,
                     size_t iovn, size_t off, size_t n)
{
    if (p->path == PATH_REGION)
        return region_frag(ep, p, op, hdr, hlen, iov, iovn, off, n);
    uint8_t tmp[FIV_INJECT];
    const void *flat = contiguous(iov, iovn, off, n);
    if (!flat && n <= sizeof tmp) {
        fiv_iov_read(iov, iovn, off, tmp, n);
        flat = tmp;
    }
    if (!flat) {
        uint8_t *buf = malloc(n);
        if (!buf)
            return -FI_ENOMEM;
        fiv_iov_read(iov, iovn, off, buf, n);
        ssize_t rc = fiv_core_send(ep, p, op, hdr, hlen, buf, n);
        free(buf);
        return (int)rc;
    }
    return (int)fiv_core_send(ep, p, op, hdr, hlen, flat, n);
}

static size_t frag_of(struct fiv_ep *ep, struct fiv_peer *p)
{
    return p->path == PATH_REGION ? ep->frag : fiv_core_frag(ep);
}

static void count_first(struct fiv_ep *ep, struct fiv_peer *p)
{
    if (p->path == PATH_REGION)
        ep->sent++;
    else
        ep->delegated++;
}

/* Push what fits now: 1 all out, 0 more to go, < 0 an error. */
static int push(struct fiv_ep *ep, struct fiv_peer *p, struct fiv_op_req *r)
{
    size_t frag = frag_of(ep, p);
    while (!r->started || r->sent < r->total) {
        size_t hlen = r->started ? 0 : r->hlen;
        size_t n = r->total - r->sent;
        if (n > frag - hlen)
            n = frag - hlen;
        const struct iovec *iov = r->iov;
        size_t iovn = r->iov_count, off = r->sent;
        struct iovec at;
        if (r->from_mr) {
            /* a large READ's answer: the registration is looked up again
               for every fragment (fiv.h, "Lifetimes"); closed since, the
               answer cannot be finished, and its path fails */
            uint8_t *src = NULL;
            if (!fiv_mr_target(ep->dom, r->mr_key, r->mr_addr + r->sent, n,
                               FI_REMOTE_READ, &src, NULL))
                return -FI_EACCES;
            at.iov_base = src;
            at.iov_len = n;
            iov = &at;
            iovn = 1;
            off = 0;
        }
        int rc = send_frag(ep, p, r->started ? FIV_OP_MORE : r->op, r->hdr,
                           hlen, iov, iovn, off, n);
        if (rc == -EAGAIN)
            return 0;
        if (rc < 0)
            return rc;
        if (!r->started)
            count_first(ep, p);
        r->started = true;
        r->sent += n;
    }
    return 1;
}

void fiv_tx_done(struct fiv_ep *ep, struct fiv_op_req *r, int err)
{
    switch (r->kind) {
    case REQ_SEND:
        fiv_complete_tx(ep, r->context, r->flags, r->complete_ev, err);
        fiv_req_free(r);
        break;
    case REQ_REPLY: {
        struct fiv_peer *p = r->charged ? fiv_peer(ep, r->peer) : NULL;
        if (p)
            p->answer_bytes -= r->charged < p->answer_bytes ? r->charged
                                                            : p->answer_bytes;
        fiv_req_free(r);
        break;
    }
    default:
        if (err || !r->awaits_answer) {
            fiv_complete_tx(ep, r->context, r->flags, r->complete_ev, err);
            fiv_req_free(r);
        } else {
            r->next = ep->waiting;
            ep->waiting = r;
        }
    }
}

/* Off the front of p's queue. */
static void dequeued(struct fiv_peer *p)
{
    if (p->queued)
        p->queued--;
}

static void enqueue(struct fiv_ep *ep, struct fiv_peer *p, struct fiv_op_req *r)
{
    if (r->kind == REQ_REPLY && p->queued >= fiv_cfg.peer_queue) {
        /* a peer that asks and does not drain: refused, not queued */
        p->violated = true;
        p->over = "it left more answers queued than its cap "
                  "(FI_IVSHM_PEER_QUEUE)";
        fiv_tx_done(ep, r, FI_EAGAIN);
        return;
    }
    p->queued++;
    r->next = NULL;
    if (!p->txq) {
        p->txq = r;
        ep->txq_peers++;
    } else {
        p->txq_tail->next = r;
    }
    p->txq_tail = r;
}

int fiv_tx_start(struct fiv_ep *ep, struct fiv_op_req *r)
{
    struct fiv_peer *p = fiv_peer(ep, r->peer);
    if (!p || p->path == PATH_NONE || p->path == PATH_UNRESOLVED || p->dead) {
        fiv_tx_done(ep, r, FI_EHOSTUNREACH);
        return 0;
    }
    if (p->path == PATH_SELF) {
        /* delivered by progress, as what arrives from others is: our
           receive side answers (RMA) through this one */
        enqueue(ep, p, r);
        return 0;
    }
    if (p->txq || p->sw_pause) {
        enqueue(ep, p, r);
        return 0;
    }
    /* One that fails is queued too: the queue's drain (fiv_tx_drain)
       tries it again and, failing, hands the error to the layer that
       fails its peer, as it does for every queued send. */
    if (push(ep, p, r) > 0)
        fiv_tx_done(ep, r, 0);
    else
        enqueue(ep, p, r);
    return 0;
}

void fiv_tx_fail_peer(struct fiv_ep *ep, struct fiv_peer *p, int err)
{
    while (p->txq) {
        struct fiv_op_req *r = p->txq;
        p->txq = r->next;
        dequeued(p);
        if (!p->txq)
            ep->txq_peers--;
        fiv_tx_done(ep, r, err);
    }
    p->txq_tail = NULL;
}

struct fiv_op_req *fiv_tx_dequeue(struct fiv_ep *ep, struct fiv_peer *p)
{
    struct fiv_op_req *r = p->txq;
    p->txq = r->next;
    dequeued(p);
    if (!p->txq) {
        p->txq_tail = NULL;
        ep->txq_peers--;
    }
    return r;
}

/* What waits on p's queue goes out while it fits: 0, or the error of
   the send that failed (its request completed with it), for the caller
   to fail the peer with (fiv_send_failed, above this file) before it
   calls again for the rest. */
int fiv_tx_drain(struct fiv_ep *ep, struct fiv_peer *p)
{
    while (p->txq) {
        struct fiv_op_req *r = p->txq;
        /* switching: a message partly out is finished on its path,
           nothing new starts (fiv_drain.c) */
        if (p->sw_pause && !r->started)
            break;
        int rc = push(ep, p, r);
        if (rc == 0)
            break;
        fiv_tx_dequeue(ep, p);
        fiv_tx_done(ep, r, rc > 0 ? 0 : -rc);
        if (rc < 0)
            return -rc;
    }
    return 0;
}
