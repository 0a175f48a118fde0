/*
 * A hostile co-tenant against two ranks of the provider sharing a region
 * (docs/security.md, "The libfabric provider"): a real process attaches
 * the region through libivshm, registers under the provider's job tag
 * with a rank's own registry name, and floods both ranks with forged
 * messages of every operation (messages with the tags the ranks use,
 * continuations, RMA writes, reads and atomics with guessed keys, answers
 * with guessed ids, unknown operations, introductions with its own slot
 * and the rank's nonce under guessed MACs) while the ranks run a checked
 * ping-pong with RMA, and again while one rank streams to another that
 * never inserted it (heard through its introduction only). Nothing forged
 * may be delivered (every payload, tag and source is checked), no rank
 * may crash, and every wait ends by its deadline. Under ASan/UBSan in the
 * sanitized build.
 */
#include "fiv_test.h"

#include <sys/mman.h>

#define JOB_TAG (UINT64_C(0x46495653) << 32)
#define ROUNDS 2000   /* both ranks: a fixed count */
#define RUN_MS 1500

static const char *region;

static void fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 131 + seed);
}

static uint64_t xs = 88172645463325252ull;
static uint64_t rnd(void)
{
    xs ^= xs << 13;
    xs ^= xs >> 7;
    xs ^= xs << 17;
    return xs;
}

/* The co-tenant: floods every provider slot it finds for RUN_MS. */
static int hostile(void)
{
    ivshm *h = NULL;
    /* wait for the two ranks, then take one's name */
    char name[32] = "fi.hostile";
    int victims[2], nv = 0;
    ivshm_config cfg = {.job_id = JOB_TAG ^ 1, .rank = 1, .name = "probe",
                        .spin_ns = 1};
    if (ivshm_attach_path(region, &cfg, &h) < 0)
        return 3;
    for (uint64_t end = t_now_ms() + 10000; nv < 2 && t_now_ms() < end;) {
        nv = 0;
        for (int s = 0; s < ivshm_max_peers(h) && nv < 2; s++) {
            ivshm_peer_info pi;
            if (ivshm_peer(h, s, &pi) == 0 && pi.job_id == JOB_TAG &&
                !strncmp(pi.name, "fi.", 3)) {
                victims[nv++] = s;
                memcpy(name, pi.name, sizeof name);
                name[31] = 0;
            }
        }
        usleep(1000);
    }
    ivshm_detach(h);
    if (nv < 2)
        return 4;
    /* pose as a rank: same job tag, same registry name */
    ivshm_config pose = {.job_id = JOB_TAG, .rank = 12345, .name = name,
                         .spin_ns = 1};
    if (ivshm_attach_path(region, &pose, &h) < 0)
        return 5;
    uint8_t buf[4096];
    uint64_t sent = 0;
    ivshm_peer_info me;
    if (ivshm_peer(h, ivshm_self(h), &me) < 0)
        return 7;
    uint64_t nonce = strtoull(name + 3, NULL, 16);
    for (uint64_t end = t_now_ms() + RUN_MS; t_now_ms() < end;) {
        int v = victims[rnd() % 2];
        if (rnd() % 4 == 0) {
            /* an introduction as a rank would write one, but for our own
               slot (the receiver checks that) and with a guessed MAC */
            struct { int16_t slot; uint16_t pad; uint32_t gen;
                     uint64_t nonce, mac; } in = {
                (int16_t)ivshm_self(h), 0, me.generation, nonce, rnd()};
            if (ivshm_send_timeout(h, v, 8, &in, sizeof in, 5) == 0)
                sent++;
            continue;
        }
        uint32_t op = (uint32_t)(rnd() % 11) | (uint32_t)(rnd() & 0x1f00);
        size_t len = (size_t)(rnd() % sizeof buf);
        for (size_t i = 0; i < len; i += 8) {
            uint64_t x = rnd();
            memcpy(buf + i, &x, len - i < 8 ? len - i : 8);
        }
        if (len >= 24 && rnd() % 2) {
            /* plausible headers: the ranks' tags, small lengths; one in
               two a whole tagged message, as a rank would write it */
            uint64_t tag = rnd() % 4096, l = rnd() % 64;
            if (rnd() % 2) {
                op = 1 | 0x100;
                len = 24 + (size_t)l;
            }
            memcpy(buf, &tag, 8);
            memcpy(buf + 8, &l, 8);
        }
        if (ivshm_send_timeout(h, v, op, buf, len, 5) == 0)
            sent++;
    }
    ivshm_detach(h);
    return sent > 0 ? 0 : 6;
}

