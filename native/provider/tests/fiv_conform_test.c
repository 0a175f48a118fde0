/*
 * libfabric's contract beyond what our three MPIs use (docs/provider.md,
 * "Conformance"), in real processes that open the provider through
 * libfabric: fi_getinfo (mode bits offered and cleared, node/service and
 * the addresses returned, capabilities implied and split between the
 * transmit and receive sides, domain capabilities we lack), the
 * connection calls of an RDM endpoint, fi_cq_signal, the domain's atomic
 * counts, atomics with no operand or with counts that disagree, closing
 * a domain with a registration open, a send with FI_INJECT in its flags,
 * a remote-write counter of an endpoint that asked for FI_RMA alone,
 * overlapping registrations each with a counter bound (fabtests'
 * fi_multi_mr), registrations rebound between counters by several
 * threads, writes with CQ data past the target's CQ size (alone and
 * beside a flooding co-tenant), a name inserted twice, and the last
 * message of a sender that left before it was inserted, triggered
 * operations (a write and, through an alias, a tagged send: not before
 * their counter's threshold, at it; a counter with one waiting does not
 * close; fi_cancel and closing the endpoint end one waiting), connected
 * endpoints and other capabilities we lack not answered, and datagram
 * endpoints: what they exchange and what they refuse, at the call and
 * from a peer's RDM endpoint, also during a drain.
 */
#include <inttypes.h>
#include <pthread.h>

#include <rdma/fi_trigger.h>

#include "fiv_test.h"

#include "ivshm_admin.h"

static const uint32_t version = FI_VERSION(1, 17);

static struct fi_info *base_hints(void)
{
    struct fi_info *h = fi_allocinfo();
    REQ(h);
    h->ep_attr->type = FI_EP_RDM;
    h->fabric_attr->prov_name = strdup("ivshm");
    return h;
}

/* ---- fi_getinfo, in one process ---- */

static void check_getinfo(void)
{
    struct fi_info *h = base_hints(), *fi = NULL;
    /* every mode bit offered, none needed: cleared, not refused */
    h->caps = FI_TAGGED | FI_MSG | FI_RMA;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_RAW | FI_MR_VIRT_ADDR |
                              FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                              FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT |
                              FI_MR_ENDPOINT | FI_MR_HMEM;
    h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_MSG_PREFIX | FI_RX_CQ_DATA;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(!(fi->domain_attr->mr_mode & (FI_MR_LOCAL | FI_MR_RAW |
                                      FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT |
                                      FI_MR_ENDPOINT | FI_MR_HMEM)));
    REQ(fi->mode == 0);
    /* implied modifiers spelled out, each side only its own */
    const uint64_t tx = FI_SEND | FI_READ | FI_WRITE;
    const uint64_t rx = FI_RECV | FI_REMOTE_READ | FI_REMOTE_WRITE;
    REQ((fi->caps & (tx | rx)) == (tx | rx));
    REQ((fi->tx_attr->caps & tx) == tx && !(fi->tx_attr->caps & rx));
    REQ((fi->rx_attr->caps & rx) == rx && !(fi->rx_attr->caps & tx));
    REQ(!(fi->tx_attr->caps & (FI_LOCAL_COMM | FI_REMOTE_COMM | FI_SOURCE |
                               FI_DIRECTED_RECV | FI_MULTI_RECV)));
    /* a source address always, no destination without one asked for */
    REQ(fi->src_addr && fi->src_addrlen == 64);
    REQ(!fi->dest_addr && fi->dest_addrlen == 0);
    fi_freeinfo(fi);
    fi = NULL;

    /* the old modes answered in their own words */
    h->domain_attr->mr_mode = FI_MR_BASIC;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(fi->domain_attr->mr_mode == FI_MR_BASIC);
    fi_freeinfo(fi);
    fi = NULL;
    h->domain_attr->mr_mode = FI_MR_SCALABLE;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(fi->domain_attr->mr_mode == FI_MR_SCALABLE);
    fi_freeinfo(fi);
    fi = NULL;
    h->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                              FI_MR_PROV_KEY;

    /* a domain capability we lack: no answer */
    h->domain_attr->caps = FI_SHARED_AV;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    h->domain_attr->caps = 0;

    /* node/service: the destination, or with FI_SOURCE the source */
    REQ_RC(fi_getinfo(version, "127.0.0.1", "9228", 0, h, &fi), 0);
    REQ(fi->dest_addr && fi->dest_addrlen == 64);
    REQ(fi->src_addr && fi->src_addrlen == 64);
    fi_freeinfo(fi);
    fi = NULL;
    REQ_RC(fi_getinfo(version, "127.0.0.1", "9228", FI_SOURCE, h, &fi), 0);
    REQ(fi->src_addr && fi->src_addrlen == 64 && !fi->dest_addr);
    fi_freeinfo(fi);
    fi = NULL;
    REQ_RC(fi_getinfo(version, NULL, "9228", FI_SOURCE, h, &fi), 0);
    REQ(fi->src_addr && fi->src_addrlen == 64);
    fi_freeinfo(fi);
    fi = NULL;
    /* a node that does not resolve: no answer, rather than an answer
       without the address asked for */
    REQ_RC(fi_getinfo(version, "g00n13s", NULL, FI_NUMERICHOST, h, &fi),
           -FI_ENODATA);
    REQ(!fi);

    /* triggered operations: answered, on the transmit side */
    h->caps = FI_MSG | FI_RMA | FI_TRIGGER;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(fi->caps & FI_TRIGGER && fi->tx_attr->caps & FI_TRIGGER);
    REQ(!(fi->rx_attr->caps & FI_TRIGGER));
    fi_freeinfo(fi);
    fi = NULL;
    /* what we do not offer is not answered: collectives, multicast,
       device memory, and a connected (FI_EP_MSG) endpoint
       (docs/provider.md, "Conformance") */
    const uint64_t lacked[] = {FI_COLLECTIVE, FI_MULTICAST, FI_HMEM,
                               FI_NAMED_RX_CTX};
    for (size_t i = 0; i < sizeof lacked / sizeof lacked[0]; i++) {
        h->caps = FI_MSG | FI_RMA | lacked[i];
        REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    }
    h->caps = FI_MSG;
    h->ep_attr->type = FI_EP_MSG;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    REQ_RC(fi_getinfo(version, "127.0.0.1", "9228", 0, h, &fi), -FI_ENODATA);
    REQ(!fi);

    /* a datagram endpoint, asked for by name: messages alone, bounded */
    h->ep_attr->type = FI_EP_DGRAM;
    h->caps = 0;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(fi->ep_attr->type == FI_EP_DGRAM && !fi->next);
    REQ(fi->ep_attr->max_msg_size == 64 << 10);
    REQ((fi->caps & (FI_MSG | FI_SEND | FI_RECV)) == (FI_MSG | FI_SEND | FI_RECV));
    REQ(!(fi->caps & (FI_TAGGED | FI_RMA | FI_ATOMIC | FI_REMOTE_WRITE |
                      FI_REMOTE_READ | FI_RMA_EVENT)));
    REQ(fi->tx_attr->rma_iov_limit == 0 && fi->ep_attr->mem_tag_format == 0);
    fi_freeinfo(fi);
    fi = NULL;
    h->caps = FI_MSG | FI_TAGGED;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    h->caps = FI_MSG | FI_RMA;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    h->caps = FI_MSG | FI_TRIGGER;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    h->caps = FI_MSG;
    h->ep_attr->max_msg_size = (64 << 10) + 1;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), -FI_ENODATA);
    h->ep_attr->max_msg_size = 0;
    /* no type named: the RDM endpoint alone */
    h->ep_attr->type = FI_EP_UNSPEC;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
    REQ(fi->ep_attr->type == FI_EP_RDM && !fi->next);
    /* ours, not a utility provider's layered on our datagrams */
    REQ(!strcmp(fi->fabric_attr->prov_name, "ivshm"));
    fi_freeinfo(fi);
    fi_freeinfo(h);
}

/* ---- an RDM endpoint, in one process ---- */

static void open_one(struct rank *r)
{
    t_open(r, version);
}

static void *signal_later(void *arg)
{
    usleep(200 * 1000);
    REQ_RC(fi_cq_signal((struct fid_cq *)arg), 0);
    return NULL;
}

static void check_endpoint(struct rank *r)
{
    /* the connection calls: no connection on an RDM endpoint, and no
       NULL entry for the core to call through */
    char name[64];
    size_t len = sizeof name;
    REQ_RC(fi_shutdown(r->ep, 0), -FI_ENOSYS);
    REQ_RC(fi_connect(r->ep, name, NULL, 0), -FI_ENOSYS);
    REQ_RC(fi_accept(r->ep, NULL, 0), -FI_ENOSYS);
    REQ_RC(fi_getpeer(r->ep, name, &len), -FI_ENOSYS);
    struct fid_mc *mc = NULL;
    REQ_RC(fi_join(r->ep, name, 0, &mc, NULL), -FI_ENOSYS);
    REQ_RC(r->ep->cm->listen(NULL), -FI_ENOSYS);
    REQ_RC(r->ep->cm->reject(NULL, NULL, NULL, 0), -FI_ENOSYS);
    /* an info without a dest_addr inserted: refused, not dereferenced */
    fi_addr_t a = 0;
    REQ_RC(fi_av_insert(r->av, NULL, 1, &a, 0, NULL), -FI_EINVAL);

    /* fi_cq_signal before the wait: it returns at once */
    struct fi_cq_tagged_entry e;
    REQ_RC(fi_cq_signal(r->cq), 0);
    uint64_t t0 = t_now_ms();
    REQ_RC(fi_cq_sread(r->cq, &e, 1, NULL, 5000), -FI_EAGAIN);
    REQ(t_now_ms() - t0 < 1000);
    /* and while a thread waits */
    pthread_t th;
    REQ(pthread_create(&th, NULL, signal_later, r->cq) == 0);
    t0 = t_now_ms();
    REQ_RC(fi_cq_sread(r->cq, &e, 1, NULL, 5000), -FI_EAGAIN);
    REQ(t_now_ms() - t0 < 2500);
    pthread_join(th, NULL);
    /* consumed: the next wait runs to its timeout */
    t0 = t_now_ms();
    REQ_RC(fi_cq_sread(r->cq, &e, 1, NULL, 300), -FI_EAGAIN);
    REQ(t_now_ms() - t0 >= 250);
}

