/*
 * FI_RMA and FI_ATOMIC, emulated by the target's progress: a write is a
 * message the target copies into its registered memory, a read a request
 * it answers with the bytes, an atomic a request it applies and answers.
 * The initiator completes each operation when the target's answer
 * arrives, so a completion means the data is in place at the target (what
 * MPI's flush and unlock need). The target checks every access against
 * its own registrations (key, bounds, access rights): a bad one is
 * answered with an error, never performed.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "fiv_complete.h"

#define EP(e) container_of(e, struct fiv_ep, ep)

static bool want_tx(struct fiv_ep *ep, uint64_t flags)
{
    return !(ep->tx_cq_flags & FI_SELECTIVE_COMPLETION) ||
           (flags & FI_COMPLETION);
}

/* ---- datatypes and operations ---- */

static size_t dt_size(enum fi_datatype dt)
{
    switch (dt) {
    case FI_INT8: case FI_UINT8: return 1;
    case FI_INT16: case FI_UINT16: return 2;
    case FI_INT32: case FI_UINT32: case FI_FLOAT: return 4;
    case FI_INT64: case FI_UINT64: case FI_DOUBLE: return 8;
    default: return 0;
    }
}

static bool op_ok(enum fi_op op)
{
    return op <= FI_MSWAP;
}

/* One element: *dst op= operand (compare for the CSWAP family). Sums and
   products are taken in W, an unsigned type at least as wide as T (the
   type itself for floating point): a peer's operands that leave T's range
   wrap around in two's complement, as hardware atomics do, where signed
   arithmetic, or 16-bit operands promoted to int, would be undefined
   behaviour (tests/fiv_conform_test.c, atomic_wraparound). */
#define APPLY(T, W)                                                           \
    static void apply_##T(T *dst, const T *opnd, const T *cmp, enum fi_op op) \
    {                                                                         \
        T d = *dst, o = opnd ? *opnd : 0, c = cmp ? *cmp : 0;                 \
        switch (op) {                                                         \
        case FI_MIN: if (o < d) d = o; break;                                 \
        case FI_MAX: if (o > d) d = o; break;                                 \
        case FI_SUM: d = (T)((W)d + (W)o); break;                             \
        case FI_PROD: d = (T)((W)d * (W)o); break;                            \
        case FI_LOR: d = (d || o); break;                                     \
        case FI_LAND: d = (d && o); break;                                    \
        case FI_LXOR: d = ((d && !o) || (!d && o)); break;                    \
        case FI_ATOMIC_WRITE: d = o; break;                                   \
        case FI_ATOMIC_READ: break;                                           \
        case FI_CSWAP: if (c == d) d = o; break;                              \
        case FI_CSWAP_NE: if (c != d) d = o; break;                           \
        case FI_CSWAP_LE: if (c <= d) d = o; break;                           \
        case FI_CSWAP_LT: if (c < d) d = o; break;                            \
        case FI_CSWAP_GE: if (c >= d) d = o; break;                           \
        case FI_CSWAP_GT: if (c > d) d = o; break;                            \
        default: break;                                                       \
        }                                                                     \
        *dst = d;                                                             \
    }
#define APPLY_BITS(T)                                                         \
    static void applyb_##T(T *dst, const T *opnd, const T *cmp, enum fi_op op)\
    {                                                                         \
        T d = *dst, o = opnd ? *opnd : 0, c = cmp ? *cmp : 0;                 \
        switch (op) {                                                         \
        case FI_BOR: d = d | o; break;                                        \
        case FI_BAND: d = d & o; break;                                       \
        case FI_BXOR: d = d ^ o; break;                                       \
        case FI_MSWAP: d = (o & c) | (d & ~c); break;                         \
        default: apply_##T(&d, opnd, cmp, op);                                \
        }                                                                     \
        *dst = d;                                                             \
    }
APPLY(int8_t, uint32_t) APPLY(uint8_t, uint32_t)
APPLY(int16_t, uint32_t) APPLY(uint16_t, uint32_t)
APPLY(int32_t, uint32_t) APPLY(uint32_t, uint32_t)
APPLY(int64_t, uint64_t) APPLY(uint64_t, uint64_t)
APPLY(float, float) APPLY(double, double)
APPLY_BITS(int8_t) APPLY_BITS(uint8_t) APPLY_BITS(int16_t) APPLY_BITS(uint16_t)
APPLY_BITS(int32_t) APPLY_BITS(uint32_t) APPLY_BITS(int64_t) APPLY_BITS(uint64_t)

static bool bitwise(enum fi_op op)
{
    return op == FI_BOR || op == FI_BAND || op == FI_BXOR || op == FI_MSWAP;
}

/* Apply `count` elements; operands are unaligned copies from a message. */
static int apply(uint8_t *mem, const uint8_t *opnd, const uint8_t *cmp,
                 size_t count, enum fi_datatype dt, enum fi_op op)
{
    size_t sz = dt_size(dt);
    if (!sz || !op_ok(op))
        return -FI_EOPNOTSUPP;
    if (bitwise(op) && (dt == FI_FLOAT || dt == FI_DOUBLE))
        return -FI_EOPNOTSUPP;
    for (size_t i = 0; i < count; i++) {
        uint8_t d[8], o[8], c[8];
        memcpy(d, mem + i * sz, sz);
        if (opnd)
            memcpy(o, opnd + i * sz, sz);
        if (cmp)
            memcpy(c, cmp + i * sz, sz);
        const void *po = opnd ? (const void *)o : NULL;
        const void *pc = cmp ? (const void *)c : NULL;
#define CASE(E, T)                                                            \
    case E:                                                                   \
        if (bitwise(op))                                                      \
            applyb_##T((T *)(void *)d, po, pc, op);                           \
        else                                                                  \
            apply_##T((T *)(void *)d, po, pc, op);                            \
        break;
        switch (dt) {
        CASE(FI_INT8, int8_t) CASE(FI_UINT8, uint8_t)
        CASE(FI_INT16, int16_t) CASE(FI_UINT16, uint16_t)
        CASE(FI_INT32, int32_t) CASE(FI_UINT32, uint32_t)
        CASE(FI_INT64, int64_t) CASE(FI_UINT64, uint64_t)
        case FI_FLOAT: apply_float((float *)(void *)d, po, pc, op); break;
        case FI_DOUBLE: apply_double((double *)(void *)d, po, pc, op); break;
        default: return -FI_EOPNOTSUPP;
        }
#undef CASE
        memcpy(mem + i * sz, d, sz);
    }
    return 0;
}

