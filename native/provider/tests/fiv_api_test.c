/*
 * The provider's own API, in real processes that open it through
 * libfabric (FI_PROVIDER_PATH, FI_IVSHM_REGION): tagged send/receive with
 * directed and wildcard receives and tag-ignore bits, FI_SOURCE, large
 * (fragmented) and unexpected messages, truncation as an error entry,
 * probes (peek/claim), self sends, RMA write/read, atomics, CQ errors of
 * RMA with a bad key, a peer killed in the middle of a message, and a
 * 3-process job where one peer is reached through the delegated core
 * provider (docs/provider.md). Also run against other libfabrics by
 * LD_LIBRARY_PATH (tests/test_fi_provider.py).
 */
#include "fiv_test.h"

static uint32_t api_version = FI_VERSION(1, 17);

/* ---- two ranks on one region ---- */

static void check_tagged(struct rank *r)
{
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    fi_addr_t src;
    int peer = 1 - r->me;
    uint64_t v = 0x1122334455667788ull + (uint64_t)r->me, got = 0;
    /* 8 B both ways, directed */
    REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[peer], 7, 0, &got), 0);
    REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[peer], 7, &v), 0);
    for (int k = 0; k < 2; k++) {
        REQ_RC(t_wait(r, &e, &err, &src, 5000), 0);
        if (e.op_context == &got) {
            REQ(e.flags & FI_RECV && e.flags & FI_TAGGED);
            REQ(e.len == 8 && e.tag == 7 && src == r->addr[peer]);
        } else {
            REQ(e.op_context == &v && e.flags & FI_SEND);
        }
    }
    REQ(got == 0x1122334455667788ull + (uint64_t)peer);
    t_barrier(r);
    if (r->me == 1) {
        /* tags 5 then 6, then 0x1ab for the ignore bits */
        uint64_t a = 5, b = 6, c = 0x1ab;
        REQ_RC(fi_tinject(r->ep, &a, 8, r->addr[0], 5), 0);
        REQ_RC(fi_tinject(r->ep, &b, 8, r->addr[0], 6), 0);
        REQ_RC(fi_tinject(r->ep, &c, 8, r->addr[0], 0x1ab), 0);
    } else {
        uint64_t x = 0, y = 0, z = 0;
        /* directed at 6 first: it must skip 5 */
        REQ_RC(fi_trecv(r->ep, &y, 8, NULL, r->addr[1], 6, 0, &y), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(e.op_context == &y && y == 6 && e.tag == 6);
        /* any source, any tag: the oldest left, 5 */
        REQ_RC(fi_trecv(r->ep, &x, 8, NULL, FI_ADDR_UNSPEC, 0, ~0ull, &x), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(e.op_context == &x && x == 5 && e.tag == 5 && src == r->addr[1]);
        /* 0x100 ignoring the low byte matches 0x1ab */
        REQ_RC(fi_trecv(r->ep, &z, 8, NULL, FI_ADDR_UNSPEC, 0x100, 0xff, &z), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 5000), 0);
        REQ(e.op_context == &z && z == 0x1ab && e.tag == 0x1ab);
    }
    t_barrier(r);
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 131 + seed);
}