static void one_endpoint(struct rank *r)
{
    open_one(r);
    check_endpoint(r);
    t_close(r);
}

/* fi_query_atomic of the domain answers what its endpoints can do: with
   no endpoint open, what the smallest slots (128 B) allow (48 operand
   bytes, 24 with a compare operand); with one attached to a region, that
   endpoint's fi_*atomicvalid counts (docs/provider.md, "Limits"). */
static void domain_atomic_counts(struct rank *r)
{
    static const struct { enum fi_datatype dt; enum fi_op op; } q[] = {
        {FI_UINT64, FI_SUM}, {FI_INT8, FI_BOR}, {FI_DOUBLE, FI_MIN},
        {FI_UINT32, FI_CSWAP}, {FI_UINT64, FI_MSWAP},
    };
    struct fi_atomic_attr a;
    {
        struct fi_info *h = base_hints(), *fi = NULL;
        h->caps = FI_ATOMIC;
        REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &fi), 0);
        struct fid_fabric *fab;
        struct fid_domain *dom;
        REQ_RC(fi_fabric(fi->fabric_attr, &fab, NULL), 0);
        REQ_RC(fi_domain(fab, fi, &dom, NULL), 0);
        REQ_RC(fi_query_atomic(dom, FI_UINT64, FI_SUM, &a, 0), 0);
        REQ(a.size == 8 && a.count == 48 / 8);
        REQ_RC(fi_query_atomic(dom, FI_UINT64, FI_CSWAP, &a,
                               FI_COMPARE_ATOMIC), 0);
        REQ(a.size == 8 && a.count == 24 / 8);
        REQ_RC(fi_close(&dom->fid), 0);
        REQ_RC(fi_close(&fab->fid), 0);
        fi_freeinfo(fi);
        fi_freeinfo(h);
    }
    t_open(r, version);
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        bool cmp = q[i].op >= FI_CSWAP;
        size_t count = 0;
        REQ_RC(cmp ? fi_compare_atomicvalid(r->ep, q[i].dt, q[i].op, &count)
                   : fi_atomicvalid(r->ep, q[i].dt, q[i].op, &count), 0);
        REQ_RC(fi_query_atomic(r->dom, q[i].dt, q[i].op, &a,
                               cmp ? FI_COMPARE_ATOMIC : 0), 0);
        if (a.count != count)
            fprintf(stderr, "query %zu: the domain says %zu, the endpoint "
                    "%zu\n", i, a.count, count);
        REQ(a.count == count && count > 0);
        if (!cmp) {
            size_t fcount = 0;
            REQ_RC(fi_fetch_atomicvalid(r->ep, q[i].dt, q[i].op, &fcount), 0);
            REQ(fcount == count);
        }
    }
    t_close(r);
}

/* Atomics without an operand, with none of their elements, or with
   counts that disagree: refused when posted, nothing read from the
   missing operand. */
static void empty_atomics(struct rank *r)
{
    t_open(r, version);
    char name[NAMELEN];
    size_t len = sizeof name;
    REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
    fi_addr_t self = 0;
    REQ_RC(fi_av_insert(r->av, name, 1, &self, 0, NULL), 1);
    uint64_t v[2] = {1, 1}, res[2] = {0, 0}, cmp[2] = {0, 0};
    struct fi_ioc none = {v, 0}, two = {v, 2};
    struct fi_ioc r1 = {res, 1}, c1 = {cmp, 1};
    struct fi_rma_ioc at = {0, 1, 1};
    struct fi_msg_atomic m = {.msg_iov = NULL, .iov_count = 0, .addr = self,
                              .rma_iov = &at, .rma_iov_count = 1,
                              .datatype = FI_UINT64, .op = FI_SUM};
    char ctx;
    REQ_RC(fi_fetch_atomicv(r->ep, NULL, NULL, 0, &r1, NULL, 1, self, 0, 1,
                            FI_UINT64, FI_SUM, &ctx), -FI_EINVAL);
    REQ_RC(fi_fetch_atomicmsg(r->ep, &m, &r1, NULL, 1, 0), -FI_EINVAL);
    REQ_RC(fi_fetch_atomicv(r->ep, &two, NULL, 1, &r1, NULL, 1, self, 0, 1,
                            FI_UINT64, FI_SUM, &ctx), -FI_EINVAL);
    REQ_RC(fi_atomic(r->ep, v, 0, NULL, self, 0, 1, FI_UINT64, FI_SUM, &ctx),
           -FI_EINVAL);
    REQ_RC(fi_atomicv(r->ep, &none, NULL, 1, self, 0, 1, FI_UINT64, FI_SUM,
                      &ctx), -FI_EINVAL);
    REQ_RC(fi_fetch_atomic(r->ep, v, 0, NULL, res, NULL, self, 0, 1,
                           FI_UINT64, FI_SUM, &ctx), -FI_EINVAL);
    REQ_RC(fi_compare_atomic(r->ep, v, 0, NULL, cmp, NULL, res, NULL, self, 0,
                             1, FI_UINT64, FI_CSWAP, &ctx), -FI_EINVAL);
    REQ_RC(fi_compare_atomicv(r->ep, &two, NULL, 1, &c1, NULL, 1, &r1, NULL,
                              1, self, 0, 1, FI_UINT64, FI_CSWAP, &ctx),
           -FI_EINVAL);
    /* nothing went out: nothing completes */
    struct fi_cq_tagged_entry e;
    REQ_RC(fi_cq_read(r->cq, &e, 1), -FI_EAGAIN);
    t_close(r);
}

/* Sums and products that leave their type wrap around in two's
   complement, as the hardware's atomics do (fabtests' fi_rdm_atomic sends
   random operands): the target computes them without undefined
   behaviour (UBSan in the sanitized build), whatever a peer sends. */
static void atomic_wraparound(struct rank *r)
{
    t_open(r, version);
    char name[NAMELEN];
    size_t len = sizeof name;
    REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
    fi_addr_t self = 0;
    REQ_RC(fi_av_insert(r->av, name, 1, &self, 0, NULL), 1);
    static uint64_t mem[8];
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, mem, sizeof mem, FI_REMOTE_READ | FI_REMOTE_WRITE,
                     0, 0, 0, &mr, NULL), 0);
    uint64_t base = (uint64_t)(uintptr_t)mem, key = fi_mr_key(mr);
    struct {
        enum fi_datatype dt;
        enum fi_op op;
        uint64_t before, operand, after;    /* the type's bytes, low first */
    } c[] = {
        {FI_INT32, FI_SUM, INT32_MAX, 1, (uint32_t)INT32_MIN},
        {FI_INT32, FI_PROD, 0x10000, 0x10000, 0},
        {FI_INT32, FI_PROD, 0x7fffffff, 0xfffffffe /* -2 */, 2},
        {FI_INT64, FI_SUM, INT64_MAX, 1, (uint64_t)INT64_MIN},
        {FI_INT64, FI_PROD, (uint64_t)INT64_MIN, UINT64_MAX /* -1 */,
         (uint64_t)INT64_MIN},
        {FI_UINT16, FI_PROD, 0xffff, 0xffff, 1},
        {FI_INT16, FI_PROD, 300, 300, 90000 - 65536},
        {FI_INT8, FI_SUM, 127, 1, 0x80},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        size_t sz = c[i].dt == FI_INT64 ? 8 : c[i].dt == FI_INT32 ? 4
                  : c[i].dt == FI_INT8 ? 1 : 2;
        uint64_t opnd = c[i].operand, want = c[i].after;
        memset(mem, 0, sizeof mem);
        memcpy(mem, &c[i].before, sz);
        struct fi_cq_tagged_entry e;
        REQ_RC(fi_atomic(r->ep, &opnd, 1, NULL, self, base, key, c[i].dt,
                         c[i].op, &opnd), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        if (memcmp(mem, &want, sz) != 0 || mem[1] != 0)
            fprintf(stderr, "case %zu: %#llx, not %#llx\n", i,
                    (unsigned long long)mem[0], (unsigned long long)want);
        REQ(memcmp(mem, &want, sz) == 0 && mem[1] == 0);
    }
    REQ_RC(fi_close(&mr->fid), 0);
    t_close(r);
}

/* A domain with a registration or a counter still open does not close
   (-FI_EBUSY, fi_domain(3)): the application's fids stay valid until it
   closes them, and then the domain closes. A registration bound to a second counter
   holds only that one. */
static void domain_children(struct rank *r)
{
    t_open(r, version);
    static uint8_t buf[4096];
    struct fid_mr *mr = NULL;
    REQ_RC(fi_mr_reg(r->dom, buf, sizeof buf, FI_REMOTE_WRITE, 0, 0, 0, &mr,
                     NULL), 0);
    REQ_RC(fi_mr_bind(mr, &r->rcntr->fid, FI_REMOTE_WRITE), 0);
    REQ_RC(fi_mr_bind(mr, &r->wcntr->fid, FI_REMOTE_WRITE), 0);
    REQ_RC(fi_close(&r->ep->fid), 0);
    REQ_RC(fi_close(&r->av->fid), 0);
    REQ_RC(fi_close(&r->cq->fid), 0);
    REQ_RC(fi_close(&r->rcntr->fid), 0);
    REQ_RC(fi_close(&r->wcntr->fid), -FI_EBUSY);
    REQ_RC(fi_close(&r->dom->fid), -FI_EBUSY);
    REQ(fi_mr_key(mr) != FI_KEY_NOTAVAIL && fi_mr_desc(mr) != NULL);
    REQ_RC(fi_close(&mr->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), -FI_EBUSY); /* the counter is open */
    REQ_RC(fi_close(&r->wcntr->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), 0);
    REQ_RC(fi_close(&r->fab->fid), 0);
    fi_freeinfo(r->info);
}

