/*
 * fi_getinfo: one RDM description (or, asked for by type, a datagram
 * one), trimmed to what the hints ask, in the version the caller asked
 * for.
 *
 * The structures we return are read and freed by the running core,
 * whose versions of them may be longer than the 1.17 ones we were built
 * with (libfabric 2.x appended fields to fi_domain_attr, for instance):
 * each is allocated with zeroed room behind it, so a newer core reads
 * zeros ("unspecified") there, never past the allocation.
 */
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "fiv.h"

#define FIV_ROOM 512 /* zeroed bytes behind every returned structure */

static void *zalloc(size_t n) { return calloc(1, n + FIV_ROOM); }

static struct fi_info *alloc_info(void)
{
    struct fi_info *fi = zalloc(sizeof *fi);
    if (!fi)
        return NULL;
    fi->tx_attr = zalloc(sizeof *fi->tx_attr);
    fi->rx_attr = zalloc(sizeof *fi->rx_attr);
    fi->ep_attr = zalloc(sizeof *fi->ep_attr);
    fi->domain_attr = zalloc(sizeof *fi->domain_attr);
    fi->fabric_attr = zalloc(sizeof *fi->fabric_attr);
    if (!fi->tx_attr || !fi->rx_attr || !fi->ep_attr || !fi->domain_attr ||
        !fi->fabric_attr) {
        free(fi->tx_attr);
        free(fi->rx_attr);
        free(fi->ep_attr);
        free(fi->domain_attr);
        free(fi->fabric_attr);
        free(fi);
        return NULL;
    }
    return fi;
}

/* The MR modes we answer with: we need none (remote accesses are
   checked against our own registrations at the target), so we keep the
   ones the caller offers that change how it addresses memory. */
static int answer_mr_mode(uint32_t version, const struct fi_info *hints)
{
    (void)version; /* below 1.5 (the old enum only) we answer nothing */
    int asked = hints && hints->domain_attr ? hints->domain_attr->mr_mode : -1;
    if (asked < 0)
        return FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    /* 1.x callers may still name the old modes: answered in their own
       words (the domain reads basic as these bits, scalable as none) */
    if (asked == 1 /* FI_MR_BASIC */ || asked == 2 /* FI_MR_SCALABLE */)
        return asked;
    return asked & (FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY);
}

/* Why we do not fit, for FI_LOG_LEVEL=info. */
static bool refuse(const char *why)
{
    FIV_INFO("hints not met: %s\n", why);
    return false;
}

/* A datagram endpoint is asked for by name; hints of no type are
   answered with the RDM endpoint alone, the one every MPI looks for
   (docs/provider.md, "Datagram endpoints"). */
static bool wants_dgram(const struct fi_info *h)
{
    return h && h->ep_attr && h->ep_attr->type == FI_EP_DGRAM;
}

/* The flag libfabric's core sets when a utility provider asks for a base
   to layer on (include/ofi.h of 1.17 and 2.x alike). The core keeps the
   providers that must not be layered on in a list of names (shm among
   them), which a provider loaded from FI_PROVIDER_PATH cannot join: so
   our datagram endpoint refuses itself to such a request, or the core
   would offer "ivshm;ofi_rxd" (RDM emulated over our datagrams) beside
   our own RDM endpoint, and with 1.17's core ahead of it, to every
   caller that names us (fiv_conform's getinfo case checks it). */
#define FIV_CORE_PROV_ONLY (1ULL << 59)