static void check_large_and_truncation(struct rank *r)
{
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    const size_t big = 3 << 20;
    uint8_t *buf = malloc(big), *want = malloc(big);
    REQ(buf && want);
    if (r->me == 1) {
        fill(want, big, 1);
        /* expected: rank 0 posted first (after the barrier) */
        t_barrier(r);
        REQ_RC(fi_tsend(r->ep, want, big, NULL, r->addr[0], 100, want), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        /* unexpected: rank 0 posts after our send completed */
        fill(want, big, 2);
        REQ_RC(fi_tsend(r->ep, want, big, NULL, r->addr[0], 101, want), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        t_barrier(r);
        /* truncated: 100 B into 10 */
        REQ_RC(fi_tsend(r->ep, want, 100, NULL, r->addr[0], 102, want), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_barrier(r);
    } else {
        REQ_RC(fi_trecv(r->ep, buf, big, NULL, r->addr[1], 100, 0, buf), 0);
        t_barrier(r);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        fill(want, big, 1);
        REQ(e.len == big && memcmp(buf, want, big) == 0);
        /* let it arrive unexpected */
        for (uint64_t end = t_now_ms() + 300; t_now_ms() < end;)
            (void)fi_cq_read(r->cq, &e, 0);
        memset(buf, 0, big);
        REQ_RC(fi_trecv(r->ep, buf, big, NULL, FI_ADDR_UNSPEC, 101, 0, buf), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        fill(want, big, 2);
        REQ(e.len == big && e.tag == 101 && memcmp(buf, want, big) == 0);
        t_barrier(r);
        uint8_t small[10];
        REQ_RC(fi_trecv(r->ep, small, sizeof small, NULL, r->addr[1], 102, 0,
                        small), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ETRUNC);
        REQ(err.op_context == small && err.olen == 90 && err.len == 10);
        REQ(memcmp(small, want, 10) == 0);
        t_barrier(r);
    }
    free(buf);
    free(want);
}

static void check_probe_and_self(struct rank *r)
{
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        uint64_t v = 42;
        REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[0], 55), 0);
        t_barrier(r);
    } else {
        t_barrier(r);
        /* nothing with tag 56: FI_ENOMSG */
        struct fi_msg_tagged m = {.addr = FI_ADDR_UNSPEC, .tag = 56,
                                  .context = &err};
        REQ_RC(fi_trecvmsg(r->ep, &m, FI_PEEK), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ENOMSG);
        /* peek + claim 55, then receive the claimed message */
        struct fi_context ctx;
        m.tag = 55;
        m.context = &ctx;
        uint64_t got = 0;
        for (;;) {
            REQ_RC(fi_trecvmsg(r->ep, &m, FI_PEEK | FI_CLAIM), 0);
            int rc = t_wait(r, &e, &err, NULL, 5000);
            if (rc == 0)
                break;
            REQ(rc == -FI_ENOMSG);
        }
        REQ(e.len == 8 && e.tag == 55);
        struct iovec iov = {&got, 8};
        struct fi_msg_tagged c = {.msg_iov = &iov, .iov_count = 1,
                                  .addr = FI_ADDR_UNSPEC, .tag = 55,
                                  .context = &ctx};
        REQ_RC(fi_trecvmsg(r->ep, &c, FI_CLAIM | FI_COMPLETION), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(got == 42);
    }
    /* to ourselves */
    uint64_t me = 77 + (uint64_t)r->me, back = 0;
    REQ_RC(fi_trecv(r->ep, &back, 8, NULL, r->addr[r->me], 9, 0, &back), 0);
    REQ_RC(fi_tsend(r->ep, &me, 8, NULL, r->addr[r->me], 9, &me), 0);
    for (int k = 0; k < 2; k++)
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ(back == me);
    t_barrier(r);
}

struct target {
    uint64_t addr, key;
};

static void check_rma_atomics(struct rank *r)
{
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    const size_t len = 256 << 10;
    uint8_t *mem = calloc(1, len + 64);
    REQ(mem);
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, mem, len + 64, FI_REMOTE_READ | FI_REMOTE_WRITE,
                     0, 0, 0, &mr, NULL), 0);
    struct target mine = {(uint64_t)(uintptr_t)mem, fi_mr_key(mr)}, t[2];
    /* swap targets through broadcasts from each rank */
    for (int root = 0; root < 2; root++) {
        struct target x = mine;
        t_bcast(r, root, &x, sizeof x);
        t[root] = x;
    }
    t_barrier(r);
    if (r->me == 1) {
        uint8_t *src = malloc(len), *back = malloc(len);
        REQ(src && back);
        fill(src, len, 9);
        REQ_RC(fi_write(r->ep, src, len, NULL, r->addr[0], t[0].addr, t[0].key,
                        src), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(e.op_context == src && e.flags & FI_WRITE);
        REQ_RC(fi_read(r->ep, back, len, NULL, r->addr[0], t[0].addr, t[0].key,
                       back), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(e.op_context == back && memcmp(src, back, len) == 0);
        REQ(fi_cntr_read(r->wcntr) == 1 && fi_cntr_read(r->rcntr) == 1);
        /* atomics on the word after the block */
        uint64_t at = t[0].addr + len, one = 5, old = 0, cmp = 5, nv = 99;
        for (int i = 0; i < 3; i++) {
            REQ_RC(fi_fetch_atomic(r->ep, &one, 1, NULL, &old, NULL,
                                   r->addr[0], at, t[0].key, FI_UINT64, FI_SUM,
                                   &old), 0);
            REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
            REQ(old == (uint64_t)i * 5);
        }
        cmp = 15;
        REQ_RC(fi_compare_atomic(r->ep, &nv, 1, NULL, &cmp, NULL, &old, NULL,
                                 r->addr[0], at, t[0].key, FI_UINT64, FI_CSWAP,
                                 &old), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(old == 15);
        double dv = 1.5;
        REQ_RC(fi_atomic(r->ep, &dv, 1, NULL, r->addr[0], at + 8, t[0].key,
                         FI_DOUBLE, FI_SUM, &dv), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        /* a bad key and an access past the registration: error entries */
        REQ_RC(fi_write(r->ep, src, 8, NULL, r->addr[0], t[0].addr,
                        t[0].key + 1000, &err), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_EACCES);
        REQ_RC(fi_read(r->ep, back, 128, NULL, r->addr[0], t[0].addr + len,
                       t[0].key, &err), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_EACCES);
        REQ(fi_cntr_readerr(r->rcntr) == 1);
        free(src);
        free(back);
        t_barrier(r);
    } else {
        /* the target only drives progress (manual progress: the MPI does) */
        uint8_t want[8];
        fill(want, 8, 9);
        t_barrier(r); /* rank 1's barrier call waits until it is done */
        uint64_t w;
        memcpy(&w, mem + len, 8);
        REQ(w == 99);
        double d;
        memcpy(&d, mem + len + 8, 8);
        REQ(d == 1.5);
        REQ(memcmp(mem, want, 8) == 0);
    }
    fi_close(&mr->fid);
    free(mem);
}

static void check_tagged_only(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    check_tagged(r);
    check_large_and_truncation(r);
    t_close(r);
}

static void two_on_region(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    check_tagged(r);
    check_large_and_truncation(r);
    check_probe_and_self(r);
    check_rma_atomics(r);
    t_close(r);
}

/* ---- many operations outstanding at once (an MPI's window of
   isend/irecv) ---- */

#define MANY 1500
#define MANY_SLOT 20000

/* Message i of `round` from rank `from`: its tag and its length (mostly
   8 B, some a few hundred, a few fragmented). */
static uint64_t many_tag(int round, int from, int i)
{
    return ((uint64_t)round << 40) | ((uint64_t)from << 32) | (uint64_t)i;
}

static size_t many_len(int i)
{
    return i % 97 == 0 ? MANY_SLOT : i % 5 == 0 ? 300 : 8;
}

/* Completions, each receive checked (its own buffer once, tag, length,
   source): for `for_ms` if not 0, else until both counts reach MANY. */
static void many_complete(struct rank *r, int round, int *sends, int *recvs,
                          const uint8_t *in, uint8_t *seen, int for_ms)
{
    int peer = 1 - r->me;
    uint64_t end = t_now_ms() + (uint64_t)for_ms;
    while (for_ms ? t_now_ms() < end : *sends < MANY || *recvs < MANY) {
        struct fi_cq_tagged_entry e;
        fi_addr_t src;
        int rc = t_wait(r, &e, NULL, &src, for_ms ? 0 : 20000);
        if (for_ms && rc == -FI_ETIMEDOUT)
            continue;
        if (rc)
            fprintf(stderr, "rank %d round %d: %d of %d sends and %d of %d "
                    "receives completed\n", r->me, round, *sends, MANY, *recvs,
                    MANY);
        REQ_RC(rc, 0);
        if (e.flags & FI_SEND) {
            ++*sends;
            continue;
        }
        size_t i = (size_t)((const uint8_t *)e.op_context - in) / MANY_SLOT;
        REQ(i < MANY && !seen[i] && src == r->addr[peer]);
        REQ(e.tag == many_tag(round, peer, (int)i) && e.len == many_len((int)i));
        seen[i] = 1;
        ++*recvs;
    }
}

/* Each rank has MANY tagged receives and MANY sends in flight to the
   other, the receives posted before the sends (round 0: all expected),
   after them (round 1: all unexpected), half before and half after with
   any source (round 2). Posted receives are taken and given back by the
   thousand, round after round. */
static void many_outstanding(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    int peer = 1 - r->me;
    uint8_t *out = malloc((size_t)MANY * MANY_SLOT);
    uint8_t *in = malloc((size_t)MANY * MANY_SLOT), *want = malloc(MANY_SLOT);
    uint8_t *seen = malloc(MANY);
    REQ(out && in && want && seen);
    for (int round = 0; round < 3; round++) {
        memset(in, 0, (size_t)MANY * MANY_SLOT);
        memset(seen, 0, MANY);
        for (int i = 0; i < MANY; i++)
            fill(out + (size_t)i * MANY_SLOT, many_len(i),
                 (unsigned)(round * 7 + r->me * 3 + i));
        int before = round == 0 ? MANY : round == 1 ? 0 : MANY / 2;
        fi_addr_t from = round == 2 ? FI_ADDR_UNSPEC : r->addr[peer];
        for (int i = 0; i < before; i++)
            REQ_RC(fi_trecv(r->ep, in + (size_t)i * MANY_SLOT, MANY_SLOT, NULL,
                            from, many_tag(round, peer, i), 0,
                            in + (size_t)i * MANY_SLOT), 0);
        t_barrier(r);
        for (int i = 0; i < MANY; i++)
            REQ_RC(fi_tsend(r->ep, out + (size_t)i * MANY_SLOT, many_len(i),
                            NULL, r->addr[peer], many_tag(round, r->me, i),
                            out + (size_t)i * MANY_SLOT), 0);
        int sends = 0, recvs = 0;
        if (before < MANY) {
            /* the other side's messages arrive before these receives */
            many_complete(r, round, &sends, &recvs, in, seen, 200);
            for (int i = before; i < MANY; i++)
                REQ_RC(fi_trecv(r->ep, in + (size_t)i * MANY_SLOT, MANY_SLOT,
                                NULL, from, many_tag(round, peer, i), 0,
                                in + (size_t)i * MANY_SLOT), 0);
        }
        many_complete(r, round, &sends, &recvs, in, seen, 0);
        for (int i = 0; i < MANY; i++) {
            fill(want, many_len(i), (unsigned)(round * 7 + peer * 3 + i));
            REQ(memcmp(in + (size_t)i * MANY_SLOT, want, many_len(i)) == 0);
        }
        t_barrier(r);
    }
    free(out);
    free(in);
    free(want);
    free(seen);
    t_close(r);
}

/* ---- untagged: multi-receive buffers (MPICH's active messages), cancel ---- */

static void multi_recv_and_cancel(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        t_barrier(r);
        uint8_t m[100];
        for (int i = 0; i < 10; i++) {
            memset(m, 'a' + i, sizeof m);
            REQ_RC(fi_send(r->ep, m, sizeof m, NULL, r->addr[0], m), 0);
            REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        }
        t_barrier(r);
    } else {
        size_t min = 256;
        REQ_RC(fi_setopt(&r->ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV,
                         &min, sizeof min), 0);
        static uint8_t a[1024], b[1024];
        struct iovec va = {a, sizeof a}, vb = {b, sizeof b};
        struct fi_msg ma = {.msg_iov = &va, .iov_count = 1,
                            .addr = FI_ADDR_UNSPEC, .context = a};
        struct fi_msg mb = {.msg_iov = &vb, .iov_count = 1,
                            .addr = FI_ADDR_UNSPEC, .context = b};
        REQ_RC(fi_recvmsg(r->ep, &ma, FI_MULTI_RECV | FI_COMPLETION), 0);
        REQ_RC(fi_recvmsg(r->ep, &mb, FI_MULTI_RECV | FI_COMPLETION), 0);
        /* a receive that will be cancelled */
        uint64_t never;
        REQ_RC(fi_trecv(r->ep, &never, 8, NULL, r->addr[1], 999, 0, &never), 0);
        t_barrier(r);
        for (int i = 0; i < 10; i++) {
            REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
            /* 8 x 100 B leave 224 < 256 in a: released with the 8th */
            uint8_t *want_buf = i < 8 ? a : b;
            REQ(e.op_context == want_buf && e.len == 100);
            REQ((uint8_t *)e.buf == want_buf + (size_t)(i % 8) * 100);
            REQ(((uint8_t *)e.buf)[0] == 'a' + i && ((uint8_t *)e.buf)[99] == 'a' + i);
            REQ(!!(e.flags & FI_MULTI_RECV) == (i == 7));
        }
        t_barrier(r);
        REQ_RC(fi_cancel(&r->ep->fid, &never), 0);
        REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_ECANCELED);
        REQ(err.op_context == &never);
    }
    t_close(r);
}

/* ---- a target that never calls in: FI_PROGRESS_AUTO answers ---- */

static void auto_progress(struct rank *r)
{
    if (r->me == 0)
        setenv("FIV_TEST_AUTO", "1", 1);
    t_open(r, api_version);
    if (r->me == 0)
        REQ(r->info->domain_attr->data_progress == FI_PROGRESS_AUTO);
    t_exchange(r);
    uint64_t words[4] = {0, 0, 0, 0};
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, words, sizeof words,
                     FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL), 0);
    struct target t = {(uint64_t)(uintptr_t)words, fi_mr_key(mr)};
    t_bcast(r, 0, &t, sizeof t);
    if (r->me == 0) {
        /* no libfabric call until rank 1 is done */
        t_barrier_plain(r);
        REQ(words[0] == 0x5555 && words[1] == 3);
    } else {
        struct fi_cq_tagged_entry e;
        uint64_t v = 0x5555, one = 3, old = 1, back = 0;
        REQ_RC(fi_write(r->ep, &v, 8, NULL, r->addr[0], t.addr, t.key, &v), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ_RC(fi_fetch_atomic(r->ep, &one, 1, NULL, &old, NULL, r->addr[0],
                               t.addr + 8, t.key, FI_UINT64, FI_SUM, &old), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(old == 0);
        REQ_RC(fi_read(r->ep, &back, 8, NULL, r->addr[0], t.addr, t.key, &back), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        REQ(back == 0x5555);
        t_barrier_plain(r);
    }
    t_barrier_plain(r);
    fi_close(&mr->fid);
    t_close(r);
}

/* ---- a peer that sends before we inserted it: kept, then delivered ---- */

static void late_insert(struct rank *r)
{
    if (r->me == 1)
        t_insert_delay_ms = 300; /* rank 0's messages arrive first */
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    uint8_t big[100000];
    if (r->me == 0) {
        for (int i = 0; i < 3; i++) {
            uint64_t v = 10 + (uint64_t)i;
            REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[1], 20 + (uint64_t)i), 0);
        }
        memset(big, 0x5a, sizeof big);
        REQ_RC(fi_tsend(r->ep, big, sizeof big, NULL, r->addr[1], 30, big), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
    } else {
        for (int i = 0; i < 3; i++) {
            uint64_t v = 0;
            fi_addr_t src = FI_ADDR_NOTAVAIL;
            REQ_RC(fi_trecv(r->ep, &v, 8, NULL, FI_ADDR_UNSPEC, 20 + (uint64_t)i,
                            0, &v), 0);
            REQ_RC(t_wait(r, &e, NULL, &src, 10000), 0);
            REQ(v == 10 + (uint64_t)i && src == r->addr[0]);
        }
        memset(big, 0, sizeof big);
        REQ_RC(fi_trecv(r->ep, big, sizeof big, NULL, r->addr[0], 30, 0, big), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        for (size_t i = 0; i < sizeof big; i++)
            REQ(big[i] == 0x5a);
    }
    t_barrier(r);
    t_close(r);
}

/* ---- a peer that never inserts us (Open MPI 5 inserts a peer only
   when it first sends to it): it hears our introduction ---- */

static void never_inserted(struct rank *r)
{
    if (r->me == 1)
        t_insert_mask = 1u << 1; /* itself only */
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    uint64_t words[2] = {5, 0};
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, words, sizeof words,
                     FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL), 0);
    struct target t = {(uint64_t)(uintptr_t)words, fi_mr_key(mr)};
    t_bcast(r, 1, &t, sizeof t);
    static uint8_t big[100000], got[100000];
    if (r->me == 0) {
        uint64_t v = 42, one = 7, old = 0, back = 0;
        memset(big, 0x3c, sizeof big);
        REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[1], 1, &v), 0);
        REQ_RC(fi_tsend(r->ep, big, sizeof big, NULL, r->addr[1], 2, big), 0);
        for (int k = 0; k < 2; k++)
            REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        /* one-sided on a target that never named us */
        uint64_t w = 0x77;
        REQ_RC(fi_write(r->ep, &w, 8, NULL, r->addr[1], t.addr, t.key, &w), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ_RC(fi_fetch_atomic(r->ep, &one, 1, NULL, &old, NULL, r->addr[1],
                               t.addr + 8, t.key, FI_UINT64, FI_SUM, &old), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(old == 0);
        REQ_RC(fi_read(r->ep, &back, 8, NULL, r->addr[1], t.addr, t.key, &back),
               0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(back == 0x77);
        t_barrier(r);
        /* arrives before rank 1 inserts us, matched after */
        uint64_t x = 43;
        REQ_RC(fi_tinject(r->ep, &x, 8, r->addr[1], 3), 0);
        t_barrier(r);
        uint64_t reply = 0;
        fi_addr_t src;
        REQ_RC(fi_trecv(r->ep, &reply, 8, NULL, r->addr[1], 4, 0, &reply), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 10000), 0);
        REQ(reply == 44 && src == r->addr[1]);
    } else {
        uint64_t v = 0;
        fi_addr_t src = 0;
        REQ_RC(fi_trecv(r->ep, &v, 8, NULL, FI_ADDR_UNSPEC, 1, 0, &v), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 10000), 0);
        REQ(v == 42 && src == FI_ADDR_NOTAVAIL);
        REQ_RC(fi_trecv(r->ep, got, sizeof got, NULL, FI_ADDR_UNSPEC, 2, 0, got),
               0);
        REQ_RC(t_wait(r, &e, NULL, &src, 10000), 0);
        REQ(e.len == sizeof got && src == FI_ADDR_NOTAVAIL);
        for (size_t i = 0; i < sizeof got; i++)
            REQ(got[i] == 0x3c);
        t_barrier(r); /* serves rank 0's RMA meanwhile */
        REQ(words[0] == 0x77 && words[1] == 7);
        t_barrier(r);
        for (uint64_t end = t_now_ms() + 100; t_now_ms() < end;)
            (void)fi_cq_read(r->cq, &e, 0);
        t_insert(r, 0);
        uint64_t x = 0, reply = 44;
        REQ_RC(fi_trecv(r->ep, &x, 8, NULL, r->addr[0], 3, 0, &x), 0);
        REQ_RC(t_wait(r, &e, NULL, &src, 10000), 0);
        REQ(x == 43 && src == r->addr[0]);
        REQ_RC(fi_tsend(r->ep, &reply, 8, NULL, r->addr[0], 4, &reply), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
    }
    t_barrier(r);
    fi_close(&mr->fid);
    t_close(r);
}

/* ---- a message lost on the way (FIV_TEST_LOSE=3 in rank 0: its third
   region message to rank 1, after the introduction and tag 1, is counted
   and dropped, as garbage in the ring would lose it) ends what waits on
   that path with an error on both sides, by the probes' bound ---- */

static void lost_message(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    uint64_t a = 1, b = 2, got = 0;
    uint64_t t0;
    if (r->me == 0) {
        REQ_RC(fi_tinject(r->ep, &a, 8, r->addr[1], 1), 0);
        REQ_RC(fi_tinject(r->ep, &b, 8, r->addr[1], 2), 0); /* lost */
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[1], 9, 0, &got), 0);
        t0 = t_now_ms();
        REQ_RC(t_wait(r, &e, &err, NULL, 10000), -FI_EIO);
        REQ(err.op_context == &got);
    } else {
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[0], 1, 0, &got), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(got == 1);
        /* any source: the path it waits on is the broken one */
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, FI_ADDR_UNSPEC, 2, 0, &got), 0);
        t0 = t_now_ms();
        REQ_RC(t_wait(r, &e, &err, NULL, 10000), -FI_EIO);
        REQ(err.op_context == &got);
    }
    uint64_t took = t_now_ms() - t0;
    if (took > 5000)
        fprintf(stderr, "rank %d: the error took %llu ms\n", r->me,
                (unsigned long long)took);
    REQ(took <= 5000);
    /* nothing more goes either way */
    int peer = 1 - r->me;
    REQ_RC(fi_tsend(r->ep, &a, 8, NULL, r->addr[peer], 3, &a), 0);
    REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_EHOSTUNREACH);
    REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[peer], 4, 0, &got), 0);
    REQ_RC(t_wait(r, &e, &err, NULL, 5000), -FI_EIO);
    t_barrier(r);
    t_close(r);
}