/* A CQ, counter or AV of another domain is not bound to an endpoint
   (-FI_EINVAL): the endpoint fills its CQ and counters under its own
   domain's lock, which would not be theirs. */
static void foreign_children(struct rank *r)
{
    t_open(r, version);
    struct fid_domain *d2 = NULL;
    struct fid_cq *cq2 = NULL;
    struct fid_cntr *c2 = NULL;
    struct fid_av *av2 = NULL;
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    REQ_RC(fi_domain(r->fab, r->info, &d2, NULL), 0);
    REQ_RC(fi_cq_open(d2, &cqa, &cq2, NULL), 0);
    REQ_RC(fi_cntr_open(d2, &ca, &c2, NULL), 0);
    REQ_RC(fi_av_open(d2, &ava, &av2, NULL), 0);
    REQ_RC(fi_ep_bind(r->ep, &cq2->fid, FI_TRANSMIT | FI_RECV), -FI_EINVAL);
    REQ_RC(fi_ep_bind(r->ep, &c2->fid, FI_SEND), -FI_EINVAL);
    REQ_RC(fi_ep_bind(r->ep, &av2->fid, 0), -FI_EINVAL);
    /* nor to a registration: the target's progress would count it, and
       start what waits on it, under the other domain's serialization */
    static uint64_t word;
    struct fid_mr *mr = NULL;
    REQ_RC(fi_mr_reg(r->dom, &word, sizeof word, FI_REMOTE_WRITE, 0, 0, 0,
                     &mr, NULL), 0);
    REQ_RC(fi_mr_bind(mr, &c2->fid, FI_REMOTE_WRITE), -FI_EINVAL);
    REQ_RC(fi_close(&mr->fid), 0);
    /* nothing of the other domain is held: all of it closes */
    REQ_RC(fi_close(&av2->fid), 0);
    REQ_RC(fi_close(&c2->fid), 0);
    REQ_RC(fi_close(&cq2->fid), 0);
    REQ_RC(fi_close(&d2->fid), 0);
    t_close(r);
}

/* ---- two ranks ---- */

/* A send with FI_INJECT among its flags completes (only fi_inject and
   its kind write no completion); the buffer is free at once. */
static void inject_flag(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    if (r->me == 1) {
        uint64_t v = 0xabcdef;
        struct iovec iov = {&v, sizeof v};
        struct fi_msg_tagged m = {.msg_iov = &iov, .iov_count = 1,
                                  .addr = r->addr[0], .tag = 3,
                                  .context = &v};
        REQ_RC(fi_tsendmsg(r->ep, &m, FI_INJECT | FI_COMPLETION), 0);
        v = 0; /* ours again */
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &v && e.flags & FI_SEND);
        struct fi_msg um = {.msg_iov = &iov, .iov_count = 1,
                            .addr = r->addr[0], .context = &iov};
        v = 0x1234;
        REQ_RC(fi_sendmsg(r->ep, &um, FI_INJECT | FI_COMPLETION |
                                       FI_INJECT_COMPLETE), 0);
        v = 0;
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &iov && e.flags & FI_SEND);
        /* fi_tinject: delivered, with no completion of ours */
        v = 77;
        REQ_RC(fi_tinject(r->ep, &v, sizeof v, r->addr[0], 4), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 300), -FI_ETIMEDOUT);
        t_barrier(r);
    } else {
        uint64_t got = 0, got2 = 0, got3 = 0;
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[1], 3, 0, &got), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &got && got == 0xabcdef);
        REQ_RC(fi_recv(r->ep, &got2, 8, NULL, r->addr[1], &got2), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &got2 && got2 == 0x1234);
        REQ_RC(fi_trecv(r->ep, &got3, 8, NULL, r->addr[1], 4, 0, &got3), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &got3 && got3 == 77);
        t_barrier(r);
    }
    t_close(r);
}

/* A receive of no buffer at all (NULL, 0 bytes), as MPI posts for a
   zero count: an empty message lands in it, and an 8-byte one is
   truncated to nothing; neither touches memory (the one-buffer receive
   path copies at a constant size, which must not reach a NULL buffer). */
static void empty_receives(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        uint64_t v = 0x5a5a;
        REQ_RC(fi_tinject(r->ep, NULL, 0, r->addr[0], 5), 0);
        REQ_RC(fi_tinject(r->ep, &v, sizeof v, r->addr[0], 6), 0);
        REQ_RC(fi_tinject(r->ep, &v, 4, r->addr[0], 7), 0);
        t_barrier(r);
    } else {
        REQ_RC(fi_trecv(r->ep, NULL, 0, NULL, r->addr[1], 5, 0, r), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == r && e.len == 0 && e.tag == 5);
        REQ_RC(fi_trecv(r->ep, NULL, 0, NULL, r->addr[1], 6, 0, r), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ETRUNC);
        REQ(err.err == FI_ETRUNC && err.olen == 8 && err.len == 0);
        REQ_RC(fi_trecv(r->ep, NULL, 0, NULL, r->addr[1], 7, 0, r), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ETRUNC);
        REQ(err.err == FI_ETRUNC && err.olen == 4 && err.len == 0);
        t_barrier(r);
    }
    t_close(r);
}

/* Both ranks as write targets: an endpoint that asked for FI_MSG |
   FI_RMA | FI_RMA_EVENT (no modifiers: all implied), a CQ of 64 entries,
   a counter bound for remote writes (`remote`) and `rma_words`
   registered; rank 0's registration broadcast to both (`addr`, `key`). */
static uint64_t rma_words[2];
struct rma_target {
    struct fid_cntr *remote;
    struct fid_mr *mr;
    uint64_t addr, key;
};

static void rma_event_open(struct rank *r, struct rma_target *tg)
{
    struct fi_info *h = base_hints();
    h->caps = FI_MSG | FI_RMA | FI_RMA_EVENT;
    h->mode = FI_CONTEXT;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ENDPOINT |
                              FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                              FI_MR_PROV_KEY | FI_MR_RAW;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &r->info), 0);
    fi_freeinfo(h);
    REQ(r->info->caps & FI_REMOTE_WRITE);
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    REQ_RC(fi_fabric(r->info->fabric_attr, &r->fab, NULL), 0);
    REQ_RC(fi_domain(r->fab, r->info, &r->dom, NULL), 0);
    REQ_RC(fi_endpoint(r->dom, r->info, &r->ep, NULL), 0);
    REQ_RC(fi_cq_open(r->dom, &cqa, &r->cq, NULL), 0);
    REQ_RC(fi_av_open(r->dom, &ava, &r->av, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->rcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->wcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &tg->remote, NULL), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->av->fid, 0), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->rcntr->fid, FI_READ), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->wcntr->fid, FI_WRITE), 0);
    REQ_RC(fi_ep_bind(r->ep, &tg->remote->fid, FI_RECV | FI_REMOTE_WRITE |
                                              FI_REMOTE_READ), 0);
    REQ_RC(fi_enable(r->ep), 0);
    t_exchange(r);
    REQ_RC(fi_mr_reg(r->dom, rma_words, sizeof rma_words,
                     FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &tg->mr,
                     NULL), 0);
    uint64_t at[2] = {(uint64_t)(uintptr_t)rma_words, fi_mr_key(tg->mr)};
    t_bcast(r, 0, at, sizeof at);
    tg->addr = at[0];
    tg->key = at[1];
}

/* Every object closes, the endpoint before the counter bound to it. */
static void rma_event_close(struct rank *r, struct rma_target *tg)
{
    REQ_RC(fi_close(&tg->mr->fid), 0);
    REQ_RC(fi_close(&r->ep->fid), 0);
    REQ_RC(fi_close(&tg->remote->fid), 0);
    r->ep = NULL;
    REQ_RC(fi_close(&r->av->fid), 0);
    REQ_RC(fi_close(&r->cq->fid), 0);
    REQ_RC(fi_close(&r->rcntr->fid), 0);
    REQ_RC(fi_close(&r->wcntr->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), 0);
    REQ_RC(fi_close(&r->fab->fid), 0);
    fi_freeinfo(r->info);
}

/* Such an endpoint is a write target, and its counter bound for remote
   writes counts them; every object closes afterwards. */
