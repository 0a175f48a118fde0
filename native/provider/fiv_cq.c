/*
 * Completion queues: every format the MPIs ask for (context, msg, data,
 * tagged), errors with truncation lengths, and the source address of
 * each receive (FI_SOURCE). Completions are kept in one wide form and
 * never refused: the queue grows (an MPI sizes its reads, not our queue).
 * Reading a CQ drives the progress of the endpoints bound to it.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fiv.h"

void fiv_cq_add_ep(struct fiv_cq *cq, struct fiv_ep *ep)
{
    for (size_t i = 0; i < cq->neps; i++)
        if (cq->eps[i] == ep)
            return;
    void *p = realloc(cq->eps, (cq->neps + 1) * sizeof *cq->eps);
    if (!p)
        return;
    cq->eps = p;
    cq->eps[cq->neps++] = ep;
    cq->refs++;
}

void fiv_cq_del_ep(struct fiv_cq *cq, struct fiv_ep *ep)
{
    for (size_t i = 0; i < cq->neps; i++)
        if (cq->eps[i] == ep) {
            cq->eps[i] = cq->eps[--cq->neps];
            cq->refs--;
            return;
        }
}

static size_t entry_size(enum fi_cq_format f)
{
    switch (f) {
    case FI_CQ_FORMAT_CONTEXT: return sizeof(struct fi_cq_entry);
    case FI_CQ_FORMAT_MSG: return sizeof(struct fi_cq_msg_entry);
    case FI_CQ_FORMAT_DATA: return sizeof(struct fi_cq_data_entry);
    default: return sizeof(struct fi_cq_tagged_entry);
    }
}

_Static_assert(offsetof(struct fiv_cqe, context) ==
                       offsetof(struct fi_cq_tagged_entry, op_context) &&
                   offsetof(struct fiv_cqe, flags) ==
                       offsetof(struct fi_cq_tagged_entry, flags) &&
                   offsetof(struct fiv_cqe, len) ==
                       offsetof(struct fi_cq_tagged_entry, len) &&
                   offsetof(struct fiv_cqe, buf) ==
                       offsetof(struct fi_cq_tagged_entry, buf) &&
                   offsetof(struct fiv_cqe, data) ==
                       offsetof(struct fi_cq_tagged_entry, data) &&
                   offsetof(struct fiv_cqe, tag) ==
                       offsetof(struct fi_cq_tagged_entry, tag) &&
                   sizeof(struct fi_cq_tagged_entry) ==
                       offsetof(struct fiv_cqe, src),
               "a tagged entry is the start of fiv_cqe, as it lies");

static void write_entry(enum fi_cq_format f, void *out, const struct fiv_cqe *e)
{
    switch (f) {
    case FI_CQ_FORMAT_CONTEXT: {
        struct fi_cq_entry *o = out;
        o->op_context = e->context;
        break;
    }
    case FI_CQ_FORMAT_MSG: {
        struct fi_cq_msg_entry *o = out;
        o->op_context = e->context;
        o->flags = e->flags;
        o->len = e->len;
        break;
    }
    case FI_CQ_FORMAT_DATA: {
        struct fi_cq_data_entry *o = out;
        o->op_context = e->context;
        o->flags = e->flags;
        o->len = e->len;
        o->buf = e->buf;
        o->data = e->data;
        break;
    }
    default: {
        struct fi_cq_tagged_entry *o = out;
        o->op_context = e->context;
        o->flags = e->flags;
        o->len = e->len;
        o->buf = e->buf;
        o->data = e->data;
        o->tag = e->tag;
        break;
    }
    }
}

static ssize_t cq_readfrom(struct fid_cq *cq_fid, void *buf, size_t count,
                           fi_addr_t *src_addr)
{
    struct fiv_cq *cq = container_of(cq_fid, struct fiv_cq, cq);
    fiv_lock(cq->dom);
    if (!cq->count && !cq->errcount)
        fiv_progress_eps(cq->eps, cq->neps);
    ssize_t n = 0;
    if (cq->errcount) {
        n = -FI_EAVAIL;
    } else if (!cq->count) {
        n = -FI_EAGAIN;
    } else {
        /* the ring's position in locals: the application's buffer may
           alias nothing of ours, but the compiler cannot know that, and
           would store head and count back after every entry */
        size_t es = entry_size(cq->format), head = cq->head,
               mask = cq->cap - 1; /* a power of two */
        size_t take = count < cq->count ? count : cq->count, core = 0;
        const struct fiv_cqe *ring = cq->ring;
        if (cq->format == FI_CQ_FORMAT_TAGGED && !src_addr) {
            /* what mtl ofi reads: the format's loop without the switch,
               over the ring's runs up to its end, each entry's six
               fields copied as they lie (fiv_cqe starts with the
               tagged entry's layout); the core writes counted in a
               pass of their own, only while there are any */
            struct fi_cq_tagged_entry *o = buf;
            if (take == 1) {
                /* a ping-pong's read: one entry, no runs to work out */
                memcpy(o, &ring[head], sizeof *o);
            } else {
                for (size_t i = 0; i < take;) {
                    size_t at = (head + i) & mask;
                    size_t run = cq->cap - at < take - i ? cq->cap - at
                                                         : take - i;
                    const struct fiv_cqe *e = &ring[at], *end = e + run;
                    for (; e < end; e++, o++)
                        memcpy(o, e, sizeof *o);
                    i += run;
                }
            }
            if (cq->core_writes)
                for (size_t i = 0; i < take; i++)
                    core += ring[(head + i) & mask].core;
        } else {
            for (size_t i = 0; i < take; i++) {
                const struct fiv_cqe *e = &ring[(head + i) & mask];
                write_entry(cq->format, (uint8_t *)buf + i * es, e);
                if (src_addr)
                    src_addr[i] = e->src;
                core += e->core;
            }
        }
        cq->core_writes -= core;
        cq->head = (head + take) & mask;
        cq->count -= take;
        n = (ssize_t)take;
    }
    fiv_unlock(cq->dom);
    return n;
}