/* Operand bytes of one atomic: FIV_ATOMIC_MAX, or less where the request
   (header, operand, compare operand) or its answer (header, fetched
   value) would not fit one fragment of `frag` bytes (a region's slot
   payload; 0: no region). An atomic is never fragmented: its target
   applies it from one message. */
static size_t frag_room(size_t frag, bool cmp)
{
    size_t room = FIV_ATOMIC_MAX;
    if (frag) {
        size_t req = (frag - sizeof(struct fiv_rma_hdr)) / (cmp ? 2 : 1);
        size_t ans = frag - sizeof(struct fiv_resp_hdr);
        if (req < room)
            room = req;
        if (ans < room)
            room = ans;
    }
    return room;
}

/* What every endpoint of the domain can do: the least of those attached
   to a region now; with none, the least of any region's slots (an
   endpoint opened later, or moved to another region, may get those). */
static size_t domain_room(struct fiv_domain *d, bool cmp)
{
    size_t room = 0;
    fiv_lock(d);
    for (size_t i = 0; i < d->neps; i++) {
        const struct fiv_ep *ep = d->eps[i];
        size_t r = ep->h && ep->frag ? frag_room(ep->frag, cmp) : 0;
        if (r && (!room || r < room))
            room = r;
    }
    fiv_unlock(d);
    return room ? room : frag_room(FIV_MIN_SLOT - 32, cmp);
}

int fiv_query_atomic(struct fid_domain *domain, enum fi_datatype datatype,
                     enum fi_op op, struct fi_atomic_attr *attr,
                     uint64_t flags)
{
    size_t sz = dt_size(datatype);
    if (!sz || !op_ok(op) ||
        (bitwise(op) && (datatype == FI_FLOAT || datatype == FI_DOUBLE)))
        return -FI_EOPNOTSUPP;
    bool cswap = op >= FI_CSWAP && op <= FI_MSWAP;
    if ((flags & FI_COMPARE_ATOMIC) && !cswap)
        return -FI_EOPNOTSUPP;
    if (!(flags & FI_COMPARE_ATOMIC) && cswap)
        return -FI_EOPNOTSUPP;
    if (attr) {
        /* no domain: an endpoint's fi_*atomicvalid asks, which bounds
           the count by its own slots (atomic_room) */
        size_t room = domain ? domain_room(container_of(domain,
                                                        struct fiv_domain,
                                                        dom),
                                           cswap)
                             : FIV_ATOMIC_MAX;
        attr->size = sz;
        attr->count = room / sz;
    }
    return 0;
}

/* ---- the target ---- */

/* Past one of `peer`'s caps: its path breaks once this message is
   handled (fiv_progress.c), as if the network had failed. */
static void over_cap(struct fiv_peer *peer, const char *what)
{
    peer->violated = true;
    peer->over = what;
}

/* An answer to `to`: `len` bytes of `data` copied now (copy), or, for a
   large READ (mr), the bytes registered under `key` at `addr`, looked up
   again as each fragment leaves (fiv.h, "Lifetimes"). What we copy
   counts against the peer's answer cap until it has gone out. */
static void reply(struct fiv_ep *ep, fi_addr_t to, struct fiv_peer *peer,
                  uint32_t op, uint64_t id, int status, const void *data,
                  size_t len, bool copy, const struct fiv_rma_hdr *mr)
{
    size_t charge = len && copy ? len : 0;
    /* counted where fiv_tx_done finds it again (for ourselves that is
       not the handler's stand-in peer) */
    struct fiv_peer *acct = fiv_peer(ep, to);
    if (acct && (charge > fiv_cfg.peer_answer_bytes ||
                 acct->answer_bytes > fiv_cfg.peer_answer_bytes - charge)) {
        over_cap(peer, "it asked for more answers than its cap "
                       "(FI_IVSHM_PEER_ANSWER_BYTES)");
        return;
    }
    struct fiv_op_req *r = fiv_req_new();
    if (!r)
        return;
    struct fiv_resp_hdr h = {.id = id, .status = status, .len = len};
    r->kind = REQ_REPLY;
    r->peer = to;
    r->op = op;
    memcpy(r->hdr, &h, sizeof h);
    r->hlen = sizeof h;
    r->total = len;
    if (charge) {
        r->own = malloc(len);
        if (!r->own) {
            free(r);
            return;
        }
        memcpy(r->own, data, len);
        data = r->own;
        r->charged = charge;
        if (acct)
            acct->answer_bytes += charge;
    } else if (mr && !copy) {
        r->from_mr = true;
        r->mr_key = mr->key;
        r->mr_addr = mr->addr;
        data = NULL;
    }
    r->iov[0] = (struct iovec){(void *)data, len};
    r->iov_count = len && data ? 1 : 0;
    fiv_tx_start(ep, r);
}

static void count_remote(struct fiv_ep *ep, struct fiv_mr *mr, bool write)
{
    fiv_cntr_inc(write ? ep->cntr_rwrite : ep->cntr_rread);
    if (mr && mr->rma_cntr)
        fiv_cntr_inc(mr->rma_cntr);
}

/* A write landed whole: counters, the target's CQ data entry, the ack.
   `mr` was looked up by this call (never one kept from an earlier one). */
