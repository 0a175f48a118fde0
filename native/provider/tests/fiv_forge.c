/*
 * A forging co-tenant against one rank of the provider (docs/security.md,
 * "The libfabric provider", "Well-formed messages of an admitted rank").
 *
 * The forger is a real process attached to the victim's region through
 * libivshm, registered under the provider's job tag with a registry name
 * of its own, whose name (struct fiv_addr) the victim inserts into its AV:
 * to the victim it is an admitted rank, exactly as a co-tenant writing
 * well-formed cells under a genuine rank's slot would be. It speaks the
 * provider's protocol by hand (fiv.h: headers, continuations, the wire
 * check), so it can stop in the middle of a message, an answer or a
 * write, and go on after the victim has closed, cancelled, discarded or
 * removed what that message pointed at. The two synchronise over a
 * socket pair: each case waits for what the victim observes (its bytes
 * landing, a peek finding the message), never for a time.
 *
 * The oracle: no sanitizer report (the victim and the forger run under
 * ASan/UBSan in the sanitized build); no byte written to the victim's
 * memory that is not, at that moment, registered or posted (victim
 * buffers sit between PROT_NONE guard pages, a buffer the application
 * got back is made PROT_NONE or refilled with "private" bytes that must
 * stay intact); none of those private bytes reaches the forger; the
 * victim's heap grows by no more than its per-peer caps; every call
 * returns within its deadline and every affected operation completes.
 *
 * FIV_FORGE_ROUNDS (default 1) runs every case that many times (make
 * test-fi-hostile-long); FIV_FORGE_CASE runs one case by name.
 */
#include "fiv_test.h"

#include <inttypes.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "ivshm_admin.h"

#include "fiv.h"

/* fiv_test.h's helpers for ranks that talk to each other: not needed by
   a victim whose one peer is the forger */
static int (*const use_run_)(int, t_body, const char *const *, int,
                             const char *) __attribute__((unused)) = t_run;
static int (*const use_wait_)(struct rank *, struct fi_cq_tagged_entry *,
                              struct fi_cq_err_entry *, fi_addr_t *, int)
    __attribute__((unused)) = t_wait;
static void (*const use_exchange_)(struct rank *) __attribute__((unused)) =
    t_exchange;
static void (*const use_close_)(struct rank *) __attribute__((unused)) =
    t_close;

#define JOB_TAG (UINT64_C(0x46495653) << 32) /* the provider's (fiv_ep.c) */
#define MARK 0x5a       /* the forger's payload bytes                     */
#define PRIVATE 0xee    /* the victim's memory it never offered           */
#define CALL_MS 2000    /* a call that does not return by then hangs      */
#define CLOSE_MS 4000   /* fi_close(ep): queued sends get up to 2 s       */

/* Heap the victim may hold for one peer that never drains: the answer
   cap (FI_IVSHM_PEER_ANSWER_BYTES' default) and slack for the rest. */
#define HEAP_SLACK (96u << 20)

/* Counted live heap: ASan's when it is there (freed blocks sit in its
   quarantine, which RSS would count), glibc's otherwise. */
extern size_t __sanitizer_get_current_allocated_bytes(void)
    __attribute__((weak));
static size_t heap_bytes(void)
{
    if (__sanitizer_get_current_allocated_bytes)
        return __sanitizer_get_current_allocated_bytes();
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static const char *region;
static size_t frag;      /* payload bytes of one slot */
static struct fiv_addr victim_name; /* the forger's copy, for a real peer */

/* ---- control messages between victim and forger: 64 bytes each ---- */

struct ctl {
    char what;
    uint8_t pad[7];
    uint64_t a, b, c, d;
    uint8_t blob[24];
};
_Static_assert(sizeof(struct ctl) == 64, "one control message");

static void ctl_send(int fd, char what, uint64_t a, uint64_t b, uint64_t c)
{
    struct ctl m = {.what = what, .a = a, .b = b, .c = c};
    REQ(write(fd, &m, sizeof m) == (ssize_t)sizeof m);
}

static struct ctl ctl_recv(int fd, char want)
{
    struct ctl m;
    ssize_t n = read(fd, &m, sizeof m);
    if (n != (ssize_t)sizeof m || m.what != want) {
        fprintf(stderr, "[pid %d] control: wanted '%c', got %zd bytes '%c'\n",
                (int)getpid(), want, n, n > 0 ? m.what : '?');
        _exit(98);
    }
    return m;
}

static bool ctl_ready(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) == 1;
}

/* ---- victim buffers: page-multiple, between PROT_NONE guard pages ---- */

static uint8_t *gbuf(size_t len)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    REQ(len % pg == 0);
    uint8_t *m = mmap(NULL, len + 2 * pg, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQ(m != MAP_FAILED);
    REQ(mprotect(m, pg, PROT_NONE) == 0);
    REQ(mprotect(m + pg + len, pg, PROT_NONE) == 0);
    return m + pg;
}

/* The application got `b` back: nothing may touch it any more. */
static void gbuf_revoke(uint8_t *b, size_t len)
{
    REQ(mprotect(b, len, PROT_NONE) == 0);
}

static size_t count_not(const uint8_t *b, size_t len, uint8_t v)
{
    size_t k = 0;
    for (size_t i = 0; i < len; i++)
        k += b[i] != v;
    return k;
}

/* ---- the victim: one rank of the provider ---- */

struct victim {
    struct rank r;
    int ctl;
    fi_addr_t forger;
    /* completions seen, by context */
    struct done {
        void *ctx;
        size_t len;
        int err;
        uint64_t flags, tag;
    } done[64];
    int ndone;
    uint64_t ncomp;        /* every completion read, logged or not */
    size_t heap0, heap_peak;
    const char *fail;      /* first failed check, for the case's line */
    char why[256];
};

static void vfail(struct victim *v, const char *fmt, ...)
{
    if (v->fail)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->why, sizeof v->why, fmt, ap);
    va_end(ap);
    v->fail = v->why;
}

/* One progress call, its completions logged. */
static void vpoll(struct victim *v)
{
    struct fi_cq_tagged_entry e;
    ssize_t n = fi_cq_read(v->r.cq, &e, 1);
    v->ncomp += n == 1 || n == -FI_EAVAIL;
    if (n == 1 && v->ndone < 64) {
        v->done[v->ndone++] = (struct done){e.op_context, e.len, 0, e.flags,
                                            e.tag};
    } else if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        if (fi_cq_readerr(v->r.cq, &err, 0) == 1 && v->ndone < 64)
            v->done[v->ndone++] = (struct done){err.op_context, err.len,
                                                err.err, err.flags, err.tag};
    }
    size_t h = heap_bytes();
    if (h > v->heap_peak)
        v->heap_peak = h;
}

static struct done *vdone(struct victim *v, void *ctx)
{
    for (int i = 0; i < v->ndone; i++)
        if (v->done[i].ctx == ctx)
            return &v->done[i];
    return NULL;
}

/* Progress until `cond` holds or `ms` pass: whether it held. */
#define VWAIT(v, cond, ms)                                                    \
    ({                                                                        \
        uint64_t end_ = t_now_ms() + (ms);                                    \
        bool ok_;                                                             \
        while (!(ok_ = (cond)) && t_now_ms() < end_)                          \
            vpoll(v);                                                         \
        ok_;                                                                  \
    })

/* A call that must return within `ms`. */
#define TIMED(v, ms, call)                                                    \
    ({                                                                        \
        uint64_t t0_ = t_now_ms();                                            \
        long long trc_ = (long long)(call);                                   \
        uint64_t dt_ = t_now_ms() - t0_;                                      \
        if (dt_ > (uint64_t)(ms))                                             \
            vfail(v, "%s took %llu ms (bound %d)", #call,                     \
                  (unsigned long long)dt_, (int)(ms));                        \
        trc_;                                                                 \
    })

static void victim_open(struct victim *v)
{
    t_open(&v->r, FI_VERSION(1, 17));
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    REQ_RC(fi_getname(&v->r.ep->fid, name, &len), 0);
    REQ(write(v->ctl, name, FIV_ADDR_LEN) == (ssize_t)FIV_ADDR_LEN);
    struct ctl m = ctl_recv(v->ctl, 'N');
    (void)m;
    uint8_t theirs[FIV_ADDR_LEN];
    t_read_full(v->ctl, theirs, sizeof theirs);
    REQ_RC(fi_av_insert(v->r.av, theirs, 1, &v->forger, 0, NULL), 1);
    v->heap0 = v->heap_peak = heap_bytes();
}

static void victim_close(struct victim *v, bool ep_closed)
{
    if (!ep_closed)
        REQ_RC(TIMED(v, CLOSE_MS, fi_close(&v->r.ep->fid)), 0);
    REQ_RC(fi_close(&v->r.av->fid), 0);
    REQ_RC(fi_close(&v->r.cq->fid), 0);
    REQ_RC(fi_close(&v->r.rcntr->fid), 0);
    REQ_RC(fi_close(&v->r.wcntr->fid), 0);
    REQ_RC(fi_close(&v->r.dom->fid), 0);
    REQ_RC(fi_close(&v->r.fab->fid), 0);
    fi_freeinfo(v->r.info);
}

static struct fid_mr *reg(struct victim *v, void *buf, size_t len,
                          uint64_t access)
{
    struct fid_mr *mr = NULL;
    REQ_RC(fi_mr_reg(v->r.dom, buf, len, access, 0, 0, 0, &mr, NULL), 0);
    ctl_send(v->ctl, 'K', (uint64_t)(uintptr_t)buf, fi_mr_key(mr), len);
    return mr;
}

/* ---- the forger: an admitted rank writing the protocol by hand ---- */

struct forger {
    ivshm *h;
    int ctl;
    int victim;           /* the victim's slot */
};

static uint64_t random64(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x)
        x = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ t_now_ms();
    return x | 1;
}

static void forger_open(struct forger *f)
{
    uint64_t nonce = random64();
    char name[32];
    snprintf(name, sizeof name, "fi.%016" PRIx64, nonce);
    ivshm_config cfg = {.job_id = JOB_TAG, .rank = (uint32_t)nonce,
                        .name = name, .spin_ns = 1};
    REQ_RC(ivshm_attach_path(region, &cfg, &f->h), 0);
    ivshm_geometry g;
    ivshm_get_geometry(f->h, &g);
    frag = g.slot_size - 32; /* libivshm's slot header */
    ivshm_peer_info me;
    REQ_RC(ivshm_peer(f->h, ivshm_self(f->h), &me), 0);
    struct fiv_addr a;
    memset(&a, 0, sizeof a);
    a.magic = FIV_ADDR_MAGIC;
    a.version = FIV_ADDR_VERSION;
    a.slot = (int16_t)ivshm_self(f->h);
    a.generation = me.generation;
    a.nonce[0] = (uint32_t)nonce;
    a.nonce[1] = (uint32_t)(nonce >> 32);
    uint64_t k[2] = {random64(), random64()};
    memcpy(a.key, k, sizeof a.key);
    /* a core address nobody listens at: a victim with a core provider
       takes it into its AV when it moves the pair (forged_switch_*) */
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(9)};
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    memcpy(a.core, &sin, sizeof sin);
    a.core_len = sizeof sin;
    struct fiv_addr theirs;
    t_read_full(f->ctl, &theirs, sizeof theirs);
    REQ(theirs.magic == FIV_ADDR_MAGIC && theirs.slot >= 0);
    f->victim = theirs.slot;
    victim_name = theirs;
    ctl_send(f->ctl, 'N', 0, 0, 0);
    REQ(write(f->ctl, &a, sizeof a) == (ssize_t)sizeof a);
}

/* One well-formed region message: the wire check in its tag. */
static int fsend(struct forger *f, uint32_t op, const void *hdr, size_t hlen,
                 const void *data, size_t n)
{
    static uint8_t buf[1 << 16];
    REQ(hlen + n <= frag);
    if (hlen)
        memcpy(buf, hdr, hlen);
    if (n)
        memcpy(buf + hlen, data, n);
    uint32_t tag = fiv_wire_tag(op, buf, hlen + n);
    return ivshm_send_timeout(f->h, f->victim, tag, buf, hlen + n, CALL_MS);
}

static uint8_t marks[1 << 16];

/* The first fragment of a message of `len` bytes: how many it carried. */
static size_t msg_first(struct forger *f, bool tagged, uint64_t tag,
                        size_t len)
{
    struct fiv_msg_hdr h = {.tag = tag, .len = len};
    size_t k = len < frag - sizeof h ? len : frag - sizeof h;
    REQ_RC(fsend(f, FIV_OP_MSG | (tagged ? FIV_F_TAGGED : 0), &h, sizeof h,
                 marks, k), 0);
    return k;
}

/* Continuations from `got` up to `len`, or until the victim has gone
   (its endpoint closed). */
static void more(struct forger *f, size_t got, size_t len)
{
    while (got < len) {
        size_t k = len - got < frag ? len - got : frag;
        if (fsend(f, FIV_OP_MORE, NULL, 0, marks, k) < 0)
            return;
        got += k;
    }
}

static void small(struct forger *f, bool tagged, uint64_t tag, uint8_t byte)
{
    struct fiv_msg_hdr h = {.tag = tag, .len = 8};
    uint8_t p[8];
    memset(p, byte, sizeof p);
    REQ_RC(fsend(f, FIV_OP_MSG | (tagged ? FIV_F_TAGGED : 0), &h, sizeof h,
                 p, sizeof p), 0);
}

static void rma_req(struct forger *f, uint32_t op, uint64_t addr, uint64_t key,
                    uint64_t len, uint64_t id, const void *data, size_t n)
{
    struct fiv_rma_hdr h = {.addr = addr, .key = key, .len = len, .id = id};
    REQ_RC(fsend(f, op, &h, sizeof h, data, n), 0);
}

/* The victim's next answer to us (INTROs and probes skipped): its op, the
   header in *h, payload bytes in buf (up to cap); -1 on timeout. */
static int answer(struct forger *f, struct fiv_resp_hdr *h, uint8_t *buf,
                  size_t cap, size_t *n, int ms)
{
    static uint8_t m[1 << 16];
    for (uint64_t end = t_now_ms() + (uint64_t)ms; t_now_ms() < end;) {
        uint32_t tag = 0;
        int src = -1;
        ssize_t len = ivshm_recv(f->h, f->victim, &src, &tag, m, sizeof m, 50);
        if (len == -ETIMEDOUT || len == -EAGAIN)
            continue;
        if (len < 0)
            return -1;
        uint32_t op = tag & FIV_OP_MASK;
        if (op == FIV_OP_INTRO || op == FIV_OP_PROBE || op == FIV_OP_PROBE_ACK)
            continue;
        size_t off = 0;
        if (op != FIV_OP_MORE) {
            if ((size_t)len < sizeof *h)
                return -1;
            memcpy(h, m, sizeof *h);
            off = sizeof *h;
        }
        *n = (size_t)len - off < cap ? (size_t)len - off : cap;
        if (buf)
            memcpy(buf, m + off, *n);
        return (int)op;
    }
    return -1;
}