static ssize_t cq_read(struct fid_cq *cq, void *buf, size_t count)
{
    return cq_readfrom(cq, buf, count, NULL);
}

static ssize_t cq_readerr(struct fid_cq *cq_fid, struct fi_cq_err_entry *buf,
                          uint64_t flags)
{
    (void)flags;
    struct fiv_cq *cq = container_of(cq_fid, struct fiv_cq, cq);
    fiv_lock(cq->dom);
    ssize_t n = -FI_EAGAIN;
    if (cq->errcount) {
        const struct fiv_cqe *e = &cq->errs[cq->errhead];
        /* only the fields of the oldest layout: a newer caller's tail
           (src_addr in 2.x) keeps what it set */
        buf->op_context = e->context;
        buf->flags = e->flags;
        buf->len = e->len;
        buf->buf = e->buf;
        buf->data = e->data;
        buf->tag = e->tag;
        buf->olen = e->olen;
        buf->err = e->err;
        buf->prov_errno = -e->err;
        if (FI_VERSION_LT(cq->dom->api_version, FI_VERSION(1, 5)) ||
            buf->err_data_size == 0)
            buf->err_data = NULL;
        buf->err_data_size = 0;
        cq->errhead = (cq->errhead + 1) % cq->errcap;
        cq->errcount--;
        n = 1;
    }
    fiv_unlock(cq->dom);
    return n;
}

static ssize_t cq_sreadfrom(struct fid_cq *cq, void *buf, size_t count,
                            fi_addr_t *src_addr, const void *cond, int timeout)
{
    (void)cond;
    struct fiv_cq *q = container_of(cq, struct fiv_cq, cq);
    uint64_t deadline = fiv_deadline(timeout);
    for (unsigned spins = 0;; spins++) {
        ssize_t n = cq_readfrom(cq, buf, count, src_addr);
        if (n != -FI_EAGAIN)
            return n;
        /* fi_cq_signal: this wait (or the next, if none waits now) ends */
        if (__atomic_exchange_n(&q->signaled, false, __ATOMIC_ACQ_REL))
            return -FI_EAGAIN;
        if (fiv_now_ns() >= deadline)
            return -FI_EAGAIN;
        if (spins > 1000)
            sched_yield();
    }
}

static ssize_t cq_sread(struct fid_cq *cq, void *buf, size_t count,
                        const void *cond, int timeout)
{
    return cq_sreadfrom(cq, buf, count, NULL, cond, timeout);
}

static int cq_signal(struct fid_cq *cq_fid)
{
    struct fiv_cq *cq = container_of(cq_fid, struct fiv_cq, cq);
    __atomic_store_n(&cq->signaled, true, __ATOMIC_RELEASE);
    return 0;
}

static const char *cq_strerror(struct fid_cq *cq, int prov_errno,
                               const void *err_data, char *buf, size_t len)
{
    (void)cq;
    (void)err_data;
    return fiv_strerror(prov_errno, buf, len);
}

static int cq_close(struct fid *fid)
{
    struct fiv_cq *cq = container_of(fid, struct fiv_cq, cq.fid);
    if (cq->refs)
        return -FI_EBUSY;
    fiv_domain_ref(cq->dom, -1);
    free(cq->ring);
    free(cq->errs);
    free(cq->eps);
    free(cq);
    return 0;
}

static int cq_control(struct fid *fid, int cmd, void *arg)
{
    (void)fid;
    (void)arg;
    return cmd == FI_GETWAIT ? -FI_ENODATA : -FI_ENOSYS;
}

static struct fi_ops cq_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = cq_close,
    .bind = fiv_no_bind,
    .control = cq_control,
    .ops_open = fiv_no_ops_open,
};

static struct fi_ops_cq cq_ops = {
    .size = sizeof(struct fi_ops_cq),
    .read = cq_read,
    .readfrom = cq_readfrom,
    .readerr = cq_readerr,
    .sread = cq_sread,
    .sreadfrom = cq_sreadfrom,
    .signal = cq_signal,
    .strerror = cq_strerror,
};

int fiv_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                struct fid_cq **cq_fid, void *context)
{
    struct fiv_domain *d = container_of(domain, struct fiv_domain, dom);
    if (attr && attr->wait_obj != FI_WAIT_NONE &&
        attr->wait_obj != FI_WAIT_UNSPEC)
        return -FI_ENOSYS;
    struct fiv_cq *cq = calloc(1, sizeof *cq);
    if (!cq)
        return -FI_ENOMEM;
    cq->dom = d;
    /* where remote writes with CQ data start to wait (fiv.h); the ring
       itself grows, so no completion of ours is ever refused */
    cq->size = attr && attr->size ? attr->size : FIV_CQ_SIZE;
    cq->format = attr && attr->format ? attr->format : FI_CQ_FORMAT_CONTEXT;
    if (cq->format > FI_CQ_FORMAT_TAGGED) {
        free(cq);
        return -FI_ENOSYS;
    }
    cq->cq.fid.fclass = FI_CLASS_CQ;
    cq->cq.fid.context = context;
    cq->cq.fid.ops = &cq_fi_ops;
    cq->cq.ops = &cq_ops;
    fiv_domain_ref(d, 1);
    *cq_fid = &cq->cq;
    return 0;
}