/* ---- a peer that stays away from libfabric for 3 s while we wait for
   it is no error: our probes wait for it like everything else ---- */

static void busy_peer(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    uint64_t v = 5, got = 0;
    int peer = 1 - r->me;
    /* the pair has talked before */
    REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[peer], 1, 0, &got), 0);
    REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[peer], 1), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
    t_barrier(r);
    if (r->me == 0) {
        sleep(3);
        REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[1], 2), 0);
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[1], 3, 0, &got), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
    } else {
        REQ_RC(fi_trecv(r->ep, &got, 8, NULL, r->addr[0], 2, 0, &got), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ_RC(fi_tinject(r->ep, &v, 8, r->addr[0], 3), 0);
    }
    t_barrier(r);
    t_close(r);
}

/* ---- a peer killed in the middle of a message ---- */

static void killed_mid_message(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    const size_t big = 8 << 20;
    uint8_t *buf = malloc(big);
    REQ(buf);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        memset(buf, 1, big);
        REQ_RC(fi_tsend(r->ep, buf, big, NULL, r->addr[0], 1, buf), 0);
        /* what fit in the ring is out, the rest is queued; wait (without
           pushing more) until rank 0 took it, die */
        t_barrier_plain(r);
        t_barrier_plain(r);
        raise(SIGKILL);
    }
    /* take nothing while rank 1 is inside fi_tsend: a receiver draining
       the ring as fast as the sender fills it lets the whole message
       through before the send returns */
    t_barrier_plain(r);
    REQ_RC(fi_trecv(r->ep, buf, big, NULL, r->addr[1], 1, 0, buf), 0);
    for (uint64_t end = t_now_ms() + 200; t_now_ms() < end;) {
        ssize_t n = fi_cq_read(r->cq, &e, 1);
        if (n == -FI_EAVAIL) {
            memset(&err, 0, sizeof err);
            fi_cq_readerr(r->cq, &err, 0);
            fprintf(stderr, "rank 0: error %d (%s) before the kill\n",
                    err.err, fi_strerror(err.err));
        }
        REQ_RC(n, -FI_EAGAIN);
    }
    t_barrier(r);
    uint64_t t0 = t_now_ms();
    int rc = t_wait(r, &e, &err, NULL, 10000);
    REQ(rc == -FI_EIO && err.op_context == buf);
    REQ(t_now_ms() - t0 < 5000);
    free(buf);
    t_close(r);
}