/* ---- the cases ---- */

struct fcase {
    const char *name;
    void (*victim)(struct victim *v);
    void (*forger)(struct forger *f);
    const char *what;
    const char *env;      /* "K=V" for the victim ("K=V K2=V2": each), or
                             NULL */
};

/* 1. The continuations of an RMA WRITE after the window's MR is closed
   and its memory reused: nothing lands, and the write is refused. */
#define WLEN (64u << 10)
static void v_write_after_close(struct victim *v)
{
    uint8_t *w = gbuf(WLEN);
    memset(w, 0, WLEN);
    struct fid_mr *mr = reg(v, w, WLEN, FI_REMOTE_WRITE);
    ctl_recv(v->ctl, 'F');
    if (!VWAIT(v, w[0] == MARK, CALL_MS))
        vfail(v, "the first fragment of the write never landed");
    REQ_RC(TIMED(v, CALL_MS, fi_close(&mr->fid)), 0);
    memset(w, PRIVATE, WLEN); /* the memory now holds something else */
    ctl_send(v->ctl, 'C', 0, 0, 0);
    (void)VWAIT(v, ctl_ready(v->ctl), 5000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    size_t hit = count_not(w, WLEN, PRIVATE);
    if (hit)
        vfail(v, "%zu B of the victim's private memory overwritten after "
              "fi_close(mr)", hit);
    if (a.a == 0)
        vfail(v, "no answer to the write came");
    else if ((int64_t)a.b != -FI_EACCES)
        vfail(v, "the write was answered with status %" PRId64 ", not "
              "-FI_EACCES", (int64_t)a.b);
}

static void f_write_after_close(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = k.c, .id = 7};
    size_t first = frag - sizeof h;
    REQ_RC(fsend(f, FIV_OP_WRITE | FIV_F_ACK, &h, sizeof h, marks, first), 0);
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'C');
    more(f, first, k.c);
    struct fiv_resp_hdr r;
    size_t n;
    int op = answer(f, &r, NULL, 0, &n, 3000);
    ctl_send(f->ctl, 'A', op == FIV_OP_ACK && r.id == 7,
             (uint64_t)(int64_t)r.status, 0);
}

/* 2. A READ larger than the inline copy, answered fragment by fragment
   while the requester drains slowly; the target closes the MR and reuses
   the memory in between: none of the new bytes goes out. */
#define RLEN (1u << 20)
static void v_read_after_close(struct victim *v)
{
    uint8_t *w = gbuf(RLEN);
    memset(w, 0x11, RLEN);
    struct fid_mr *mr = reg(v, w, RLEN, FI_REMOTE_READ);
    (void)VWAIT(v, ctl_ready(v->ctl), CALL_MS);
    ctl_recv(v->ctl, 'F');
    REQ_RC(TIMED(v, CALL_MS, fi_close(&mr->fid)), 0);
    memset(w, PRIVATE, RLEN);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    (void)VWAIT(v, ctl_ready(v->ctl), 8000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%" PRIu64 " B of the victim's private memory sent to the "
              "co-tenant after fi_close(mr) (%" PRIu64 " B of answer read)",
              a.a, a.b);
}

static void f_read_after_close(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    rma_req(f, FIV_OP_READ, k.a, k.b, k.c, 9, NULL, 0);
    struct fiv_resp_hdr r;
    size_t n;
    static uint8_t b[1 << 16];
    int op = answer(f, &r, b, sizeof b, &n, 3000);
    REQ(op == FIV_OP_READ_RESP && r.status == 0);
    ctl_send(f->ctl, 'F', 0, 0, 0); /* and stop reading for now */
    ctl_recv(f->ctl, 'C');
    uint64_t leaked = 0, got = n;
    while ((op = answer(f, &r, b, sizeof b, &n, 500)) == FIV_OP_MORE) {
        leaked += count_not(b, n, 0x11);
        got += n;
    }
    ctl_send(f->ctl, 'A', leaked, got, 0);
}

/* 3. A multi-receive buffer cancelled while a message fills it: the
   buffer is the application's again (PROT_NONE here), the rest of the
   message goes nowhere, and a receive posted next gets the next message,
   not the rest of this one. */
#define MLEN (64u << 10)
static void v_multi_recv_cancel(struct victim *v)
{
    uint8_t *b = gbuf(MLEN), *r = gbuf(4096);
    memset(b, 0, MLEN);
    memset(r, 0, 4096);
    struct iovec iov = {b, MLEN};
    struct fi_msg m = {.msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC,
                       .context = b};
    REQ_RC(fi_recvmsg(v->r.ep, &m, FI_MULTI_RECV | FI_COMPLETION), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    ctl_recv(v->ctl, 'F');
    if (!VWAIT(v, b[0] == MARK, CALL_MS))
        vfail(v, "the first fragment never landed in the buffer");
    long long rc = TIMED(v, CALL_MS, fi_cancel(&v->r.ep->fid, b));
    if (rc == 0 && !VWAIT(v, vdone(v, b) != NULL, CALL_MS))
        vfail(v, "fi_cancel returned 0 but the buffer never completed");
    gbuf_revoke(b, MLEN);
    REQ_RC(fi_recv(v->r.ep, r, 4096, NULL, FI_ADDR_UNSPEC, r), 0);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    if (!VWAIT(v, vdone(v, r) != NULL, CALL_MS))
        vfail(v, "the receive posted after the cancel never completed");
    struct done *d = vdone(v, r);
    if (d && (d->err || d->len != 8 || r[0] != 0x77 || count_not(r, 8, 0x77)))
        vfail(v, "the receive posted after the cancel completed with a "
              "message it never received (err %d, %zu B, first byte %#x)",
              d->err, d->len, r[0]);
}

static void f_multi_recv_cancel(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    size_t k = msg_first(f, false, 0, 32u << 10);
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'C');
    more(f, k, 32u << 10);
    small(f, false, 0, 0x77);
}

/* 4. FI_PEEK|FI_CLAIM, then FI_CLAIM|FI_DISCARD, of a message still
   arriving; its continuations follow, then another message. */
static void peek_then_drop(struct victim *v, uint64_t drop_flags)
{
    uint8_t *r = gbuf(4096);
    char ctx;
    struct fi_msg_tagged m = {.addr = FI_ADDR_UNSPEC, .tag = 0x44,
                              .context = &ctx};
    ctl_recv(v->ctl, 'F');
    bool found = false;
    for (uint64_t end = t_now_ms() + CALL_MS; !found && t_now_ms() < end;) {
        v->ndone = 0;
        REQ_RC(fi_trecvmsg(v->r.ep, &m, FI_PEEK | (drop_flags & FI_CLAIM)), 0);
        (void)VWAIT(v, vdone(v, &ctx) != NULL, CALL_MS);
        struct done *d = vdone(v, &ctx);
        found = d && d->err == 0;
    }
    if (!found)
        vfail(v, "the peek never found the message");
    v->ndone = 0;
    REQ_RC(TIMED(v, CALL_MS, fi_trecvmsg(v->r.ep, &m, drop_flags)), 0);
    if (!VWAIT(v, vdone(v, &ctx) != NULL, CALL_MS))
        vfail(v, "the discard never completed");
    REQ_RC(fi_trecv(v->r.ep, r, 4096, NULL, FI_ADDR_UNSPEC, 0x45, 0, r), 0);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    if (!VWAIT(v, vdone(v, r) != NULL, CALL_MS))
        vfail(v, "the next message never arrived");
    struct done *d = vdone(v, r);
    if (d && (d->err || d->len != 8 || count_not(r, 8, 0x77)))
        vfail(v, "the next message arrived wrong (err %d, %zu B)", d->err,
              d->len);
}

static void v_claim_discard(struct victim *v)
{
    peek_then_drop(v, FI_CLAIM | FI_DISCARD);
}

static void v_peek_discard(struct victim *v)
{
    peek_then_drop(v, FI_PEEK | FI_DISCARD);
}

static void f_discard_arriving(struct forger *f)
{
    size_t k = msg_first(f, true, 0x44, 64u << 10);
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'C');
    more(f, k, 64u << 10);
    small(f, true, 0x45, 0x77);
}

/* 5. 48-byte READ requests of 64 KiB each while the requester drains
   nothing: the target's memory for that peer stays within its cap. */
#define FLOOD 4096
static void v_read_flood(struct victim *v)
{
    uint8_t *w = gbuf(64u << 10);
    memset(w, 0x11, 64u << 10);
    struct fid_mr *mr = reg(v, w, 64u << 10, FI_REMOTE_READ);
    (void)VWAIT(v, ctl_ready(v->ctl), 30000);
    struct ctl a = ctl_recv(v->ctl, 'D');
    uint64_t end = t_now_ms() + 200;
    while (t_now_ms() < end)
        vpoll(v);
    size_t grew = v->heap_peak - v->heap0;
    if (getenv("FIV_FORGE_VERBOSE"))
        fprintf(stderr, "read flood: heap +%zu KiB at its peak\n", grew >> 10);
    if (grew > HEAP_SLACK)
        vfail(v, "the victim's heap grew by %zu MiB for %" PRIu64
              " requests of one peer (bound %u MiB)", grew >> 20, a.a,
              HEAP_SLACK >> 20);
    REQ_RC(TIMED(v, CALL_MS, fi_close(&mr->fid)), 0);
}

static void f_read_flood(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    uint64_t sent = 0;
    for (int i = 0; i < FLOOD; i++) {
        struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = k.c,
                                .id = 100 + (uint64_t)i};
        if (fsend(f, FIV_OP_READ, &h, sizeof h, NULL, 0) < 0)
            break; /* the victim stopped reading us: refused */
        sent++;
    }
    ctl_send(f->ctl, 'D', sent, 0, 0);
}

/* 6. fi_av_remove of a peer whose message is filling a posted receive:
   the receive completes (with an error) and nothing more lands. */
static void v_av_remove(struct victim *v)
{
    uint8_t *r = gbuf(64u << 10);
    memset(r, 0, 64u << 10);
    REQ_RC(fi_trecv(v->r.ep, r, 64u << 10, NULL, FI_ADDR_UNSPEC, 0x66, 0, r), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    ctl_recv(v->ctl, 'F');
    if (!VWAIT(v, r[0] == MARK, CALL_MS))
        vfail(v, "the first fragment never landed");
    REQ_RC(TIMED(v, CALL_MS, fi_av_remove(v->r.av, &v->forger, 1, 0)), 0);
    if (!VWAIT(v, vdone(v, r) != NULL, CALL_MS))
        vfail(v, "the receive the removed peer was filling never completed "
              "(%d ms)", CALL_MS);
    else if (vdone(v, r)->err == 0)
        vfail(v, "the receive the removed peer was filling completed as "
              "whole");
    gbuf_revoke(r, 64u << 10);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    ctl_recv(v->ctl, 'D');
    uint64_t end = t_now_ms() + 100;
    while (t_now_ms() < end)
        vpoll(v);
}

static void f_av_remove(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    size_t k = msg_first(f, true, 0x66, 32u << 10);
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'C');
    more(f, k, 32u << 10);
    ctl_send(f->ctl, 'D', 0, 0, 0);
}

/* 7. The endpoint closed with a large answer queued for a peer that does
   not drain and that peer's message half in a posted receive; then the
   CQ (refused while bound, accepted after), the MR, the rest. */
static void v_ep_close(struct victim *v)
{
    uint8_t *w = gbuf(RLEN), *r = gbuf(64u << 10);
    memset(w, 0x11, RLEN);
    struct fid_mr *mr = reg(v, w, RLEN, FI_REMOTE_READ);
    REQ_RC(fi_trecv(v->r.ep, r, 64u << 10, NULL, FI_ADDR_UNSPEC, 0x77, 0, r), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    ctl_recv(v->ctl, 'F');
    if (!VWAIT(v, r[0] == MARK, CALL_MS))
        vfail(v, "the message never began to land");
    long long rc = fi_close(&v->r.cq->fid);
    if (rc != -FI_EBUSY)
        vfail(v, "fi_close(cq) of a bound CQ returned %lld", rc);
    REQ_RC(TIMED(v, CLOSE_MS, fi_close(&v->r.ep->fid)), 0);
    gbuf_revoke(r, 64u << 10);
    REQ_RC(TIMED(v, CALL_MS, fi_close(&mr->fid)), 0);
    memset(w, PRIVATE, RLEN);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%" PRIu64 " B of private memory went out after the "
              "endpoint and MR closed", a.a);
    victim_close(v, true);
    v->r.ep = NULL;
}

static void f_ep_close(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    ctl_recv(f->ctl, 'R');
    rma_req(f, FIV_OP_READ, k.a, k.b, k.c, 11, NULL, 0);
    size_t first = msg_first(f, true, 0x77, 32u << 10);
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'C');
    more(f, first, 32u << 10);
    struct fiv_resp_hdr r;
    size_t n;
    static uint8_t b[1 << 16];
    uint64_t leaked = 0;
    int op;
    while ((op = answer(f, &r, b, sizeof b, &n, 300)) >= 0)
        if (op == FIV_OP_MORE || op == FIV_OP_READ_RESP)
            leaked += count_not(b, n, 0x11);
    ctl_send(f->ctl, 'A', leaked, 0, 0);
}

/* 8. A multi-receive buffer consumed to its end while its last message
   still arrives: the last completion releases it (PROT_NONE here) and
   nothing lands after, nor past its end. */