static void rma_event_counter(struct rank *r)
{
    struct rma_target tg;
    rma_event_open(r, &tg);
    if (r->me == 1) {
        struct fi_cq_tagged_entry e;
        uint64_t v = 0x77;
        REQ_RC(fi_write(r->ep, &v, 8, NULL, r->addr[0], tg.addr, tg.key,
                        &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &v);
        REQ(fi_cntr_read(r->wcntr) == 1);
        t_barrier(r);
    } else {
        REQ_RC(fi_cntr_wait(tg.remote, 1, 5000), 0);
        REQ(rma_words[0] == 0x77);
        t_barrier(r);
    }
    rma_event_close(r, &tg);
}

/* Two registrations over overlapping memory (one byte apart), each with a
   counter bound for remote writes, written by the peer once each, as
   fabtests' fi_multi_mr does. `virt`: the hints offer FI_MR_VIRT_ADDR and
   FI_MR_PROV_KEY, which the answer keeps: the writes name the virtual
   address and the key we gave, and address 0 (what fi_multi_mr writes
   whatever the answer said) is refused with FI_EACCES. Without them the
   keys are the application's and addresses are offsets from each
   registration's start: address 0 is its first byte. Either way each
   write lands in its own registration and counts on its own counter. */
static void multi_mr(struct rank *r, bool virt)
{
    struct fi_info *h = base_hints();
    h->caps = FI_MSG | FI_RMA | FI_RMA_EVENT;
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ENDPOINT | FI_MR_ALLOCATED |
                              FI_MR_RAW |
                              (virt ? FI_MR_VIRT_ADDR | FI_MR_PROV_KEY : 0);
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &r->info), 0);
    fi_freeinfo(h);
    uint64_t mode = r->info->domain_attr->mr_mode;
    REQ(!!(mode & FI_MR_VIRT_ADDR) == virt && !!(mode & FI_MR_PROV_KEY) == virt);
    REQ(!(mode & (FI_MR_LOCAL | FI_MR_ENDPOINT | FI_MR_RAW)));
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    REQ_RC(fi_fabric(r->info->fabric_attr, &r->fab, NULL), 0);
    REQ_RC(fi_domain(r->fab, r->info, &r->dom, NULL), 0);
    REQ_RC(fi_endpoint(r->dom, r->info, &r->ep, NULL), 0);
    REQ_RC(fi_cq_open(r->dom, &cqa, &r->cq, NULL), 0);
    REQ_RC(fi_av_open(r->dom, &ava, &r->av, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->rcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->wcntr, NULL), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->av->fid, 0), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->rcntr->fid, FI_READ), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->wcntr->fid, FI_WRITE), 0);
    REQ_RC(fi_enable(r->ep), 0);
    t_exchange(r);
    enum { LEN = 4096, NMR = 2 };
    static uint8_t mem[LEN + NMR];
    struct fid_mr *mr[NMR];
    struct fid_cntr *hits[NMR];
    uint64_t at[NMR][2];
    for (int i = 0; i < NMR; i++) {
        REQ_RC(fi_cntr_open(r->dom, &ca, &hits[i], NULL), 0);
        REQ_RC(fi_mr_reg(r->dom, mem + i, LEN, FI_REMOTE_WRITE, 0,
                         (uint64_t)i + 1, 0, &mr[i], NULL), 0);
        REQ_RC(fi_mr_bind(mr[i], &hits[i]->fid, FI_REMOTE_WRITE), 0);
        if (!virt)
            REQ(fi_mr_key(mr[i]) == (uint64_t)i + 1); /* the one asked for */
        at[i][0] = virt ? (uint64_t)(uintptr_t)(mem + i) : 0;
        at[i][1] = fi_mr_key(mr[i]);
    }
    uint64_t peer[NMR][2];
    memcpy(peer, at, sizeof at);
    t_bcast(r, 0, peer, sizeof peer);
    static uint8_t src[LEN];
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        if (virt) { /* fi_multi_mr's address: not one of ours */
            memset(&err, 0, sizeof err);
            REQ_RC(fi_write(r->ep, src, LEN, NULL, r->addr[0], 0, peer[0][1],
                            src), 0);
            REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_EACCES);
        }
        for (int i = 0; i < NMR; i++) {
            memset(src, 0xa0 + i, LEN);
            REQ_RC(fi_write(r->ep, src, LEN, NULL, r->addr[0], peer[i][0],
                            peer[i][1], src), 0);
            REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
            t_barrier(r); /* the next write only after the target looked */
        }
        t_barrier(r);
    } else {
        for (int i = 0; i < NMR; i++) {
            REQ_RC(fi_cntr_wait(hits[i], 1, 5000), 0);
            REQ(fi_cntr_read(hits[1 - i]) == (uint64_t)(1 - i < i ? 1 : 0));
            for (int k = 0; k < LEN; k++)
                REQ(mem[i + k] == 0xa0 + i);
            t_barrier(r);
        }
        REQ(mem[0] == 0xa0);
        t_barrier(r);
    }
    for (int i = 0; i < NMR; i++) {
        REQ_RC(fi_close(&mr[i]->fid), 0);
        REQ_RC(fi_close(&hits[i]->fid), 0);
    }
    t_close(r);
}

static void multi_mr_offsets(struct rank *r) { multi_mr(r, false); }
static void multi_mr_virtual(struct rank *r) { multi_mr(r, true); }

/* Registrations moved between two counters by several threads at once
   (FI_THREAD_SAFE): each thread rebinds its own registration from one
   counter to the other 3000000 times. A counter knows how many
   registrations hold it (it does not close while one does, fi_cntr(3));
   every rebind moves one hold, so once the registrations are closed
   both counters close, and while one still holds a counter it does not
   (without the domain's lock in fi_mr_bind, holds raced and were lost:
   -FI_EBUSY for good, or a close while still bound). */
enum { BIND_THREADS = 4, BIND_ROUNDS = 3000000 };
struct bind_arg {
    struct fid_mr *mr;
    struct fid_cntr *c[2];
};

static void *rebind_loop(void *p)
{
    struct bind_arg *a = p;
    for (int i = 0; i < BIND_ROUNDS; i++)
        if (fi_mr_bind(a->mr, &a->c[i & 1]->fid, FI_REMOTE_WRITE))
            return (void *)1;
    return NULL;
}

static void mr_bind_threads(struct rank *r)
{
    struct fi_info *h = base_hints();
    h->caps = FI_MSG | FI_RMA | FI_RMA_EVENT;
    h->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                              FI_MR_PROV_KEY;
    h->domain_attr->threading = FI_THREAD_SAFE;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &r->info), 0);
    fi_freeinfo(h);
    REQ_RC(fi_fabric(r->info->fabric_attr, &r->fab, NULL), 0);
    REQ_RC(fi_domain(r->fab, r->info, &r->dom, NULL), 0);
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    struct fid_cntr *c[2];
    for (int k = 0; k < 2; k++)
        REQ_RC(fi_cntr_open(r->dom, &ca, &c[k], NULL), 0);
    static uint64_t words[BIND_THREADS];
    struct bind_arg args[BIND_THREADS];
    pthread_t th[BIND_THREADS];
    for (int i = 0; i < BIND_THREADS; i++) {
        args[i] = (struct bind_arg){.c = {c[i & 1], c[1 - (i & 1)]}};
        REQ_RC(fi_mr_reg(r->dom, &words[i], 8, FI_REMOTE_WRITE, 0, 0, 0,
                         &args[i].mr, NULL), 0);
    }
    for (int i = 0; i < BIND_THREADS; i++)
        REQ(pthread_create(&th[i], NULL, rebind_loop, &args[i]) == 0);
    for (int i = 0; i < BIND_THREADS; i++) {
        void *rc = NULL;
        REQ(pthread_join(th[i], &rc) == 0 && rc == NULL);
    }
    /* each registration ends on the counter it started on: both are held */
    for (int k = 0; k < 2; k++)
        REQ_RC(fi_close(&c[k]->fid), -FI_EBUSY);
    for (int i = 0; i < BIND_THREADS; i++)
        REQ_RC(fi_close(&args[i].mr->fid), 0);
    for (int k = 0; k < 2; k++)
        REQ_RC(fi_close(&c[k]->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), 0);
    REQ_RC(fi_close(&r->fab->fid), 0);
    fi_freeinfo(r->info);
}

/* An honest writer sends more writes with CQ data than the target's CQ
   size (64). While the target only waits on a counter, exactly the CQ's
   size of them land and the rest wait in the writer's ring (the counter
   stands still); once the target reads its CQ every one lands, in order,
   never more than the CQ's size held at once, and none fails the writer
   (docs/provider.md, "Caps per peer"). */
enum { CQ64 = 64 };
static void writedata_burst(struct rank *r)
{
    struct rma_target tg;
    rma_event_open(r, &tg);
    enum { BURST = 200 };
    if (r->me == 1) {
        struct fi_cq_tagged_entry e;
        static uint64_t v = 0x77;
        for (int i = 0; i < BURST; i++) {
            ssize_t rc;
            while ((rc = fi_writedata(r->ep, &v, 8, NULL, (uint64_t)i,
                                      r->addr[0], tg.addr, tg.key, &v)) ==
                   -FI_EAGAIN)
                (void)fi_cq_read(r->cq, &e, 1);
            REQ_RC(rc, 0);
        }
        for (uint64_t end = t_now_ms() + 15000;
             fi_cntr_read(r->wcntr) + fi_cntr_readerr(r->wcntr) < BURST &&
             t_now_ms() < end;)
            (void)fi_cq_read(r->cq, &e, 1);
        REQ(fi_cntr_read(r->wcntr) == BURST);
        REQ(fi_cntr_readerr(r->wcntr) == 0);
        t_barrier(r);
    } else {
        REQ_RC(fi_cntr_wait(tg.remote, CQ64, 8000), 0);
        /* the rest wait where they lie while nobody reads the CQ */
        for (uint64_t end = t_now_ms() + 300; t_now_ms() < end;)
            (void)fi_cntr_read(tg.remote);
        uint64_t landed = fi_cntr_read(tg.remote);
        if (landed != CQ64)
            fprintf(stderr, "%" PRIu64 " writes landed with the CQ of %d "
                    "unread\n", landed, CQ64);
        REQ(landed == CQ64);
        size_t got = 0;
        struct fi_cq_tagged_entry e[256];
        for (uint64_t end = t_now_ms() + 15000;
             got < BURST && t_now_ms() < end;) {
            ssize_t n = fi_cq_read(r->cq, e, 256);
            if (n == -FI_EAGAIN)
                continue;
            REQ(n > 0 && n <= CQ64);
            for (ssize_t k = 0; k < n; k++) {
                REQ(e[k].flags & FI_REMOTE_CQ_DATA);
                REQ(e[k].data == got); /* the writer's order */
                got++;
            }
        }
        REQ(got == BURST);
        REQ(fi_cntr_read(tg.remote) == BURST);
        t_barrier(r);
    }
    rma_event_close(r, &tg);
}

/* A co-tenant (rank 1) floods rank 0 with 0-byte writes with CQ data,
   4000 past what a cap shared by all peers held (the CQ's size, at
   least 65536), while rank 0 reads no CQ; then an honest writer (rank 2) sends
   its writes with data, and rank 0 starts reading. The flood waits in
   the co-tenant's own ring: every honest write lands with its entry and
   none fails its writer (before, the flood filled the one cap of all
   peers and the honest writer's path failed). */