static bool hints_fit(uint32_t version, const struct fi_info *h)
{
    if (!h)
        return true;
    const bool dg = wants_dgram(h);
    const uint64_t offered = dg ? FIV_DGRAM_CAPS : FIV_CAPS;
    const uint64_t order = dg ? FI_ORDER_SAS : FIV_MSG_ORDER;
    if (h->caps & ~offered)
        return refuse("h->caps & ~offered");
    if (h->addr_format != FI_FORMAT_UNSPEC)
        return refuse("h->addr_format != FI_FORMAT_UNSPEC");
    if (h->ep_attr) {
        if (h->ep_attr->type != FI_EP_UNSPEC && h->ep_attr->type != FI_EP_RDM &&
            !dg)
            return refuse("h->ep_attr->type: neither RDM nor DGRAM");
        if (h->ep_attr->max_msg_size > (dg ? FIV_DGRAM_MAX_MSG : FIV_MAX_MSG))
            return refuse("h->ep_attr->max_msg_size > our max_msg_size");
        if (h->ep_attr->tx_ctx_cnt > 1 && h->ep_attr->tx_ctx_cnt != FI_SHARED_CONTEXT)
            return refuse("h->ep_attr->tx_ctx_cnt > 1 && h->ep_attr->tx_ctx_cnt != FI_SHARED_CONTEXT");
        if (h->ep_attr->rx_ctx_cnt > 1 && h->ep_attr->rx_ctx_cnt != FI_SHARED_CONTEXT)
            return refuse("h->ep_attr->rx_ctx_cnt > 1 && h->ep_attr->rx_ctx_cnt != FI_SHARED_CONTEXT");
        if (h->ep_attr->auth_key_size)
            return refuse("h->ep_attr->auth_key_size");
    }
    if (h->fabric_attr) {
        if (h->fabric_attr->prov_name &&
            !strstr(h->fabric_attr->prov_name, FIV_PROV_NAME))
            return refuse("h->fabric_attr->prov_name && !strstr(h->fabric_attr->prov_name, FIV_PROV_NAME)");
        if (h->fabric_attr->name &&
            strcmp(h->fabric_attr->name, FIV_FABRIC_NAME))
            return refuse("h->fabric_attr->name && strcmp(h->fabric_attr->name, FIV_FABRIC_NAME)");
    }
    if (h->domain_attr) {
        const struct fi_domain_attr *d = h->domain_attr;
        if (d->name && strcmp(d->name, FIV_DOMAIN_NAME))
            return refuse("d->name && strcmp(d->name, FIV_DOMAIN_NAME)");
        if (d->cq_data_size > FIV_CQ_DATA_SIZE)
            return refuse("d->cq_data_size > FIV_CQ_DATA_SIZE");
        if (d->mr_key_size > 8)
            return refuse("d->mr_key_size > 8");
        if (d->auth_key_size)
            return refuse("d->auth_key_size");
        if (d->caps & ~(FI_LOCAL_COMM | FI_REMOTE_COMM))
            return refuse("d->caps & ~(FI_LOCAL_COMM | FI_REMOTE_COMM)");
        /* every mode bit the caller offers is one we may clear (fi_mr(3)):
           we need none of them (answer_mr_mode) */
    }
    if (h->tx_attr) {
        if (h->tx_attr->caps & ~offered)
            return refuse("h->tx_attr->caps & ~offered");
        if (h->tx_attr->inject_size > FIV_INJECT)
            return refuse("h->tx_attr->inject_size > FIV_INJECT");
        if (h->tx_attr->iov_limit > FIV_IOV_LIMIT)
            return refuse("h->tx_attr->iov_limit > FIV_IOV_LIMIT");
        if (h->tx_attr->rma_iov_limit > (dg ? 0 : FIV_RMA_IOV_LIMIT))
            return refuse("h->tx_attr->rma_iov_limit > our rma_iov_limit");
        if (h->tx_attr->msg_order & ~order)
            return refuse("h->tx_attr->msg_order & ~order");
    }
    if (h->rx_attr) {
        if (h->rx_attr->caps & ~offered)
            return refuse("h->rx_attr->caps & ~offered");
        if (h->rx_attr->iov_limit > FIV_IOV_LIMIT)
            return refuse("h->rx_attr->iov_limit > FIV_IOV_LIMIT");
        if (h->rx_attr->msg_order & ~order)
            return refuse("h->rx_attr->msg_order & ~order");
        if (h->rx_attr->total_buffered_recv > 0 &&
            FI_VERSION_LT(version, FI_VERSION(1, 5)))
            return refuse("h->rx_attr->total_buffered_recv > 0 && FI_VERSION_LT(version, FI_VERSION(1, 5))");
    }
    return true;
}

/* The capabilities asked for, with what they imply spelled out (fi_getinfo(3):
   a primary capability without any of its modifiers means all of them),
   so that an endpoint serves what it was promised: FI_RMA alone is a
   target too, and its FI_REMOTE_WRITE counter counts. */
static uint64_t implied_caps(uint64_t caps)
{
    if (caps & (FI_MSG | FI_TAGGED) && !(caps & (FI_SEND | FI_RECV)))
        caps |= FI_SEND | FI_RECV;
    const uint64_t rma_mods = FI_READ | FI_WRITE | FI_REMOTE_READ |
                              FI_REMOTE_WRITE;
    if (caps & (FI_RMA | FI_ATOMIC) && !(caps & rma_mods))
        caps |= rma_mods;
    return caps;
}

/* Names as getinfo hands them out (struct fiv_addr, slot -1): what a
   caller's node/service resolve to (the core provider's socket address,
   fiv_ep.c reaches such a name through the core), or only the format,
   filled in by the endpoint (fi_getname) when none is given. */
static void *name_for(const struct sockaddr *sa, size_t salen)
{
    struct fiv_addr *a = zalloc(sizeof *a);
    if (!a)
        return NULL;
    a->magic = FIV_ADDR_MAGIC;
    a->version = FIV_ADDR_VERSION;
    a->slot = -1;
    if (sa && salen <= FIV_CORE_ADDR_MAX) {
        memcpy(a->core, sa, salen);
        a->core_len = (uint8_t)salen;
    }
    return a;
}