static void v_multi_recv_consume(struct victim *v)
{
    uint8_t *b = gbuf(MLEN), *r = gbuf(4096);
    struct iovec iov = {b, MLEN};
    struct fi_msg m = {.msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC,
                       .context = b};
    REQ_RC(fi_recvmsg(v->r.ep, &m, FI_MULTI_RECV | FI_COMPLETION), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    bool released = VWAIT(v, ({
        bool rel = false;
        for (int i = 0; i < v->ndone; i++)
            rel |= v->done[i].ctx == b && (v->done[i].flags & FI_MULTI_RECV);
        rel;
    }), CALL_MS);
    if (!released)
        vfail(v, "the multi-receive buffer was never released");
    gbuf_revoke(b, MLEN);
    REQ_RC(fi_recv(v->r.ep, r, 4096, NULL, FI_ADDR_UNSPEC, r), 0);
    ctl_send(v->ctl, 'C', 0, 0, 0);
    if (!VWAIT(v, vdone(v, r) != NULL, CALL_MS))
        vfail(v, "the receive after the buffer's release never completed");
    else if (vdone(v, r)->err || vdone(v, r)->len != 8)
        vfail(v, "the receive after the buffer's release got %zu B (err %d)",
              vdone(v, r)->len, vdone(v, r)->err);
}

static void f_multi_recv_consume(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    size_t a = msg_first(f, false, 0, 40u << 10);
    more(f, a, 40u << 10);
    /* 24 KiB are left: this one takes them and retires the buffer, which
       its continuations still fill */
    a = msg_first(f, false, 0, 30u << 10);
    more(f, a, 30u << 10);
    ctl_recv(f->ctl, 'C');
    small(f, false, 0, 0x77);
}

/* 9. RMA at the edges of a registration: a write flush with its end
   lands, one byte more, an address that wraps, a wrong key or access, a
   length past the maximum are refused; nothing lands outside. */
static void v_rma_bounds(struct victim *v)
{
    uint8_t *w = gbuf(8192);
    memset(w, 0, 8192);
    struct fid_mr *mr = reg(v, w, 8192, FI_REMOTE_WRITE);
    (void)VWAIT(v, ctl_ready(v->ctl), 5000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%s", (const char *)a.blob);
    if (count_not(w, 8192 - 64, 0) || count_not(w + 8192 - 64, 64, MARK))
        vfail(v, "the registration holds other bytes than the one write "
              "that fits");
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_rma_bounds(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct { uint64_t addr, key, len; uint32_t op; int want; const char *what; }
    t[] = {
        {k.a + k.c - 64, k.b, 64, FIV_OP_WRITE, 0, "a write flush with the end"},
        {k.a + k.c - 63, k.b, 64, FIV_OP_WRITE, -FI_EACCES, "one byte past"},
        {k.a - 1, k.b, 8, FIV_OP_WRITE, -FI_EACCES, "one byte before"},
        {UINT64_MAX - 3, k.b, 8, FIV_OP_WRITE, -FI_EACCES, "a wrapping address"},
        {k.a, k.b + 1, 8, FIV_OP_WRITE, -FI_EACCES, "a wrong key"},
        {k.a, k.b, 8, FIV_OP_READ, -FI_EACCES, "a read of write-only memory"},
        {k.a, k.b, FIV_MAX_MSG + 1, FIV_OP_READ, -FI_EINVAL, "a read past the maximum"},
        /* what an atomic fetches it reads; a compare operand only for
           the compare operations (its bytes would be read past those
           the message holds) */
        {k.a, k.b, 8, FIV_OP_ATOMIC | FIV_F_FETCH, -FI_EACCES,
         "a fetch of write-only memory"},
        {k.a, k.b, 8, FIV_OP_ATOMIC | FIV_F_FETCH | FIV_F_COMPARE, -FI_EACCES,
         "a fetching swap of write-only memory"},
        {k.a, k.b, 256, FIV_OP_ATOMIC | FIV_F_COMPARE, -FI_EINVAL,
         "a compare operand for a read"},
        {k.a, k.b, 8, FIV_OP_ATOMIC | FIV_F_COMPARE, -FI_EINVAL,
         "a compare operand for a sum"},
    };
    struct ctl out = {.what = 'A'};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        uint32_t aop = i == 8 ? FI_CSWAP : i == 9 ? FI_ATOMIC_READ : FI_SUM;
        struct fiv_rma_hdr h = {.addr = t[i].addr, .key = t[i].key,
                                .len = t[i].len, .id = 200 + i,
                                .op = aop, .datatype = FI_UINT64};
        if ((t[i].op & FIV_OP_MASK) == FIV_OP_ATOMIC) {
            /* every operand the flags announce, so that only the check
               named is what refuses it */
            size_t n = h.op == FI_ATOMIC_READ ? 0
                       : t[i].op & FIV_F_COMPARE ? 2 * t[i].len : t[i].len;
            REQ_RC(fsend(f, t[i].op, &h, sizeof h, marks, n), 0);
        } else {
            bool w = t[i].op == FIV_OP_WRITE;
            REQ_RC(fsend(f, t[i].op | (w ? FIV_F_ACK : 0), &h, sizeof h, marks,
                         w ? t[i].len : 0), 0);
        }
        struct fiv_resp_hdr r;
        size_t n;
        int op = answer(f, &r, NULL, 0, &n, 3000);
        if (op < 0 || r.id != 200 + i || r.status != t[i].want) {
            out.a = 1;
            snprintf((char *)out.blob, sizeof out.blob, "%.23s", t[i].what);
            break;
        }
    }
    REQ(write(f->ctl, &out, sizeof out) == (ssize_t)sizeof out);
}

/* 10. Answers to the victim's own RMA written by the co-tenant: longer
   than asked, repeated, for ids never issued; an atomic's fetched value
   longer than its result; atomics and an INTRO towards the victim. Only
   the victim's result buffers are written, and only as far as each
   operation asked. */
static void v_forged_answers(struct victim *v)
{
    uint8_t *res = gbuf(8192), *word = gbuf(4096), *w = gbuf(4096);
    memset(res, 0, 8192);
    memset(word, 0, 4096);
    memset(w, 0, 4096);
    struct fid_mr *mr = reg(v, w, 4096, FI_REMOTE_WRITE | FI_REMOTE_READ);
    char c1, c2;
    REQ_RC(fi_read(v->r.ep, res, 4096, NULL, v->forger, 0x1000, 5, &c1), 0);
    if (!VWAIT(v, vdone(v, &c1) != NULL, 3000))
        vfail(v, "the read never completed");
    else if (vdone(v, &c1)->err)
        vfail(v, "the read failed (%d)", vdone(v, &c1)->err);
    if (count_not(res, 4096, MARK) || count_not(res + 4096, 4096, 0))
        vfail(v, "the read's result holds other bytes than the 4096 it "
              "asked for");
    uint64_t one = 1;
    REQ_RC(fi_fetch_atomic(v->r.ep, &one, 1, NULL, word, NULL, v->forger,
                           0x2000, 6, FI_UINT64, FI_SUM, &c2), 0);
    if (!VWAIT(v, vdone(v, &c2) != NULL, 3000))
        vfail(v, "the atomic never completed");
    if (count_not(word, 8, MARK) || count_not(word + 8, 4096 - 8, 0))
        vfail(v, "the atomic's result holds more than its 8 bytes");
    ctl_send(v->ctl, 'G', 0, 0, 0);
    (void)VWAIT(v, ctl_ready(v->ctl), 5000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%s", (const char *)a.blob);
    if (count_not(w, 4088, 0) || w[4088] != 3)
        vfail(v, "the registration holds other bytes than the one atomic "
              "that fits");
    uint64_t end = t_now_ms() + 100;
    while (t_now_ms() < end)
        vpoll(v);
    if (v->ndone != 2)
        vfail(v, "%d completions for 2 operations", v->ndone);
    REQ_RC(fi_close(&mr->fid), 0);
}

/* 9b. An atomic read of memory the application registered read-only
   (its pages cannot be written): answered with the value, and nothing
   is stored back. */
static void v_atomic_read_only(struct victim *v)
{
    uint8_t *w = gbuf(4096);
    memset(w, 7, 4096);
    REQ(mprotect(w, 4096, PROT_READ) == 0);
    struct fid_mr *mr = reg(v, w, 4096, FI_REMOTE_READ);
    (void)VWAIT(v, ctl_ready(v->ctl), 5000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%s", (const char *)a.blob);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_atomic_read_only(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct fiv_rma_hdr h = {.addr = k.a + 64, .key = k.b, .len = 8, .id = 400,
                            .op = FI_ATOMIC_READ, .datatype = FI_UINT64};
    REQ_RC(fsend(f, FIV_OP_ATOMIC | FIV_F_FETCH, &h, sizeof h, NULL, 0), 0);
    struct fiv_resp_hdr r;
    uint8_t got[8] = {0};
    size_t n = 0;
    int op = answer(f, &r, got, sizeof got, &n, 3000);
    struct ctl out = {.what = 'A'};
    if (op != FIV_OP_ACK || r.id != 400 || r.status != 0 || n != 8 ||
        count_not(got, 8, 7)) {
        out.a = 1;
        snprintf((char *)out.blob, sizeof out.blob, "no value answered");
    }
    REQ(write(f->ctl, &out, sizeof out) == (ssize_t)sizeof out);
}

/* 10b. An answer to the victim's READ that breaks the protocol (longer
   than any message): the read still ends, with an error, by its
   deadline. */
static void v_bad_read_answer(struct victim *v)
{
    uint8_t *res = gbuf(4096);
    memset(res, 0, 4096);
    char c;
    REQ_RC(fi_read(v->r.ep, res, 64, NULL, v->forger, 0x1000, 5, &c), 0);
    if (!VWAIT(v, vdone(v, &c) != NULL, 3000))
        vfail(v, "the read never completed");
    else if (!vdone(v, &c)->err)
        vfail(v, "the read completed without an error");
    if (count_not(res + 64, 4096 - 64, 0))
        vfail(v, "bytes past the read's 64 were written");
}

/* The victim's next request to us (INTROs and probes skipped). */
static int request(struct forger *f, struct fiv_rma_hdr *h)
{
    static uint8_t m[1 << 16];
    for (uint64_t end = t_now_ms() + 3000; t_now_ms() < end;) {
        uint32_t tag = 0;
        ssize_t len = ivshm_recv(f->h, f->victim, NULL, &tag, m, sizeof m, 50);
        if (len == -ETIMEDOUT || len == -EAGAIN)
            continue;
        uint32_t op = tag & FIV_OP_MASK;
        if (len < (ssize_t)sizeof *h || op == FIV_OP_INTRO ||
            op == FIV_OP_PROBE || op == FIV_OP_PROBE_ACK)
            continue;
        memcpy(h, m, sizeof *h);
        return (int)op;
    }
    return -1;
}

static void f_bad_read_answer(struct forger *f)
{
    struct fiv_rma_hdr q;
    REQ(request(f, &q) == FIV_OP_READ && q.len == 64);
    struct fiv_resp_hdr r = {.id = q.id, .len = FIV_MAX_MSG + 1};
    REQ_RC(fsend(f, FIV_OP_READ_RESP, &r, sizeof r, marks, 8), 0);
}

static void f_forged_answers(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct fiv_rma_hdr q;
    REQ(request(f, &q) == FIV_OP_READ && q.len == 4096);
    /* 64 KiB for a 4 KiB read, then the same answer again, and answers
       for ids never issued */
    struct fiv_resp_hdr r = {.id = q.id, .len = 64u << 10};
    for (int rep = 0; rep < 2; rep++) {
        REQ_RC(fsend(f, FIV_OP_READ_RESP, &r, sizeof r, marks,
                     frag - sizeof r), 0);
        more(f, frag - sizeof r, r.len);
    }
    struct fiv_resp_hdr bogus = {.id = q.id + 1000, .len = 8};
    REQ_RC(fsend(f, FIV_OP_ACK, &bogus, sizeof bogus, marks, 8), 0);
    REQ_RC(fsend(f, FIV_OP_READ_RESP, &bogus, sizeof bogus, marks, 8), 0);
    REQ(request(f, &q) == FIV_OP_ATOMIC);
    struct fiv_resp_hdr ack = {.id = q.id, .len = 256};
    REQ_RC(fsend(f, FIV_OP_ACK, &ack, sizeof ack, marks, 256), 0);
    ctl_recv(f->ctl, 'G');
    /* an INTRO from a rank heard already changes nothing */
    struct fiv_intro in = {.slot = (int16_t)ivshm_self(f->h)};
    REQ_RC(fsend(f, FIV_OP_INTRO, &in, sizeof in, NULL, 0), 0);
    /* atomics towards the victim at and past the registration's edges */
    uint64_t three[4] = {3, 3, 3, 3};
    struct { uint64_t addr, len; uint32_t dt, op; int want; const char *what; }
    t[] = {
        {k.a + k.c - 8, 8, FI_UINT64, FI_SUM, 0, "an atomic at the end"},
        {k.a + k.c - 8, 16, FI_UINT64, FI_SUM, -FI_EACCES, "one past the end"},
        {k.a, 8, 99, FI_SUM, -FI_EINVAL, "an unknown datatype"},
        {k.a, 8, FI_UINT64, 99, -FI_EOPNOTSUPP, "an unknown operation"},
        {k.a, 12, FI_UINT64, FI_SUM, -FI_EINVAL, "a partial element"},
        {k.a, 512, FI_UINT8, FI_SUM, -FI_EINVAL, "past the operand maximum"},
    };
    struct ctl out = {.what = 'A'};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        struct fiv_rma_hdr h = {.addr = t[i].addr, .key = k.b, .len = t[i].len,
                                .id = 300 + i, .op = t[i].op,
                                .datatype = t[i].dt};
        size_t n = t[i].len <= sizeof three ? t[i].len : 0;
        REQ_RC(fsend(f, FIV_OP_ATOMIC | FIV_F_FETCH, &h, sizeof h, three, n), 0);
        struct fiv_resp_hdr a;
        size_t got;
        int op = answer(f, &a, NULL, 0, &got, 3000);
        if (op != FIV_OP_ACK || a.id != 300 + i || a.status != t[i].want) {
            out.a = 1;
            snprintf((char *)out.blob, sizeof out.blob, "%.23s", t[i].what);
            break;
        }
    }
    REQ(write(f->ctl, &out, sizeof out) == (ssize_t)sizeof out);
}

/* 11. Unexpected messages past the victim's cap for one peer: its path
   fails (a receive of any source ends with FI_EIO) and the victim holds
   no more than the cap. */
#define UNEXP_CAP (4u << 20)
static void v_unexp_cap(struct victim *v)
{
    uint8_t *r = gbuf(4096);
    REQ_RC(fi_trecv(v->r.ep, r, 4096, NULL, FI_ADDR_UNSPEC, 0x99, 0, r), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    if (!VWAIT(v, vdone(v, r) != NULL, 10000))
        vfail(v, "the path never failed past the cap");
    else if (vdone(v, r)->err != FI_EIO)
        vfail(v, "the receive ended with %d, not FI_EIO", vdone(v, r)->err);
    size_t grew = v->heap_peak - v->heap0;
    if (grew > UNEXP_CAP + (2u << 20))
        vfail(v, "the victim's heap grew by %zu KiB (cap %u KiB)", grew >> 10,
              UNEXP_CAP >> 10);
    ctl_send(v->ctl, 'C', 0, 0, 0);
}

static void f_unexp_cap(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    for (int i = 0; i < 2 * (int)(UNEXP_CAP >> 16); i++) {
        struct fiv_msg_hdr h = {.tag = 0x98, .len = 64u << 10};
        if (fsend(f, FIV_OP_MSG | FIV_F_TAGGED, &h, sizeof h, marks,
                  frag - sizeof h) < 0)
            break;
        more(f, frag - sizeof h, h.len);
    }
    ctl_recv(f->ctl, 'C');
}

/* 12. Sends to a peer that reads nothing, past the victim's queue cap:
   refused with -FI_EAGAIN, not queued; once the peer reads, they all
   complete. */
#define QCAP 64
static void v_queue_cap(struct victim *v)
{
    static uint8_t msg[8];
    int accepted = 0, refused = 0;
    for (int i = 0; i < 2000 && !refused; i++) {
        ssize_t rc = fi_tsend(v->r.ep, msg, sizeof msg, NULL, v->forger, 1,
                              msg);
        if (rc == 0)
            accepted++;
        else if (rc == -FI_EAGAIN)
            refused++;
        else
            vfail(v, "fi_tsend returned %zd", rc);
        vpoll(v);
    }
    if (!refused)
        vfail(v, "2000 sends to a peer that reads nothing were all queued");
    ctl_send(v->ctl, 'D', (uint64_t)accepted, 0, 0);
    uint64_t end = t_now_ms() + 5000;
    while (v->ncomp < (uint64_t)accepted && t_now_ms() < end)
        vpoll(v);
    if (v->ncomp != (uint64_t)accepted)
        vfail(v, "%" PRIu64 " completions for %d accepted sends once the "
              "peer read", v->ncomp, accepted);
}

static void f_queue_cap(struct forger *f)
{
    struct ctl d = ctl_recv(f->ctl, 'D');
    static uint8_t m[1 << 16];
    uint64_t got = 0;
    for (uint64_t end = t_now_ms() + 5000; got < d.a && t_now_ms() < end;) {
        uint32_t tag = 0;
        ssize_t n = ivshm_recv(f->h, f->victim, NULL, &tag, m, sizeof m, 50);
        if (n >= 0 && (tag & FIV_OP_MASK) == FIV_OP_MSG)
            got++;
    }
}

/* 13. Not an attack: the answer to a READ of our own memory larger than
   the inline copy, looked up by key like any other, is whole. */
static void v_self_read(struct victim *v)
{
    uint8_t *w = gbuf(RLEN), *res = gbuf(RLEN);
    for (size_t i = 0; i < RLEN; i++)
        w[i] = (uint8_t)(i * 7);
    struct fid_mr *mr = reg(v, w, RLEN, FI_REMOTE_READ);
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    fi_addr_t self;
    REQ_RC(fi_getname(&v->r.ep->fid, name, &len), 0);
    REQ_RC(fi_av_insert(v->r.av, name, 1, &self, 0, NULL), 1);
    char c;
    REQ_RC(fi_read(v->r.ep, res, RLEN, NULL, self, (uint64_t)(uintptr_t)w,
                   fi_mr_key(mr), &c), 0);
    if (!VWAIT(v, vdone(v, &c) != NULL, CALL_MS))
        vfail(v, "the read of ourselves never completed");
    else if (vdone(v, &c)->err || memcmp(res, w, RLEN))
        vfail(v, "the read of ourselves came back wrong (err %d)",
              vdone(v, &c)->err);
    REQ_RC(fi_close(&mr->fid), 0);
}

/* 15. A SWITCH that counts messages the victim never received, with no
   drain asked: the pair breaks (what waits on it fails), nothing else. */
static void v_switch_counts(struct victim *v)
{
    uint64_t a = 0, b = 0;
    REQ_RC(fi_trecv(v->r.ep, &a, sizeof a, NULL, v->forger, 1, 0, &a), 0);
    REQ_RC(fi_trecv(v->r.ep, &b, sizeof b, NULL, v->forger, 1, 0, &b), 0);
    ctl_send(v->ctl, 'K', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &a) != NULL, CALL_MS))
        vfail(v, "the forger's first message never came");
    else if (vdone(v, &a)->err || a != 0x5a5a5a5a5a5a5a5aull)
        vfail(v, "the first message came with error %d", vdone(v, &a)->err);
    if (!VWAIT(v, vdone(v, &b) != NULL, CALL_MS))
        vfail(v, "a receive from the forger still waits after its false "
              "switch");
    else if (vdone(v, &b)->err != FI_EIO)
        vfail(v, "the receive after the false switch ended with %d, not "
              "FI_EIO", vdone(v, &b)->err);
    ctl_send(v->ctl, 'D', 0, 0, 0);
}

static void f_switch_counts(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    small(f, true, 1, MARK);
    struct fiv_switch m = {.region_sent = 1000, .core_seq = 0};
    REQ_RC(fsend(f, FIV_OP_SWITCH, &m, sizeof m, NULL, 0), 0);
    (void)ctl_recv(f->ctl, 'D');
}

/* 16. The forger asks for the victim's drain (a co-tenant can write that
   word) and answers the victim's SWITCH with one that names a core
   message out of order: the pair breaks within the drain's deadline, the
   drain ends with -EIO, and the victim leaves the region. */
static void v_switch_answer(struct victim *v)
{
    uint64_t b = 0;
    REQ_RC(fi_trecv(v->r.ep, &b, sizeof b, NULL, v->forger, 1, 0, &b), 0);
    ctl_send(v->ctl, 'K', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &b) != NULL, CALL_MS + 2000))
        vfail(v, "a receive from the forger still waits after its forged "
              "answer");
    else if (vdone(v, &b)->err != FI_EIO)
        vfail(v, "the receive after the forged answer ended with %d, not "
              "FI_EIO", vdone(v, &b)->err);
    /* the drain finished: our name has no slot any more */
    (void)VWAIT(v, false, 100);
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    REQ_RC(fi_getname(&v->r.ep->fid, name, &len), 0);
    struct fiv_addr me;
    memcpy(&me, name, sizeof me);
    if (me.slot != -1)
        vfail(v, "the victim is still in the region (slot %d) after its "
              "drain", me.slot);
    ctl_send(v->ctl, 'D', 0, 0, 0);
    struct ctl st = ctl_recv(v->ctl, 'S');
    if ((int64_t)st.a != 1 || (int64_t)st.b != -EIO)
        vfail(v, "the drain's answer: state %" PRId64 ", status %" PRId64
              " (wanted 1, -EIO)", (int64_t)st.a, (int64_t)st.b);
}