static void writedata_flooded(struct rank *r)
{
    struct rma_target tg;
    rma_event_open(r, &tg);
    enum { FLOOD = 65536 + 4000, HONEST = 200 };
    const uint64_t mark = 1ull << 40; /* the honest writer's data */
    struct fi_cq_tagged_entry e[256];
    if (r->me == 1) {
        /* as fast as it can; what finds no room (its queue cap) is tried
           again until the target has held it off for 2 s */
        int sent = 0;
        for (uint64_t stuck = 0; sent < FLOOD;) {
            ssize_t rc = fi_inject_writedata(r->ep, NULL, 0, (uint64_t)sent,
                                             r->addr[0], tg.addr, tg.key);
            if (rc == 0) {
                sent++;
                stuck = 0;
                continue;
            }
            REQ_RC(rc, -FI_EAGAIN);
            (void)fi_cntr_read(r->wcntr);
            if (!stuck)
                stuck = t_now_ms();
            else if (t_now_ms() - stuck > 2000)
                break;
        }
        t_barrier(r); /* the flood is in */
        t_barrier(r); /* the honest writes landed */
    } else if (r->me == 2) {
        t_barrier(r);
        static uint64_t v;
        for (int i = 0; i < HONEST; i++) {
            ssize_t rc;
            while ((rc = fi_writedata(r->ep, &v, 8, NULL, mark + (uint64_t)i,
                                      r->addr[0], tg.addr, tg.key, &v)) ==
                   -FI_EAGAIN)
                (void)fi_cq_read(r->cq, e, 1);
            REQ_RC(rc, 0);
        }
        for (uint64_t end = t_now_ms() + 20000;
             fi_cntr_read(r->wcntr) + fi_cntr_readerr(r->wcntr) < HONEST &&
             t_now_ms() < end;)
            (void)fi_cq_read(r->cq, e, 1);
        if (fi_cntr_readerr(r->wcntr) || fi_cntr_read(r->wcntr) != HONEST)
            fprintf(stderr, "honest writer: %" PRIu64 " of %d writes "
                    "completed, %" PRIu64 " failed\n", fi_cntr_read(r->wcntr),
                    HONEST, fi_cntr_readerr(r->wcntr));
        REQ(fi_cntr_readerr(r->wcntr) == 0);
        REQ(fi_cntr_read(r->wcntr) == HONEST);
        t_barrier(r);
    } else {
        t_barrier(r); /* progress through a counter: the CQ stays unread */
        size_t honest = 0, flood = 0;
        for (uint64_t end = t_now_ms() + 20000;
             honest < HONEST && t_now_ms() < end;) {
            ssize_t n = fi_cq_read(r->cq, e, 256);
            if (n == -FI_EAGAIN)
                continue;
            REQ(n > 0 && n <= CQ64);
            for (ssize_t k = 0; k < n; k++) {
                REQ(e[k].flags & FI_REMOTE_CQ_DATA);
                if (e[k].data >= mark)
                    REQ(e[k].data == mark + honest++); /* its order */
                else
                    flood++;
            }
        }
        if (getenv("FIV_CONFORM_VERBOSE"))
            fprintf(stderr, "flooded: %zu honest entries, %zu of the "
                    "co-tenant's meanwhile\n", honest, flood);
        REQ(honest == HONEST);
        t_barrier(r);
    }
    rma_event_close(r, &tg);
}

/* Rank 1 sends one message and leaves (endpoint closed, slot free)
   before rank 0 inserts it: the message is still delivered, matched by
   a receive directed at the address inserted afterwards. With `peek`,
   rank 0 reads its region (the INTRO and the message) before it
   inserts; without, only after. */
static void departed_sender(struct rank *r, bool peek)
{
    t_open(r, version);
    if (r->me == 0)
        t_insert_mask = 1u; /* ourselves only, for now */
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    if (r->me == 1) {
        uint64_t v = 0x600d;
        REQ_RC(fi_tsend(r->ep, &v, sizeof v, NULL, r->addr[0], 9, &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_close(r);
        t_barrier_plain(r); /* gone from the region */
        return;
    }
    t_barrier_plain(r);
    if (peek)
        for (int i = 0; i < 50; i++)
            REQ_RC(fi_cq_read(r->cq, &e, 1), -FI_EAGAIN);
    t_insert(r, 1);
    uint64_t got = 0;
    fi_addr_t src = FI_ADDR_NOTAVAIL;
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], 9, 0, &got), 0);
    REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
    REQ(e.op_context == &got && got == 0x600d && src == r->addr[1]);
    t_close(r);
}

/* A name inserted again is the same address (as libfabric's own AVs
   answer; an MPI's MPI_Comm_connect/accept inserts a peer it knows):
   receives directed at it match, and one fi_av_remove of the two keeps
   the peer. */
static void inserted_twice(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    fi_addr_t src = FI_ADDR_NOTAVAIL;
    if (r->me == 0) {
        fi_addr_t again = FI_ADDR_NOTAVAIL;
        REQ_RC(fi_av_insert(r->av, r->names + NAMELEN, 1, &again, 0, NULL), 1);
        REQ(again == r->addr[1]);
        uint64_t got = 0;
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, again, 1, 0, &got), 0);
        t_barrier(r);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(got == 11 && src == r->addr[1]);
        REQ_RC(fi_av_remove(r->av, &again, 1, 0), 0);
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[1], 2, 0, &got), 0);
        t_barrier(r);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(got == 12 && src == r->addr[1]);
    } else {
        uint64_t v = 11;
        t_barrier(r);
        REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[0], 1, &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        v = 12;
        t_barrier(r);
        REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[0], 2, &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    }
    t_barrier(r);
    t_close(r);
}

/* Two datagram endpoints: a message as large as a datagram may be, and
   one with CQ data, delivered from the right source; what a datagram
   endpoint does not offer (tagged, RMA, atomics, a larger message) is
   refused at the call. */
#define DGRAM_MAX (64 << 10)

static void dgram_exchange(struct rank *r)
{
    t_dgram = true;
    t_open(r, version);
    REQ(r->info->ep_attr->type == FI_EP_DGRAM);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    static uint8_t buf[DGRAM_MAX + 1];
    if (r->me == 1) {
        uint64_t v = 5, res = 0;
        size_t cnt = 0;
        REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[0], 1, &v), -FI_ENOSYS);
        REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[0], 1), -FI_ENOSYS);
        REQ_RC(fi_trecv(r->ep, &v, 8, NULL, r->addr[0], 1, 0, &v), -FI_ENOSYS);
        REQ_RC(fi_write(r->ep, &v, 8, NULL, r->addr[0], 0, 0, &v), -FI_ENOSYS);
        REQ_RC(fi_read(r->ep, &v, 8, NULL, r->addr[0], 0, 0, &v), -FI_ENOSYS);
        REQ_RC(fi_atomic(r->ep, &v, 1, NULL, r->addr[0], 0, 0, FI_UINT64,
                         FI_SUM, &v), -FI_ENOSYS);
        REQ_RC(fi_fetch_atomic(r->ep, &v, 1, NULL, &res, NULL, r->addr[0], 0,
                               0, FI_UINT64, FI_SUM, &v), -FI_ENOSYS);
        REQ_RC(fi_atomicvalid(r->ep, FI_UINT64, FI_SUM, &cnt), -FI_EOPNOTSUPP);
        REQ_RC(fi_compare_atomicvalid(r->ep, FI_UINT64, FI_CSWAP, &cnt),
               -FI_EOPNOTSUPP);
        /* refused before the arguments an RDM endpoint checks first */
        REQ_RC(fi_inject_write(r->ep, buf, DGRAM_MAX, r->addr[0], 0, 0),
               -FI_ENOSYS);
        REQ_RC(fi_atomic(r->ep, &v, 0, NULL, r->addr[0], 0, 0, FI_UINT64,
                         FI_SUM, &v), -FI_ENOSYS);
        REQ_RC(fi_atomic(r->ep, &v, 1, NULL, r->addr[0], 0, 0, FI_UINT64,
                         FI_CSWAP, &v), -FI_ENOSYS);
        REQ_RC(fi_compare_atomic(r->ep, &v, 1, NULL, &v, NULL, &res, NULL,
                                 r->addr[0], 0, 0, FI_UINT64, FI_SUM, &v),
               -FI_ENOSYS);
        struct iovec many[64];
        for (size_t i = 0; i < 64; i++)
            many[i] = (struct iovec){&v, 8};
        REQ_RC(fi_readv(r->ep, many, NULL, 64, r->addr[0], 0, 0, &v),
               -FI_ENOSYS);
        REQ_RC(fi_send(r->ep, buf, DGRAM_MAX + 1, NULL, r->addr[0], buf),
               -FI_EMSGSIZE);
        for (size_t i = 0; i < DGRAM_MAX; i++)
            buf[i] = (uint8_t)(i * 7 + 1);
        t_barrier(r);
        REQ_RC(fi_send(r->ep, buf, DGRAM_MAX, NULL, r->addr[0], buf), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == buf && e.flags & FI_SEND && e.flags & FI_MSG);
        v = 0x5eed;
        REQ_RC(fi_senddata(r->ep, &v, 8, NULL, 0xda7a, r->addr[0], &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_barrier(r);
    } else {
        uint64_t got = 0;
        fi_addr_t src = FI_ADDR_NOTAVAIL;
        REQ_RC(fi_recv(r->ep, buf, sizeof buf, NULL, r->addr[1], buf), 0);
        REQ_RC(fi_recv(r->ep, &got, 8, NULL, FI_ADDR_UNSPEC, &got), 0);
        t_barrier(r);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(e.op_context == buf && e.len == DGRAM_MAX && src == r->addr[1]);
        REQ(e.flags & FI_RECV && e.flags & FI_MSG);
        for (size_t i = 0; i < DGRAM_MAX; i++)
            REQ(buf[i] == (uint8_t)(i * 7 + 1));
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(e.op_context == &got && got == 0x5eed && src == r->addr[1]);
        REQ(e.flags & FI_REMOTE_CQ_DATA && e.data == 0xda7a);
        t_barrier(r);
    }
    t_close(r);
}

