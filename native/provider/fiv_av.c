/*
 * Address vectors (map and table, both answered with table indices): the
 * names the application inserts. Inserting is what makes a peer heard
 * (docs/security.md, "The libfabric provider"): each bound endpoint
 * resolves the new entry to its path at once (fiv_ep.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fiv.h"

static bool addr_valid(const struct fiv_addr *a)
{
    return a->magic == FIV_ADDR_MAGIC && a->version == FIV_ADDR_VERSION &&
           a->core_len <= FIV_CORE_ADDR_MAX && a->slot >= -1;
}

/* The entry holding name `a`, or av->count. */
static size_t find(const struct fiv_av *av, const struct fiv_addr *a)
{
    for (size_t i = 0; i < av->count; i++)
        if (av->entries[i].used &&
            memcmp(&av->entries[i].addr, a, sizeof *a) == 0)
            return i;
    return av->count;
}

static int av_insert(struct fid_av *av_fid, const void *addr, size_t count,
                     fi_addr_t *fi_addr, uint64_t flags, void *context)
{
    (void)context;
    struct fiv_av *av = container_of(av_fid, struct fiv_av, av);
    struct fiv_domain *d = av->dom;
    if (!addr && count)
        return -FI_EINVAL; /* e.g. an info without a dest_addr */
    /* names are FIV_ADDR_LEN bytes each, packed */
    fiv_lock(d);
    if (av->count + count > av->cap) {
        size_t n = av->cap ? av->cap : 64;
        while (n < av->count + count)
            n *= 2;
        void *p = realloc(av->entries, n * sizeof *av->entries);
        if (!p) {
            fiv_unlock(d);
            return -FI_ENOMEM;
        }
        av->entries = p;
        av->cap = n;
    }
    int inserted = 0;
    const uint8_t *src = addr;
    for (size_t i = 0; i < count; i++) {
        struct fiv_addr a;
        memcpy(&a, src + i * FIV_ADDR_LEN, sizeof a);
        if (!addr_valid(&a)) {
            if (fi_addr)
                fi_addr[i] = FI_ADDR_NOTAVAIL;
            continue;
        }
        /* A name we have already is that entry again, as libfabric's own
           AVs answer: one peer, one address. Two entries for one peer
           would split what it sends (the region names each message's
           sender by one entry) from receives directed at the other: an
           MPI inserts a peer again for MPI_Comm_connect/accept. */
        size_t idx = find(av, &a);
        if (idx < av->count) {
            av->entries[idx].inserts++;
            if (fi_addr)
                fi_addr[i] = idx;
            inserted++;
            continue;
        }
        idx = av->count++;
        struct fiv_av_entry *e = &av->entries[idx];
        e->addr = a;
        e->used = true;
        e->inserts = 1;
        for (size_t k = 0; k < av->neps; k++)
            fiv_ep_resolve(av->eps[k], idx);
        if (fi_addr)
            fi_addr[i] = idx;
        inserted++;
    }
    fiv_unlock(d);
    return inserted;
}

static int av_remove(struct fid_av *av_fid, fi_addr_t *fi_addr, size_t count,
                     uint64_t flags)
{
    (void)flags;
    struct fiv_av *av = container_of(av_fid, struct fiv_av, av);
    fiv_lock(av->dom);
    for (size_t i = 0; i < count; i++) {
        fi_addr_t a = fi_addr[i];
        if (a < av->count && av->entries[a].used &&
            --av->entries[a].inserts == 0) {
            for (size_t k = 0; k < av->neps; k++)
                fiv_ep_forget(av->eps[k], a);
            av->entries[a].used = false;
        }
    }
    fiv_unlock(av->dom);
    return 0;
}

static int av_lookup(struct fid_av *av_fid, fi_addr_t fi_addr, void *addr,
                     size_t *addrlen)
{
    struct fiv_av *av = container_of(av_fid, struct fiv_av, av);
    fiv_lock(av->dom);
    int rc = -FI_EINVAL;
    if (fi_addr < av->count && av->entries[fi_addr].used) {
        struct fiv_av_entry *e = &av->entries[fi_addr];
        memcpy(addr, &e->addr, *addrlen < FIV_ADDR_LEN ? *addrlen : FIV_ADDR_LEN);
        rc = *addrlen < FIV_ADDR_LEN ? -FI_ETOOSMALL : 0;
        *addrlen = FIV_ADDR_LEN;
    }
    fiv_unlock(av->dom);
    return rc;
}

static const char *av_straddr(struct fid_av *av_fid, const void *addr,
                              char *buf, size_t *len)
{
    (void)av_fid;
    struct fiv_addr a;
    memset(&a, 0, sizeof a);
    memcpy(&a, addr, FIV_ADDR_LEN);
    char s[80];
    int n = snprintf(s, sizeof s, "ivshm://%d.%u.%08x%08x+%u", a.slot,
                     a.generation, a.nonce[1], a.nonce[0], a.core_len);
    if (buf && *len) {
        snprintf(buf, *len, "%s", s);
    }
    *len = (size_t)n + 1;
    return buf;
}

static int av_insertsvc(struct fid_av *av, const char *node,
                        const char *service, fi_addr_t *fi_addr,
                        uint64_t flags, void *context)
{
    (void)av; (void)node; (void)service; (void)fi_addr; (void)flags;
    (void)context;
    return -FI_ENOSYS;
}

static int av_insertsym(struct fid_av *av, const char *node, size_t nodecnt,
                        const char *service, size_t svccnt, fi_addr_t *fi_addr,
                        uint64_t flags, void *context)
{
    (void)av; (void)node; (void)nodecnt; (void)service; (void)svccnt;
    (void)fi_addr; (void)flags; (void)context;
    return -FI_ENOSYS;
}

static int av_set(struct fid_av *av, struct fi_av_set_attr *attr,
                  struct fid_av_set **av_set, void *context)
{
    (void)av; (void)attr; (void)av_set; (void)context;
    return -FI_ENOSYS;
}

static int av_close(struct fid *fid)
{
    struct fiv_av *av = container_of(fid, struct fiv_av, av.fid);
    if (av->refs)
        return -FI_EBUSY;
    fiv_domain_ref(av->dom, -1);
    free(av->entries);
    free(av->eps);
    free(av);
    return 0;
}

static struct fi_ops av_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = av_close,
    .bind = fiv_no_bind,
    .control = fiv_no_control,
    .ops_open = fiv_no_ops_open,
};

static struct fi_ops_av av_ops = {
    .size = sizeof(struct fi_ops_av),
    .insert = av_insert,
    .insertsvc = av_insertsvc,
    .insertsym = av_insertsym,
    .remove = av_remove,
    .lookup = av_lookup,
    .straddr = av_straddr,
    .av_set = av_set,
};

int fiv_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                struct fid_av **av_fid, void *context)
{
    if (attr && attr->name)
        return -FI_ENOSYS; /* named (shared) AVs */
    struct fiv_av *av = calloc(1, sizeof *av);
    if (!av)
        return -FI_ENOMEM;
    av->dom = container_of(domain, struct fiv_domain, dom);
    av->type = attr && attr->type ? attr->type : FI_AV_TABLE;
    av->av.fid.fclass = FI_CLASS_AV;
    av->av.fid.context = context;
    av->av.fid.ops = &av_fi_ops;
    av->av.ops = &av_ops;
    fiv_domain_ref(av->dom, 1);
    *av_fid = &av->av;
    return 0;
}