static void f_switch_answer(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    int fd = open(region, O_RDWR | O_CLOEXEC);
    REQ(fd >= 0);
    ivshm_admin *a = NULL;
    REQ_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    ivshm_peer_info vp;
    REQ_RC(ivshm_peer(f->h, f->victim, &vp), 0);
    REQ_RC(ivshm_admin_drain_slot(a, f->victim, vp.generation, 3), 0);
    /* the victim's SWITCH to us */
    int op = -1;
    static uint8_t m[1 << 16];
    for (uint64_t end = t_now_ms() + CALL_MS; op != FIV_OP_SWITCH &&
         t_now_ms() < end;) {
        uint32_t tag = 0;
        int src = -1;
        ssize_t len = ivshm_recv(f->h, f->victim, &src, &tag, m, sizeof m, 50);
        if (len >= 0)
            op = (int)(tag & FIV_OP_MASK);
    }
    REQ(op == FIV_OP_SWITCH);
    struct fiv_switch ans = {.region_sent = 1, .core_seq = 5};
    REQ_RC(fsend(f, FIV_OP_SWITCH, &ans, sizeof ans, NULL, 0), 0);
    (void)ctl_recv(f->ctl, 'D');
    int32_t st = 0;
    int rc = ivshm_admin_drain_state(a, f->victim, vp.generation, 3, &st);
    ctl_send(f->ctl, 'S', (uint64_t)(int64_t)rc, (uint64_t)(int64_t)st, 0);
    ivshm_admin_close(a);
}

/* 17. A region BACK (the first region message after a move back from
   the core) from a peer that never left the region: the pair breaks. */
static void f_back_unasked(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    small(f, true, 1, MARK);
    struct fiv_switch m = {.region_sent = 2, .core_seq = 0};
    REQ_RC(fsend(f, FIV_OP_BACK, &m, sizeof m, NULL, 0), 0);
    (void)ctl_recv(f->ctl, 'D');
}

/* 18. A SWITCH with the right counts while the victim's answer cannot
   go (a message of its own to the forger is partly out, the forger reads
   nothing), then the forger leaves: the looks for departed peers skip a
   switching pair, so only the switch's own deadline ends what waits on
   the pair (FI_IVSHM_DRAIN_MS=500). */
static void v_switch_stuck(struct victim *v)
{
    static uint8_t big[4 << 20];
    uint64_t a = 0, b = 0;
    REQ_RC(fi_tsend(v->r.ep, big, sizeof big, NULL, v->forger, 2, big), 0);
    REQ_RC(fi_trecv(v->r.ep, &a, sizeof a, NULL, v->forger, 1, 0, &a), 0);
    REQ_RC(fi_trecv(v->r.ep, &b, sizeof b, NULL, v->forger, 1, 0, &b), 0);
    (void)VWAIT(v, false, 50); /* the ring to the forger fills */
    ctl_send(v->ctl, 'K', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &a) != NULL, CALL_MS))
        vfail(v, "the forger's first message never came");
    else if (vdone(v, &a)->err || a != 0x5a5a5a5a5a5a5a5aull)
        vfail(v, "the first message came with error %d", vdone(v, &a)->err);
    (void)VWAIT(v, false, 50); /* its SWITCH taken */
    ctl_send(v->ctl, 'G', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &b) != NULL && vdone(v, big) != NULL,
               CALL_MS + 500))
        vfail(v, "a receive from (or a send to) a peer whose switch our "
              "answer could not take still waits past the drain's "
              "deadline");
    else if (vdone(v, &b)->err != FI_EIO || !vdone(v, big)->err)
        vfail(v, "the receive ended with %d (not FI_EIO), the send with %d",
              vdone(v, &b)->err, vdone(v, big)->err);
    ctl_send(v->ctl, 'D', 0, 0, 0);
}

static void f_switch_stuck(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    small(f, true, 1, MARK);
    struct fiv_switch m = {.region_sent = 2, .core_seq = 0};
    REQ_RC(fsend(f, FIV_OP_SWITCH, &m, sizeof m, NULL, 0), 0);
    (void)ctl_recv(f->ctl, 'G');
    ivshm_detach(f->h);
    f->h = NULL;
    (void)ctl_recv(f->ctl, 'D');
}

/* 19. A peer inserted while a drain (asked by the forger, unanswered, so
   it lasts its deadline) is under way: the region goes at the drain's
   end, and what the victim sends that peer afterwards must not touch it
   (that peer has no core address: the send fails, nothing more). */
static void v_insert_in_drain(struct victim *v)
{
    ctl_send(v->ctl, 'K', 0, 0, 0);
    (void)ctl_recv(v->ctl, 'A');
    uint8_t other[FIV_ADDR_LEN];
    t_read_full(v->ctl, other, sizeof other);
    (void)VWAIT(v, false, 200); /* the request read, the drain begun */
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    REQ_RC(fi_getname(&v->r.ep->fid, name, &len), 0);
    struct fiv_addr me;
    memcpy(&me, name, sizeof me);
    if (me.slot < 0)
        vfail(v, "the drain ended before its deadline");
    fi_addr_t o = FI_ADDR_NOTAVAIL;
    REQ_RC(fi_av_insert(v->r.av, other, 1, &o, 0, NULL), 1);
    /* FI_IVSHM_DRAIN_MS=1000: the drain ends, the region goes */
    bool gone = VWAIT(v, (len = sizeof name,
                          fi_getname(&v->r.ep->fid, name, &len) == 0 &&
                          (memcpy(&me, name, sizeof me), me.slot < 0)),
                      CALL_MS + 1000);
    if (!gone)
        vfail(v, "the victim is still in the region after its drain");
    uint64_t x = 7;
    ssize_t rc = fi_tsend(v->r.ep, &x, sizeof x, NULL, o, 1, &x);
    if (rc == 0 && !VWAIT(v, vdone(v, &x) != NULL, CALL_MS))
        vfail(v, "a send to the peer inserted during the drain never ended");
    else if (rc == 0 && !vdone(v, &x)->err)
        vfail(v, "a send to a peer with no path was said to arrive");
    ctl_send(v->ctl, 'D', 0, 0, 0);
}

static void f_insert_in_drain(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    int fd = open(region, O_RDWR | O_CLOEXEC);
    REQ(fd >= 0);
    ivshm_admin *a = NULL;
    REQ_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    ivshm_peer_info vp;
    REQ_RC(ivshm_peer(f->h, f->victim, &vp), 0);
    /* a second attachment of ours, named as a provider endpoint would be,
       with no core address */
    uint64_t nonce = random64();
    char name[32];
    snprintf(name, sizeof name, "fi.%016" PRIx64, nonce);
    ivshm_config cfg = {.job_id = JOB_TAG, .rank = (uint32_t)nonce,
                        .name = name, .spin_ns = 1};
    ivshm *h2 = NULL;
    REQ_RC(ivshm_attach_path(region, &cfg, &h2), 0);
    ivshm_peer_info me;
    REQ_RC(ivshm_peer(h2, ivshm_self(h2), &me), 0);
    struct fiv_addr o;
    memset(&o, 0, sizeof o);
    o.magic = FIV_ADDR_MAGIC;
    o.version = FIV_ADDR_VERSION;
    o.slot = (int16_t)ivshm_self(h2);
    o.generation = me.generation;
    o.nonce[0] = (uint32_t)nonce;
    o.nonce[1] = (uint32_t)(nonce >> 32);
    uint64_t k[2] = {random64(), random64()};
    memcpy(o.key, k, sizeof o.key);
    REQ_RC(ivshm_admin_drain_slot(a, f->victim, vp.generation, 4), 0);
    ctl_send(f->ctl, 'A', 0, 0, 0);
    REQ(write(f->ctl, &o, sizeof o) == (ssize_t)sizeof o);
    (void)ctl_recv(f->ctl, 'D');
    ivshm_detach(h2);
    ivshm_admin_close(a);
}

/* 20. A peer that failed in a drain (it never answered) keeps its slot of the
   old region; the victim takes a smaller region afterwards (its host's
   new one), then removes that peer from its AV: nothing of the old slot
   may index the new region's tables. */