static void write_done(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                       struct fiv_mr *mr, uint32_t op, uint64_t id,
                       uint64_t data, int status, size_t len, void *at)
{
    if (status == 0) {
        if (op & FIV_F_DATA && ep->rx_cq && ep->core_rx &&
            ep->rx_cq->core_writes >= (ep->rx_cq->size > FIV_CQ_SIZE
                                      ? ep->rx_cq->size
                                      : FIV_CQ_SIZE)) {
            /* a completion without a receive of ours. A region write
               waited in its ring for room (fiv_progress.c, take_message);
               a core message was read off the core already, so its kind
               is bounded by what the application chose (its CQ size, at
               least the default), not by the writer; counted over core
               writes only, so no region peer's entries take that room */
            over_cap(peer, "it wrote more remote CQ data than the CQ's "
                           "size holds");
            return;
        }
        count_remote(ep, mr, true);
        if (op & FIV_F_DATA && ep->rx_cq) {
            struct fiv_cqe e = {.flags = FI_RMA | FI_REMOTE_WRITE |
                                         FI_REMOTE_CQ_DATA,
                                .len = len, .buf = at, .data = data,
                                .src = ep->caps & FI_SOURCE ? src : FI_ADDR_NOTAVAIL,
                                .core = ep->core_rx};
            if (fiv_cq_push(ep->rx_cq, &e) == 0 && e.core)
                ep->rx_cq->core_writes++;
        }
    }
    if (op & FIV_F_ACK)
        reply(ep, src, peer, FIV_OP_ACK, id, status, NULL, 0, false, NULL);
}

void fiv_rma_target(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                    uint32_t op, const uint8_t *p, size_t n)
{
    struct fiv_rma_hdr h;
    if (n < sizeof h) {
        peer->violated = true;
        return;
    }
    memcpy(&h, p, sizeof h); /* once: the region is shared */
    p += sizeof h;
    n -= sizeof h;
    struct fiv_domain *d = ep->dom;
    struct fiv_mr *mr = NULL;
    switch (op & FIV_OP_MASK) {
    case FIV_OP_WRITE: {
        if (h.len > FIV_MAX_MSG || n > h.len) {
            peer->violated = true;
            return;
        }
        uint8_t *dst = NULL;
        bool ok = fiv_mr_target(d, h.key, h.addr, h.len, FI_REMOTE_WRITE,
                                &dst, &mr);
        if (ok && n)
            memcpy(dst, p, n);
        if (n < h.len) {
            /* the MR is named by its key, not kept: each continuation
               looks it up again */
            peer->as = (struct fiv_asm){.kind = ASM_WRITE, .total = h.len,
                                        .got = n, .key = h.key,
                                        .addr = h.addr, .refused = !ok,
                                        .flags = op, .data = h.data,
                                        .write_id = h.id};
            return;
        }
        write_done(ep, src, peer, mr, op, h.id, h.data, ok ? 0 : -FI_EACCES,
                   h.len, dst);
        break;
    }
    case FIV_OP_READ: {
        if (h.len > FIV_MAX_MSG) {
            reply(ep, src, peer, FIV_OP_READ_RESP, h.id, -FI_EINVAL, NULL, 0,
                  false, NULL);
            return;
        }
        uint8_t *at = NULL;
        if (!fiv_mr_target(d, h.key, h.addr, h.len, FI_REMOTE_READ, &at,
                           &mr)) {
            reply(ep, src, peer, FIV_OP_READ_RESP, h.id, -FI_EACCES, NULL, 0,
                  false, NULL);
            return;
        }
        count_remote(ep, mr, false);
        /* small answers carry a copy (a later write cannot overtake them);
           large ones go out from registered memory as they leave, looked
           up again for every fragment */
        reply(ep, src, peer, FIV_OP_READ_RESP, h.id, 0, at, h.len,
              h.len <= FIV_READ_COPY, &h);
        break;
    }
    case FIV_OP_ATOMIC: {
        size_t sz = dt_size((enum fi_datatype)h.datatype);
        bool cmp = op & FIV_F_COMPARE;
        bool fetch = op & FIV_F_FETCH;
        bool read_only = h.op == FI_ATOMIC_READ;
        size_t need = read_only ? 0 : (cmp ? 2 * h.len : h.len);
        /* what it fetches it reads: a fetch needs read access too */
        uint64_t access = (read_only ? 0 : FI_REMOTE_WRITE) |
                          (read_only || fetch ? FI_REMOTE_READ : 0);
        int status = 0;
        uint8_t *mem = NULL;
        uint8_t old[FIV_ATOMIC_MAX];
        if (!sz || !h.len || h.len > FIV_ATOMIC_MAX || h.len % sz ||
            n < need ||
            cmp != (h.op >= FI_CSWAP && h.op <= FI_MSWAP))
            status = -FI_EINVAL;
        else if (!fiv_mr_target(d, h.key, h.addr, h.len, access, &mem, &mr))
            status = -FI_EACCES;
        if (status == 0) {
            memcpy(old, mem, h.len);
            /* a read stores nothing: its memory may be read-only, and a
               write back of the copy could undo a store made meanwhile */
            if (!read_only)
                status = apply(mem, p, cmp ? p + h.len : NULL, h.len / sz,
                               (enum fi_datatype)h.datatype, (enum fi_op)h.op);
            if (status == 0)
                count_remote(ep, mr, !read_only);
        }
        reply(ep, src, peer, FIV_OP_ACK, h.id, status, old,
              fetch && status == 0 ? h.len : 0, true, NULL);
        break;
    }
    default:
        break;
    }
}

/* ---- the initiator ---- */

static struct fiv_op_req *take_waiting(struct fiv_ep *ep, uint64_t id,
                                       fi_addr_t from)
{
    struct fiv_op_req *prev = NULL;
    for (struct fiv_op_req *r = ep->waiting; r; prev = r, r = r->next) {
        if (r->id != id || r->peer != from)
            continue;
        if (prev)
            prev->next = r->next;
        else
            ep->waiting = r->next;
        r->next = NULL;
        return r;
    }
    return NULL;
}