static void *copy_name(const void *addr, size_t len)
{
    if (!addr || len != FIV_ADDR_LEN)
        return NULL;
    void *a = zalloc(FIV_ADDR_LEN);
    if (a)
        memcpy(a, addr, FIV_ADDR_LEN);
    return a;
}

/* node/service as a socket address, as the core provider names its peers:
   0, or -FI_ENODATA for a name that does not resolve. */
static int resolve(const char *node, const char *service, uint64_t flags,
                   struct sockaddr_storage *out, size_t *outlen)
{
    struct addrinfo ai = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    if (flags & FI_NUMERICHOST)
        ai.ai_flags |= AI_NUMERICHOST;
    if ((flags & FI_SOURCE) && !node)
        ai.ai_flags |= AI_PASSIVE;
    if (getaddrinfo(node, service, &ai, &res) != 0 || !res)
        return -FI_ENODATA;
    int rc = -FI_ENODATA;
    for (struct addrinfo *r = res; r; r = r->ai_next)
        if (r->ai_addrlen <= FIV_CORE_ADDR_MAX &&
            r->ai_addrlen <= sizeof *out) {
            memcpy(out, r->ai_addr, r->ai_addrlen);
            *outlen = r->ai_addrlen;
            rc = 0;
            break;
        }
    freeaddrinfo(res);
    return rc;
}

/* src_addr and dest_addr of the answer (fi_getinfo(3)): node/service
   name the destination, or with FI_SOURCE the source; a source is always
   given (the hints', else the bare format). */
static int fill_addrs(struct fi_info *fi, const char *node,
                      const char *service, uint64_t flags,
                      const struct fi_info *h)
{
    struct sockaddr_storage ss;
    size_t sslen = 0;
    if (node || service) {
        int rc = resolve(node, service, flags, &ss, &sslen);
        if (rc)
            return rc;
    }
    const struct sockaddr *sa = (const struct sockaddr *)&ss;
    if ((node || service) && (flags & FI_SOURCE))
        fi->src_addr = name_for(sa, sslen);
    else if (h && h->src_addr)
        fi->src_addr = copy_name(h->src_addr, h->src_addrlen);
    if (!fi->src_addr)
        fi->src_addr = name_for(NULL, 0);
    if ((node || service) && !(flags & FI_SOURCE))
        fi->dest_addr = name_for(sa, sslen);
    else if (h && h->dest_addr)
        fi->dest_addr = copy_name(h->dest_addr, h->dest_addrlen);
    if (!fi->src_addr || (node && !(flags & FI_SOURCE) && !fi->dest_addr))
        return -FI_ENOMEM;
    fi->src_addrlen = FIV_ADDR_LEN;
    fi->dest_addrlen = fi->dest_addr ? FIV_ADDR_LEN : 0;
    return 0;
}

static struct fi_info *describe(uint32_t version, const struct fi_info *h)
{
    struct fi_info *fi = alloc_info();
    if (!fi)
        return NULL;
    const bool dg = wants_dgram(h);
    uint64_t caps = implied_caps(h && h->caps ? h->caps
                                              : dg ? FIV_DGRAM_CAPS : FIV_CAPS);
    fi->caps = caps;
    fi->mode = 0; /* we need nothing of the caller's contexts or buffers */
    fi->addr_format = FI_FORMAT_UNSPEC;

    /* each side carries only what applies to it */
    fi->tx_attr->caps = caps & FIV_TX_CAPS;
    fi->tx_attr->mode = 0;
    fi->tx_attr->op_flags = h && h->tx_attr ? h->tx_attr->op_flags & FIV_TX_OP_FLAGS : 0;
    fi->tx_attr->msg_order = dg ? FI_ORDER_SAS : FIV_MSG_ORDER;
    fi->tx_attr->comp_order = 0;
    fi->tx_attr->inject_size = FIV_INJECT;
    fi->tx_attr->size = 1024;
    fi->tx_attr->iov_limit = FIV_IOV_LIMIT;
    fi->tx_attr->rma_iov_limit = dg ? 0 : FIV_RMA_IOV_LIMIT;

    fi->rx_attr->caps = caps & FIV_RX_CAPS;
    fi->rx_attr->mode = 0;
    fi->rx_attr->op_flags = h && h->rx_attr ? h->rx_attr->op_flags & FIV_RX_OP_FLAGS : 0;
    fi->rx_attr->msg_order = dg ? FI_ORDER_SAS : FIV_MSG_ORDER;
    fi->rx_attr->comp_order = 0;
    fi->rx_attr->total_buffered_recv = 0;
    fi->rx_attr->size = 1024;
    fi->rx_attr->iov_limit = FIV_IOV_LIMIT;