/* A peer's RDM endpoint writing into memory a datagram endpoint's domain
   registered for remote writes, sending it a tagged message, or a
   message past its 64 KiB (with a receive of that size posted): a
   datagram endpoint serves none of them, so the bytes stay as they were,
   nothing is received, and the sender's path breaks (the receive
   directed at it fails). */
enum refused { REFUSE_WRITE, REFUSE_TAGGED, REFUSE_BIG };

static void dgram_refuses(struct rank *r, enum refused what)
{
    static uint8_t big[DGRAM_MAX + 1];
    t_dgram = r->me == 0;
    t_open(r, version);
    t_exchange(r);
    static uint64_t words[2] = {0x1111, 0x2222};
    struct fid_mr *mr = NULL;
    uint64_t at[2] = {0, 0};
    if (r->me == 0) {
        REQ_RC(fi_mr_reg(r->dom, words, sizeof words,
                         FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &mr,
                         NULL), 0);
        at[0] = (uint64_t)(uintptr_t)words;
        at[1] = fi_mr_key(mr);
    }
    t_bcast(r, 0, at, sizeof at);
    struct fi_cq_tagged_entry e;
    if (r->me == 1) {
        uint64_t v = 0xbad;
        if (what == REFUSE_TAGGED)
            REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[0], 1, &v), 0);
        else if (what == REFUSE_WRITE)
            REQ_RC(fi_write(r->ep, &v, 8, NULL, r->addr[0], at[0], at[1], &v),
                   0);
        else {
            memset(big, 0xb1, sizeof big);
            REQ_RC(fi_send(r->ep, big, sizeof big, NULL, r->addr[0], &v), 0);
        }
        /* completed with an error or not at all: either way not served */
        (void)t_wait(r, &e, NULL, NULL, 500);
        t_barrier(r);
    } else {
        uint64_t got = 0;
        if (what == REFUSE_BIG)
            REQ_RC(fi_recv(r->ep, big, sizeof big, NULL, r->addr[1], &got), 0);
        else
            REQ_RC(fi_recv(r->ep, &got, 8, NULL, r->addr[1], &got), 0);
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        int rc = t_wait(r, &e, &err, NULL, 5000);
        REQ(rc != 0 && rc != -FI_ETIMEDOUT && err.op_context == &got);
        REQ(words[0] == 0x1111 && words[1] == 0x2222 && got == 0);
        for (size_t i = 0; i < sizeof big; i++)
            REQ(big[i] == 0);
        t_barrier(r);
        REQ_RC(fi_close(&mr->fid), 0);
    }
    t_close(r);
}

/* The same refusal during a drain (docs/migration.md): rank 0, a
   datagram endpoint, lets go of the region, and rank 1's tagged message
   goes over the core while rank 1's SWITCH still waits in rank 0's ring
   behind a flood of its untagged ones (rank 0 polls its region slowly,
   FIV_TEST_SLOW_REGION). The core message is held until the SWITCH
   releases it, and then breaks rank 1's path as on the core: the flood
   is received, and the next receive directed at rank 1 fails with
   FI_EIO instead of waiting. */
#define DG_FLOOD 2000
static const char *drain_region;

static void dgram_drain_violation(struct rank *r)
{
    t_dgram = r->me == 0;
    t_open(r, version);
    t_exchange(r);
    int16_t slot0;
    uint32_t gen0;
    memcpy(&slot0, r->names + 4, sizeof slot0); /* struct fiv_addr */
    memcpy(&gen0, r->names + 8, sizeof gen0);
    struct fi_cq_tagged_entry e;
    uint64_t hello = 1, first = 0;
    /* one message each way first: the pair's rings are open */
    REQ_RC(fi_recv(r->ep, &first, sizeof first, NULL, r->addr[1 - r->me],
                   &first), 0);
    REQ_RC(fi_send(r->ep, &hello, sizeof hello, NULL, r->addr[1 - r->me],
                   &hello), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    t_barrier(r);
    if (r->me == 1) {
        static uint64_t msg[DG_FLOOD];
        int fd = open(drain_region, O_RDWR | O_CLOEXEC);
        REQ(fd >= 0);
        ivshm_admin *a = NULL;
        REQ_RC(ivshm_admin_open(fd, &a), 0);
        close(fd);
        REQ_RC(ivshm_admin_drain_slot(a, slot0, gen0, 7), 0);
        ivshm_admin_close(a);
        t_barrier_plain(r); /* 1: rank 0 reads the request, sends SWITCH */
        for (uint32_t i = 0; i < DG_FLOOD; i++) {
            msg[i] = i;
            REQ_RC(fi_send(r->ep, &msg[i], sizeof msg[i], NULL, r->addr[0],
                           &msg[i]), 0);
        }
        t_barrier_plain(r); /* 2 */
        /* rank 0's SWITCH read: ours goes behind the flood, the tagged
           message after it over the core */
        t_progress_ms(r, 200);
        uint64_t bad = 0xbad;
        ssize_t rc;
        while ((rc = fi_tsend(r->ep, &bad, sizeof bad, NULL, r->addr[0], 1,
                              &bad)) == -FI_EAGAIN)
            (void)fi_cntr_read(r->rcntr);
        REQ_RC(rc, 0);
        t_barrier_plain(r); /* 3: rank 0 reads now */
        t_barrier(r);
        t_close(r);
        return;
    }
    t_progress_ms(r, 100); /* the request read, our SWITCH out */
    t_barrier_plain(r); /* 1 */
    t_barrier_plain(r); /* 2 */
    t_barrier_plain(r); /* 3 */
    uint32_t got_n = 0;
    int rc = 0;
    struct fi_cq_err_entry err;
    memset(&err, 0, sizeof err);
    for (uint32_t i = 0; i <= DG_FLOOD; i++) {
        uint64_t got = ~0ull;
        REQ_RC(fi_recv(r->ep, &got, sizeof got, NULL, r->addr[1], &got), 0);
        rc = t_wait(r, &e, &err, NULL, 5000);
        if (rc != 0)
            break;
        REQ(got == i);
        got_n++;
    }
    if (rc != -FI_EIO || got_n != DG_FLOOD) {
        fprintf(stderr, "received %u of %u, then %d\n", got_n, DG_FLOOD, rc);
        _exit(99);
    }
    t_barrier(r);
    t_close(r);
}

static void dgram_refuses_write(struct rank *r)
{
    dgram_refuses(r, REFUSE_WRITE);
}
static void dgram_refuses_tagged(struct rank *r)
{
    dgram_refuses(r, REFUSE_TAGGED);
}
static void dgram_refuses_big(struct rank *r)
{
    dgram_refuses(r, REFUSE_BIG);
}

/* ---- triggered operations (fi_trigger(3)) ---- */

static uint64_t trig_words[4];

static struct fi_triggered_context threshold_ctx(struct fid_cntr *c,
                                                 size_t threshold)
{
    struct fi_triggered_context tc;
    memset(&tc, 0, sizeof tc);
    tc.event_type = FI_TRIGGER_THRESHOLD;
    tc.trigger.threshold.cntr = c;
    tc.trigger.threshold.threshold = threshold;
    return tc;
}

static ssize_t trig_write(struct rank *r, uint64_t *v, uint64_t addr,
                          uint64_t key, struct fi_triggered_context *tc)
{
    struct iovec iov = {v, sizeof *v};
    struct fi_rma_iov rma = {.addr = addr, .len = sizeof *v, .key = key};
    struct fi_msg_rma m = {.msg_iov = &iov, .iov_count = 1,
                           .addr = r->addr[0], .rma_iov = &rma,
                           .rma_iov_count = 1, .context = tc};
    return fi_writemsg(r->ep, &m, FI_TRIGGER | FI_COMPLETION);
}

/* The two triggered cases' rank: `caps` with FI_TRIGGER, the threading
   model asked, the CQ bound with `cq_flags`, a read and a write counter
   and, in *gate, a counter bound to nothing that the case adds to;
   *scntr (if given) counts sends. */
static void trig_open(struct rank *r, uint64_t caps, enum fi_threading th,
                      uint64_t cq_flags, struct fid_cntr **gate,
                      struct fid_cntr **scntr)
{
    struct fi_info *h = base_hints();
    h->caps = caps | FI_TRIGGER;
    h->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                              FI_MR_PROV_KEY;
    if (th != FI_THREAD_UNSPEC)
        h->domain_attr->threading = th;
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, h, &r->info), 0);
    fi_freeinfo(h);
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    REQ_RC(fi_fabric(r->info->fabric_attr, &r->fab, NULL), 0);
    REQ_RC(fi_domain(r->fab, r->info, &r->dom, NULL), 0);
    REQ_RC(fi_endpoint(r->dom, r->info, &r->ep, NULL), 0);
    REQ_RC(fi_cq_open(r->dom, &cqa, &r->cq, NULL), 0);
    REQ_RC(fi_av_open(r->dom, &ava, &r->av, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->rcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->wcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, gate, NULL), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV | cq_flags),
           0);
    REQ_RC(fi_ep_bind(r->ep, &r->av->fid, 0), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->rcntr->fid, FI_READ), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->wcntr->fid, FI_WRITE), 0);
    if (scntr) {
        REQ_RC(fi_cntr_open(r->dom, &ca, scntr, NULL), 0);
        REQ_RC(fi_ep_bind(r->ep, &(*scntr)->fid, FI_SEND), 0);
    }
    REQ_RC(fi_enable(r->ep), 0);
    t_exchange(r);
}

/* Rank 1 writes into rank 0's `trig_words` and sends it tagged messages,
   each deferred until a counter of its own reaches a threshold: a
   counter bound to nothing that the test adds to, and its write
   counter, which a plain write moves; then a read and an atomic.
   Nothing goes before its threshold, it goes at it; a counter with one
   waiting does not close; fi_cancel and closing the endpoint end those
   still waiting with FI_ECANCELED; what is not a threshold on one of
   the domain's open counters is refused at the call. */