static bool v_slot_is(struct victim *v, bool in)
{
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    struct fiv_addr me;
    if (fi_getname(&v->r.ep->fid, name, &len) != 0)
        return false;
    memcpy(&me, name, sizeof me);
    return in ? me.slot >= 0 : me.slot < 0;
}

static void v_forget_after_rejoin(struct victim *v)
{
    ctl_send(v->ctl, 'K', 0, 0, 0);
    (void)ctl_recv(v->ctl, 'A');
    uint8_t other[FIV_ADDR_LEN];
    t_read_full(v->ctl, other, sizeof other);
    fi_addr_t o = FI_ADDR_NOTAVAIL;
    REQ_RC(fi_av_insert(v->r.av, other, 1, &o, 0, NULL), 1);
    ctl_send(v->ctl, 'I', 0, 0, 0);
    /* FI_IVSHM_DRAIN_MS=500: the forger answers nothing */
    if (!VWAIT(v, v_slot_is(v, false), CALL_MS + 500))
        vfail(v, "the victim did not leave the region");
    ctl_send(v->ctl, 'G', 0, 0, 0);
    (void)ctl_recv(v->ctl, 'R');
    if (!VWAIT(v, v_slot_is(v, true), CALL_MS))
        vfail(v, "the victim did not take the new region");
    REQ_RC(fi_av_remove(v->r.av, &o, 1, 0), 0);
    (void)VWAIT(v, false, 50);
    ctl_send(v->ctl, 'D', 0, 0, 0);
}

static void f_forget_after_rejoin(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    int fd = open(region, O_RDWR | O_CLOEXEC);
    REQ(fd >= 0);
    ivshm_admin *a = NULL;
    REQ_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    ivshm_peer_info vp;
    REQ_RC(ivshm_peer(f->h, f->victim, &vp), 0);
    /* a second attachment (slot 2), as silent as we are: its pair fails
       at the drain's deadline */
    uint64_t nonce = random64();
    char name[32];
    snprintf(name, sizeof name, "fi.%016" PRIx64, nonce);
    ivshm_config cfg = {.job_id = JOB_TAG, .rank = (uint32_t)nonce,
                        .name = name, .spin_ns = 1};
    ivshm *h2 = NULL;
    REQ_RC(ivshm_attach_path(region, &cfg, &h2), 0);
    ivshm_peer_info me;
    REQ_RC(ivshm_peer(h2, ivshm_self(h2), &me), 0);
    REQ(ivshm_self(h2) >= 2);
    struct fiv_addr o;
    memset(&o, 0, sizeof o);
    o.magic = FIV_ADDR_MAGIC;
    o.version = FIV_ADDR_VERSION;
    o.slot = (int16_t)ivshm_self(h2);
    o.generation = me.generation;
    o.nonce[0] = (uint32_t)nonce;
    o.nonce[1] = (uint32_t)(nonce >> 32);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(9)};
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    memcpy(o.core, &sin, sizeof sin);
    o.core_len = sizeof sin;
    ctl_send(f->ctl, 'A', 0, 0, 0);
    REQ(write(f->ctl, &o, sizeof o) == (ssize_t)sizeof o);
    (void)ctl_recv(f->ctl, 'I');
    REQ_RC(ivshm_admin_drain_slot(a, f->victim, vp.generation, 5), 0);
    (void)ctl_recv(f->ctl, 'G');
    /* the region the victim finds next holds two endpoints */
    ivshm_geometry g = {.max_peers = 2};
    REQ(unlink(region) == 0);
    REQ_RC(ivshm_format_file(region, ivshm_min_region_size(&g), &g, 0600), 0);
    ctl_send(f->ctl, 'R', 0, 0, 0);
    (void)ctl_recv(f->ctl, 'D');
    ivshm_detach(h2);
    ivshm_admin_close(a);
}

/* 21. A drain the forger asks for (the request word is in the region)
   of a victim with no core provider: it refuses, acknowledging with
   -EHOSTUNREACH, and its pairs go on in the region untouched. */
static void v_drain_refused(struct victim *v)
{
    uint64_t a = 0;
    REQ_RC(fi_trecv(v->r.ep, &a, sizeof a, NULL, v->forger, 1, 0, &a), 0);
    ctl_send(v->ctl, 'K', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &a) != NULL, 2 * CALL_MS))
        vfail(v, "the forger's message after its drain request never came");
    else if (vdone(v, &a)->err || a != 0x5a5a5a5a5a5a5a5aull)
        vfail(v, "the message after the drain request came with error %d",
              vdone(v, &a)->err);
    if (!v_slot_is(v, true))
        vfail(v, "the victim left the region on a drain it cannot make");
    ctl_send(v->ctl, 'D', 0, 0, 0);
    struct ctl st = ctl_recv(v->ctl, 'S');
    if ((int64_t)st.a != 1 || (int64_t)st.b != -EHOSTUNREACH)
        vfail(v, "the drain's answer: state %" PRId64 ", status %" PRId64
              " (wanted 1, -EHOSTUNREACH)", (int64_t)st.a, (int64_t)st.b);
}

static void f_drain_refused(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
    int fd = open(region, O_RDWR | O_CLOEXEC);
    REQ(fd >= 0);
    ivshm_admin *a = NULL;
    REQ_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    ivshm_peer_info vp;
    REQ_RC(ivshm_peer(f->h, f->victim, &vp), 0);
    REQ_RC(ivshm_admin_drain_slot(a, f->victim, vp.generation, 6), 0);
    int32_t st = 0;
    int rc = 0;
    for (uint64_t end = t_now_ms() + CALL_MS; rc == 0 && t_now_ms() < end;) {
        rc = ivshm_admin_drain_state(a, f->victim, vp.generation, 6, &st);
        if (rc == 0)
            usleep(1000);
    }
    small(f, true, 1, MARK);
    (void)ctl_recv(f->ctl, 'D');
    ctl_send(f->ctl, 'S', (uint64_t)(int64_t)rc, (uint64_t)(int64_t)st, 0);
    ivshm_admin_close(a);
}

/* 22. 0-byte accesses of an empty registration (NULL, 0 bytes: what an
   MPI registers for a window of size 0): a READ and a WRITE of nothing
   succeed, and touch no memory. */