static void finish(struct fiv_ep *ep, struct fiv_op_req *r, int status)
{
    /* the answering peer wrote `status`: 0, or a libfabric error; any
       other value (also INT32_MIN, whose negation overflows) is EIO */
    int err = status == 0 ? 0
              : status < 0 && status >= -FI_ERRNO_MAX ? -status : FI_EIO;
    fiv_complete_tx(ep, r->context, r->flags, r->complete_ev, err);
    fiv_req_free(r);
}

void fiv_rma_answer(struct fiv_ep *ep, fi_addr_t src, struct fiv_peer *peer,
                    uint32_t op, const uint8_t *p, size_t n)
{
    struct fiv_asm *as = &peer->as;
    if ((op & FIV_OP_MASK) == FIV_OP_MORE) {
        size_t k = n < as->total - as->got ? n : as->total - as->got;
        if (as->kind == ASM_WRITE && !as->refused) {
            /* the registration may have been closed since the last
               fragment: looked up again, with bounds and access */
            uint8_t *dst = NULL;
            if (!fiv_mr_target(ep->dom, as->key, as->addr + as->got, k,
                               FI_REMOTE_WRITE, &dst, NULL))
                as->refused = true;
            else if (k)
                memcpy(dst, p, k);
        } else if (as->kind == ASM_READ_RESP && as->req && !as->status) {
            fiv_iov_write(as->req->res, as->req->res_count, as->got, p, k);
        }
        as->got += k;
        if (as->got < as->total)
            return;
        struct fiv_asm done = *as;
        memset(as, 0, sizeof *as);
        if (done.kind == ASM_WRITE) {
            struct fiv_mr *mr = NULL;
            uint8_t *at = NULL;
            bool ok = !done.refused &&
                      fiv_mr_target(ep->dom, done.key, done.addr, done.total,
                                    FI_REMOTE_WRITE, &at, &mr);
            write_done(ep, src, peer, mr, done.flags, done.write_id, done.data,
                       ok ? 0 : -FI_EACCES, done.total, at);
        } else if (done.req) {
            finish(ep, done.req, done.status);
        }
        return;
    }
    struct fiv_resp_hdr h;
    if (n < sizeof h) {
        peer->violated = true;
        return;
    }
    memcpy(&h, p, sizeof h); /* once: the region is shared */
    p += sizeof h;
    n -= sizeof h;
    struct fiv_op_req *r = take_waiting(ep, h.id, src);
    if ((op & FIV_OP_MASK) == FIV_OP_READ_RESP) {
        if (h.len > FIV_MAX_MSG || n > h.len) {
            peer->violated = true;
            if (r) /* taken off the waiting list: it ends here */
                finish(ep, r, -FI_EIO);
            return;
        }
        /* an answer shorter than the read fails it, nothing stored */
        int32_t status = h.status;
        if (r && status == 0 && h.len < fiv_iov_total(r->res, r->res_count))
            status = -FI_EIO;
        if (r && status == 0)
            fiv_iov_write(r->res, r->res_count, 0, p, n);
        if (n < h.len) {
            /* an unknown id's bytes are consumed, never stored */
            peer->as = (struct fiv_asm){.kind = ASM_READ_RESP, .total = h.len,
                                        .got = n, .req = r, .status = status};
            return;
        }
        if (r)
            finish(ep, r, status);
        return;
    }
    if (!r)
        return;
    /* what the operation fetches comes whole, or it failed: nothing of
       a short answer is stored */
    size_t need = fiv_iov_total(r->res, r->res_count);
    int status = h.status;
    if (status == 0 && need) {
        if (h.len < need || n < need)
            status = -FI_EIO;
        else
            fiv_iov_write(r->res, r->res_count, 0, p, need);
    }
    finish(ep, r, status);
}

void fiv_rma_fail_peer(struct fiv_ep *ep, fi_addr_t a, int err)
{
    struct fiv_op_req **pp = &ep->waiting;
    while (*pp) {
        struct fiv_op_req *r = *pp;
        if (r->peer == a) {
            *pp = r->next;
            finish(ep, r, -err);
        } else {
            pp = &r->next;
        }
    }
}

/* ---- issuing ---- */

/* r goes out now, or with FI_TRIGGER (a *msg call's flag) once its
   counter says so (fiv_trigger.c). */
static ssize_t issue(struct fiv_ep *ep, struct fiv_op_req *r, uint64_t flags)
{
    fiv_lock(ep->dom);
    struct fiv_peer *p = fiv_peer(ep, r->peer);
    if (p && p->queued >= fiv_cfg.peer_queue) {
        fiv_unlock(ep->dom); /* a peer that drains nothing: try later */
        fiv_req_free(r);
        return -FI_EAGAIN;
    }
    r->id = ep->next_id++;
    struct fiv_rma_hdr *h = (struct fiv_rma_hdr *)(void *)r->hdr;
    h->id = r->id;
    r->awaits_answer = true;
    int rc = flags & FI_TRIGGER ? fiv_trigger_post(ep, r) : fiv_tx_start(ep, r);
    fiv_unlock(ep->dom);
    return rc;
}

static ssize_t rma_write(struct fiv_ep *ep, const struct iovec *iov,
                         size_t count, fi_addr_t dest, uint64_t addr,
                         uint64_t key, uint64_t data, void *context,
                         uint64_t flags)
{
    if (count > FIV_IOV_LIMIT)
        return -FI_EINVAL;
    size_t len = fiv_iov_total(iov, count);
    if (len > FIV_MAX_MSG || (flags & FI_INJECT && len > FIV_INJECT))
        return -FI_EMSGSIZE;
    struct fiv_op_req *r = fiv_req_new();
    if (!r)
        return -FI_ENOMEM;
    struct fiv_rma_hdr h = {.addr = addr, .key = key, .len = len, .data = data};
    r->kind = REQ_WRITE;
    r->peer = dest;
    r->context = context;
    r->flags = FI_RMA | FI_WRITE;
    r->complete_ev = !(flags & FIV_NO_EVENT) && want_tx(ep, flags);
    r->op = FIV_OP_WRITE | FIV_F_ACK | (flags & FI_REMOTE_CQ_DATA ? FIV_F_DATA : 0);
    memcpy(r->hdr, &h, sizeof h);
    r->hlen = sizeof h;
    if (fiv_req_payload(r, iov, count, flags & FI_INJECT) < 0) {
        fiv_req_free(r);
        return -FI_ENOMEM;
    }
    return issue(ep, r, flags);
}