/* ---- three ranks: 0 and 1 share a region, 2 has its own ---- */

static void mixed(struct rank *r)
{
    t_open(r, api_version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    /* a ring: everyone sends 8 B and 1 MiB to the next, receives from the
       previous (0->1 region, 1->2 and 2->0 core) */
    int next = (r->me + 1) % 3, prev = (r->me + 2) % 3;
    const size_t big = 1 << 20;
    uint8_t *out = malloc(big), *in = malloc(big), *want = malloc(big);
    REQ(out && in && want);
    fill(out, big, (unsigned)r->me);
    fill(want, big, (unsigned)prev);
    uint64_t v = 1000 + (uint64_t)r->me, got = 0;
    REQ_RC(fi_trecv(r->ep, &got, 8, NULL, FI_ADDR_UNSPEC, 3, 0, &got), 0);
    REQ_RC(fi_trecv(r->ep, in, big, NULL, r->addr[prev], 4, 0, in), 0);
    t_barrier(r);
    REQ_RC(fi_tsend(r->ep, &v, 8, NULL, r->addr[next], 3, &v), 0);
    REQ_RC(fi_tsend(r->ep, out, big, NULL, r->addr[next], 4, out), 0);
    fi_addr_t src;
    for (int k = 0; k < 4; k++) {
        int rc = t_wait(r, &e, NULL, &src, 10000);
        if (rc)
            fprintf(stderr, "rank %d: completion %d of 4 missing (8 B in %s, "
                    "1 MiB in %s)\n", r->me, k, got ? "done" : "waiting",
                    in[0] == want[0] && in[big - 1] == want[big - 1]
                        ? "done" : "waiting");
        REQ_RC(rc, 0);
        if (e.op_context == &got)
            REQ(src == r->addr[prev]);
    }
    REQ(got == 1000 + (uint64_t)prev);
    REQ(memcmp(in, want, big) == 0);
    /* RMA over the core path: 2 reads 0's word */
    uint64_t word = 0xabcdef, rd = 0;
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, &word, 8, FI_REMOTE_READ, 0, 0, 0, &mr, NULL), 0);
    struct target t = {(uint64_t)(uintptr_t)&word, fi_mr_key(mr)};
    t_bcast(r, 0, &t, sizeof t);
    if (r->me == 2) {
        REQ_RC(fi_read(r->ep, &rd, 8, NULL, r->addr[0], t.addr, t.key, &rd), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 10000), 0);
        REQ(rd == 0xabcdef);
    }
    t_barrier(r);
    fi_close(&mr->fid);
    free(out);
    free(in);
    free(want);
    t_close(r);
}