/* The raw scribbler: random bytes at random places of the mapped file
   (past its first page, the header read once at attach) for RUN_MS. */
static int scribbler(void)
{
    int fd = open(region, O_RDWR);
    if (fd < 0)
        return 3;
    off_t size = lseek(fd, 0, SEEK_END);
    uint8_t *base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE,
                         MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return 4;
    usleep(200000); /* let the ranks attach */
    uint64_t writes = 0;
    for (uint64_t end = t_now_ms() + RUN_MS; t_now_ms() < end;) {
        size_t off = 4096 + (size_t)(rnd() % (uint64_t)(size - 4096 - 8));
        uint64_t v = rnd();
        memcpy(base + off, &v, 1 + rnd() % 8);
        if (++writes % 64 == 0)
            usleep(100);
    }
    munmap(base, (size_t)size);
    return 0;
}

/* Ranks under the scribbler: messages may be lost or corrupted (raw
   writes cannot be told from a rank's own), but every call returns, no
   rank crashes or reads out of bounds, and each gives up by its deadline. */
static void survive(struct rank *r)
{
    t_open(r, FI_VERSION(1, 17));
    t_exchange(r);
    int peer = 1 - r->me;
    uint8_t *buf = malloc(1 << 16);
    REQ(buf);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    uint64_t end = t_now_ms() + RUN_MS + 500;
    for (int i = 0; t_now_ms() < end; i++) {
        size_t len = (size_t)8 << (i % 14);
        if (fi_trecv(r->ep, buf, 1 << 16, NULL, FI_ADDR_UNSPEC, 0, ~0ull, buf))
            break;
        (void)fi_tsend(r->ep, buf, len, NULL, r->addr[peer], (uint64_t)i, r);
        /* whatever comes, within 50 ms */
        for (uint64_t t = t_now_ms() + 50; t_now_ms() < t;)
            if (fi_cq_read(r->cq, &e, 1) == -FI_EAVAIL)
                (void)fi_cq_readerr(r->cq, &err, 0);
        (void)fi_cancel(&r->ep->fid, buf);
    }
    free(buf);
    t_barrier_plain(r);
    t_close(r);
}

struct target {
    uint64_t addr, key;
};

static void pingpong(struct rank *r)
{
    t_open(r, FI_VERSION(1, 17));
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    fi_addr_t src = FI_ADDR_NOTAVAIL;
    int peer = 1 - r->me;
    uint8_t *out = malloc(1 << 16), *in = malloc(1 << 16), *want = malloc(1 << 16);
    uint64_t word[2] = {0, 0};
    REQ(out && in && want);
    struct fid_mr *mr;
    REQ_RC(fi_mr_reg(r->dom, word, sizeof word, FI_REMOTE_READ | FI_REMOTE_WRITE,
                     0, 0, 0, &mr, NULL), 0);
    struct target mine = {(uint64_t)(uintptr_t)word, fi_mr_key(mr)}, t[2];
    for (int root = 0; root < 2; root++) {
        struct target x = mine;
        t_bcast(r, root, &x, sizeof x);
        t[root] = x;
    }
    for (int i = 0; i < ROUNDS; i++) {
        size_t len = (size_t)8 << (i % 14); /* 8 B .. 64 KiB */
        uint64_t tag = (uint64_t)(i % 4096);
        if ((i % 2) == r->me) {
            fill(out, len, (unsigned)i);
            REQ_RC(fi_tsend(r->ep, out, len, NULL, r->addr[peer], tag, out), 0);
            REQ_RC(t_wait(r, &e, &err, NULL, 10000), 0);
            REQ(e.op_context == out);
        } else {
            REQ_RC(fi_trecv(r->ep, in, 1 << 16, NULL, FI_ADDR_UNSPEC, tag, 0,
                            in), 0);
            int rc = t_wait(r, &e, &err, &src, 10000);
            if (rc)
                fprintf(stderr, "rank %d: receive %d (%zu B) failed\n", r->me,
                        i, len);
            REQ_RC(rc, 0);
            fill(want, len, (unsigned)i);
            REQ(e.op_context == in && e.len == len && e.tag == tag);
            REQ(src == r->addr[peer]);
            REQ(memcmp(in, want, len) == 0);
        }
        if (i % 50 == 0 && r->me == 0) {
            /* an atomic and a read on the peer's words, checked */
            uint64_t one = 1, old = 0, rd = 0;
            REQ_RC(fi_fetch_atomic(r->ep, &one, 1, NULL, &old, NULL,
                                   r->addr[peer], t[peer].addr, t[peer].key,
                                   FI_UINT64, FI_SUM, &old), 0);
            REQ_RC(t_wait(r, &e, &err, NULL, 10000), 0);
            REQ(old == (uint64_t)(i / 50));
            REQ_RC(fi_read(r->ep, &rd, 8, NULL, r->addr[peer], t[peer].addr,
                           t[peer].key, &rd), 0);
            REQ_RC(t_wait(r, &e, &err, NULL, 10000), 0);
            REQ(rd == (uint64_t)(i / 50) + 1);
        }
    }
    t_barrier(r);
    REQ(word[1] == 0); /* the second word is never written by a rank */
    fi_close(&mr->fid);
    free(out);
    free(in);
    free(want);
    t_close(r);
}