static void triggered(struct rank *r)
{
    struct fid_cntr *scntr, *gate;
    trig_open(r, FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC, FI_THREAD_UNSPEC, 0,
              &gate, &scntr);
    struct fid_mr *mr = NULL;
    if (r->me == 0)
        REQ_RC(fi_mr_reg(r->dom, trig_words, sizeof trig_words,
                         FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &mr,
                         NULL), 0);
    uint64_t at[2] = {(uint64_t)(uintptr_t)trig_words,
                      mr ? fi_mr_key(mr) : 0};
    t_bcast(r, 0, at, sizeof at);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;

    /* a write at the gate's 2: not at 1, at 2; one at 0 goes at once */
    struct fi_triggered_context tc1 = threshold_ctx(gate, 2),
                                tc0 = threshold_ctx(gate, 0);
    uint64_t v1 = 0x1111, v0 = 0x3333;
    if (r->me == 1) {
        REQ_RC(trig_write(r, &v1, at[0], at[1], &tc1), 0);
        REQ_RC(fi_cntr_add(gate, 1), 0);
        t_progress_ms(r, 200);
        REQ(fi_cntr_read(r->wcntr) == 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 0), -FI_ETIMEDOUT);
        REQ_RC(trig_write(r, &v0, at[0] + 16, at[1], &tc0), 0);
        REQ_RC(fi_cntr_wait(r->wcntr, 1, 5000), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &tc0 && e.flags & FI_WRITE);
    }
    t_barrier(r);
    if (r->me == 0)
        REQ(trig_words[0] == 0 && trig_words[2] == 0x3333);
    t_barrier(r);
    if (r->me == 1) {
        REQ_RC(fi_cntr_add(gate, 1), 0);
        REQ_RC(fi_cntr_wait(r->wcntr, 2, 5000), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &tc1 && e.flags & FI_WRITE && e.flags & FI_RMA);
    }
    t_barrier(r);
    if (r->me == 0)
        REQ(trig_words[0] == 0x1111);

    /* a tagged send through an alias of FI_TRIGGER, at the write
       counter's next count: it waits for a plain write, and goes after
       it */
    uint64_t got = 0;
    if (r->me == 0)
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[1], 9, 0, &got), 0);
    t_barrier(r);
    if (r->me == 1) {
        struct fid_ep *al = NULL;
        REQ_RC(fi_ep_alias(r->ep, &al, FI_TRANSMIT | FI_TRIGGER), 0);
        struct fi_triggered_context tc2 = threshold_ctx(r->wcntr, 3);
        uint64_t s = 0x2222, v2 = 0x4444;
        REQ_RC(fi_tsend(al, &s, 8, NULL, r->addr[0], 9, &tc2), 0);
        /* an inject names no context to trigger by */
        REQ_RC(fi_tinject(al, &s, 8, r->addr[0], 9), -FI_EINVAL);
        /* the endpoint stays while its alias is open */
        REQ_RC(fi_close(&r->ep->fid), -FI_EBUSY);
        t_progress_ms(r, 200);
        REQ(fi_cntr_read(scntr) == 0);
        REQ_RC(fi_write(r->ep, &v2, 8, NULL, r->addr[0], at[0] + 8, at[1],
                        &v2), 0);
        REQ_RC(fi_cntr_wait(scntr, 1, 5000), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &v2 && e.flags & FI_WRITE);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &tc2 && e.flags & FI_SEND && e.flags & FI_TAGGED);
        REQ_RC(fi_close(&al->fid), 0);
        /* a receive alias takes no FI_TRIGGER, at its opening nor later */
        REQ_RC(fi_ep_alias(r->ep, &al, FI_RECV | FI_TRIGGER), -FI_EINVAL);
        REQ_RC(fi_ep_alias(r->ep, &al, FI_RECV), 0);
        uint64_t rf = FI_RECV | FI_TRIGGER;
        REQ_RC(fi_control(&al->fid, FI_SETOPSFLAG, &rf), -FI_EINVAL);
        REQ_RC(fi_close(&al->fid), 0);
    } else {
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &got && got == 0x2222);
        REQ(trig_words[1] == 0x4444); /* the write landed first */
    }
    t_barrier(r);

    /* a read and an atomic at the gate's 3: neither before it */
    uint64_t rd = 0;
    struct fi_triggered_context tcr = threshold_ctx(gate, 3),
                                tca = threshold_ctx(gate, 3);
    if (r->me == 1) {
        struct iovec riov = {&rd, sizeof rd};
        struct fi_rma_iov rma = {.addr = at[0] + 16, .len = 8, .key = at[1]};
        struct fi_msg_rma rm = {.msg_iov = &riov, .iov_count = 1,
                                .addr = r->addr[0], .rma_iov = &rma,
                                .rma_iov_count = 1, .context = &tcr};
        REQ_RC(fi_readmsg(r->ep, &rm, FI_TRIGGER | FI_COMPLETION), 0);
        uint64_t one = 1;
        struct fi_ioc ioc = {&one, 1};
        struct fi_rma_ioc rioc = {.addr = at[0] + 24, .count = 1,
                                  .key = at[1]};
        struct fi_msg_atomic am = {.msg_iov = &ioc, .iov_count = 1,
                                   .addr = r->addr[0], .rma_iov = &rioc,
                                   .rma_iov_count = 1,
                                   .datatype = FI_UINT64, .op = FI_SUM,
                                   .context = &tca};
        REQ_RC(fi_atomicmsg(r->ep, &am, FI_TRIGGER | FI_COMPLETION), 0);
        t_progress_ms(r, 200);
        REQ(fi_cntr_read(r->rcntr) == 0 && fi_cntr_read(r->wcntr) == 3);
        REQ_RC(fi_cntr_add(gate, 1), 0);
        REQ_RC(fi_cntr_wait(r->rcntr, 1, 5000), 0);
        REQ_RC(fi_cntr_wait(r->wcntr, 4, 5000), 0);
        REQ(rd == 0x3333);
        for (int i = 0; i < 2; i++) {
            REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
            REQ((e.op_context == &tcr && e.flags & FI_READ) ||
                (e.op_context == &tca && e.flags & FI_ATOMIC));
        }
    }
    t_barrier(r);
    if (r->me == 0)
        REQ(trig_words[3] == 1);

    /* an atomic's operand is read when the atomic starts, not when it
       is posted: what it forwards arrives in between (fi_trigger(3):
       "send a message only after receiving all input data") */
    uint64_t in = 0;
    struct fi_triggered_context tcs = threshold_ctx(gate, 4);
    if (r->me == 1) {
        REQ_RC(fi_trecv(r->ep, &in, 8, NULL, r->addr[0], 11, 0, &in), 0);
        struct fi_ioc ioc = {&in, 1};
        struct fi_rma_ioc rioc = {.addr = at[0] + 24, .count = 1,
                                  .key = at[1]};
        struct fi_msg_atomic am = {.msg_iov = &ioc, .iov_count = 1,
                                   .addr = r->addr[0], .rma_iov = &rioc,
                                   .rma_iov_count = 1,
                                   .datatype = FI_UINT64, .op = FI_SUM,
                                   .context = &tcs};
        REQ_RC(fi_atomicmsg(r->ep, &am, FI_TRIGGER | FI_COMPLETION), 0);
    }
    t_barrier(r);
    if (r->me == 0) {
        uint64_t seven = 7;
        REQ_RC(fi_tinject(r->ep, &seven, 8, r->addr[1], 11), 0);
    } else {
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &in && in == 7);
        REQ_RC(fi_cntr_add(gate, 1), 0);
        REQ_RC(fi_cntr_wait(r->wcntr, 5, 5000), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(e.op_context == &tcs && e.flags & FI_ATOMIC);
    }
    t_barrier(r);
    if (r->me == 0)
        REQ(trig_words[3] == 1 + 7);

    /* refused at the call: FI_TRIGGER in the endpoint's own flags, a
       counter that is not one of the domain's, an event we lack */
    if (r->me == 1) {
        uint64_t f = FI_TRANSMIT | FI_TRIGGER;
        REQ_RC(fi_control(&r->ep->fid, FI_SETOPSFLAG, &f), -FI_EINVAL);
        uint64_t bogus[8] = {0};
        struct fi_triggered_context tb =
            threshold_ctx((struct fid_cntr *)(void *)bogus, 1);
        REQ_RC(trig_write(r, &v1, at[0], at[1], &tb), -FI_EINVAL);
        tb = threshold_ctx(gate, 1);
        tb.event_type = FI_TRIGGER_XPU;
        REQ_RC(trig_write(r, &v1, at[0], at[1], &tb), -FI_ENOSYS);
        REQ_RC(trig_write(r, &v1, at[0], at[1], NULL), -FI_EINVAL);
    }

    /* waiting: the counter does not close, fi_cancel ends it */
    struct fid_cntr *later;
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    REQ_RC(fi_cntr_open(r->dom, &ca, &later, NULL), 0);
    struct fi_triggered_context tc3 = threshold_ctx(later, 5),
                                tc4 = threshold_ctx(later, 6);
    uint64_t v3 = 0x5555;
    if (r->me == 1) {
        REQ_RC(trig_write(r, &v3, at[0] + 24, at[1], &tc3), 0);
        REQ_RC(fi_close(&later->fid), -FI_EBUSY);
        REQ_RC(fi_cancel(&r->ep->fid, &tc3), 0);
        REQ_RC(fi_cancel(&r->ep->fid, &tc3), -FI_ENOENT);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ECANCELED);
        REQ(err.op_context == &tc3);
        /* reached but not yet started (no progress since): fi_cancel
           still finds it */
        struct fi_triggered_context tc5 = threshold_ctx(later, 1);
        REQ_RC(trig_write(r, &v3, at[0] + 24, at[1], &tc5), 0);
        REQ_RC(fi_cntr_add(later, 1), 0);
        REQ_RC(fi_cancel(&r->ep->fid, &tc5), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ECANCELED);
        REQ(err.op_context == &tc5);
        struct iovec iov = {&v3, sizeof v3};
        struct fi_msg_tagged m = {.msg_iov = &iov, .iov_count = 1,
                                  .addr = r->addr[0], .tag = 10,
                                  .context = &tc4};
        REQ_RC(fi_tsendmsg(r->ep, &m, FI_TRIGGER), 0);
    }
    t_barrier(r);
    if (r->me == 0) /* neither cancelled write landed */
        REQ(trig_words[3] == 1 + 7);
    /* closing the endpoint ends what waits (its counter closes after) */
    REQ_RC(fi_close(&r->ep->fid), 0);
    if (r->me == 1) {
        REQ_RC(t_wait(r, &e, &err, NULL, 1000), -FI_ECANCELED);
        REQ(err.op_context == &tc4);
    }
    REQ_RC(fi_close(&later->fid), 0);
    if (mr)
        REQ_RC(fi_close(&mr->fid), 0);
    REQ_RC(fi_close(&r->av->fid), 0);
    REQ_RC(fi_close(&r->cq->fid), 0);
    REQ_RC(fi_close(&r->rcntr->fid), 0);
    REQ_RC(fi_close(&r->wcntr->fid), 0);
    REQ_RC(fi_close(&scntr->fid), 0);
    REQ_RC(fi_close(&gate->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), 0);
    REQ_RC(fi_close(&r->fab->fid), 0);
    fi_freeinfo(r->info);
}