static void v_empty_registration(struct victim *v)
{
    struct fid_mr *mr = reg(v, NULL, 0, FI_REMOTE_READ | FI_REMOTE_WRITE);
    (void)VWAIT(v, ctl_ready(v->ctl), 5000);
    struct ctl a = ctl_recv(v->ctl, 'A');
    if (a.a)
        vfail(v, "%s", (const char *)a.blob);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_empty_registration(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct ctl out = {.what = 'A'};
    const uint32_t ops[] = {FIV_OP_READ, FIV_OP_WRITE | FIV_F_ACK};
    for (int i = 0; i < 2 && !out.a; i++) {
        rma_req(f, ops[i], k.a, k.b, 0, 500 + (uint64_t)i, NULL, 0);
        struct fiv_resp_hdr r;
        size_t n = 0;
        int op = answer(f, &r, NULL, 0, &n, 3000);
        if (op < 0 || r.id != 500 + (uint64_t)i || r.status != 0 || r.len ||
            n) {
            out.a = 1;
            snprintf((char *)out.blob, sizeof out.blob, "a 0-byte %s: %d",
                     i ? "write" : "read", op < 0 ? 0 : r.status);
        }
    }
    REQ(write(f->ctl, &out, sizeof out) == (ssize_t)sizeof out);
}

/* 23. An answer to the victim's READ that refuses it but carries bytes
   over several fragments: the read completes with the peer's error and
   none of those bytes lands in its buffer. */
#define ELEN (64u << 10)
static void v_read_refused_in_fragments(struct victim *v)
{
    uint8_t *res = gbuf(ELEN);
    memset(res, 0, ELEN);
    char c;
    REQ_RC(fi_read(v->r.ep, res, ELEN, NULL, v->forger, 0x1000, 5, &c), 0);
    if (!VWAIT(v, vdone(v, &c) != NULL, 3000))
        vfail(v, "the read never completed");
    else if (vdone(v, &c)->err != FI_EACCES)
        vfail(v, "the read completed with %d, not FI_EACCES",
              vdone(v, &c)->err);
    if (count_not(res, ELEN, 0))
        vfail(v, "%zu bytes of a refused read were written",
              count_not(res, ELEN, 0));
}

static void f_read_refused_in_fragments(struct forger *f)
{
    struct fiv_rma_hdr q;
    REQ(request(f, &q) == FIV_OP_READ && q.len == ELEN);
    struct fiv_resp_hdr r = {.id = q.id, .status = -FI_EACCES, .len = ELEN};
    REQ_RC(fsend(f, FIV_OP_READ_RESP, &r, sizeof r, marks, frag - sizeof r),
           0);
    more(f, frag - sizeof r, ELEN);
}

/* 24. Answers to the victim's fetching atomics shorter than the value
   each fetches (a length short of it; a length that fits over bytes the
   message lacks): each atomic completes with FI_EIO and nothing is
   written to its result. */
static void v_short_fetch_answer(struct victim *v)
{
    uint8_t *res = gbuf(4096);
    memset(res, 0, 4096);
    uint64_t ops[4] = {1, 1, 1, 1}, cmp[4] = {0};
    char c[2];
    REQ_RC(fi_fetch_atomic(v->r.ep, ops, 4, NULL, res, NULL, v->forger,
                           0x2000, 6, FI_UINT64, FI_SUM, &c[0]), 0);
    REQ_RC(fi_compare_atomic(v->r.ep, ops, 4, NULL, cmp, NULL, res + 64, NULL,
                             v->forger, 0x2000, 6, FI_UINT64, FI_CSWAP,
                             &c[1]), 0);
    for (int i = 0; i < 2; i++) {
        if (!VWAIT(v, vdone(v, &c[i]) != NULL, 3000))
            vfail(v, "atomic %d never completed", i);
        else if (vdone(v, &c[i])->err != FI_EIO)
            vfail(v, "atomic %d completed with %d, not FI_EIO", i,
                  vdone(v, &c[i])->err);
    }
    if (count_not(res, 4096, 0))
        vfail(v, "%zu bytes of short answers were written to the results",
              count_not(res, 4096, 0));
}

static void f_short_fetch_answer(struct forger *f)
{
    struct fiv_rma_hdr q;
    REQ(request(f, &q) == FIV_OP_ATOMIC && q.len == 32);
    struct fiv_resp_hdr a = {.id = q.id, .len = 8};
    REQ_RC(fsend(f, FIV_OP_ACK, &a, sizeof a, marks, 8), 0);
    REQ(request(f, &q) == FIV_OP_ATOMIC && q.len == 32);
    a = (struct fiv_resp_hdr){.id = q.id, .len = 32};
    REQ_RC(fsend(f, FIV_OP_ACK, &a, sizeof a, marks, 8), 0);
}

/* 25. Atomics in a region of the smallest slots (128 bytes), where the
   largest operands do not fit one fragment: the valid counts say what
   fits, an atomic past them is refused when posted (an atomic is never
   fragmented), and one that fits arrives whole and completes. */
#define SMALL_SLOT 128
#define SMALL_ROOM (SMALL_SLOT - 32 - sizeof(struct fiv_rma_hdr))
static void v_atomic_small_slot(struct victim *v)
{
    size_t fits = 0, cfits = 0;
    REQ_RC(fi_fetch_atomicvalid(v->r.ep, FI_UINT64, FI_SUM, &fits), 0);
    REQ_RC(fi_compare_atomicvalid(v->r.ep, FI_UINT64, FI_CSWAP, &cfits), 0);
    if (!fits || fits * 8 > SMALL_ROOM || !cfits || cfits * 16 > SMALL_ROOM)
        vfail(v, "atomics of %zu and %zu elements declared valid in %zu "
              "bytes", fits, cfits, SMALL_ROOM);
    uint8_t *res = gbuf(4096);
    memset(res, 0, 4096);
    uint64_t ops[8] = {1, 1, 1, 1, 1, 1, 1, 1}, cmp[8] = {0};
    const size_t past = SMALL_ROOM / 8 + 1, cpast = SMALL_ROOM / 16 + 1;
    char c[4];
    ssize_t rc[3] = {
        fi_fetch_atomic(v->r.ep, ops, past, NULL, res, NULL, v->forger,
                        0x2000, 6, FI_UINT64, FI_SUM, &c[0]),
        fi_atomic(v->r.ep, ops, past, NULL, v->forger, 0x2000, 6, FI_UINT64,
                  FI_SUM, &c[1]),
        fi_compare_atomic(v->r.ep, ops, cpast, NULL, cmp, NULL, res, NULL,
                          v->forger, 0x2000, 6, FI_UINT64, FI_CSWAP, &c[2]),
    };
    for (int i = 0; i < 3; i++)
        if (rc[i] != -FI_EINVAL)
            vfail(v, "atomic %d past the slot's fragment posted: %zd, not "
                  "-FI_EINVAL", i, rc[i]);
    REQ_RC(fi_fetch_atomic(v->r.ep, ops, SMALL_ROOM / 8, NULL, res, NULL,
                           v->forger, 0x2000, 6, FI_UINT64, FI_SUM, &c[3]), 0);
    if (!VWAIT(v, vdone(v, &c[3]) != NULL, 3000))
        vfail(v, "the atomic that fits never completed");
    else if (vdone(v, &c[3])->err)
        vfail(v, "the atomic that fits failed (%d)", vdone(v, &c[3])->err);
    if (count_not(res, SMALL_ROOM, MARK) ||
        count_not(res + SMALL_ROOM, 4096 - SMALL_ROOM, 0))
        vfail(v, "the atomic's result is not its %zu fetched bytes",
              SMALL_ROOM);
}

static void f_atomic_small_slot(struct forger *f)
{
    /* the one that fits, whole in one message; anything else is skipped */
    static uint8_t m[1 << 16];
    for (uint64_t end = t_now_ms() + 3000; t_now_ms() < end;) {
        uint32_t tag = 0;
        ssize_t len = ivshm_recv(f->h, f->victim, NULL, &tag, m, sizeof m, 50);
        struct fiv_rma_hdr q;
        if (len < (ssize_t)sizeof q || (tag & FIV_OP_MASK) != FIV_OP_ATOMIC)
            continue;
        memcpy(&q, m, sizeof q);
        if (q.len != SMALL_ROOM ||
            (size_t)len != sizeof q + SMALL_ROOM)
            continue;
        struct fiv_resp_hdr a = {.id = q.id, .len = q.len};
        REQ_RC(fsend(f, FIV_OP_ACK, &a, sizeof a, marks, q.len), 0);
        return;
    }
}

/* 26. 0-byte RMA WRITEs with remote CQ data, faster than the application
   reads its CQ: the CQ holds no more of their entries than the size the
   application gave it (fiv_test.h gives 256), the rest wait in the
   writer's ring until the application reads (the forger's send is held
   off until its deadline), and the path does not fail: once the victim
   reads its CQ, every write the forger got into the ring lands. */
#define WD_FLOOD (FIV_CQ_SIZE + 4000)
#define CQ_SIZE 256
static void v_write_data_flood(struct victim *v)
{
    uint8_t *w = gbuf(4096);
    struct fid_mr *mr = reg(v, w, 4096, FI_REMOTE_WRITE);
    /* progress through a counter: nothing reads the CQ meanwhile */
    for (uint64_t end = t_now_ms() + 30000;
         !ctl_ready(v->ctl) && t_now_ms() < end;)
        (void)fi_cntr_read(v->r.wcntr);
    struct ctl d = ctl_recv(v->ctl, 'D');
    /* what the CQ holds: one read of more than that (a read makes
       progress only when the CQ is empty) */
    static struct fi_cq_tagged_entry all[4 * CQ_SIZE];
    ssize_t n = fi_cq_read(v->r.cq, all, 4 * CQ_SIZE);
    size_t held = 0, got = 0;
    for (ssize_t k = 0; k < n; k++)
        if (all[k].flags & FI_REMOTE_CQ_DATA) {
            if (all[k].data != held)
                vfail(v, "write %zu landed as %" PRIu64, held, all[k].data);
            held++;
        }
    struct fi_cq_tagged_entry e;
    if (getenv("FIV_FORGE_VERBOSE"))
        fprintf(stderr, "write data flood: %zu entries held of %" PRIu64
                " writes sent\n", held, d.a);
    if (held > CQ_SIZE)
        vfail(v, "the CQ held %zu entries of %" PRIu64 " 0-byte writes with "
              "data (its size %d)", held, d.a, CQ_SIZE);
    /* the rest land as the CQ is read, in the writer's order */
    got = held;
    for (uint64_t end = t_now_ms() + 10000; got < d.a && t_now_ms() < end;) {
        n = fi_cq_read(v->r.cq, &e, 1);
        if (n == -FI_EAVAIL) {
            vfail(v, "an error entry after %zu writes with data", got);
            break;
        }
        if (n == 1 && (e.flags & FI_REMOTE_CQ_DATA)) {
            if (e.data != got)
                vfail(v, "write %zu landed as %" PRIu64, got, e.data);
            got++;
        }
    }
    if (got != d.a)
        vfail(v, "%zu of the %" PRIu64 " writes with data landed once the CQ "
              "was read", got, d.a);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_write_data_flood(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    uint64_t sent = 0;
    for (int i = 0; i < WD_FLOOD; i++) {
        struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = 0,
                                .id = 600 + (uint64_t)i, .data = (uint64_t)i};
        if (fsend(f, FIV_OP_WRITE | FIV_F_DATA, &h, sizeof h, NULL, 0) < 0)
            break; /* held off for CALL_MS: the victim's CQ is full */
        sent++;
    }
    ctl_send(f->ctl, 'D', sent, 0, 0);
}

/* 27. Empty messages no receive takes, past the victim's cap on one
   peer's unexpected bytes: each counts (its record), so the path fails
   (a receive of any source ends with FI_EIO) and the victim holds about
   the cap, not one record per message. */
#define ZFLOOD 20000
#define ZCAP (64u << 10)
static void v_empty_unexp_flood(struct victim *v)
{
    uint8_t *r = gbuf(4096);
    REQ_RC(fi_trecv(v->r.ep, r, 4096, NULL, FI_ADDR_UNSPEC, 0x99, 0, r), 0);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    (void)VWAIT(v, vdone(v, r) != NULL || ctl_ready(v->ctl), 20000);
    (void)VWAIT(v, vdone(v, r) != NULL, 500);
    if (!vdone(v, r))
        vfail(v, "%d empty unexpected messages never failed the path (cap "
              "%u bytes)", ZFLOOD, ZCAP);
    else if (vdone(v, r)->err != FI_EIO)
        vfail(v, "the receive ended with %d, not FI_EIO", vdone(v, r)->err);
    size_t grew = v->heap_peak - v->heap0;
    if (getenv("FIV_FORGE_VERBOSE"))
        fprintf(stderr, "empty unexpected flood: heap +%zu KiB at its peak\n",
                grew >> 10);
    if (grew > ZCAP + (1u << 20))
        vfail(v, "the victim's heap grew by %zu KiB (cap %u KiB)", grew >> 10,
              ZCAP >> 10);
    /* what it still sends is read and dropped: it gets to the end */
    if (VWAIT(v, ctl_ready(v->ctl), 20000))
        ctl_recv(v->ctl, 'D');
}

static void f_empty_unexp_flood(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    uint64_t sent = 0;
    for (int i = 0; i < ZFLOOD; i++) {
        struct fiv_msg_hdr h = {.tag = 0x98, .len = 0};
        if (fsend(f, FIV_OP_MSG | FIV_F_TAGGED, &h, sizeof h, NULL, 0) < 0)
            break;
        sent++;
    }
    ctl_send(f->ctl, 'D', sent, 0, 0);
}

/* 28. An answer to the victim's READ shorter than the read: it
   completes with FI_EIO and nothing of the answer is stored. */
static void v_short_read_answer(struct victim *v)
{
    uint8_t *res = gbuf(4096);
    memset(res, 0, 4096);
    char c;
    REQ_RC(fi_read(v->r.ep, res, 64, NULL, v->forger, 0x1000, 5, &c), 0);
    if (!VWAIT(v, vdone(v, &c) != NULL, 3000))
        vfail(v, "the read never completed");
    else if (vdone(v, &c)->err != FI_EIO)
        vfail(v, "the read completed with %d, not FI_EIO", vdone(v, &c)->err);
    if (count_not(res, 4096, 0))
        vfail(v, "%zu bytes of a short answer were stored",
              count_not(res, 4096, 0));
}

static void f_short_read_answer(struct forger *f)
{
    struct fiv_rma_hdr q;
    REQ(request(f, &q) == FIV_OP_READ && q.len == 64);
    struct fiv_resp_hdr r = {.id = q.id, .len = 8};
    REQ_RC(fsend(f, FIV_OP_READ_RESP, &r, sizeof r, marks, 8), 0);
}

/* 29. One honest message of exactly the victim's unexpected-bytes cap,
   before its receive: it fits (its record is not added to its bytes) and
   arrives whole. */
#define ATCAP (64u << 10)
static void v_unexp_at_cap(struct victim *v)
{
    uint8_t *r = gbuf(ATCAP);
    ctl_send(v->ctl, 'R', 0, 0, 0);
    (void)VWAIT(v, ctl_ready(v->ctl), 10000);
    ctl_recv(v->ctl, 'D');
    for (int i = 0; i < 200; i++)
        vpoll(v);
    REQ_RC(fi_trecv(v->r.ep, r, ATCAP, NULL, FI_ADDR_UNSPEC, 0x98, 0, r), 0);
    if (!VWAIT(v, vdone(v, r) != NULL, 5000))
        vfail(v, "the message at the cap never arrived");
    else if (vdone(v, r)->err)
        vfail(v, "a message of exactly the cap failed the path: err %d",
              vdone(v, r)->err);
}

static void f_unexp_at_cap(struct forger *f)
{
    ctl_recv(f->ctl, 'R');
    size_t got = msg_first(f, true, 0x98, ATCAP);
    more(f, got, ATCAP);
    ctl_send(f->ctl, 'D', 0, 0, 0);
}


/* A writer whose writes with data wait in its ring (the CQ full) sends a
   message behind them and leaves. The victim polls only through a counter
   for 1.5 s (several looks for departed peers, none of which may fail the
   writer while its messages wait behind the held write), then reads its
   CQ: every write and the message land. */
static void v_departed_behind_held(struct victim *v)
{
    uint8_t *w = gbuf(4096);
    struct fid_mr *mr = reg(v, w, 4096, FI_REMOTE_WRITE);
    uint8_t *r = gbuf(4096);
    REQ_RC(fi_trecv(v->r.ep, r, 4096, NULL, v->forger, 0x77, 0, r), 0);
    for (uint64_t end = t_now_ms() + 30000;
         !ctl_ready(v->ctl) && t_now_ms() < end;)
        (void)fi_cntr_read(v->r.wcntr);
    struct ctl d = ctl_recv(v->ctl, 'D');
    for (uint64_t end = t_now_ms() + 1500; t_now_ms() < end;)
        (void)fi_cntr_read(v->r.wcntr);
    size_t got = 0;
    int rerr = -1;
    for (uint64_t end = t_now_ms() + 5000; t_now_ms() < end &&
         (got < d.a || rerr < 0);) {
        struct fi_cq_tagged_entry e;
        ssize_t n = fi_cq_read(v->r.cq, &e, 1);
        if (n == 1 && (e.flags & FI_REMOTE_CQ_DATA))
            got++;
        else if (n == 1 && e.op_context == r)
            rerr = 0;
        else if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            if (fi_cq_readerr(v->r.cq, &err, 0) == 1 && err.op_context == r)
                rerr = err.err;
        }
    }
    fprintf(stderr, "departed_behind_held_write: %zu of %" PRIu64 " writes landed; "
            "receive: %d\n", got, d.a, rerr);
    if (got != d.a || rerr != 0)
        vfail(v, "%zu of %" PRIu64 " writes landed, receive ended %d", got,
              d.a, rerr);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_departed_behind_held(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    uint64_t sent = 0;
    for (int i = 0; i < CQ_SIZE + 8; i++) {
        struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = 0,
                                .id = 600 + (uint64_t)i, .data = (uint64_t)i};
        if (fsend(f, FIV_OP_WRITE | FIV_F_DATA, &h, sizeof h, NULL, 0) < 0)
            break;
        sent++;
    }
    (void)msg_first(f, true, 0x77, 8);
    ctl_send(f->ctl, 'D', sent, 0, 0);
    ivshm_detach(f->h);
    _exit(0);
}


/* The shared queue's form of the case above (IVSHM_FAST_AFTER large: no
   fast channels): hostile H fills the CQ through the queue, honest B
   queues a message behind H's held cell and leaves; the victim polls
   through a counter for 1.5 s, then reads its CQ: B's message lands. */
/* The victim's side of the held-write cases: a window the forger's
   writes fill, a receive (tag) directed at the honest peer the forger
   names, then progress only through a counter until the forger says
   its writes are held and the honest peer left ('D', a: the writes). */
static struct ctl held_beside(struct victim *v, uint64_t tag,
                              struct fid_mr **mr, uint8_t **r)
{
    *mr = reg(v, gbuf(4096), 4096, FI_REMOTE_WRITE);
    ctl_recv(v->ctl, 'A');
    uint8_t name[FIV_ADDR_LEN];
    t_read_full(v->ctl, name, sizeof name);
    fi_addr_t honest;
    REQ_RC(fi_av_insert(v->r.av, name, 1, &honest, 0, NULL), 1);
    *r = gbuf(4096);
    REQ_RC(fi_trecv(v->r.ep, *r, 4096, NULL, honest, tag, 0, *r), 0);
    ctl_send(v->ctl, 'P', 0, 0, 0);
    for (uint64_t end = t_now_ms() + 30000;
         !ctl_ready(v->ctl) && t_now_ms() < end;)
        (void)fi_cntr_read(v->r.wcntr);
    return ctl_recv(v->ctl, 'D');
}

static void v_queue_departed_behind_held(struct victim *v)
{
    struct fid_mr *mr;
    uint8_t *r;
    struct ctl d = held_beside(v, 0x88, &mr, &r);
    for (uint64_t end = t_now_ms() + 1500; t_now_ms() < end;)
        (void)fi_cntr_read(v->r.wcntr);
    size_t got = 0;
    int rerr = -1;
    for (uint64_t end = t_now_ms() + 5000; t_now_ms() < end &&
         (got < d.a || rerr < 0);) {
        struct fi_cq_tagged_entry e;
        ssize_t n = fi_cq_read(v->r.cq, &e, 1);
        if (n == 1 && (e.flags & FI_REMOTE_CQ_DATA))
            got++;
        else if (n == 1 && e.op_context == r)
            rerr = 0;
        else if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            if (fi_cq_readerr(v->r.cq, &err, 0) == 1 && err.op_context == r)
                rerr = err.err;
        }
    }
    fprintf(stderr, "queue_departed_behind_held_write: %zu of %" PRIu64 " writes of H "
            "landed; B's message: %d\n", got, d.a, rerr);
    if (got != d.a || rerr != 0)
        vfail(v, "%zu of H's %" PRIu64 " writes landed; B's message behind "
              "them: receive ended %d", got, d.a, rerr);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_queue_departed_behind_held(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    int sp[2];
    REQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) == 0);
    pid_t bp = fork();
    REQ(bp >= 0);
    if (bp == 0) {
        struct forger b = {.victim = f->victim};
        uint64_t nonce = random64();
        char name[32];
        snprintf(name, sizeof name, "fi.%016" PRIx64, nonce);
        ivshm_config cfg = {.job_id = JOB_TAG, .rank = (uint32_t)nonce,
                            .name = name, .spin_ns = 1};
        REQ_RC(ivshm_attach_path(region, &cfg, &b.h), 0);
        ivshm_peer_info me;
        REQ_RC(ivshm_peer(b.h, ivshm_self(b.h), &me), 0);
        struct fiv_addr a;
        memset(&a, 0, sizeof a);
        a.magic = FIV_ADDR_MAGIC;
        a.version = FIV_ADDR_VERSION;
        a.slot = (int16_t)ivshm_self(b.h);
        a.generation = me.generation;
        a.nonce[0] = (uint32_t)nonce;
        a.nonce[1] = (uint32_t)(nonce >> 32);
        uint64_t kk[2] = {random64(), random64()};
        memcpy(a.key, kk, sizeof a.key);
        REQ(write(sp[1], &a, sizeof a) == (ssize_t)sizeof a);
        char g;
        REQ(read(sp[1], &g, 1) == 1);
        (void)msg_first(&b, true, 0x88, 8);
        ivshm_detach(b.h);
        _exit(0);
    }
    struct fiv_addr ba;
    REQ(read(sp[0], &ba, sizeof ba) == (ssize_t)sizeof ba);
    ctl_send(f->ctl, 'A', 0, 0, 0);
    REQ(write(f->ctl, &ba, FIV_ADDR_LEN) == (ssize_t)FIV_ADDR_LEN);
    ctl_recv(f->ctl, 'P');
    uint64_t sent = 0;
    for (int i = 0; i < CQ_SIZE + 8; i++) {
        struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = 0,
                                .id = 600 + (uint64_t)i, .data = (uint64_t)i};
        if (fsend(f, FIV_OP_WRITE | FIV_F_DATA, &h, sizeof h, NULL, 0) < 0)
            break;
        sent++;
    }
    usleep(200000); /* the victim reaches the held write */
    REQ(write(sp[0], "G", 1) == 1);
    int st = 0;
    waitpid(bp, &st, 0);
    ctl_send(f->ctl, 'D', sent, 0, 0);
}

