/*
 * Memory registrations: what a remote peer may read or write here. The
 * target of every RMA and atomic is this process's own progress, which
 * looks the key up here and checks the bytes against the registration
 * (never past it, whatever the request says).
 */
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

static ssize_t find(struct fiv_domain *d, uint64_t key)
{
    size_t lo = 0, hi = d->nmrs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (d->mrs[mid]->mr.key < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < d->nmrs && d->mrs[lo]->mr.key == key ? (ssize_t)lo
                                                     : -(ssize_t)lo - 1;
}

bool fiv_mr_target(struct fiv_domain *d, uint64_t key, uint64_t addr,
                   size_t len, uint64_t access, uint8_t **at,
                   struct fiv_mr **out)
{
    ssize_t i = find(d, key);
    if (i < 0)
        return false;
    struct fiv_mr *m = d->mrs[i];
    if ((m->access & access) != access)
        return false;
    uint64_t start = d->mr_mode & FI_MR_VIRT_ADDR ? (uint64_t)(uintptr_t)m->base
                                                  : m->offset;
    if (addr < start)
        return false;
    uint64_t off = addr - start;
    if (off > m->len || len > m->len - off)
        return false;
    if (out)
        *out = m;
    /* no pointer arithmetic on the NULL base of an empty registration */
    *at = m->base ? m->base + off : NULL;
    return true;
}

static int mr_close(struct fid *fid)
{
    struct fiv_mr *m = container_of(fid, struct fiv_mr, mr.fid);
    struct fiv_domain *d = m->dom;
    fiv_lock(d);
    ssize_t i = find(d, m->mr.key);
    if (i >= 0) {
        memmove(&d->mrs[i], &d->mrs[i + 1], (d->nmrs - (size_t)i - 1) * sizeof *d->mrs);
        d->nmrs--;
    }
    if (m->rma_cntr)
        m->rma_cntr->refs--;
    fiv_unlock(d);
    free(m);
    return 0;
}

static int mr_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
    struct fiv_mr *m = container_of(fid, struct fiv_mr, mr.fid);
    (void)flags;
    if (bfid->fclass == FI_CLASS_CNTR) {
        /* under the lock, as the target's progress counts through it and
           mr_close lets it go; a second counter replaces the first,
           which the registration no longer holds */
        struct fiv_cntr *c = container_of(bfid, struct fiv_cntr, cntr.fid);
        /* one of our domain's only: its count may start triggered
           operations (fiv_complete.h), whose lists that domain's
           serialization guards, not ours */
        if (c->dom != m->dom)
            return -FI_EINVAL;
        fiv_lock(m->dom);
        if (m->rma_cntr != c) {
            if (m->rma_cntr)
                m->rma_cntr->refs--;
            c->refs++;
            m->rma_cntr = c;
        }
        fiv_unlock(m->dom);
        return 0;
    }
    if (bfid->fclass == FI_CLASS_EP)
        return 0; /* FI_MR_ENDPOINT: any endpoint of the domain serves */
    return -FI_EINVAL;
}

static int mr_control(struct fid *fid, int cmd, void *arg)
{
    (void)fid;
    (void)arg;
    return cmd == FI_ENABLE ? 0 : -FI_ENOSYS;
}

static struct fi_ops mr_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = mr_close,
    .bind = mr_bind,
    .control = mr_control,
    .ops_open = fiv_no_ops_open,
};

static int reg(struct fiv_domain *d, const void *buf, size_t len,
               uint64_t access, uint64_t offset, uint64_t requested_key,
               struct fid_mr **out, void *context)
{
    if (!buf && len) /* only an empty registration may have no address */
        return -FI_EINVAL;
    struct fiv_mr *m = calloc(1, sizeof *m);
    if (!m)
        return -FI_ENOMEM;
    m->dom = d;
    m->base = (uint8_t *)buf;
    m->len = len;
    m->access = access ? access
                       : FI_SEND | FI_RECV | FI_READ | FI_WRITE |
                             FI_REMOTE_READ | FI_REMOTE_WRITE;
    m->offset = offset;
    m->mr.fid.fclass = FI_CLASS_MR;
    m->mr.fid.context = context;
    m->mr.fid.ops = &mr_fi_ops;
    m->mr.mem_desc = m;
    fiv_lock(d);
    uint64_t key = requested_key;
    if (d->mr_mode & FI_MR_PROV_KEY) {
        while (find(d, d->next_key) >= 0)
            d->next_key++;
        key = d->next_key++;
    }
    ssize_t i = find(d, key);
    int rc = 0;
    if (i >= 0) {
        rc = -FI_ENOKEY;
    } else if (d->nmrs == d->capmrs) {
        size_t n = d->capmrs ? 2 * d->capmrs : 16;
        void *p = realloc(d->mrs, n * sizeof *d->mrs);
        if (!p)
            rc = -FI_ENOMEM;
        else {
            d->mrs = p;
            d->capmrs = n;
        }
    }
    if (rc == 0) {
        size_t at = (size_t)(-i - 1);
        memmove(&d->mrs[at + 1], &d->mrs[at], (d->nmrs - at) * sizeof *d->mrs);
        m->mr.key = key;
        d->mrs[at] = m;
        d->nmrs++;
    }
    fiv_unlock(d);
    if (rc) {
        free(m);
        return rc;
    }
    *out = &m->mr;
    return 0;
}

int fiv_mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access,
               uint64_t offset, uint64_t requested_key, uint64_t flags,
               struct fid_mr **mr, void *context)
{
    (void)flags;
    struct fiv_domain *d = container_of(fid, struct fiv_domain, dom.fid);
    return reg(d, buf, len, access, offset, requested_key, mr, context);
}

int fiv_mr_regv(struct fid *fid, const struct iovec *iov, size_t count,
                uint64_t access, uint64_t offset, uint64_t requested_key,
                uint64_t flags, struct fid_mr **mr, void *context)
{
    if (count > 1)
        return -FI_EINVAL;
    return fiv_mr_reg(fid, count ? iov[0].iov_base : NULL,
                      count ? iov[0].iov_len : 0, access, offset,
                      requested_key, flags, mr, context);
}

int fiv_mr_regattr(struct fid *fid, const struct fi_mr_attr *attr,
                   uint64_t flags, struct fid_mr **mr)
{
    if (attr->iov_count > 1)
        return -FI_EINVAL;
    if (attr->iface != FI_HMEM_SYSTEM)
        return -FI_ENOSYS;
    return fiv_mr_reg(fid, attr->iov_count ? attr->mr_iov[0].iov_base : NULL,
                      attr->iov_count ? attr->mr_iov[0].iov_len : 0,
                      attr->access, attr->offset, attr->requested_key, flags,
                      mr, attr->context);
}