static void departed_unread(struct rank *r) { departed_sender(r, false); }
static void departed_read(struct rank *r) { departed_sender(r, true); }

/* Under FI_THREAD_ENDPOINT the application serializes each object, not
   the provider's work on what they share: one thread posts triggered
   writes on the endpoint while another adds to their counter, whose
   increment moves them to the endpoint's ready list. Every write lands
   once, at its threshold or later (without the domain's lock in this
   model the two threads changed the counter's list at once). */
enum { RACE_N = 50000 };
static uint64_t race_words[64];
struct race_arg {
    struct rank *r;
    struct fid_cntr *gate;
    uint64_t at[2];
};

static void *race_post(void *p)
{
    struct race_arg *a = p;
    static uint64_t v = 1;
    static struct fi_triggered_context tc[RACE_N];
    for (size_t i = 0; i < RACE_N; i++) {
        tc[i] = threshold_ctx(a->gate, i + 1);
        uint64_t addr = a->at[0] + (i % 64) * sizeof(uint64_t);
        ssize_t rc;
        while ((rc = trig_write(a->r, &v, addr, a->at[1], &tc[i])) ==
               -FI_EAGAIN)
            (void)fi_cntr_read(a->r->wcntr);
        if (rc)
            return (void *)1;
    }
    return NULL;
}

static void *race_add(void *p)
{
    struct race_arg *a = p;
    for (size_t i = 0; i < RACE_N; i++)
        if (fi_cntr_add(a->gate, 1))
            return (void *)1;
    return NULL;
}

static void triggered_threads(struct rank *r)
{
    struct fid_cntr *gate;
    trig_open(r, FI_MSG | FI_RMA, FI_THREAD_ENDPOINT, FI_SELECTIVE_COMPLETION,
              &gate, NULL);
    struct fid_mr *mr = NULL;
    if (r->me == 0)
        REQ_RC(fi_mr_reg(r->dom, race_words, sizeof race_words,
                         FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL), 0);
    struct race_arg a = {.r = r, .gate = gate,
                         .at = {(uint64_t)(uintptr_t)race_words,
                                mr ? fi_mr_key(mr) : 0}};
    t_bcast(r, 0, a.at, sizeof a.at);
    if (r->me == 1) {
        pthread_t tp, ta;
        REQ(pthread_create(&tp, NULL, race_post, &a) == 0);
        REQ(pthread_create(&ta, NULL, race_add, &a) == 0);
        void *rp = NULL, *ra = NULL;
        REQ(pthread_join(tp, &rp) == 0 && rp == NULL);
        REQ(pthread_join(ta, &ra) == 0 && ra == NULL);
        REQ(fi_cntr_read(gate) == RACE_N);
        /* every write lands once: the count stops at RACE_N */
        REQ_RC(fi_cntr_wait(r->wcntr, RACE_N, 20000), 0);
        t_progress_ms(r, 100);
        REQ(fi_cntr_read(r->wcntr) == RACE_N);
        REQ(fi_cntr_readerr(r->wcntr) == 0);
    }
    t_barrier(r);
    if (r->me == 0)
        for (size_t i = 0; i < 64; i++)
            REQ(race_words[i] == 1);
    t_barrier(r);
    if (mr)
        REQ_RC(fi_close(&mr->fid), 0);
    REQ_RC(fi_close(&gate->fid), 0);
    t_close(r);
}

int main(void)
{
    if (!getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "FI_PROVIDER_PATH must name the provider's directory\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int failed = 0;
    char env[256];
    const char *reg = t_region(8, 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", reg);
    const char *env1[] = {env};
    char envsmall[256];
    snprintf(envsmall, sizeof envsmall,
             "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", t_region(8, 128));
    const char *env1small[] = {envsmall};
    const char *env2[] = {env, env};
    const char *env3[] = {env, env, env};

    /* in a child, as every case: a crash is a failed case, not the end */
    pid_t p = fork();
    REQ(p >= 0);
    if (p == 0) {
        alarm(30);
        check_getinfo();
        _exit(0);
    }
    int st = 0;
    waitpid(p, &st, 0);
    int f = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    printf("%s: fi_getinfo: mode bits cleared, node/service, addresses, "
           "implied and per-side capabilities\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, one_endpoint, env1, 30, NULL);
    printf("%s: connection calls of an RDM endpoint, fi_cq_signal\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, domain_atomic_counts, env1, 30, NULL);
    f += t_run(1, domain_atomic_counts, env1small, 30, NULL);
    printf("%s: the domain's atomic counts are its endpoints' (default "
           "and 128-byte slots)\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, empty_atomics, env1, 30, NULL);
    printf("%s: atomics without operands or with counts that disagree are "
           "refused\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, atomic_wraparound, env1, 30, NULL);
    printf("%s: sums and products past their type wrap around\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, domain_children, env1, 30, NULL);
    printf("%s: a domain with a registration open does not close; a "
           "registration holds the last counter bound\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, foreign_children, env1, 30, NULL);
    printf("%s: a CQ, counter or AV of another domain is not bound, nor its "
           "counter to a registration\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, inject_flag, env2, 30, NULL);
    printf("%s: a send with FI_INJECT in its flags completes\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, empty_receives, env2, 30, NULL);
    printf("%s: a receive of no buffer takes empty and truncated messages\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, rma_event_counter, env2, 30, NULL);
    printf("%s: FI_RMA alone: remote writes counted, every object closes\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, multi_mr_offsets, env2, 30, NULL);
    f += t_run(2, multi_mr_virtual, env2, 30, NULL);
    printf("%s: overlapping registrations with their own counters, by "
           "offset and requested key, and by virtual address and our key\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(1, mr_bind_threads, env1, 60, NULL);
    printf("%s: registrations rebound between two counters by %d threads "
           "at once\n", f ? "FAIL" : "ok", BIND_THREADS);
    failed += f;

    f = t_run(2, writedata_burst, env2, 30, NULL);
    printf("%s: an honest burst of writes with data past the CQ's size\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(3, writedata_flooded, env3, 60, NULL);
    printf("%s: an honest writer with data beside a co-tenant flooding "
           "writes with data\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, inserted_twice, env2, 30, NULL);
    printf("%s: a name inserted twice is one address\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, departed_unread, env2, 30, NULL);
    printf("%s: the last message of a sender gone before it was inserted\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, departed_read, env2, 30, NULL);
    printf("%s: the same, read before the insert\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, triggered, env2, 30, NULL);
    printf("%s: triggered writes, sends, reads and atomics go at their "
           "counter's threshold, not before, with the operands there then; "
           "what waits holds its counter, is cancelled, ends with its "
           "endpoint\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, triggered_threads, env2, 60, NULL);
    printf("%s: FI_THREAD_ENDPOINT: triggered writes posted on one thread "
           "while another adds to their counter all land once\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, dgram_exchange, env2, 30, NULL);
    printf("%s: datagram endpoints exchange messages up to their size and "
           "refuse the rest at the call\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, dgram_refuses_write, env2, 30, NULL);
    f += t_run(2, dgram_refuses_tagged, env2, 30, NULL);
    f += t_run(2, dgram_refuses_big, env2, 30, NULL);
    printf("%s: a datagram endpoint serves no remote write, tagged "
           "message or message past 64 KiB of a peer's RDM endpoint\n",
           f ? "FAIL" : "ok");
    failed += f;

    /* rings of 4096 small slots: the whole flood fits; the core path
       on (FI_IVSHM_CORE's default) */
    static char deep[96];
    snprintf(deep, sizeof deep, "/dev/shm/fiv-conform-deep-%d", (int)getpid());
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4096, .slot_size = 256,
                        .fast_channels = 2};
    unlink(deep);
    REQ_RC(ivshm_format_file(deep, ivshm_min_region_size(&g), &g, 0600), 0);
    t_track(deep);
    drain_region = deep;
    char denv[320], dslow[400];
    snprintf(denv, sizeof denv, "FI_IVSHM_REGION=%s", deep);
    snprintf(dslow, sizeof dslow, "%s;FIV_TEST_SLOW_REGION=2000;"
             "FI_IVSHM_DRAIN_MS=30000", denv);
    const char *env_drain[] = {dslow, denv};
    f = t_run(2, dgram_drain_violation, env_drain, 60, NULL);
    printf("%s: a tagged message held during a drain until its sender's "
           "SWITCH breaks the path when released\n", f ? "FAIL" : "ok");
    failed += f;

    printf("%s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}