/* 30. A datagram endpoint issues no RMA, so it awaits no answer: an
   ACK or a READ_RESP it never asked for breaks the forger's path
   (docs/provider.md, "Datagram endpoints"), and the receive directed at
   the forger fails with FI_EIO. */
static void v_dgram_unasked(struct victim *v)
{
    REQ(v->r.info->ep_attr->type == FI_EP_DGRAM);
    uint8_t *buf = gbuf(4096);
    char c;
    REQ_RC(fi_recv(v->r.ep, buf, 64, NULL, v->forger, &c), 0);
    ctl_send(v->ctl, 'K', 0, 0, 0);
    if (!VWAIT(v, vdone(v, &c) != NULL, 3000))
        vfail(v, "the forger's path did not break");
    else if (vdone(v, &c)->err != FI_EIO)
        vfail(v, "the receive completed with %d, not FI_EIO",
              vdone(v, &c)->err);
}

static void f_dgram_unasked(struct forger *f, uint32_t op)
{
    (void)ctl_recv(f->ctl, 'K');
    struct fiv_resp_hdr r = {.id = 1, .len = 8};
    REQ_RC(fsend(f, op, &r, sizeof r, marks, 8), 0);
}

static void f_dgram_unasked_ack(struct forger *f)
{
    f_dgram_unasked(f, FIV_OP_ACK);
}

static void f_dgram_unasked_read_resp(struct forger *f)
{
    f_dgram_unasked(f, FIV_OP_READ_RESP);
}

/* 31. OFFERs (the way back from the core, fiv_drain.c) are the core's
   alone: written into the region as cells of admitted ranks they break
   the writer's own path, whatever they name, while a real peer's checked
   traffic with the victim goes on untouched. Each forging sender is an
   admitted rank of its own, so each naming meets an intact pair: the
   real peer's place (slot, generation, nonce), the writer's own slot in
   another incarnation, a departed rank's slot, 1000 repeated offers of
   the writer's true place; one more comes from a rank that leaves right
   after it (read after its departure, or not), and one from the next
   incarnation of that rank's slot, which the victim never inserted. */
#define OFFER_ROUNDS 300
enum { OF_PLACE, OF_INCARNATION, OF_DEPARTED, OF_REPEATED, OF_LEAVER,
       OF_N };

static void pattern(uint8_t *b, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(i * 131 + seed);
}

/* The victim's CQ: the forging senders' receives are logged in `got`
   (their errors), the real peer's operation `ctx` ends the wait: its
   error, or -1 when `ms` passed first. */
struct offer_rx {
    uint64_t buf;
    int err;
    bool done;
};

static int offer_wait(struct victim *v, struct offer_rx *got, void *ctx,
                      fi_addr_t peer, size_t len, uint64_t tag, int ms)
{
    for (uint64_t end = t_now_ms() + (uint64_t)ms; t_now_ms() < end;) {
        struct fi_cq_tagged_entry e;
        fi_addr_t from = FI_ADDR_NOTAVAIL;
        ssize_t n = fi_cq_readfrom(v->r.cq, &e, 1, &from);
        void *c = NULL;
        int err = 0;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry ee;
            memset(&ee, 0, sizeof ee);
            REQ_RC(fi_cq_readerr(v->r.cq, &ee, 0), 1);
            c = ee.op_context;
            err = ee.err ? ee.err : -1;
        } else if (n == 1) {
            c = e.op_context;
        }
        size_t h = heap_bytes();
        if (h > v->heap_peak)
            v->heap_peak = h;
        if (!c)
            continue;
        bool forged = false;
        for (int k = 0; k < OF_N; k++)
            if (c == &got[k]) {
                forged = true;
                if (got[k].done)
                    vfail(v, "the receive from forging sender %d completed "
                          "twice", k);
                got[k].done = true;
                got[k].err = err;
            }
        if (forged)
            continue;
        if (c != ctx) {
            vfail(v, "a completion for a context never posted");
            continue;
        }
        if (!err && (e.flags & FI_RECV) &&
            (e.len != len || e.tag != tag || from != peer))
            vfail(v, "the real peer's message %#" PRIx64 " came as %zu B, "
                  "tag %#" PRIx64 ", from %" PRIu64, tag, e.len, e.tag,
                  (uint64_t)from);
        return err;
    }
    return -1;
}

static void v_forged_offers(struct victim *v)
{
    ctl_recv(v->ctl, 'A');
    uint8_t names[OF_N + 1][FIV_ADDR_LEN];
    t_read_full(v->ctl, names, sizeof names);
    fi_addr_t who[OF_N], p;
    for (int k = 0; k < OF_N; k++)
        REQ_RC(fi_av_insert(v->r.av, names[k], 1, &who[k], 0, NULL), 1);
    REQ_RC(fi_av_insert(v->r.av, names[OF_N], 1, &p, 0, NULL), 1);
    struct offer_rx got[OF_N];
    memset(got, 0, sizeof got);
    for (int k = 0; k < OF_N; k++)
        REQ_RC(fi_trecv(v->r.ep, &got[k].buf, sizeof got[k].buf, NULL,
                        who[k], 1, 0, &got[k]), 0);
    v->heap0 = v->heap_peak = heap_bytes();
    ctl_send(v->ctl, 'P', 0, 0, 0);
    uint8_t *buf = gbuf(64 << 10), *want = gbuf(64 << 10);
    for (int i = 0; i < OFFER_ROUNDS && !v->fail; i++) {
        if (i == OFFER_ROUNDS / 2) {
            /* the rest after every forgery: the pair still carries */
            uint64_t end = t_now_ms() + 5000;
            while (!ctl_ready(v->ctl) && t_now_ms() < end)
                (void)fi_cntr_read(v->r.rcntr);
            ctl_recv(v->ctl, 'F');
        }
        size_t len = (size_t)8 << (i % 14);
        uint64_t tag = 0x500000 + (uint64_t)i;
        int rc;
        if (i % 2 == 0) {
            REQ_RC(fi_trecv(v->r.ep, buf, 64 << 10, NULL, p, tag, 0, buf), 0);
            rc = offer_wait(v, got, buf, p, len, tag, 5000);
            pattern(want, len, (unsigned)i);
            if (!rc && memcmp(buf, want, len))
                vfail(v, "the real peer's message %d came garbled", i);
        } else {
            pattern(buf, len, (unsigned)i);
            REQ_RC(fi_tsend(v->r.ep, buf, len, NULL, p, tag, buf), 0);
            rc = offer_wait(v, got, buf, p, len, tag, 5000);
        }
        if (rc)
            vfail(v, "round %d with the real peer ended %d (-1: not within "
                  "5 s)", i, rc);
    }
    for (uint64_t end = t_now_ms() + CALL_MS; t_now_ms() < end;) {
        bool all = true;
        for (int k = 0; k < OF_N; k++)
            all = all && got[k].done;
        if (all)
            break;
        (void)offer_wait(v, got, NULL, p, 0, 0, 1);
    }
    for (int k = 0; k < OF_N; k++)
        if (!got[k].done)
            vfail(v, "a receive from forging sender %d still waits", k);
        else if (k != OF_LEAVER && got[k].err != FI_EIO)
            vfail(v, "the receive from forging sender %d ended %d, not "
                  "FI_EIO", k, got[k].err);
        else if (!got[k].err)
            vfail(v, "the departed forger's receive was said to arrive");
    if (v->heap_peak - v->heap0 > (8u << 20))
        vfail(v, "the victim's heap grew by %zu B", v->heap_peak - v->heap0);
    ctl_send(v->ctl, 'D', 0, 0, 0);
    struct ctl st = ctl_recv(v->ctl, 'S');
    if (st.a)
        vfail(v, "the real peer failed (status %#" PRIx64 ")", st.a);
}

/* A provider rank of its own, in the victim's region: the other end of
   the victim's traffic. */
static void offer_peer(int sock)
{
    setenv("FI_IVSHM_REGION", region, 1);
    setenv("FI_IVSHM_CORE", "none", 1);
    setenv("FI_PROVIDER", "ivshm", 1);
    struct rank r = {.me = 1, .n = 2, .sock = -1};
    t_open(&r, FI_VERSION(1, 17));
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    REQ_RC(fi_getname(&r.ep->fid, name, &len), 0);
    REQ(write(sock, name, FIV_ADDR_LEN) == (ssize_t)FIV_ADDR_LEN);
    fi_addr_t v;
    REQ_RC(fi_av_insert(r.av, &victim_name, 1, &v, 0, NULL), 1);
    uint8_t *buf = malloc(64 << 10), *want = malloc(64 << 10);
    REQ(buf && want);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    fi_addr_t src;
    for (int i = 0; i < OFFER_ROUNDS; i++) {
        size_t n = (size_t)8 << (i % 14);
        uint64_t tag = 0x500000 + (uint64_t)i;
        if (i % 2 == 0) {
            pattern(buf, n, (unsigned)i);
            REQ_RC(fi_tsend(r.ep, buf, n, NULL, v, tag, buf), 0);
            REQ_RC(t_wait(&r, &e, &err, NULL, 10000), 0);
        } else {
            REQ_RC(fi_trecv(r.ep, buf, 64 << 10, NULL, v, tag, 0, buf), 0);
            REQ_RC(t_wait(&r, &e, &err, &src, 10000), 0);
            pattern(want, n, (unsigned)i);
            REQ(e.len == n && e.tag == tag && src == v &&
                memcmp(buf, want, n) == 0);
        }
    }
    free(buf);
    free(want);
    t_close(&r);
    _exit(0);
}

/* A fresh attachment registered as a provider endpoint would be, and
   its name. */
static void attach_rank(struct forger *x, int victim, struct fiv_addr *a)
{
    uint64_t nonce = random64();
    char name[32];
    snprintf(name, sizeof name, "fi.%016" PRIx64, nonce);
    ivshm_config cfg = {.job_id = JOB_TAG, .rank = (uint32_t)nonce,
                        .name = name, .spin_ns = 1};
    x->victim = victim;
    REQ_RC(ivshm_attach_path(region, &cfg, &x->h), 0);
    ivshm_peer_info me;
    REQ_RC(ivshm_peer(x->h, ivshm_self(x->h), &me), 0);
    memset(a, 0, sizeof *a);
    a->magic = FIV_ADDR_MAGIC;
    a->version = FIV_ADDR_VERSION;
    a->slot = (int16_t)ivshm_self(x->h);
    a->generation = me.generation;
    a->nonce[0] = (uint32_t)nonce;
    a->nonce[1] = (uint32_t)(nonce >> 32);
    uint64_t k[2] = {random64(), random64()};
    memcpy(a->key, k, sizeof a->key);
}

static void offer(struct forger *x, const struct fiv_addr *named,
                  uint32_t generation, uint16_t flags)
{
    struct fiv_offer o = {.slot = named->slot, .flags = flags,
                          .generation = generation,
                          .nonce = {named->nonce[0], named->nonce[1]}};
    REQ_RC(fsend(x, FIV_OP_OFFER, &o, sizeof o, NULL, 0), 0);
}

static void f_forged_offers(struct forger *f)
{
    int sp[2];
    REQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) == 0);
    pid_t pp = fork();
    REQ(pp >= 0);
    if (pp == 0) {
        close(sp[0]);
        offer_peer(sp[1]);
    }
    close(sp[1]);
    struct fiv_addr names[OF_N + 1];
    struct forger x[OF_N];
    for (int k = 0; k < OF_N; k++)
        attach_rank(&x[k], f->victim, &names[k]);
    t_read_full(sp[0], &names[OF_N], FIV_ADDR_LEN);
    ctl_send(f->ctl, 'A', 0, 0, 0);
    REQ(write(f->ctl, names, sizeof names) == (ssize_t)sizeof names);
    ctl_recv(f->ctl, 'P');
    const struct fiv_addr *peer = &names[OF_N];
    offer(&x[OF_PLACE], peer, peer->generation, 0);
    offer(&x[OF_PLACE], peer, peer->generation, FIV_OFFER_HEARD);
    offer(&x[OF_INCARNATION], &names[OF_INCARNATION],
          names[OF_INCARNATION].generation + 1, 0);
    /* one that leaves right after its offer; then its slot is named by
       another, and written from by its next incarnation */
    offer(&x[OF_LEAVER], &names[OF_LEAVER], names[OF_LEAVER].generation, 0);
    ivshm_detach(x[OF_LEAVER].h);
    offer(&x[OF_DEPARTED], &names[OF_LEAVER], names[OF_LEAVER].generation,
          FIV_OFFER_HEARD);
    struct forger next;
    struct fiv_addr nname;
    attach_rank(&next, f->victim, &nname);
    offer(&next, &names[OF_LEAVER], names[OF_LEAVER].generation, 0);
    for (int i = 0; i < 1000; i++)
        offer(&x[OF_REPEATED], &names[OF_REPEATED],
              names[OF_REPEATED].generation, (uint16_t)(i & 1));
    ctl_send(f->ctl, 'F', 0, 0, 0);
    ctl_recv(f->ctl, 'D');
    int st = -1;
    for (uint64_t end = t_now_ms() + 5000; t_now_ms() < end;)
        if (waitpid(pp, &st, WNOHANG) == pp)
            break;
        else
            usleep(1000);
    if (st == -1) {
        kill(pp, SIGKILL);
        waitpid(pp, &st, 0);
    }
    ctl_send(f->ctl, 'S', (uint64_t)(unsigned)st, 0, 0);
    ivshm_detach(next.h);
    for (int k = 0; k < OF_N; k++)
        if (k != OF_LEAVER)
            ivshm_detach(x[k].h);
}

/* 32. The other side of case 28: a peer whose messages are not behind
   the held write. The forger fills the CQ with writes with data (held),
   then honest D, which the victim waits on (a receive directed at it)
   and which sent nothing, leaves. The victim polls only through a
   counter and looks at its CQ's errors alone (its entries stay unread,
   the writes stay held): D's receive fails within the looks for
   departed peers (FI_EIO), not only once the application reads its
   CQ; the writes all land afterwards. */