static ssize_t rma_read(struct fiv_ep *ep, const struct iovec *iov,
                        size_t count, fi_addr_t src, uint64_t addr,
                        uint64_t key, void *context, uint64_t flags)
{
    if (count > FIV_IOV_LIMIT)
        return -FI_EINVAL;
    size_t len = fiv_iov_total(iov, count);
    if (len > FIV_MAX_MSG)
        return -FI_EMSGSIZE;
    struct fiv_op_req *r = fiv_req_new();
    if (!r)
        return -FI_ENOMEM;
    struct fiv_rma_hdr h = {.addr = addr, .key = key, .len = len};
    r->kind = REQ_READ;
    r->peer = src;
    r->context = context;
    r->flags = FI_RMA | FI_READ;
    r->complete_ev = want_tx(ep, flags);
    r->op = FIV_OP_READ;
    memcpy(r->hdr, &h, sizeof h);
    r->hlen = sizeof h;
    memcpy(r->res, iov, count * sizeof *iov);
    r->res_count = count;
    return issue(ep, r, flags);
}

static ssize_t r_read(struct fid_ep *e, void *buf, size_t len, void *desc,
                      fi_addr_t src, uint64_t addr, uint64_t key, void *ctx)
{
    (void)desc;
    struct iovec v = {buf, len};
    return rma_read(EP(e), &v, 1, src, addr, key, ctx,
                    EP(e)->tx_op_flags | FI_COMPLETION);
}

static ssize_t r_readv(struct fid_ep *e, const struct iovec *iov, void **desc,
                       size_t count, fi_addr_t src, uint64_t addr,
                       uint64_t key, void *ctx)
{
    (void)desc;
    return rma_read(EP(e), iov, count, src, addr, key, ctx,
                    EP(e)->tx_op_flags | FI_COMPLETION);
}

static ssize_t r_readmsg(struct fid_ep *e, const struct fi_msg_rma *m,
                         uint64_t flags)
{
    if (m->rma_iov_count != 1)
        return -FI_EINVAL;
    return rma_read(EP(e), m->msg_iov, m->iov_count, m->addr,
                    m->rma_iov[0].addr, m->rma_iov[0].key, m->context, flags);
}

static ssize_t r_write(struct fid_ep *e, const void *buf, size_t len,
                       void *desc, fi_addr_t dest, uint64_t addr, uint64_t key,
                       void *ctx)
{
    (void)desc;
    struct iovec v = {(void *)buf, len};
    return rma_write(EP(e), &v, 1, dest, addr, key, 0, ctx,
                     EP(e)->tx_op_flags | FI_COMPLETION);
}

static ssize_t r_writev(struct fid_ep *e, const struct iovec *iov, void **desc,
                        size_t count, fi_addr_t dest, uint64_t addr,
                        uint64_t key, void *ctx)
{
    (void)desc;
    return rma_write(EP(e), iov, count, dest, addr, key, 0, ctx,
                     EP(e)->tx_op_flags | FI_COMPLETION);
}

static ssize_t r_writemsg(struct fid_ep *e, const struct fi_msg_rma *m,
                          uint64_t flags)
{
    if (m->rma_iov_count != 1)
        return -FI_EINVAL;
    return rma_write(EP(e), m->msg_iov, m->iov_count, m->addr,
                     m->rma_iov[0].addr, m->rma_iov[0].key, m->data,
                     m->context, flags & ~FIV_NO_EVENT);
}

static ssize_t r_inject(struct fid_ep *e, const void *buf, size_t len,
                        fi_addr_t dest, uint64_t addr, uint64_t key)
{
    struct iovec v = {(void *)buf, len};
    return rma_write(EP(e), &v, 1, dest, addr, key, 0, NULL,
                     FI_INJECT | FIV_NO_EVENT);
}

static ssize_t r_writedata(struct fid_ep *e, const void *buf, size_t len,
                           void *desc, uint64_t data, fi_addr_t dest,
                           uint64_t addr, uint64_t key, void *ctx)
{
    (void)desc;
    struct iovec v = {(void *)buf, len};
    return rma_write(EP(e), &v, 1, dest, addr, key, data, ctx,
                     EP(e)->tx_op_flags | FI_COMPLETION | FI_REMOTE_CQ_DATA);
}

static ssize_t r_injectdata(struct fid_ep *e, const void *buf, size_t len,
                            uint64_t data, fi_addr_t dest, uint64_t addr,
                            uint64_t key)
{
    struct iovec v = {(void *)buf, len};
    return rma_write(EP(e), &v, 1, dest, addr, key, data, NULL,
                     FI_INJECT | FIV_NO_EVENT | FI_REMOTE_CQ_DATA);
}

struct fi_ops_rma fiv_rma_ops = {
    .size = sizeof(struct fi_ops_rma),
    .read = r_read,
    .readv = r_readv,
    .readmsg = r_readmsg,
    .write = r_write,
    .writev = r_writev,
    .writemsg = r_writemsg,
    .inject = r_inject,
    .writedata = r_writedata,
    .injectdata = r_injectdata,
};

/* ---- atomics ---- */

static size_t atomic_room(const struct fiv_ep *ep, bool cmp)
{
    return frag_room(ep->frag, cmp);
}