/* One way, to a rank that never inserts the sender: it hears rank 0
   through its introduction alone, and nothing else. */
static void unnamed(struct rank *r)
{
    if (r->me == 1)
        t_insert_mask = 1u << 1;
    t_open(r, FI_VERSION(1, 17));
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    fi_addr_t src = 0;
    uint8_t *buf = malloc(1 << 16), *want = malloc(1 << 16);
    REQ(buf && want);
    for (int i = 0; i < ROUNDS; i++) {
        size_t len = (size_t)8 << (i % 14);
        uint64_t tag = (uint64_t)(i % 4096);
        if (r->me == 0) {
            fill(buf, len, (unsigned)i);
            REQ_RC(fi_tsend(r->ep, buf, len, NULL, r->addr[1], tag, buf), 0);
            REQ_RC(t_wait(r, &e, &err, NULL, 10000), 0);
        } else {
            REQ_RC(fi_trecv(r->ep, buf, 1 << 16, NULL, FI_ADDR_UNSPEC, tag, 0,
                            buf), 0);
            int rc = t_wait(r, &e, &err, &src, 10000);
            if (rc)
                fprintf(stderr, "rank 1: receive %d (%zu B) failed\n", i, len);
            REQ_RC(rc, 0);
            fill(want, len, (unsigned)i);
            REQ(e.len == len && e.tag == tag && src == FI_ADDR_NOTAVAIL);
            REQ(memcmp(buf, want, len) == 0);
        }
    }
    t_barrier(r);
    free(buf);
    free(want);
    t_close(r);
}

/* Two ranks running `body` on a fresh region under the flooding
   co-tenant: the number of failures. */
static int under_hostile(t_body body)
{
    region = t_region(8, 0);
    pid_t h = getenv("FIV_NO_HOSTILE") ? -1 : fork();
    if (h == 0) {
        alarm(30);
        _exit(hostile());
    }
    char env[256];
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", region);
    const char *envs[] = {env, env};
    int failed = t_run(2, body, envs, 60, NULL);
    int st = 0;
    if (h > 0)
        waitpid(h, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "the hostile process did not flood (status %#x)\n", st);
        failed++;
    }
    return failed;
}

int main(void)
{
    if (!getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "FI_PROVIDER_PATH must name the provider's directory\n");
        return 2;
    }
    /* lines, not a buffer forked children would inherit */
    setvbuf(stdout, NULL, _IOLBF, 0);
    int failed = under_hostile(pingpong);
    printf("%s: checked ping-pong and RMA under a flooding co-tenant posing "
           "as a rank\n", failed ? "FAIL" : "ok");
    int f = under_hostile(unnamed);
    printf("%s: the same towards a rank that never inserted its sender "
           "(forged introductions)\n", f ? "FAIL" : "ok");
    failed += f;

    region = t_region(8, 0);
    char env[256];
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", region);
    const char *envs[] = {env, env};
    pid_t s = fork();
    if (s == 0) {
        alarm(30);
        _exit(scribbler());
    }
    int st = 0;
    f = t_run(2, survive, envs, 60, NULL);
    waitpid(s, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "the scribbler failed (status %#x)\n", st);
        f++;
    }
    printf("%s: two ranks survive raw writes all over their region\n",
           f ? "FAIL" : "ok");
    failed += f;
    return failed ? 1 : 0;
}