    const size_t rma_order = dg ? 0 : FIV_MAX_MSG;
    fi->ep_attr->type = dg ? FI_EP_DGRAM : FI_EP_RDM;
    fi->ep_attr->protocol = FI_PROTO_SHM;
    fi->ep_attr->protocol_version = 1;
    fi->ep_attr->max_msg_size = dg ? FIV_DGRAM_MAX_MSG : FIV_MAX_MSG;
    fi->ep_attr->msg_prefix_size = 0;
    fi->ep_attr->max_order_raw_size = rma_order;
    fi->ep_attr->max_order_war_size = rma_order;
    fi->ep_attr->max_order_waw_size = rma_order;
    /* 64 tag bits */
    fi->ep_attr->mem_tag_format = dg ? 0 : 0xaaaaaaaaaaaaaaaaull;
    fi->ep_attr->tx_ctx_cnt = 1;
    fi->ep_attr->rx_ctx_cnt = 1;

    struct fi_domain_attr *d = fi->domain_attr;
    const struct fi_domain_attr *hd = h ? h->domain_attr : NULL;
    d->name = strdup(FIV_DOMAIN_NAME);
    d->threading = hd && hd->threading ? hd->threading : FI_THREAD_SAFE;
    d->control_progress = FI_PROGRESS_MANUAL;
    /* auto progress when asked for (a thread per domain); manual else */
    d->data_progress = hd && hd->data_progress == FI_PROGRESS_AUTO
                           ? FI_PROGRESS_AUTO : FI_PROGRESS_MANUAL;
    if (hd && hd->control_progress == FI_PROGRESS_AUTO)
        d->control_progress = FI_PROGRESS_AUTO;
    d->resource_mgmt = hd && hd->resource_mgmt ? hd->resource_mgmt : FI_RM_ENABLED;
    d->av_type = hd && hd->av_type ? hd->av_type : FI_AV_TABLE;
    d->mr_mode = answer_mr_mode(version, h);
    d->mr_key_size = 8;
    d->cq_data_size = FIV_CQ_DATA_SIZE;
    d->cq_cnt = 1024;
    d->ep_cnt = 128;
    d->tx_ctx_cnt = 128;
    d->rx_ctx_cnt = 128;
    d->max_ep_tx_ctx = 1;
    d->max_ep_rx_ctx = 1;
    d->max_ep_stx_ctx = 0;
    d->max_ep_srx_ctx = 0;
    d->cntr_cnt = 1024;
    d->mr_iov_limit = 1;
    d->caps = FI_LOCAL_COMM | FI_REMOTE_COMM;
    d->mode = 0;
    d->max_err_data = 0;
    d->mr_cnt = 1 << 16;

    fi->fabric_attr->name = strdup(FIV_FABRIC_NAME);
    fi->fabric_attr->prov_version = FIV_PROV_VERSION;
    fi->fabric_attr->api_version = version;
    if (!d->name || !fi->fabric_attr->name) {
        fi_freeinfo(fi);
        return NULL;
    }
    return fi;
}

int fiv_getinfo(uint32_t version, const char *node, const char *service,
                uint64_t flags, const struct fi_info *hints,
                struct fi_info **info)
{
    *info = NULL;
    FIV_INFO("getinfo %u.%u caps %#llx mode %#llx mr_mode %#x\n",
             FI_MAJOR(version), FI_MINOR(version),
             hints ? (unsigned long long)hints->caps : 0ull,
             hints ? (unsigned long long)hints->mode : 0ull,
             hints && hints->domain_attr ? hints->domain_attr->mr_mode : -1);
    /* Intel MPI's core probes with version 0 and no hints: it means "any",
       answered in the core's own version */
    if (version == 0)
        version = fiv_prov.fi_version;
    if (FI_VERSION_LT(version, FI_VERSION(1, 5)))
        return -FI_ENODATA;
    if (!hints_fit(version, hints))
        return -FI_ENODATA;
    if (wants_dgram(hints) && (flags & FIV_CORE_PROV_ONLY)) {
        FIV_INFO("no datagram endpoint as a utility provider's base\n");
        return -FI_ENODATA;
    }
    struct fi_info *fi = describe(version, hints);
    if (!fi)
        return -FI_ENOMEM;
    int rc = fill_addrs(fi, node, service, flags, hints);
    if (rc) {
        FIV_INFO("node %s service %s: %s\n", node ? node : "-",
                 service ? service : "-", fi_strerror(-rc));
        fi_freeinfo(fi);
        return rc;
    }
    *info = fi;
    return 0;
}