static ssize_t atomic_issue(struct fiv_ep *ep, const void *opnd,
                            const void *cmp, void *result, size_t count,
                            fi_addr_t dest, uint64_t addr, uint64_t key,
                            enum fi_datatype dt, enum fi_op op, void *ctx,
                            uint64_t flags, bool fetch)
{
    size_t sz = dt_size(dt);
    if (!sz || !op_ok(op))
        return -FI_EOPNOTSUPP;
    size_t len = count * sz;
    bool read_only = op == FI_ATOMIC_READ;
    /* a compare operand exactly for the compare ops: the target checks
       the same (fiv_rma_target); an operand for all but a read */
    if (!count || len > atomic_room(ep, cmp != NULL) || len / count != sz ||
        (op >= FI_CSWAP && op <= FI_MSWAP) != (cmp != NULL) ||
        (!read_only && !opnd))
        return -FI_EINVAL;
    struct fiv_op_req *r = fiv_req_new();
    if (!r)
        return -FI_ENOMEM;
    size_t plen = read_only ? 0 : (cmp ? 2 * len : len);
    if (flags & FI_TRIGGER && !(flags & FI_INJECT)) {
        /* read when it starts, as a triggered send's buffer is: what it
           forwards may arrive after the call (fi_trigger(3)) */
        r->iov_count = 0;
        if (!read_only)
            r->iov[r->iov_count++] = (struct iovec){(void *)opnd, len};
        if (!read_only && cmp)
            r->iov[r->iov_count++] = (struct iovec){(void *)cmp, len};
    } else {
        r->own = malloc(plen ? plen : 1);
        if (!r->own) {
            free(r);
            return -FI_ENOMEM;
        }
        if (!read_only) {
            memcpy(r->own, opnd, len);
            if (cmp)
                memcpy(r->own + len, cmp, len);
        }
        r->iov[0] = (struct iovec){r->own, plen};
        r->iov_count = 1;
    }
    struct fiv_rma_hdr h = {.addr = addr, .key = key, .len = len,
                            .op = (uint32_t)op, .datatype = (uint32_t)dt};
    r->kind = REQ_ATOMIC;
    r->peer = dest;
    r->context = ctx;
    r->flags = FI_ATOMIC | (fetch ? FI_READ : FI_WRITE);
    r->complete_ev = !(flags & FIV_NO_EVENT) && want_tx(ep, flags);
    r->op = FIV_OP_ATOMIC | (fetch ? FIV_F_FETCH : 0) | (cmp ? FIV_F_COMPARE : 0);
    memcpy(r->hdr, &h, sizeof h);
    r->hlen = sizeof h;
    r->total = plen;
    if (fetch) {
        r->res[0] = (struct iovec){result, len};
        r->res_count = 1;
    }
    return issue(ep, r, flags);
}

static ssize_t a_write(struct fid_ep *e, const void *buf, size_t count,
                       void *desc, fi_addr_t dest, uint64_t addr, uint64_t key,
                       enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)desc;
    if (op >= FI_CSWAP || op == FI_ATOMIC_READ)
        return -FI_EINVAL;
    return atomic_issue(EP(e), buf, NULL, NULL, count, dest, addr, key, dt, op,
                        ctx, EP(e)->tx_op_flags | FI_COMPLETION, false);
}

static ssize_t a_writev(struct fid_ep *e, const struct fi_ioc *iov, void **desc,
                        size_t count, fi_addr_t dest, uint64_t addr,
                        uint64_t key, enum fi_datatype dt, enum fi_op op,
                        void *ctx)
{
    if (count != 1)
        return -FI_EINVAL;
    return a_write(e, iov[0].addr, iov[0].count, desc ? desc[0] : NULL, dest,
                   addr, key, dt, op, ctx);
}

static ssize_t a_writemsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                          uint64_t flags)
{
    if (m->iov_count != 1 || m->rma_iov_count != 1)
        return -FI_EINVAL;
    if (m->op >= FI_CSWAP || m->op == FI_ATOMIC_READ)
        return -FI_EINVAL;
    return atomic_issue(EP(e), m->msg_iov[0].addr, NULL, NULL,
                        m->msg_iov[0].count, m->addr, m->rma_iov[0].addr,
                        m->rma_iov[0].key, m->datatype, m->op, m->context,
                        flags & ~FIV_NO_EVENT, false);
}

static ssize_t a_inject(struct fid_ep *e, const void *buf, size_t count,
                        fi_addr_t dest, uint64_t addr, uint64_t key,
                        enum fi_datatype dt, enum fi_op op)
{
    if (op >= FI_CSWAP || op == FI_ATOMIC_READ)
        return -FI_EINVAL;
    return atomic_issue(EP(e), buf, NULL, NULL, count, dest, addr, key, dt, op,
                        NULL, FI_INJECT | FIV_NO_EVENT, false);
}

static ssize_t a_readwrite(struct fid_ep *e, const void *buf, size_t count,
                           void *desc, void *result, void *result_desc,
                           fi_addr_t dest, uint64_t addr, uint64_t key,
                           enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)desc;
    (void)result_desc;
    if (op >= FI_CSWAP)
        return -FI_EINVAL;
    return atomic_issue(EP(e), buf, NULL, result, count, dest, addr, key, dt,
                        op, ctx, EP(e)->tx_op_flags | FI_COMPLETION, true);
}

static ssize_t a_readwritev(struct fid_ep *e, const struct fi_ioc *iov,
                            void **desc, size_t count, struct fi_ioc *resultv,
                            void **result_desc, size_t result_count,
                            fi_addr_t dest, uint64_t addr, uint64_t key,
                            enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)desc;
    (void)result_desc;
    if (count > 1 || result_count != 1 ||
        (count && iov[0].count != resultv[0].count))
        return -FI_EINVAL;
    return a_readwrite(e, count ? iov[0].addr : NULL, resultv[0].count, NULL,
                       resultv[0].addr, NULL, dest, addr, key, dt, op, ctx);
}