/* ivshmem-server of this build tree (beside the provider's directory). */
static pid_t start_server(const char *sock)
{
    char exe[512], bin[600];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return -1;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash)
        return -1;
    *slash = 0;
    snprintf(bin, sizeof bin, "%s/../ivshmem-server", exe);
    unlink(sock);
    pid_t p = fork();
    if (p == 0) {
        execl(bin, bin, "-S", sock, "-F", "-l", "64M", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 500 && access(sock, F_OK) != 0; i++)
        usleep(10000);
    if (access(sock, F_OK) != 0) {
        kill(p, SIGKILL);
        waitpid(p, NULL, 0);
        fprintf(stderr, "ivshmem-server (%s) did not start\n", bin);
        return -1;
    }
    return p;
}

static int report_field(const char *path, const char *field)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[512];
    int val = -1;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "fi_ivshm: pid ");
        const char *q = p ? strstr(p, field) : NULL;
        if (q)
            val = atoi(q + strlen(field));
    }
    fclose(f);
    return val;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        api_version = FI_VERSION(atoi(argv[1]), argc > 2 ? atoi(argv[2]) : 0);
    if (!getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "FI_PROVIDER_PATH must name the provider's directory\n");
        return 2;
    }
    /* lines, not a buffer forked children would inherit */
    setvbuf(stdout, NULL, _IOLBF, 0);
    int failed = 0;

    char env_a[256], env_b[256];
    const char *ra = t_region(8, 0);
    snprintf(env_a, sizeof env_a, "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", ra);
    const char *env2[] = {env_a, env_a};
    int f = t_run(2, two_on_region, env2, 60, NULL);
    printf("%s: two ranks on one region (tagged, wildcard, large, truncation, "
           "probe, self, RMA, atomics, errors)\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, many_outstanding, env2, 60, NULL);
    printf("%s: %d tagged receives and sends outstanding each way (expected, "
           "unexpected, wildcard)\n", f ? "FAIL" : "ok", MANY);
    failed += f;

    f = t_run(2, multi_recv_and_cancel, env2, 30, NULL);
    printf("%s: multi-receive buffers, cancel\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, auto_progress, env2, 30, NULL);
    printf("%s: a target that never calls in (FI_PROGRESS_AUTO)\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, late_insert, env2, 30, NULL);
    printf("%s: a peer that sent before we inserted it\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, never_inserted, env2, 30, NULL);
    printf("%s: a peer that never inserted us hears us (messages, RMA), "
           "then inserts us\n", f ? "FAIL" : "ok");
    failed += f;

    char env_lose[300];
    snprintf(env_lose, sizeof env_lose, "%s;FIV_TEST_LOSE=3", env_a);
    const char *env_l[] = {env_lose, env_a};
    f = t_run(2, lost_message, env_l, 30, NULL);
    printf("%s: a message lost on the way fails what waits on its path, on "
           "both sides\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, busy_peer, env2, 30, NULL);
    printf("%s: a peer away from libfabric for 3 s is no error\n",
           f ? "FAIL" : "ok");
    failed += f;

    f = t_run_ex(2, killed_mid_message, env2, 30, NULL, 2u);
    printf("%s: a peer killed in the middle of a message\n", f ? "FAIL" : "ok");
    failed += f;

    /* through an ivshmem-server (eventfd doorbells, a sealed memfd) */
    char sock[96], env_s[160];
    snprintf(sock, sizeof sock, "/tmp/fiv-server-%d.sock", (int)getpid());
    pid_t server = start_server(sock);
    f = server < 0;
    if (!f) {
        snprintf(env_s, sizeof env_s, "FI_IVSHM_SOCKET=%s;FI_IVSHM_CORE=none",
                 sock);
        const char *envs[] = {env_s, env_s};
        f = t_run(2, check_tagged_only, envs, 60, NULL);
        kill(server, SIGTERM);
        waitpid(server, NULL, 0);
        unlink(sock);
    }
    printf("%s: two ranks attached through an ivshmem-server\n",
           f ? "FAIL" : "ok");
    failed += f;

    const char *nothing[] = {"FI_IVSHM_REPORT=1", "FI_IVSHM_REPORT=1"};
    unsetenv("FI_IVSHM_REGION");
    unsetenv("IVSHM_REGION");
    f = t_run(2, check_tagged_only, nothing, 60, NULL);
    printf("%s: no region: everything through the core provider\n",
           f ? "FAIL" : "ok");
    failed += f;

    const char *rb = t_region(8, 0);
    char tmpl[] = "/tmp/fiv-report-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd >= 0)
        close(fd);
    t_track(tmpl);
    for (int i = 0; i < 3; i++) {
        char p[300];
        snprintf(p, sizeof p, "%s.%d", tmpl, i);
        t_track(p);
    }
    /* with AV maps this time */
    snprintf(env_a, sizeof env_a,
             "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1;FIV_TEST_AV_MAP=1", ra);
    snprintf(env_b, sizeof env_b,
             "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1;FIV_TEST_AV_MAP=1", rb);
    const char *env3[] = {env_a, env_a, env_b};
    f = t_run(3, mixed, env3, 60, tmpl);
    char p0[300], p2[300];
    snprintf(p0, sizeof p0, "%s.0", tmpl);
    snprintf(p2, sizeof p2, "%s.2", tmpl);
    /* rank 0 sent over the region (to 1) and delegated (to 2); rank 2 only
       delegated */
    int s0 = report_field(p0, " sent "), d0 = report_field(p0, " delegated ");
    int s2 = report_field(p2, " sent "), d2 = report_field(p2, " delegated ");
    int r2 = report_field(p2, " received ");
    if (!f && !(s0 > 0 && d0 > 0 && s2 == 0 && r2 == 0 && d2 > 0)) {
        fprintf(stderr, "report lines: rank 0 sent %d delegated %d; rank 2 "
                "sent %d received %d delegated %d\n", s0, d0, s2, r2, d2);
        f = 1;
    }
    printf("%s: three ranks, one through the core provider (AV map, report "
           "lines)\n",
           f ? "FAIL" : "ok");
    failed += f;
    for (int i = 0; i < 3; i++) {
        char p[300];
        snprintf(p, sizeof p, "%s.%d", tmpl, i);
        if (f) {
            FILE *x = fopen(p, "r");
            char line[512];
            while (x && fgets(line, sizeof line, x))
                fprintf(stderr, "rank %d: %s", i, line);
            if (x)
                fclose(x);
        }
        unlink(p);
    }
    unlink(tmpl);
    printf("%s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}