static void v_departed_beside_held(struct victim *v)
{
    struct fid_mr *mr;
    uint8_t *r;
    struct ctl dn = held_beside(v, 0x99, &mr, &r);
    int rerr = 0;
    uint64_t t0 = t_now_ms();
    while (!rerr && t_now_ms() < t0 + 3000) {
        (void)fi_cntr_read(v->r.wcntr);
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        if (fi_cq_readerr(v->r.cq, &err, 0) == 1 && err.op_context == r)
            rerr = err.err ? err.err : -1;
    }
    uint64_t took = t_now_ms() - t0;
    size_t got = 0;
    for (uint64_t end = t_now_ms() + 5000; t_now_ms() < end && got < dn.a;) {
        struct fi_cq_tagged_entry e;
        ssize_t n = fi_cq_read(v->r.cq, &e, 1);
        if (n == 1 && (e.flags & FI_REMOTE_CQ_DATA))
            got++;
        else if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            (void)fi_cq_readerr(v->r.cq, &err, 0);
        }
    }
    fprintf(stderr, "departed_beside_held_write: D's receive ended %d after "
            "%" PRIu64 " ms with the CQ unread; %zu of %" PRIu64 " writes "
            "landed\n", rerr, took, got, dn.a);
    if (rerr != FI_EIO)
        vfail(v, "the receive from the departed peer ended %d within 3 s "
              "of a held write (0: still waiting), not FI_EIO", rerr);
    if (got != dn.a)
        vfail(v, "%zu of the forger's %" PRIu64 " writes landed", got, dn.a);
    REQ_RC(fi_close(&mr->fid), 0);
}

static void f_departed_beside_held(struct forger *f)
{
    struct ctl k = ctl_recv(f->ctl, 'K');
    struct forger dx;
    struct fiv_addr dname;
    attach_rank(&dx, f->victim, &dname);
    ctl_send(f->ctl, 'A', 0, 0, 0);
    REQ(write(f->ctl, &dname, FIV_ADDR_LEN) == (ssize_t)FIV_ADDR_LEN);
    ctl_recv(f->ctl, 'P');
    uint64_t sent = 0;
    for (int i = 0; i < CQ_SIZE + 8; i++) {
        struct fiv_rma_hdr h = {.addr = k.a, .key = k.b, .len = 0,
                                .id = 700 + (uint64_t)i, .data = (uint64_t)i};
        if (fsend(f, FIV_OP_WRITE | FIV_F_DATA, &h, sizeof h, NULL, 0) < 0)
            break;
        sent++;
    }
    usleep(200000); /* the victim reaches the held write */
    ivshm_detach(dx.h);
    ctl_send(f->ctl, 'D', sent, 0, 0);
}

static void f_idle(struct forger *f)
{
    (void)ctl_recv(f->ctl, 'K');
}

static const struct fcase cases[] = {
    {"write_after_mr_close", v_write_after_close, f_write_after_close,
     "RMA WRITE continuations after fi_close(mr) and reuse of the memory", NULL},
    {"read_after_mr_close", v_read_after_close, f_read_after_close,
     "a large RMA READ still answered after fi_close(mr)", NULL},
    {"multi_recv_after_cancel", v_multi_recv_cancel, f_multi_recv_cancel,
     "a message still filling a multi-receive buffer that fi_cancel returned", NULL},
    {"claim_discard_while_arriving", v_claim_discard, f_discard_arriving,
     "FI_PEEK|FI_CLAIM, then FI_CLAIM|FI_DISCARD of a message still arriving", NULL},
    {"read_flood_no_drain", v_read_flood, f_read_flood,
     "64 KiB READ requests from a peer that drains no answer", NULL},
    {"peek_discard_while_arriving", v_peek_discard, f_discard_arriving,
     "FI_PEEK|FI_DISCARD of a message still arriving", NULL},
    {"av_remove_mid_message", v_av_remove, f_av_remove,
     "fi_av_remove of a peer whose message fills a posted receive", NULL},
    {"ep_close_mid_assembly", v_ep_close, f_ep_close,
     "fi_close(ep) with an answer queued and a message half received", NULL},
    {"multi_recv_consumed_while_arriving", v_multi_recv_consume,
     f_multi_recv_consume,
     "a multi-receive buffer used up while its last message arrives", NULL},
    {"rma_at_the_bounds", v_rma_bounds, f_rma_bounds,
     "RMA requests at and past the edges of a registration", NULL},
    {"forged_answers_and_atomics", v_forged_answers, f_forged_answers,
     "answers longer than asked, repeated or for no request; atomics at "
     "the edges", NULL},
    {"atomic_read_of_read_only_pages", v_atomic_read_only, f_atomic_read_only,
     "an atomic read of memory registered from read-only pages", NULL},
    {"read_answer_past_the_maximum", v_bad_read_answer, f_bad_read_answer,
     "an answer to a READ longer than any message", NULL},
    {"unexpected_past_cap", v_unexp_cap, f_unexp_cap,
     "8 MiB of unexpected messages against a cap of 4 MiB",
     "FI_IVSHM_PEER_UNEXPECTED_BYTES=4194304"},
    {"sends_past_queue_cap", v_queue_cap, f_queue_cap,
     "sends to a peer that reads nothing, past a queue cap of 64",
     "FI_IVSHM_PEER_QUEUE=64"},
    {"forged_switch_counts", v_switch_counts, f_switch_counts,
     "a SWITCH counting messages never sent, with no drain asked", NULL},
    {"forged_switch_answer", v_switch_answer, f_switch_answer,
     "a drain the forger asks for, answered with a SWITCH out of order",
     "FI_IVSHM_CORE=tcp;ofi_rxm,tcp,sockets"},
    {"forged_back_unasked", v_switch_counts, f_back_unasked,
     "a region BACK from a peer that never moved to the core", NULL},
    {"forged_switch_stuck", v_switch_stuck, f_switch_stuck,
     "a SWITCH our answer cannot follow, its writer gone since",
     "FI_IVSHM_CORE=tcp;ofi_rxm,tcp,sockets FI_IVSHM_DRAIN_MS=500"},
    {"insert_during_drain", v_insert_in_drain, f_insert_in_drain,
     "a peer inserted while a drain is under way, sent to after it",
     "FI_IVSHM_CORE=tcp;ofi_rxm,tcp,sockets FI_IVSHM_DRAIN_MS=1000"},
    {"forget_after_rejoin", v_forget_after_rejoin, f_forget_after_rejoin,
     "a peer failed in a drain removed after a smaller region was taken",
     "FI_IVSHM_CORE=tcp;ofi_rxm,tcp,sockets FI_IVSHM_DRAIN_MS=500"},
    {"drain_refused", v_drain_refused, f_drain_refused,
     "a drain a co-tenant asks of a rank with no core provider", NULL},
    {"empty_registration_zero_bytes", v_empty_registration,
     f_empty_registration,
     "0-byte READ and WRITE of a NULL, 0-byte registration", NULL},
    {"read_refused_in_fragments", v_read_refused_in_fragments,
     f_read_refused_in_fragments,
     "an answer refusing a READ whose bytes still come in fragments", NULL},
    {"short_fetch_answer", v_short_fetch_answer, f_short_fetch_answer,
     "answers to fetching atomics shorter than the value they fetch", NULL},
    {"atomic_past_a_small_slot", v_atomic_small_slot, f_atomic_small_slot,
     "atomics larger than one fragment of a region's smallest slots", NULL},
    {"write_data_flood", v_write_data_flood, f_write_data_flood,
     "0-byte RMA WRITEs with CQ data past the CQ's size, the CQ unread",
     NULL},
    {"empty_unexpected_past_cap", v_empty_unexp_flood, f_empty_unexp_flood,
     "20000 empty unexpected messages against a cap of 64 KiB",
     "FI_IVSHM_PEER_UNEXPECTED_BYTES=65536"},
    {"short_read_answer", v_short_read_answer, f_short_read_answer,
     "an answer to a READ shorter than the read", NULL},
    {"unexpected_at_the_cap", v_unexp_at_cap, f_unexp_at_cap,
     "one honest message of exactly the unexpected-bytes cap",
     "FI_IVSHM_PEER_UNEXPECTED_BYTES=65536"},
    {"departed_behind_held_write", v_departed_behind_held,
     f_departed_behind_held,
     "a writer leaves with a message behind its writes waiting on a full CQ",
     NULL},
    {"queue_departed_behind_held_write", v_queue_departed_behind_held,
     f_queue_departed_behind_held,
     "an honest sender leaves with a message queued behind a co-tenant's "
     "write waiting on a full CQ", "IVSHM_FAST_AFTER=1000000000"},
    {"dgram_unasked_ack", v_dgram_unasked, f_dgram_unasked_ack,
     "an ACK a datagram endpoint never asked for", NULL},
    {"dgram_unasked_read_resp", v_dgram_unasked, f_dgram_unasked_read_resp,
     "a READ_RESP a datagram endpoint never asked for", NULL},
    {"departed_beside_held_write", v_departed_beside_held,
     f_departed_beside_held,
     "a peer that sent nothing leaves while another's write waits on a "
     "full CQ", NULL},
    {"forged_offers", v_forged_offers, f_forged_offers,
     "OFFER cells in the region from admitted ranks, naming another "
     "place, incarnation or a departed slot, repeated, beside a real "
     "peer's traffic", NULL},
    {"self_read_large", v_self_read, f_idle,
     "a READ of our own memory over the inline copy (no forgery)", NULL},
};

/* The slot size of a case's region: libivshm's default (0), but for a
   case about the smallest slots. */
static uint32_t case_slot(const struct fcase *c)
{
    return c->victim == v_atomic_small_slot ? SMALL_SLOT : 0;
}

/* One case in two fresh processes on the case's own region: 0 if it
   held. */
static int run_case(const struct fcase *c, const char *where)
{
    region = where;
    int sv[2];
    REQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0);
    int pipefd[2];
    REQ(pipe(pipefd) == 0);
    pid_t vp = fork();
    REQ(vp >= 0);
    if (vp == 0) {
        close(sv[0]);
        close(pipefd[0]);
        alarm(40);
        setenv("FI_IVSHM_REGION", region, 1);
        setenv("FI_IVSHM_CORE", "none", 1);
        /* no other provider's signal handlers between a fault and us */
        setenv("FI_PROVIDER", "ivshm", 1);
        char *envs = c->env ? strdup(c->env) : NULL, *save = NULL;
        for (char *kv = envs ? strtok_r(envs, " ", &save) : NULL; kv;
             kv = strtok_r(NULL, " ", &save))
            putenv(kv);
        t_dgram = c->victim == v_dgram_unasked;
        struct victim v = {.ctl = sv[1], .r = {.me = 0, .n = 1, .sock = -1}};
        victim_open(&v);
        c->victim(&v);
        if (v.r.ep)
            victim_close(&v, false);
        if (v.fail)
            REQ(write(pipefd[1], v.why, strlen(v.why)) > 0);
        _exit(v.fail ? 3 : 0);
    }
    pid_t fp = fork();
    REQ(fp >= 0);
    if (fp == 0) {
        close(sv[1]);
        close(pipefd[0]);
        close(pipefd[1]);
        alarm(40);
        /* a case's libivshm settings (IVSHM_*) hold for its senders too */
        char *envs = c->env ? strdup(c->env) : NULL, *save = NULL;
        for (char *kv = envs ? strtok_r(envs, " ", &save) : NULL; kv;
             kv = strtok_r(NULL, " ", &save))
            if (!strncmp(kv, "IVSHM_", 6))
                putenv(kv);
        struct forger f = {.ctl = sv[0]};
        forger_open(&f);
        c->forger(&f);
        /* stay attached until the victim is done with us */
        char b[64];
        (void)read(f.ctl, b, sizeof b);
        ivshm_detach(f.h);
        _exit(0);
    }
    close(sv[0]);
    close(sv[1]);
    close(pipefd[1]);
    uint64_t t0 = t_now_ms();
    int vst = 0, fst = 0;
    waitpid(vp, &vst, 0);
    char why[512] = {0};
    (void)read(pipefd[0], why, sizeof why - 1);
    close(pipefd[0]);
    /* the forger leaves once the victim has gone */
    for (uint64_t end = t_now_ms() + 5000;
         waitpid(fp, &fst, WNOHANG) == 0;) {
        if (t_now_ms() > end) {
            kill(fp, SIGKILL);
            waitpid(fp, &fst, 0);
            break;
        }
        usleep(1000);
    }
    int bad = 0;
    if (WIFSIGNALED(vst)) {
        snprintf(why, sizeof why, "the victim was killed by signal %d (%s)",
                 WTERMSIG(vst), strsignal(WTERMSIG(vst)));
        bad = 1;
    } else if (WEXITSTATUS(vst) == 3) {
        bad = 1;
    } else if (WEXITSTATUS(vst) != 0) {
        snprintf(why, sizeof why, "the victim exited with status %d (a "
                 "sanitizer report or a failed step, see above)",
                 WEXITSTATUS(vst));
        bad = 1;
    }
    if (WIFEXITED(fst) && WEXITSTATUS(fst) != 0 && !bad) {
        snprintf(why, sizeof why, "the forger failed (status %d)",
                 WEXITSTATUS(fst));
        bad = 1;
    }
    printf("%s: %s: %s (%llu ms)%s%s\n", bad ? "FAIL" : "ok", c->name, c->what,
           (unsigned long long)(t_now_ms() - t0), bad ? ": " : "",
           bad ? why : "");
    return bad;
}

int main(void)
{
    if (!getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "FI_PROVIDER_PATH must name the provider's directory\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *only = getenv("FIV_FORGE_CASE");
    int rounds = getenv("FIV_FORGE_ROUNDS") ? atoi(getenv("FIV_FORGE_ROUNDS")) : 1;
    if (rounds < 1) {
        fprintf(stderr, "FIV_FORGE_ROUNDS must be a positive count\n");
        return 2;
    }
    memset(marks, MARK, sizeof marks);
    size_t ncases = sizeof cases / sizeof cases[0];
    const char *regions[sizeof cases / sizeof cases[0]] = {0};
    int failed = 0, ran = 0;
    for (int round = 0; round < rounds; round++)
        for (size_t i = 0; i < ncases; i++) {
            if (only && strcmp(only, cases[i].name))
                continue;
            if (!regions[i]) /* reused by later rounds: both processes leave */
                regions[i] = t_region(8, case_slot(&cases[i]));
            failed += run_case(&cases[i], regions[i]);
            ran++;
        }
    if (!ran) {
        fprintf(stderr, "no case named %s\n", only);
        return 2;
    }
    printf("%d of %d cases failed\n", failed, ran);
    return failed ? 1 : 0;
}