static ssize_t a_readwritemsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                              struct fi_ioc *resultv, void **result_desc,
                              size_t result_count, uint64_t flags)
{
    (void)result_desc;
    if (m->iov_count > 1 || m->rma_iov_count != 1 || result_count != 1 ||
        (m->iov_count && m->msg_iov[0].count != resultv[0].count))
        return -FI_EINVAL;
    if (m->op >= FI_CSWAP)
        return -FI_EINVAL;
    return atomic_issue(EP(e), m->iov_count ? m->msg_iov[0].addr : NULL, NULL,
                        resultv[0].addr, resultv[0].count, m->addr,
                        m->rma_iov[0].addr, m->rma_iov[0].key, m->datatype,
                        m->op, m->context, flags & ~FIV_NO_EVENT, true);
}

static ssize_t a_compwrite(struct fid_ep *e, const void *buf, size_t count,
                           void *desc, const void *compare, void *compare_desc,
                           void *result, void *result_desc, fi_addr_t dest,
                           uint64_t addr, uint64_t key, enum fi_datatype dt,
                           enum fi_op op, void *ctx)
{
    (void)desc;
    (void)compare_desc;
    (void)result_desc;
    if (op < FI_CSWAP || op > FI_MSWAP)
        return -FI_EINVAL;
    return atomic_issue(EP(e), buf, compare, result, count, dest, addr, key, dt,
                        op, ctx, EP(e)->tx_op_flags | FI_COMPLETION, true);
}

static ssize_t a_compwritev(struct fid_ep *e, const struct fi_ioc *iov,
                            void **desc, size_t count,
                            const struct fi_ioc *comparev, void **compare_desc,
                            size_t compare_count, struct fi_ioc *resultv,
                            void **result_desc, size_t result_count,
                            fi_addr_t dest, uint64_t addr, uint64_t key,
                            enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)desc;
    (void)compare_desc;
    (void)result_desc;
    if (count != 1 || compare_count != 1 || result_count != 1 ||
        comparev[0].count != iov[0].count || resultv[0].count != iov[0].count)
        return -FI_EINVAL;
    return a_compwrite(e, iov[0].addr, iov[0].count, NULL, comparev[0].addr,
                       NULL, resultv[0].addr, NULL, dest, addr, key, dt, op, ctx);
}

static ssize_t a_compwritemsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                              const struct fi_ioc *comparev, void **compare_desc,
                              size_t compare_count, struct fi_ioc *resultv,
                              void **result_desc, size_t result_count,
                              uint64_t flags)
{
    (void)compare_desc;
    (void)result_desc;
    if (m->iov_count != 1 || m->rma_iov_count != 1 || compare_count != 1 ||
        result_count != 1 || comparev[0].count != m->msg_iov[0].count ||
        resultv[0].count != m->msg_iov[0].count)
        return -FI_EINVAL;
    if (m->op < FI_CSWAP || m->op > FI_MSWAP)
        return -FI_EINVAL;
    return atomic_issue(EP(e), m->msg_iov[0].addr, comparev[0].addr,
                        resultv[0].addr, m->msg_iov[0].count, m->addr,
                        m->rma_iov[0].addr, m->rma_iov[0].key, m->datatype,
                        m->op, m->context, flags & ~FIV_NO_EVENT, true);
}

static int a_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                   size_t *count)
{
    if (op >= FI_CSWAP)
        return -FI_EOPNOTSUPP;
    struct fi_atomic_attr a;
    int rc = fiv_query_atomic(NULL, dt, op, &a, 0);
    if (rc == 0 && count)
        *count = atomic_room(EP(e), false) / a.size;
    return rc;
}

static int a_fetch_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                         size_t *count)
{
    return a_valid(e, dt, op, count);
}

static int a_comp_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                        size_t *count)
{
    struct fi_atomic_attr a;
    int rc = fiv_query_atomic(NULL, dt, op, &a, FI_COMPARE_ATOMIC);
    if (rc == 0 && count)
        *count = atomic_room(EP(e), true) / a.size;
    return rc;
}

struct fi_ops_atomic fiv_atomic_ops = {
    .size = sizeof(struct fi_ops_atomic),
    .write = a_write,
    .writev = a_writev,
    .writemsg = a_writemsg,
    .inject = a_inject,
    .readwrite = a_readwrite,
    .readwritev = a_readwritev,
    .readwritemsg = a_readwritemsg,
    .compwrite = a_compwrite,
    .compwritev = a_compwritev,
    .compwritemsg = a_compwritemsg,
    .writevalid = a_valid,
    .readwritevalid = a_fetch_valid,
    .compwritevalid = a_comp_valid,
};

/* ---- a datagram endpoint's: no RMA and no atomics ----
   Refused before any argument is looked at (docs/provider.md, "Datagram
   endpoints"), so a call that would fail a check on RDM gets the same
   -FI_ENOSYS, and the RDM path carries no test for the endpoint's type. */

static ssize_t no_read(struct fid_ep *e, void *buf, size_t len, void *desc,
                       fi_addr_t src, uint64_t addr, uint64_t key, void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)src; (void)addr;
    (void)key; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_rmav(struct fid_ep *e, const struct iovec *iov, void **desc,
                       size_t count, fi_addr_t a, uint64_t addr, uint64_t key,
                       void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)a; (void)addr;
    (void)key; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_rmamsg(struct fid_ep *e, const struct fi_msg_rma *m,
                         uint64_t flags)
{
    (void)e; (void)m; (void)flags;
    return -FI_ENOSYS;
}

static ssize_t no_write(struct fid_ep *e, const void *buf, size_t len,
                        void *desc, fi_addr_t dest, uint64_t addr, uint64_t key,
                        void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)dest; (void)addr;
    (void)key; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_rinject(struct fid_ep *e, const void *buf, size_t len,
                          fi_addr_t dest, uint64_t addr, uint64_t key)
{
    (void)e; (void)buf; (void)len; (void)dest; (void)addr; (void)key;
    return -FI_ENOSYS;
}

static ssize_t no_writedata(struct fid_ep *e, const void *buf, size_t len,
                            void *desc, uint64_t data, fi_addr_t dest,
                            uint64_t addr, uint64_t key, void *ctx)
{
    (void)e; (void)buf; (void)len; (void)desc; (void)data; (void)dest;
    (void)addr; (void)key; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_injectdata(struct fid_ep *e, const void *buf, size_t len,
                             uint64_t data, fi_addr_t dest, uint64_t addr,
                             uint64_t key)
{
    (void)e; (void)buf; (void)len; (void)data; (void)dest; (void)addr;
    (void)key;
    return -FI_ENOSYS;
}

struct fi_ops_rma fiv_no_rma_ops = {
    .size = sizeof(struct fi_ops_rma),
    .read = no_read,
    .readv = no_rmav,
    .readmsg = no_rmamsg,
    .write = no_write,
    .writev = no_rmav,
    .writemsg = no_rmamsg,
    .inject = no_rinject,
    .writedata = no_writedata,
    .injectdata = no_injectdata,
};

static ssize_t no_a_write(struct fid_ep *e, const void *buf, size_t count,
                          void *desc, fi_addr_t dest, uint64_t addr,
                          uint64_t key, enum fi_datatype dt, enum fi_op op,
                          void *ctx)
{
    (void)e; (void)buf; (void)count; (void)desc; (void)dest; (void)addr;
    (void)key; (void)dt; (void)op; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_writev(struct fid_ep *e, const struct fi_ioc *iov,
                           void **desc, size_t count, fi_addr_t dest,
                           uint64_t addr, uint64_t key, enum fi_datatype dt,
                           enum fi_op op, void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)dest; (void)addr;
    (void)key; (void)dt; (void)op; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_writemsg(struct fid_ep *e, const struct fi_msg_atomic *m,
                             uint64_t flags)
{
    (void)e; (void)m; (void)flags;
    return -FI_ENOSYS;
}

static ssize_t no_a_inject(struct fid_ep *e, const void *buf, size_t count,
                           fi_addr_t dest, uint64_t addr, uint64_t key,
                           enum fi_datatype dt, enum fi_op op)
{
    (void)e; (void)buf; (void)count; (void)dest; (void)addr; (void)key;
    (void)dt; (void)op;
    return -FI_ENOSYS;
}

static ssize_t no_a_readwrite(struct fid_ep *e, const void *buf, size_t count,
                              void *desc, void *result, void *result_desc,
                              fi_addr_t dest, uint64_t addr, uint64_t key,
                              enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)e; (void)buf; (void)count; (void)desc; (void)result;
    (void)result_desc; (void)dest; (void)addr; (void)key; (void)dt; (void)op;
    (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_readwritev(struct fid_ep *e, const struct fi_ioc *iov,
                               void **desc, size_t count,
                               struct fi_ioc *resultv, void **result_desc,
                               size_t result_count, fi_addr_t dest,
                               uint64_t addr, uint64_t key,
                               enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)resultv;
    (void)result_desc; (void)result_count; (void)dest; (void)addr; (void)key;
    (void)dt; (void)op; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_readwritemsg(struct fid_ep *e,
                                 const struct fi_msg_atomic *m,
                                 struct fi_ioc *resultv, void **result_desc,
                                 size_t result_count, uint64_t flags)
{
    (void)e; (void)m; (void)resultv; (void)result_desc; (void)result_count;
    (void)flags;
    return -FI_ENOSYS;
}

static ssize_t no_a_compwrite(struct fid_ep *e, const void *buf, size_t count,
                              void *desc, const void *compare,
                              void *compare_desc, void *result,
                              void *result_desc, fi_addr_t dest, uint64_t addr,
                              uint64_t key, enum fi_datatype dt, enum fi_op op,
                              void *ctx)
{
    (void)e; (void)buf; (void)count; (void)desc; (void)compare;
    (void)compare_desc; (void)result; (void)result_desc; (void)dest;
    (void)addr; (void)key; (void)dt; (void)op; (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_compwritev(struct fid_ep *e, const struct fi_ioc *iov,
                               void **desc, size_t count,
                               const struct fi_ioc *comparev,
                               void **compare_desc, size_t compare_count,
                               struct fi_ioc *resultv, void **result_desc,
                               size_t result_count, fi_addr_t dest,
                               uint64_t addr, uint64_t key,
                               enum fi_datatype dt, enum fi_op op, void *ctx)
{
    (void)e; (void)iov; (void)desc; (void)count; (void)comparev;
    (void)compare_desc; (void)compare_count; (void)resultv; (void)result_desc;
    (void)result_count; (void)dest; (void)addr; (void)key; (void)dt; (void)op;
    (void)ctx;
    return -FI_ENOSYS;
}

static ssize_t no_a_compwritemsg(struct fid_ep *e,
                                 const struct fi_msg_atomic *m,
                                 const struct fi_ioc *comparev,
                                 void **compare_desc, size_t compare_count,
                                 struct fi_ioc *resultv, void **result_desc,
                                 size_t result_count, uint64_t flags)
{
    (void)e; (void)m; (void)comparev; (void)compare_desc; (void)compare_count;
    (void)resultv; (void)result_desc; (void)result_count; (void)flags;
    return -FI_ENOSYS;
}

static int no_a_valid(struct fid_ep *e, enum fi_datatype dt, enum fi_op op,
                      size_t *count)
{
    (void)e; (void)dt; (void)op; (void)count;
    return -FI_EOPNOTSUPP;
}

struct fi_ops_atomic fiv_no_atomic_ops = {
    .size = sizeof(struct fi_ops_atomic),
    .write = no_a_write,
    .writev = no_a_writev,
    .writemsg = no_a_writemsg,
    .inject = no_a_inject,
    .readwrite = no_a_readwrite,
    .readwritev = no_a_readwritev,
    .readwritemsg = no_a_readwritemsg,
    .compwrite = no_a_compwrite,
    .compwritev = no_a_compwritev,
    .compwritemsg = no_a_compwritemsg,
    .writevalid = no_a_valid,
    .readwritevalid = no_a_valid,
    .compwritevalid = no_a_valid,
};
