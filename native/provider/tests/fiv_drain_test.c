/*
 * A pair moved from the region to the core path and back under a running
 * stream (docs/migration.md): two real provider processes on one region
 * send each other an ordered, content-checked tagged stream (small
 * messages, messages of several fragments on either path, fetching
 * atomics) while the host asks one of them to let go of the region,
 * through ivshm_admin_drain_slot on the region file, as the server
 * would; once it answered, the host takes its name of the region away
 * (its device unplugged) and gives it back later (the device plugged).
 *
 * Checked: every message arrives once and in order with its bytes; each
 * fetching atomic returns the count of the ones before it (none lost,
 * none applied twice); the drained rank acknowledges with status 0 and
 * leaves its slot; its report line's phases show the region before, the
 * core only while it was away and the region again after, one drain, one
 * rejoin and the pair moved twice on both sides. Two cases have a
 * migration's shape: three ranks, one moving between the others'
 * regions; and four ranks as two servers of two (`ivcloud bench
 * migrate`), where rank 2 joins the region of ranks 0 and 1 and both new
 * pairs go back to it at once (rank 2 then sends them nothing over the
 * core; each pair's round trip before and after is printed). A guest's
 * round trip: rank 0 moves to an empty region and back, twice, each drain
 * begun under a put and a 64 MiB message each way, each region mapped
 * away from the last one's addresses. Another
 * puts thousands of region messages ahead of a SWITCH while the core
 * messages behind it arrive first.
 *
 * Hostile: a peer that never answers the SWITCH (away from libfabric
 * past the deadline): the drain ends at FI_IVSHM_DRAIN_MS, the pair's
 * waiting receive fails with an error instead of hanging, the status
 * says -ETIMEDOUT, and the rank has left the region. And a back switch
 * whose region BACK cannot go: the peer took the core BACK, reads nothing
 * of its region, and a co-tenant process keeps its queue full; what waits
 * on the pair (a receive, a send held behind that BACK) fails by the
 * deadline instead of waiting for good. Forged SWITCH and
 * BACK messages are fiv_forge's cases ("forged_switch_*",
 * "forged_back_unasked").
 */
#include "fiv_test.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include "ivshm_admin.h"

static const uint32_t version = FI_VERSION(1, 17);

#define TAG 0x77
#define N_MSG 8000          /* each way, one per PACE_US at most          */
#define PACE_US 200
#define DRAIN_AT 2000       /* rank 1 asks for the drain after this many  */
#define RELINK_AT 3000      /* and gives rank 0 its region back here      */
#define WIN 32              /* receives posted, sends in flight           */
#define BIG 20000           /* several region slots and core buffers      */
#define MAXLEN BIG
#define ATOMIC_EVERY 16
#define REQ_NO 7            /* the drain request's number                 */

static const char *region_path;
/* rank 0's way to the region in the stream: a second name of the file,
   which goes while rank 0 is away (its device unplugged) */
static char link_path[128];

static uint64_t t_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static size_t len_of(uint32_t i)
{
    return i % 97 == 5 ? BIG : 8 + (i * 37u) % 300;
}

static uint8_t byte_of(int from, uint32_t i, size_t j)
{
    return (uint8_t)(i * 131u + j * 7u + (unsigned)from * 29u);
}

/* Slot and generation of a provider's name (struct fiv_addr: int16 slot
   at byte 4, uint32 generation at byte 8). */
static void name_slot(const char *name, int *slot, uint32_t *gen)
{
    int16_t s;
    memcpy(&s, name + 4, sizeof s);
    memcpy(gen, name + 8, sizeof *gen);
    *slot = s;
}

static ivshm_admin *admin_open(void)
{
    int fd = open(region_path, O_RDWR | O_CLOEXEC);
    REQ(fd >= 0);
    ivshm_admin *a = NULL;
    REQ_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    return a;
}

struct rxbuf {
    uint8_t mem[MAXLEN];
};
struct txbuf {
    bool busy;
    uint8_t mem[MAXLEN];
};

struct stream {
    struct rank *r;
    int peer;
    uint32_t next_tx, next_rx, posted;
    struct rxbuf rx[WIN];
    uint32_t rx_seq[WIN];       /* which message each posted buffer gets */
    struct txbuf tx[WIN];
    int tx_busy;
    uint64_t counter;           /* the peer's atomics add to it           */
    struct fid_mr *mr;
    uint64_t peer_key, peer_addr;
    uint64_t fetched[WIN], add_one;
    bool fetch_busy[WIN];
    uint32_t atomics_done, atomics_sent;
    uint64_t last_fetch;
    bool any_fetch;
    uint64_t t0_us;
};

static void post_rx(struct stream *s)
{
    while (s->posted < N_MSG && s->posted - s->next_rx < WIN) {
        uint32_t k = s->posted % WIN;
        s->rx_seq[k] = s->posted;
        REQ_RC(fi_trecv(s->r->ep, s->rx[k].mem, MAXLEN, NULL,
                        s->r->addr[s->peer], TAG, 0, &s->rx[k]), 0);
        s->posted++;
    }
}

static void check_rx(struct stream *s, struct fi_cq_tagged_entry *e)
{
    struct rxbuf *b = e->op_context;
    uint32_t k = (uint32_t)(b - s->rx);
    REQ(k < WIN);
    uint32_t want = s->next_rx;
    uint32_t seq;
    memcpy(&seq, b->mem, sizeof seq);
    if (seq != want || s->rx_seq[k] != want || e->len != len_of(want)) {
        fprintf(stderr, "[pid %d] message %u arrived as %u (buffer for %u, "
                "%zu bytes, wanted %zu)\n", (int)getpid(), want, seq,
                s->rx_seq[k], e->len, len_of(want));
        _exit(99);
    }
    for (size_t j = sizeof seq; j < e->len; j++)
        if (b->mem[j] != byte_of(s->peer, seq, j)) {
            fprintf(stderr, "[pid %d] message %u byte %zu differs\n",
                    (int)getpid(), seq, j);
            _exit(99);
        }
    s->next_rx++;
}

static void try_send(struct stream *s)
{
    /* at most 4 windows ahead of what we received: both directions are
       mid-stream when the drain comes */
    while (s->next_tx < N_MSG && s->tx_busy < WIN &&
           s->next_tx < s->next_rx + 4 * WIN &&
           t_now_us() >= s->t0_us + (uint64_t)s->next_tx * PACE_US) {
        int k = 0;
        while (s->tx[k].busy)
            k++;
        uint32_t i = s->next_tx;
        size_t len = len_of(i);
        memcpy(s->tx[k].mem, &i, sizeof i);
        for (size_t j = sizeof i; j < len; j++)
            s->tx[k].mem[j] = byte_of(s->r->me, i, j);
        ssize_t rc = fi_tsend(s->r->ep, s->tx[k].mem, len, NULL,
                              s->r->addr[s->peer], TAG, &s->tx[k]);
        if (rc == -FI_EAGAIN)
            return;
        REQ_RC(rc, 0);
        s->tx[k].busy = true;
        s->tx_busy++;
        s->next_tx++;
        if (i % ATOMIC_EVERY == 0) {
            int f = 0;
            while (f < WIN && s->fetch_busy[f])
                f++;
            if (f == WIN)
                continue;
            rc = fi_fetch_atomic(s->r->ep, &s->add_one, 1, NULL,
                                 &s->fetched[f], NULL, s->r->addr[s->peer],
                                 s->peer_addr, s->peer_key, FI_UINT64, FI_SUM,
                                 &s->fetched[f]);
            if (rc == 0) {
                s->fetch_busy[f] = true;
                s->atomics_sent++;
            } else {
                REQ_RC(rc, -FI_EAGAIN);
            }
        }
    }
}

static void on_tx(struct stream *s, struct fi_cq_tagged_entry *e)
{
    if (e->op_context >= (void *)&s->fetched[0] &&
        e->op_context < (void *)&s->fetched[WIN]) {
        uint64_t *v = e->op_context;
        int f = (int)(v - s->fetched);
        /* only we add to the peer's counter, one at a time in order:
           each fetch returns the count of the adds before it */
        if (*v != s->atomics_done) {
            fprintf(stderr, "[pid %d] atomic %u fetched %llu\n", (int)getpid(),
                    s->atomics_done, (unsigned long long)*v);
            _exit(99);
        }
        s->atomics_done++;
        s->fetch_busy[f] = false;
        return;
    }
    struct txbuf *b = e->op_context;
    int k = (int)(b - s->tx);
    REQ(k >= 0 && k < WIN && b->busy);
    b->busy = false;
    s->tx_busy--;
}

static void stream_body(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct stream *s = calloc(1, sizeof *s);
    REQ(s);
    s->r = r;
    s->peer = 1 - r->me;
    s->add_one = 1;
    REQ_RC(fi_mr_reg(r->dom, &s->counter, sizeof s->counter,
                     FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &s->mr, NULL),
           0);
    uint64_t mine[2] = {fi_mr_key(s->mr), (uint64_t)(uintptr_t)&s->counter};
    uint64_t keys[2][2];
    for (int root = 0; root < 2; root++) {
        uint64_t b[2] = {mine[0], mine[1]};
        t_bcast(r, root, b, sizeof b);
        memcpy(keys[root], b, sizeof b);
    }
    s->peer_key = keys[s->peer][0];
    s->peer_addr = keys[s->peer][1];
    int slot0;
    uint32_t gen0;
    name_slot(r->names, &slot0, &gen0);
    REQ(slot0 >= 0);
    /* rank 1 is the host too: 0 region, 1 asked, 2 left (its name of the
       region gone), 3 given back */
    int host = 0;
    ivshm_admin *a = r->me == 1 ? admin_open() : NULL;
    uint64_t end = t_now_ms() + 60000;
    s->t0_us = t_now_us();
    post_rx(s);
    while (s->next_rx < N_MSG || s->next_tx < N_MSG || s->tx_busy ||
           s->atomics_done < s->atomics_sent) {
        REQ(t_now_ms() < end);
        try_send(s);
        if (host == 1) {
            int32_t st = 1;
            int rc = ivshm_admin_drain_state(a, slot0, gen0, REQ_NO, &st);
            REQ(rc >= 0);
            if (rc == 1) {
                REQ_RC(st, 0);
                REQ(unlink(link_path) == 0);
                host = 2;
            }
        } else if (host == 2 && s->next_rx >= RELINK_AT) {
            REQ(link(region_path, link_path) == 0);
            host = 3;
        }
        struct fi_cq_tagged_entry e;
        ssize_t n = fi_cq_read(r->cq, &e, 1);
        if (n == -FI_EAGAIN)
            continue;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            REQ_RC(fi_cq_readerr(r->cq, &err, 0), 1);
            fprintf(stderr, "[pid %d] error completion: %s\n", (int)getpid(),
                    fi_strerror(err.err));
            _exit(99);
        }
        REQ_RC(n, 1);
        if (e.flags & FI_RECV) {
            check_rx(s, &e);
            post_rx(s);
            if (r->me == 1 && host == 0 && s->next_rx == DRAIN_AT) {
                /* the host: rank 0 is to let go of the region */
                REQ_RC(ivshm_admin_drain_slot(a, slot0, gen0, REQ_NO), 0);
                host = 1;
            }
        } else {
            on_tx(s, &e);
        }
    }
    REQ(r->me == 0 || host == 3);
    REQ(s->atomics_done == s->atomics_sent && s->atomics_sent > 0);
    /* the peer's atomics on our counter: all of them, once each */
    t_barrier(r);
    uint64_t theirs = 0;
    for (uint32_t i = 0; i < N_MSG; i += ATOMIC_EVERY)
        theirs++;
    if (s->counter > theirs) {
        fprintf(stderr, "[pid %d] counter %llu > %llu atomics sent\n",
                (int)getpid(), (unsigned long long)s->counter,
                (unsigned long long)theirs);
        _exit(99);
    }
    uint64_t c[2];
    for (int root = 0; root < 2; root++) {
        uint64_t b[2] = {s->counter, s->atomics_sent};
        t_bcast(r, root, b, sizeof b);
        c[root] = b[0] + (b[1] << 32);
    }
    /* our counter holds exactly what the peer says it sent */
    REQ((c[s->peer] >> 32) == (c[r->me] & 0xffffffffu));
    if (a) {
        /* rank 0's first entry answered and left; it is back in another */
        uint32_t g = 0;
        int rc = ivshm_admin_peer_id(a, slot0, NULL, &g);
        REQ(rc == -ENOENT || (rc == 0 && g != gen0));
        ivshm_admin_close(a);
    }
    t_barrier(r);
    REQ_RC(fi_close(&s->mr->fid), 0);
    t_close(r);
    free(s);
}

/* The peer that never answers: rank 1 asks for rank 0's drain and goes
   away from libfabric for longer than rank 0's deadline. Rank 0 waits on
   a receive directed at rank 1 and must get an error, not hang. */
static void never_answers(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    int slot0;
    uint32_t gen0;
    name_slot(r->names, &slot0, &gen0);
    uint64_t x = 42, got = 0;
    struct fi_cq_tagged_entry e;
    struct fi_cq_err_entry err;
    if (r->me == 1) {
        /* one message first: the pair has spoken over the region */
        REQ_RC(fi_tsend(r->ep, &x, sizeof x, NULL, r->addr[0], TAG, &x), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_barrier_plain(r);
        ivshm_admin *a = admin_open();
        REQ_RC(ivshm_admin_drain_slot(a, slot0, gen0, REQ_NO), 0);
        sleep(3); /* rank 0's deadline is 1 s */
        int32_t st = 0;
        int rc = 0;
        for (uint64_t t = t_now_ms() + 5000; t_now_ms() < t;) {
            rc = ivshm_admin_drain_state(a, slot0, gen0, REQ_NO, &st);
            if (rc != 0)
                break;
            usleep(1000);
        }
        REQ_RC(rc, 1);
        REQ_RC(st, -ETIMEDOUT);
        ivshm_admin_close(a);
        t_barrier_plain(r);
        t_close(r);
        return;
    }
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], TAG, 0, &got),
           0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ(got == 42);
    t_barrier_plain(r);
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], TAG, 0, &got),
           0);
    uint64_t t0 = t_now_ms();
    memset(&err, 0, sizeof err);
    int rc = t_wait(r, &e, &err, NULL, 4000);
    uint64_t dt = t_now_ms() - t0;
    if (rc == 0 || rc == -FI_ETIMEDOUT || dt > 2500) {
        fprintf(stderr, "the receive from a peer that never answered: %s "
                "after %llu ms\n", fi_strerror(-rc), (unsigned long long)dt);
        _exit(99);
    }
    REQ(err.op_context == &got);
    /* it left the region anyway: its name has no slot any more */
    char name[NAMELEN];
    size_t len = sizeof name;
    REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
    int slot;
    uint32_t gen;
    name_slot(name, &slot, &gen);
    REQ(slot == -1);
    t_barrier_plain(r);
    t_close(r);
}

/* Rank 0's receive ring toward rank 1 holds thousands of rank 1's region
   messages when rank 1's SWITCH lands behind them, and rank 1's core
   messages arrive meanwhile: they must wait for the SWITCH however often
   rank 0 polls the core while it works through the ring. */
#define FLOOD 3000
#define AFTER 600
static void backlog(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    int slot0;
    uint32_t gen0;
    name_slot(r->names, &slot0, &gen0);
    static uint64_t msg[FLOOD + AFTER];
    struct fi_cq_tagged_entry e;
    /* one message each way first: the pair's fast rings are open */
    uint64_t hello = 1, first = 0;
    REQ_RC(fi_trecv(r->ep, &first, sizeof first, NULL, r->addr[1 - r->me],
                    TAG + 1, 0, &first), 0);
    REQ_RC(fi_tsend(r->ep, &hello, sizeof hello, NULL, r->addr[1 - r->me],
                    TAG + 1, &hello), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    t_barrier(r);
    if (r->me == 1) {
        ivshm_admin *a = admin_open();
        REQ_RC(ivshm_admin_drain_slot(a, slot0, gen0, REQ_NO), 0);
        ivshm_admin_close(a);
        t_barrier_plain(r); /* 1: rank 0 reads the request, sends SWITCH */
        /* the flood, while rank 0 reads nothing and we read nothing:
           all of it in the region ring, ahead of our SWITCH */
        for (uint32_t i = 0; i < FLOOD; i++) {
            msg[i] = i;
            REQ_RC(fi_tsend(r->ep, &msg[i], sizeof msg[i], NULL, r->addr[0],
                            TAG, &msg[i]), 0);
        }
        t_barrier_plain(r); /* 2 */
        /* we read rank 0's SWITCH: ours goes behind the flood, and what
           follows goes over the core */
        t_progress_ms(r, 200);
        for (uint32_t i = FLOOD; i < FLOOD + AFTER; i++) {
            msg[i] = i;
            ssize_t rc;
            while ((rc = fi_tsend(r->ep, &msg[i], sizeof msg[i], NULL,
                                  r->addr[0], TAG, &msg[i])) == -FI_EAGAIN)
                (void)fi_cntr_read(r->rcntr);
            REQ_RC(rc, 0);
        }
        t_barrier_plain(r); /* 3: rank 0 reads now */
        for (uint32_t n = 0; n < FLOOD + AFTER; n++)
            REQ_RC(t_wait(r, &e, NULL, NULL, 20000), 0);
        t_barrier(r);
        t_close(r);
        return;
    }
    t_progress_ms(r, 100); /* the request read, our SWITCH out */
    t_barrier_plain(r); /* 1 */
    t_barrier_plain(r); /* 2 */
    t_barrier_plain(r); /* 3 */
    for (uint32_t i = 0; i < FLOOD + AFTER; i++) {
        uint64_t got = ~0ull;
        REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], TAG, 0,
                        &got), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 20000), 0);
        if (got != i) {
            fprintf(stderr, "message %u arrived as %llu\n", i,
                    (unsigned long long)got);
            _exit(99);
        }
    }
    t_barrier(r);
    t_close(r);
}

/* A migration's shape: rank 0 leaves region A, where rank 1 stays, for
   region B, where rank 2 always was. Pair (0,1) goes region -> core,
   pair (0,2) core -> region, pair (1,2) stays on the core; every pair
   streams both ways throughout. */
#define N3 6000     /* long enough after the relink for the way back under load */
#define W3 16
#define PACE3_US 300
#define LEN3 512
#define TAG3 0x33
static const char *region_b;

struct lane {
    int peer;
    uint32_t next_tx, next_rx, posted;
    uint8_t rx[W3][LEN3];
    uint32_t rx_seq[W3];
    uint8_t tx[W3][LEN3];
    bool tx_busy[W3];
    int ntx;
};

static size_t len3(uint32_t i)
{
    return 8 + (i * 53u) % (LEN3 - 8);
}

static void moving_body(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct lane *l = calloc(2, sizeof *l);
    REQ(l);
    for (int k = 0, p = 0; p < 3; p++)
        if (p != r->me)
            l[k++].peer = p;
    int slot0;
    uint32_t gen0;
    name_slot(r->names, &slot0, &gen0);
    ivshm_admin *a = r->me == 1 ? admin_open() : NULL;
    int host = 0; /* rank 1: 0, 1 asked, 2 left, 3 in region B */
    uint64_t t0 = t_now_us(), end = t_now_ms() + 60000;
    for (;;) {
        bool done = true;
        for (int k = 0; k < 2; k++) {
            struct lane *x = &l[k];
            done &= x->next_rx == N3 && x->next_tx == N3 && x->ntx == 0;
            while (x->posted < N3 && x->posted - x->next_rx < W3) {
                uint32_t b = x->posted % W3;
                x->rx_seq[b] = x->posted;
                REQ_RC(fi_trecv(r->ep, x->rx[b], LEN3, NULL, r->addr[x->peer],
                                TAG3, 0, x->rx[b]), 0);
                x->posted++;
            }
            while (x->next_tx < N3 && x->ntx < W3 &&
                   x->next_tx < x->next_rx + 4 * W3 &&
                   t_now_us() >= t0 + (uint64_t)x->next_tx * PACE3_US) {
                int b = 0;
                while (x->tx_busy[b])
                    b++;
                uint32_t i = x->next_tx;
                memcpy(x->tx[b], &i, sizeof i);
                for (size_t j = sizeof i; j < len3(i); j++)
                    x->tx[b][j] = byte_of(r->me, i, j);
                ssize_t rc = fi_tsend(r->ep, x->tx[b], len3(i), NULL,
                                      r->addr[x->peer], TAG3, x->tx[b]);
                if (rc == -FI_EAGAIN)
                    break;
                REQ_RC(rc, 0);
                x->tx_busy[b] = true;
                x->ntx++;
                x->next_tx++;
            }
        }
        if (done)
            break;
        REQ(t_now_ms() < end);
        struct lane *to0 = r->me == 1 ? &l[0] : NULL;
        if (host == 0 && to0 && to0->next_rx >= 800) {
            REQ_RC(ivshm_admin_drain_slot(a, slot0, gen0, REQ_NO), 0);
            host = 1;
        } else if (host == 1) {
            int32_t st = 1;
            int rc = ivshm_admin_drain_state(a, slot0, gen0, REQ_NO, &st);
            REQ(rc >= 0);
            if (rc == 1) {
                REQ_RC(st, 0);
                REQ(unlink(link_path) == 0);
                host = 2;
            }
        } else if (host == 2 && to0->next_rx >= 1400) {
            REQ(link(region_b, link_path) == 0); /* its new server's */
            host = 3;
        }
        struct fi_cq_tagged_entry e;
        ssize_t n = fi_cq_read(r->cq, &e, 1);
        if (n == -FI_EAGAIN)
            continue;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            REQ_RC(fi_cq_readerr(r->cq, &err, 0), 1);
            fprintf(stderr, "[pid %d] error completion: %s\n", (int)getpid(),
                    fi_strerror(err.err));
            _exit(99);
        }
        REQ_RC(n, 1);
        for (int k = 0; k < 2; k++) {
            struct lane *x = &l[k];
            uint8_t *c = e.op_context;
            if (c >= &x->rx[0][0] && c < &x->rx[0][0] + sizeof x->rx) {
                uint32_t b = (uint32_t)((c - &x->rx[0][0]) / LEN3), seq;
                memcpy(&seq, c, sizeof seq);
                if (seq != x->next_rx || x->rx_seq[b] != seq ||
                    e.len != len3(seq)) {
                    fprintf(stderr, "[pid %d] from rank %d: message %u "
                            "arrived as %u\n", (int)getpid(), x->peer,
                            x->next_rx, seq);
                    _exit(99);
                }
                for (size_t j = sizeof seq; j < e.len; j++)
                    REQ(c[j] == byte_of(x->peer, seq, j));
                x->next_rx++;
            } else if (c >= &x->tx[0][0] && c < &x->tx[0][0] + sizeof x->tx) {
                int b = (int)((c - &x->tx[0][0]) / LEN3);
                REQ(x->tx_busy[b]);
                x->tx_busy[b] = false;
                x->ntx--;
            }
        }
    }
    REQ(r->me != 1 || host == 3);
    if (a)
        ivshm_admin_close(a);
    t_barrier(r);
    t_close(r);
    free(l);
}

/* ---- there and back: a guest's rank moves to another server and back
   under a ring with an RMA epoch and a 64 MiB message in flight ---- */

#define RT_TURNS 26
#define RT_BIG (64u << 20)
#define RT_SMALL 8
#define RT_SMALL_MAX 65536
#define RT_TAG_S 0x51
#define RT_TAG_B 0x52
#define RT_TAG_F 0x53
#define RT_HOLD_MS 200
static const int rt_moves[] = {3, 8, 13, 18}; /* turns: B, A, B, A */
#define RT_NMOVES (int)(sizeof rt_moves / sizeof rt_moves[0])

struct rt {
    struct rank *r;
    int peer;
    fi_addr_t pa;
    uint8_t win[64];             /* the peer's puts, a half per turn      */
    struct fid_mr *mr;
    uint64_t pkey, paddr;
    uint8_t put[2][16];
    int puts_out;
    uint8_t *big_in, *big_out;
    bool big_in_done, big_out_done;
    uint32_t nbig;
    uint8_t tx[RT_SMALL][RT_SMALL_MAX], rx[RT_SMALL][RT_SMALL_MAX];
    uint32_t next_tx, next_rx;   /* small messages, each way               */
    int tx_out, rx_out;
    uint64_t fence_in, fence_out;
    bool fence_got, fence_sent;
    int peeks;                   /* FI_PEEKs not answered yet             */
};

/* MPI_Iprobe of any source: progress, and a look at what has arrived. */
static void rt_peek(struct rt *s)
{
    struct fi_msg_tagged m = {.addr = FI_ADDR_UNSPEC, .tag = RT_TAG_B,
                              .context = &s->peeks};
    REQ_RC(fi_trecvmsg(s->r->ep, &m, FI_PEEK), 0);
    s->peeks++;
}

static size_t rt_len(uint32_t i)
{
    return i % 3 == 0 ? RT_SMALL_MAX : 64;
}

static void rt_stamp(uint8_t out[16], uint32_t turn, int src, int k)
{
    uint64_t a = (uint64_t)turn * 2 + (uint64_t)k, b = (uint64_t)src;
    memcpy(out, &a, 8);
    memcpy(out + 8, &b, 8);
}

static uint8_t rt_fill(uint32_t nbig, int src)
{
    return (uint8_t)(nbig * 37u + (unsigned)src);
}

/* One completion, if any, checked and counted. */
static void rt_poll(struct rt *s)
{
    struct fi_cq_tagged_entry e;
    ssize_t n = fi_cq_read(s->r->cq, &e, 1);
    if (n == -FI_EAGAIN)
        return;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        REQ_RC(fi_cq_readerr(s->r->cq, &err, 0), 1);
        if (err.op_context == &s->peeks && err.err == FI_ENOMSG) {
            s->peeks--; /* nothing yet (MPI_Iprobe) */
            return;
        }
        fprintf(stderr, "[pid %d] error completion: %s\n", (int)getpid(),
                fi_strerror(err.err));
        _exit(99);
    }
    REQ_RC(n, 1);
    void *c = e.op_context;
    if (c == &s->peeks) {
        REQ(e.len == RT_BIG && e.tag == RT_TAG_B);
        s->peeks--;
    } else if (c == s->put[0] || c == s->put[1]) {
        s->puts_out--;
    } else if (c == s->big_out) {
        s->big_out_done = true;
    } else if (c == s->big_in) {
        uint8_t want = rt_fill(s->nbig, s->peer);
        uint64_t hdr[2];
        memcpy(hdr, s->big_in, sizeof hdr);
        REQ(e.len == RT_BIG && hdr[0] == s->nbig &&
            hdr[1] == (uint64_t)s->peer);
        for (size_t j = 16; j < RT_BIG; j++)
            if (s->big_in[j] != want) {
                fprintf(stderr, "[pid %d] 64 MiB message %u: byte %zu is %u, "
                        "not %u\n", (int)getpid(), s->nbig, j, s->big_in[j],
                        want);
                _exit(99);
            }
        s->big_in_done = true;
    } else if (c >= (void *)s->tx && c < (void *)(s->tx + RT_SMALL)) {
        s->tx_out--;
    } else if (c >= (void *)s->rx && c < (void *)(s->rx + RT_SMALL)) {
        uint8_t *b = c;
        uint32_t seq;
        memcpy(&seq, b, sizeof seq);
        if (seq != s->next_rx || e.len != rt_len(seq)) {
            fprintf(stderr, "[pid %d] message %u arrived as %u\n",
                    (int)getpid(), s->next_rx, seq);
            _exit(99);
        }
        for (size_t j = sizeof seq; j < e.len; j++)
            REQ(b[j] == byte_of(s->peer, seq, j));
        s->next_rx++;
        s->rx_out--;
    } else if (c == &s->fence_in) {
        s->fence_got = true;
    } else if (c == &s->fence_out) {
        s->fence_sent = true;
    } else {
        REQ(!"a completion of nothing we posted");
    }
}

/* MPI's fence: our puts are in place at the peer (acknowledged), then
   each side tells the other. */
static void rt_fence(struct rt *s, uint32_t turn, uint64_t end)
{
    s->fence_got = s->fence_sent = false;
    REQ_RC(fi_trecv(s->r->ep, &s->fence_in, sizeof s->fence_in, NULL, s->pa,
                    RT_TAG_F, 0, &s->fence_in), 0);
    while (s->puts_out) {
        REQ(t_now_ms() < end);
        rt_poll(s);
    }
    s->fence_out = turn;
    ssize_t rc;
    while ((rc = fi_tsend(s->r->ep, &s->fence_out, sizeof s->fence_out, NULL,
                          s->pa, RT_TAG_F, &s->fence_out)) == -FI_EAGAIN)
        rt_poll(s);
    REQ_RC(rc, 0);
    while (!s->fence_got || !s->fence_sent) {
        REQ(t_now_ms() < end);
        rt_poll(s);
    }
    REQ(s->fence_in == turn);
}

static void rt_put(struct rt *s, uint32_t turn, int k)
{
    rt_stamp(s->put[k], turn, s->r->me, k);
    uint64_t at = s->paddr + (turn % 2) * 32 + (uint64_t)k * 16;
    ssize_t rc;
    while ((rc = fi_write(s->r->ep, s->put[k], 16, NULL, s->pa, at, s->pkey,
                          s->put[k])) == -FI_EAGAIN)
        rt_poll(s);
    REQ_RC(rc, 0);
    s->puts_out++;
}

/* The bytes of the file at `path` mapped here: the range, if one. */
static bool rt_mapping(const char *path, uintptr_t *lo, uintptr_t *hi)
{
    struct stat st;
    REQ(stat(path, &st) == 0);
    FILE *f = fopen("/proc/self/maps", "r");
    REQ(f);
    char line[512];
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        unsigned long a, b, ino;
        unsigned maj, mnr;
        if (sscanf(line, "%lx-%lx %*s %*s %x:%x %lu", &a, &b, &maj, &mnr,
                   &ino) == 5 && ino == st.st_ino && b - a > *hi - *lo) {
            *lo = a;
            *hi = b;
            found = true;
        }
    }
    fclose(f);
    return found;
}

/* Rank 0 is the guest that moves, and the host of its own moves: at a
   move's turn it asks its entry to drain while the turn's put and a
   64 MiB message to it (whose receive it holds back) are in flight, takes
   its name of the region away once it answered, puts a placeholder where
   the region was mapped (a hot-plugged device's BAR is mapped elsewhere:
   nothing may point into the old mapping), then receives, and gives it
   the other region. */
static void round_trip(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct rt *s = calloc(1, sizeof *s);
    REQ(s);
    s->r = r;
    s->peer = 1 - r->me;
    s->pa = r->addr[s->peer];
    s->big_in = malloc(RT_BIG);
    s->big_out = malloc(RT_BIG);
    REQ(s->big_in && s->big_out);
    REQ_RC(fi_mr_reg(r->dom, s->win, sizeof s->win,
                     FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 0, 0, &s->mr, NULL),
           0);
    uint64_t keys[2][2];
    for (int root = 0; root < 2; root++) {
        uint64_t b[2] = {fi_mr_key(s->mr), (uint64_t)(uintptr_t)s->win};
        t_bcast(r, root, b, sizeof b);
        memcpy(keys[root], b, sizeof b);
    }
    s->pkey = keys[s->peer][0];
    s->paddr = keys[s->peer][1];
    uint64_t end = t_now_ms() + 150000;
    int moved = 0;
    for (uint32_t turn = 0; turn < RT_TURNS; turn++) {
        rt_fence(s, turn, end);
        rt_put(s, turn, 0);
        bool big = moved < RT_NMOVES && (int)turn == rt_moves[moved];
        if (big) {
            memset(s->big_out, rt_fill(s->nbig, r->me), RT_BIG);
            uint64_t hdr[2] = {s->nbig, (uint64_t)r->me};
            memcpy(s->big_out, hdr, sizeof hdr);
            s->big_in_done = s->big_out_done = false;
            ssize_t rc;
            while ((rc = fi_tsend(r->ep, s->big_out, RT_BIG, NULL, s->pa,
                                  RT_TAG_B, s->big_out)) == -FI_EAGAIN)
                rt_poll(s);
            REQ_RC(rc, 0);
            if (r->me == 0) {
                const char *from = moved % 2 ? region_b : region_path;
                const char *to = moved % 2 ? region_path : region_b;
                /* in a region again since the last move */
                char name[NAMELEN];
                int slot = -1;
                uint32_t gen = 0;
                while (slot < 0) {
                    REQ(t_now_ms() < end);
                    size_t len = sizeof name;
                    REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
                    name_slot(name, &slot, &gen);
                    rt_poll(s);
                }
                uintptr_t lo = 0, hi = 0;
                REQ(rt_mapping(from, &lo, &hi));
                int fd = open(from, O_RDWR | O_CLOEXEC);
                REQ(fd >= 0);
                ivshm_admin *a = NULL;
                REQ_RC(ivshm_admin_open(fd, &a), 0);
                close(fd);
                uint32_t req = REQ_NO + (uint32_t)moved;
                REQ_RC(ivshm_admin_drain_slot(a, slot, gen, req), 0);
                int32_t st = 1;
                int rc2;
                /* as MPI_Iprobe in a loop with a pause: progress at a
                   slow pace while the receive is held */
                while ((rc2 = ivshm_admin_drain_state(a, slot, gen, req,
                                                      &st)) == 0) {
                    REQ(t_now_ms() < end);
                    rt_peek(s);
                    rt_poll(s);
                    usleep(500);
                }
                REQ_RC(rc2, 1);
                REQ_RC(st, 0);
                ivshm_admin_close(a);
                REQ(unlink(link_path) == 0);
                /* the old mapping's addresses stay taken (by this, or by
                   what the rank mapped there since) */
                void *ph = mmap((void *)lo, hi - lo, PROT_NONE,
                                MAP_PRIVATE | MAP_ANONYMOUS |
                                MAP_FIXED_NOREPLACE, -1, 0);
                REQ(ph == (void *)lo || (ph == MAP_FAILED && errno == EEXIST));
                uint64_t hold = t_now_ms() + RT_HOLD_MS;
                while (t_now_ms() < hold) {
                    rt_peek(s);
                    rt_poll(s);
                    usleep(500);
                }
                /* the device comes back while the message may still
                   arrive over the core: its receive posted before the
                   rank takes the region again, or after */
                bool late = moved / 2 % 2;
                if (!late)
                    REQ_RC(fi_trecv(r->ep, s->big_in, RT_BIG, NULL, s->pa,
                                    RT_TAG_B, 0, s->big_in), 0);
                REQ(link(to, link_path) == 0);
                if (late) {
                    for (slot = -1; slot < 0;) {
                        REQ(t_now_ms() < end);
                        size_t len = sizeof name;
                        REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
                        name_slot(name, &slot, &gen);
                        rt_poll(s);
                    }
                    REQ_RC(fi_trecv(r->ep, s->big_in, RT_BIG, NULL, s->pa,
                                    RT_TAG_B, 0, s->big_in), 0);
                }
            } else {
                REQ_RC(fi_trecv(r->ep, s->big_in, RT_BIG, NULL, s->pa,
                                RT_TAG_B, 0, s->big_in), 0);
            }
            while (!s->big_in_done || !s->big_out_done) {
                REQ(t_now_ms() < end);
                rt_poll(s);
            }
            s->nbig++;
            moved++;
        }
        /* the turn's messages, a third of them of several fragments */
        uint32_t first = s->next_rx;
        for (int k = 0; k < RT_SMALL; k++) {
            REQ_RC(fi_trecv(r->ep, s->rx[k], RT_SMALL_MAX, NULL, s->pa,
                            RT_TAG_S, 0, s->rx[k]), 0);
            s->rx_out++;
        }
        for (int k = 0; k < RT_SMALL; k++) {
            uint32_t i = s->next_tx;
            memcpy(s->tx[k], &i, sizeof i);
            for (size_t j = sizeof i; j < rt_len(i); j++)
                s->tx[k][j] = byte_of(r->me, i, j);
            ssize_t rc;
            while ((rc = fi_tsend(r->ep, s->tx[k], rt_len(i), NULL, s->pa,
                                  RT_TAG_S, s->tx[k])) == -FI_EAGAIN)
                rt_poll(s);
            REQ_RC(rc, 0);
            s->tx_out++;
            s->next_tx++;
        }
        while (s->tx_out || s->rx_out) {
            REQ(t_now_ms() < end);
            rt_poll(s);
        }
        REQ(s->next_rx == first + RT_SMALL);
        rt_put(s, turn, 1);
        rt_fence(s, turn + RT_TURNS, end);
        uint8_t want[32];
        rt_stamp(want, turn, s->peer, 0);
        rt_stamp(want + 16, turn, s->peer, 1);
        if (memcmp(s->win + (turn % 2) * 32, want, sizeof want)) {
            fprintf(stderr, "[pid %d] turn %u: the peer's puts are not in "
                    "our window\n", (int)getpid(), turn);
            _exit(99);
        }
    }
    REQ(moved == RT_NMOVES);
    while (s->peeks) {
        REQ(t_now_ms() < end);
        rt_poll(s);
    }
    t_barrier(r);
    REQ_RC(fi_close(&s->mr->fid), 0);
    t_close(r);
    free(s->big_in);
    free(s->big_out);
    free(s);
}

/* ---- four ranks on two regions, one moving: every pair after ---- */

#define PP_N 50
#define TAG4 0x44

/* Round trips of 8 bytes between ranks a and b (the others wait in a
   barrier that drives progress): the median in microseconds. */
static double pingpong(struct rank *r, int a, int b)
{
    double med = 0;
    if (r->me == a || r->me == b) {
        int peer = r->me == a ? b : a;
        static double rtt[PP_N];
        uint64_t x = 0;
        struct fi_cq_tagged_entry e;
        for (int i = 0; i < PP_N; i++) {
            uint64_t t = t_now_us();
            if (r->me == a) {
                REQ_RC(fi_tsend(r->ep, &x, sizeof x, NULL, r->addr[peer],
                                TAG4, NULL), 0);
                REQ_RC(t_wait(r, &e, NULL, NULL, 30000), 0);
                REQ_RC(fi_trecv(r->ep, &x, sizeof x, NULL, r->addr[peer],
                                TAG4, 0, &x), 0);
                do
                    REQ_RC(t_wait(r, &e, NULL, NULL, 30000), 0);
                while (e.op_context != &x);
            } else {
                REQ_RC(fi_trecv(r->ep, &x, sizeof x, NULL, r->addr[peer],
                                TAG4, 0, &x), 0);
                do
                    REQ_RC(t_wait(r, &e, NULL, NULL, 30000), 0);
                while (e.op_context != &x);
                REQ_RC(fi_tsend(r->ep, &x, sizeof x, NULL, r->addr[peer],
                                TAG4, NULL), 0);
                REQ_RC(t_wait(r, &e, NULL, NULL, 30000), 0);
            }
            rtt[i] = (double)(t_now_us() - t);
        }
        for (int i = 1; i < PP_N; i++)
            for (int j = i; j > 0 && rtt[j - 1] > rtt[j]; j--) {
                double s = rtt[j];
                rtt[j] = rtt[j - 1];
                rtt[j - 1] = s;
            }
        med = rtt[PP_N / 2];
    }
    t_barrier(r);
    return med;
}

static const int pair4[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
static double rtt4[6][2]; /* per pair: before, after (rank pair4[k][0]'s) */

/* Ranks 0 and 1 in region A, 2 (through link_path) and 3 in region B, as
   two servers of two instances each; rank 2 moves to region A. */
static void four_body(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    t_barrier(r);
    double m[2][6];
    for (int k = 0; k < 6; k++)
        m[0][k] = pingpong(r, pair4[k][0], pair4[k][1]);
    if (r->me == 3) {
        /* the host: rank 2 lets go of region B, which then goes */
        int slot2;
        uint32_t gen2;
        name_slot(r->names + 2 * NAMELEN, &slot2, &gen2);
        const char *keep = region_path;
        region_path = region_b;
        ivshm_admin *a = admin_open();
        region_path = keep;
        REQ_RC(ivshm_admin_drain_slot(a, slot2, gen2, REQ_NO), 0);
        uint64_t end = t_now_ms() + 20000;
        for (;;) {
            (void)fi_cntr_read(r->rcntr);
            int32_t st = 1;
            int rc = ivshm_admin_drain_state(a, slot2, gen2, REQ_NO, &st);
            REQ(rc >= 0);
            if (rc == 1) {
                REQ_RC(st, 0);
                break;
            }
            REQ(t_now_ms() < end);
        }
        ivshm_admin_close(a);
        REQ(unlink(link_path) == 0);
        REQ(link(region_path, link_path) == 0); /* region A's name now */
    }
    t_barrier(r);
    /* rank 2 finds region A within a quarter of a second and offers it;
       everyone drives progress meanwhile */
    t_progress_ms(r, 1500);
    t_barrier(r);
    /* (2,3) stays on the core: not measured after, so that rank 2's
       report shows only region messages after its rejoin */
    for (int k = 0; k < 5; k++)
        m[1][k] = pingpong(r, pair4[k][0], pair4[k][1]);
    m[1][5] = 0;
    /* each pair's first rank says what it measured */
    for (int k = 0; k < 6; k++) {
        double v[2] = {m[0][k], m[1][k]};
        t_bcast(r, pair4[k][0], v, sizeof v);
        rtt4[k][0] = v[0];
        rtt4[k][1] = v[1];
    }
    if (r->me == 0)
        for (int k = 0; k < 6; k++)
            printf("  pair %d-%d: round trip %.1f us before, %.1f us after\n",
                   pair4[k][0], pair4[k][1], rtt4[k][0], rtt4[k][1]);
    t_barrier(r);
    t_close(r);
}

/* ---- a back switch whose region BACK cannot go ---- */

/* Each rank in a region of its own (no fast rings: every message goes
   through the receiver's queue), reached through a name of its own. */
static char stuck_region[2][96], stuck_link[2][128];
#define STUCK_TAG 0x5e

static uint64_t name_nonce(const char *name)
{
    /* struct fiv_addr: uint32 nonce[2] at byte 12 */
    uint32_t n[2];
    memcpy(n, name + 12, sizeof n);
    return (uint64_t)n[1] << 32 | n[0];
}

/* The hostile co-tenant: a process forked before the rank opens
   libfabric, told later which region's slot to fill (or nothing, at
   end of file). It fills that slot's queue with messages of its own and
   tops it up whenever room appears, until end of file again (its rank
   done, or gone). */
struct filler {
    pid_t pid;
    int cmd, go;
};

static struct filler filler_fork(int rank_sock)
{
    int cmd[2], go[2];
    REQ(pipe(cmd) == 0 && pipe(go) == 0);
    pid_t pid = fork();
    REQ(pid >= 0);
    if (pid == 0) {
        close(cmd[1]);
        close(go[0]);
        close(rank_sock); /* the test sees its rank's end, not ours */
        alarm(60);
        int what[2]; /* region index, slot */
        if (read(cmd[0], what, sizeof what) != (ssize_t)sizeof what)
            _exit(0);
        REQ(what[0] >= 0 && what[0] < 2);
        ivshm_config cfg = {.job_id = 0x686f7374ull, .rank = 1,
                            .name = "filler", .spin_ns = 1};
        ivshm *h = NULL;
        REQ_RC(ivshm_attach_path(stuck_region[what[0]], &cfg, &h), 0);
        uint64_t junk = 0x6a756e6bull;
        int cells = 0;
        while (ivshm_try_send(h, what[1], 1, &junk, sizeof junk) == 0)
            cells++;
        REQ(cells > 0);
        REQ(write(go[1], &cells, sizeof cells) == (ssize_t)sizeof cells);
        struct pollfd p = {.fd = cmd[0], .events = POLLIN};
        while (poll(&p, 1, 1) == 0)
            while (ivshm_try_send(h, what[1], 1, &junk, sizeof junk) == 0)
                ;
        ivshm_detach(h);
        _exit(0);
    }
    close(cmd[0]);
    close(go[1]);
    return (struct filler){pid, cmd[1], go[0]};
}

/* It begins on region `i`'s slot `slot`: back once that queue is full. */
static void filler_go(struct filler *f, int i, int slot)
{
    int what[2] = {i, slot}, cells = 0;
    REQ(write(f->cmd, what, sizeof what) == (ssize_t)sizeof what);
    t_read_full(f->go, &cells, sizeof cells);
}

static void filler_end(struct filler *f)
{
    close(f->cmd);
    close(f->go);
    int st = 0;
    REQ(waitpid(f->pid, &st, 0) == f->pid);
    REQ(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* The rank with the lower nonce (V) leaves its region for the other's
   (P's) and begins the pair's way back to the region; P answers with its
   core BACK, then reads nothing of its region (FIV_TEST_SLOW_REGION),
   whose queue a co-tenant keeps full: V's region BACK cannot go. What
   waits on the pair must fail by V's deadline (FI_IVSHM_DRAIN_MS=1000
   from the flip), not wait for good. */
static void back_stuck(struct rank *r)
{
    struct filler fl = filler_fork(r->sock);
    t_open(r, version);
    t_exchange(r);
    int other = 1 - r->me;
    bool v = name_nonce(r->names + r->me * NAMELEN) <
             name_nonce(r->names + other * NAMELEN);
    struct fi_cq_tagged_entry e;
    /* one message each way: the pair speaks over the core */
    uint64_t hello = 1, first = 0;
    REQ_RC(fi_trecv(r->ep, &first, sizeof first, NULL, r->addr[other], TAG,
                    0, &first), 0);
    REQ_RC(fi_tsend(r->ep, &hello, sizeof hello, NULL, r->addr[other], TAG,
                    &hello), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ(first == 1);
    int vslot;
    uint32_t vgen;
    int vi = v ? r->me : other, pi = v ? other : r->me;
    name_slot(r->names + vi * NAMELEN, &vslot, &vgen);
    REQ(vslot >= 0);
    if (!v) {
        /* P: the co-tenant fills our queue; we ask for V's drain, as its
           host would, and give V our region once it answered */
        int pslot;
        uint32_t pgen;
        name_slot(r->names + pi * NAMELEN, &pslot, &pgen);
        filler_go(&fl, pi, pslot);
        t_barrier(r);
        int fd = open(stuck_region[vi], O_RDWR | O_CLOEXEC);
        REQ(fd >= 0);
        ivshm_admin *a = NULL;
        REQ_RC(ivshm_admin_open(fd, &a), 0);
        close(fd);
        REQ_RC(ivshm_admin_drain_slot(a, vslot, vgen, REQ_NO), 0);
        uint64_t end = t_now_ms() + 5000;
        for (;;) {
            (void)fi_cntr_read(r->rcntr);
            int32_t st = 1;
            int rc = ivshm_admin_drain_state(a, vslot, vgen, REQ_NO, &st);
            REQ(rc >= 0);
            if (rc == 1) {
                REQ_RC(st, 0);
                break;
            }
            REQ(t_now_ms() < end);
        }
        ivshm_admin_close(a);
        REQ(unlink(stuck_link[vi]) == 0);
        REQ(link(stuck_region[pi], stuck_link[vi]) == 0);
        t_barrier(r); /* V is done: progress meanwhile, as a rank would */
        filler_end(&fl);
        t_close(r);
        return;
    }
    filler_end(&fl); /* V's has nothing to fill */
    /* V: a receive from P that P never matches waits on the pair */
    uint64_t got = 0;
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[other],
                    STUCK_TAG, 0, &got), 0);
    t_barrier(r);
    /* away from our region, then in P's */
    char name[NAMELEN];
    size_t len;
    int slot = vslot;
    uint32_t gen;
    bool away = false;
    uint64_t end = t_now_ms() + 10000;
    while (!away || slot < 0) {
        (void)fi_cntr_read(r->rcntr);
        len = sizeof name;
        REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
        name_slot(name, &slot, &gen);
        away |= slot < 0;
        REQ(t_now_ms() < end);
    }
    /* sends, one at a time, until the pair breaks: the one in flight
       then waits behind the region BACK (the pair's sends are held) */
    static uint64_t x[256];
    int posted = 0, ended = 0, rx_err = 0, tx_err = 0;
    bool rx_done = false;
    uint64_t t0 = t_now_ms(), last = 0;
    while (!rx_done || ended < posted) {
        if (!rx_done && !tx_err && ended == posted && posted < 256 &&
            t_now_ms() >= last + 20) {
            x[posted] = (uint64_t)posted;
            REQ_RC(fi_tsend(r->ep, &x[posted], sizeof x[posted], NULL,
                            r->addr[other], STUCK_TAG, &x[posted]), 0);
            posted++;
            last = t_now_ms();
        }
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        int rc = t_wait(r, &e, &err, NULL, 10);
        if (rc == -FI_ETIMEDOUT) {
            if (t_now_ms() - t0 > 5000) {
                fprintf(stderr, "[pid %d] after %llu ms in the new region "
                        "the receive from the peer %s, %d of %d sends to it "
                        "ended\n", (int)getpid(),
                        (unsigned long long)(t_now_ms() - t0),
                        rx_done ? "ended" : "still waits", ended, posted);
                _exit(99);
            }
            continue;
        }
        void *ctx = rc == 0 ? e.op_context : err.op_context;
        if (ctx == &got) {
            rx_done = true;
            rx_err = -rc;
        } else {
            REQ(ctx == &x[ended]);
            ended++;
            tx_err = -rc;
        }
    }
    /* the last send was held and failed with the pair */
    REQ_RC(tx_err, FI_EIO);
    REQ_RC(rx_err, FI_EIO);
    t_barrier(r);
    t_close(r);
}

/* A report field of rank i's line, -1 if absent. */
static long long field(const char *base, int i, const char *name)
{
    char p[320], line[512];
    snprintf(p, sizeof p, "%s.%d", base, i);
    FILE *f = fopen(p, "r");
    long long v = -1;
    while (f && fgets(line, sizeof line, f)) {
        const char *l = strstr(line, "fi_ivshm: pid ");
        const char *q = l ? strstr(l, name) : NULL;
        if (q)
            v = atoll(q + strlen(name));
    }
    if (f)
        fclose(f);
    return v;
}

/* Rank i's " phases S/D,S/D,..." into ph (up to 3): how many. */
static int phases(const char *base, int i, long long ph[3][2])
{
    char p[320], line[512];
    snprintf(p, sizeof p, "%s.%d", base, i);
    FILE *f = fopen(p, "r");
    int n = 0;
    while (f && fgets(line, sizeof line, f)) {
        const char *q = strstr(line, " phases ");
        if (!strstr(line, "fi_ivshm: pid ") || !q)
            continue;
        q += strlen(" phases ");
        n = 0;
        while (n < 3 && sscanf(q, "%lld/%lld", &ph[n][0], &ph[n][1]) == 2) {
            n++;
            q = strchr(q, ',');
            if (!q)
                break;
            q++;
        }
    }
    if (f)
        fclose(f);
    return n;
}

static void show(const char *base, int n)
{
    for (int i = 0; i < n; i++) {
        char p[320], line[512];
        snprintf(p, sizeof p, "%s.%d", base, i);
        FILE *f = fopen(p, "r");
        while (f && fgets(line, sizeof line, f))
            fprintf(stderr, "rank %d: %s", i, line);
        if (f)
            fclose(f);
    }
}

/* Whether a line of one of the n ranks' stderr holds `what`. */
static bool seen(const char *base, int n, const char *what)
{
    bool found = false;
    for (int i = 0; i < n && !found; i++) {
        char p[320], line[512];
        snprintf(p, sizeof p, "%s.%d", base, i);
        FILE *f = fopen(p, "r");
        while (f && !found && fgets(line, sizeof line, f))
            found = strstr(line, what) != NULL;
        if (f)
            fclose(f);
    }
    return found;
}

/* A core peer's writes with CQ data beside a region co-tenant's that
   filled the target's CQ (docs/provider.md, "Caps per peer"): rank 1, on
   rank 0's region, lands FLOOD_W writes with data in rank 0's CQ of that
   size, which rank 0 does not read; rank 2, on another region (the core
   path to both), then writes with data to rank 0. The core's entries are
   counted apart from the region's, so its writes land and its pair stays
   whole; rank 0 then reads every entry of both. */
#define FLOOD_W 65536
#define CORE_W 4
#define CORE_DATA 0xc0de00u
static void core_beside_flood(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    static uint64_t target[CORE_W + 1], src[CORE_W + 1];
    struct {
        uint64_t key, addr;
    } k = {0, 0};
    struct fid_mr *mr = NULL;
    if (r->me == 0) {
        REQ_RC(fi_mr_reg(r->dom, target, sizeof target, FI_REMOTE_WRITE, 0,
                         0, 0, &mr, NULL), 0);
        k.key = fi_mr_key(mr);
        k.addr = (uintptr_t)target;
    }
    t_bcast(r, 0, &k, sizeof k);
    struct fi_cq_tagged_entry e[64];
    if (r->me == 1) {
        /* each write completes here once it landed (its ack) */
        uint64_t posted = 0, done = 0, end = t_now_ms() + 60000;
        while (done < FLOOD_W) {
            while (posted < FLOOD_W && posted - done < 256) {
                src[0] = posted;
                ssize_t rc = fi_writedata(r->ep, src, sizeof src[0], NULL,
                                          posted, r->addr[0], k.addr, k.key,
                                          NULL);
                if (rc == -FI_EAGAIN)
                    break;
                REQ_RC(rc, 0);
                posted++;
            }
            ssize_t n = fi_cq_read(r->cq, e, 64);
            if (n > 0)
                done += (uint64_t)n;
            else
                REQ_RC(n, -FI_EAGAIN);
            REQ(t_now_ms() < end);
        }
    }
    t_barrier(r); /* rank 0's CQ holds FLOOD_W region entries, unread */
    if (r->me == 2) {
        for (uint32_t i = 0; i < CORE_W; i++) {
            src[1 + i] = CORE_DATA + i;
            REQ_RC(fi_writedata(r->ep, &src[1 + i], sizeof src[0], NULL,
                                CORE_DATA + i, r->addr[0],
                                k.addr + (1 + i) * sizeof src[0], k.key,
                                &src[1 + i]), 0);
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof err);
            int rc = t_wait(r, e, &err, NULL, 10000);
            if (rc != 0) {
                fprintf(stderr, "core write %u beside the region's flood: "
                        "%s\n", i, fi_strerror(-rc));
                _exit(99);
            }
            REQ(e[0].op_context == &src[1 + i]);
        }
    }
    t_barrier(r);
    if (r->me == 0) {
        uint64_t region = 0, core = 0, end = t_now_ms() + 20000;
        while (region < FLOOD_W || core < CORE_W) {
            ssize_t n = fi_cq_read(r->cq, e, 64);
            REQ(n > 0 || n == -FI_EAGAIN);
            for (ssize_t i = 0; i < n; i++) {
                REQ(e[i].flags & FI_REMOTE_CQ_DATA);
                if (e[i].data >= CORE_DATA)
                    REQ(e[i].data == CORE_DATA + core++);
                else
                    region++;
            }
            if (t_now_ms() > end) {
                fprintf(stderr, "rank 0 read %llu of %d region entries, "
                        "%llu of %d core entries\n",
                        (unsigned long long)region, FLOOD_W,
                        (unsigned long long)core, CORE_W);
                _exit(99);
            }
        }
        for (uint32_t i = 0; i < CORE_W; i++)
            REQ(target[1 + i] == CORE_DATA + i);
    }
    t_barrier_plain(r);
    if (mr)
        REQ_RC(fi_close(&mr->fid), 0);
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
    char tmpl[] = "/tmp/fiv-drain-XXXXXX";
    int fd = mkstemp(tmpl);
    REQ(fd >= 0);
    close(fd);
    t_track(tmpl);
    char out[4][320];
    for (int i = 0; i < 4; i++) {
        snprintf(out[i], sizeof out[i], "%s.%d", tmpl, i);
        t_track(out[i]);
    }

    region_path = t_region(8, 0);
    snprintf(link_path, sizeof link_path, "/dev/shm/fiv-drain-link-%d",
             (int)getpid());
    unlink(link_path);
    REQ(link(region_path, link_path) == 0);
    t_track(link_path);
    char env[400], env_link[400];
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             region_path);
    snprintf(env_link, sizeof env_link, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             link_path);
    const char *env2[] = {env, env};
    const char *env_stream[] = {env_link, env};
    uint64_t t0 = t_now_ms();
    int f = t_run(2, stream_body, env_stream, 90, tmpl);
    /* rank 0: region, then core while away, then region again; rank 1
       moved the pair twice and never left */
    long long ph[3][2];
    int nph = phases(tmpl, 0, ph);
    long long dr0 = field(tmpl, 0, " drained "), sw0 = field(tmpl, 0, " switched ");
    long long rj0 = field(tmpl, 0, " rejoined ");
    long long dr1 = field(tmpl, 1, " drained "), sw1 = field(tmpl, 1, " switched ");
    long long rj1 = field(tmpl, 1, " rejoined ");
    if (!f && !(nph == 3 && ph[0][0] > 0 && ph[1][0] == 0 && ph[1][1] > 0 &&
                ph[2][0] > 0 && dr0 == 1 && sw0 == 2 && rj0 == 1 &&
                dr1 == 0 && sw1 == 2 && rj1 == 0)) {
        fprintf(stderr, "report lines: rank 0 %d phases, drained %lld "
                "switched %lld rejoined %lld; rank 1 drained %lld switched "
                "%lld rejoined %lld\n", nph, dr0, sw0, rj0, dr1, sw1, rj1);
        f = 1;
    }
    /* FIV_DRAIN_SHOW=1: the ranks' stderr (report lines, FI_LOG_LEVEL's
       lines) even when a case passes */
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 2);
    printf("%s: %d messages each way and fetching atomics; rank 0 drained "
           "after %d, back after %d: every one once, in order (rank 0 region/"
           "core: %lld/%lld before, %lld/%lld away, %lld/%lld after) (%llu "
           "ms)\n", f ? "FAIL" : "ok", N_MSG, DRAIN_AT, RELINK_AT,
           nph > 0 ? ph[0][0] : -1, nph > 0 ? ph[0][1] : -1,
           nph > 1 ? ph[1][0] : -1, nph > 1 ? ph[1][1] : -1,
           nph > 2 ? ph[2][0] : -1, nph > 2 ? ph[2][1] : -1,
           (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* rank 0 moves from region A (rank 1's) to region B (rank 2's) */
    region_path = t_region(8, 0);
    region_b = t_region(8, 0);
    unlink(link_path);
    REQ(link(region_path, link_path) == 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             region_path);
    char env_b[400];
    snprintf(env_b, sizeof env_b, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             region_b);
    const char *env_move[] = {env_link, env, env_b};
    t0 = t_now_ms();
    f = t_run(3, moving_body, env_move, 90, tmpl);
    nph = phases(tmpl, 0, ph);
    long long sw2 = field(tmpl, 2, " switched "), dr2 = field(tmpl, 2, " drained ");
    sw0 = field(tmpl, 0, " switched ");
    rj0 = field(tmpl, 0, " rejoined ");
    sw1 = field(tmpl, 1, " switched ");
    /* rank 0: region (to 1) and core (to 2) before, core only while
       away, region (to 2) and core (to 1) after; one move per pair */
    if (!f && !(nph == 3 && ph[0][0] > 0 && ph[0][1] > 0 && ph[1][0] == 0 &&
                ph[1][1] > 0 && ph[2][0] > 0 && ph[2][1] > 0 && sw0 == 2 &&
                rj0 == 1 && sw1 == 1 && sw2 == 1 && dr2 == 0)) {
        fprintf(stderr, "report lines: rank 0 %d phases, switched %lld "
                "rejoined %lld; rank 1 switched %lld; rank 2 switched %lld "
                "drained %lld\n", nph, sw0, rj0, sw1, sw2, dr2);
        f = 1;
    }
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 3);
    printf("%s: rank 0 moves from rank 1's region to rank 2's under three "
           "streams: (0,1) region -> core, (0,2) core -> region, every "
           "message once and in order (rank 0 region/core: %lld/%lld before, "
           "%lld/%lld away, %lld/%lld after) (%llu ms)\n", f ? "FAIL" : "ok",
           nph > 0 ? ph[0][0] : -1, nph > 0 ? ph[0][1] : -1,
           nph > 1 ? ph[1][0] : -1, nph > 1 ? ph[1][1] : -1,
           nph > 2 ? ph[2][0] : -1, nph > 2 ? ph[2][1] : -1,
           (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* rank 0 (a guest) moves from region A to B and back, twice, each
       drain begun while a put and a 64 MiB message each way are in flight,
       each region mapped where no old pointer reaches */
    region_path = t_region(8, 0);
    region_b = t_region(8, 0);
    unlink(link_path);
    REQ(link(region_path, link_path) == 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1;"
             "FI_IVSHM_DRAIN_MS=40000", region_path);
    char env_rt[480];
    snprintf(env_rt, sizeof env_rt, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1;"
             "FI_IVSHM_DRAIN_MS=40000", link_path);
    const char *env_trip[] = {env_rt, env};
    t0 = t_now_ms();
    f = t_run(2, round_trip, env_trip, 180, tmpl);
    /* each move away switched the pair to the core, each move back to
       the region again, on both sides */
    long long dr = field(tmpl, 0, " drained ");
    rj0 = field(tmpl, 0, " rejoined ");
    sw0 = field(tmpl, 0, " switched ");
    sw1 = field(tmpl, 1, " switched ");
    if (!f && !(dr == RT_NMOVES && rj0 == RT_NMOVES && sw0 == RT_NMOVES &&
                sw1 == RT_NMOVES)) {
        fprintf(stderr, "report lines: rank 0 drained %lld rejoined %lld "
                "switched %lld, rank 1 switched %lld\n", dr, rj0, sw0, sw1);
        f = 1;
    }
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 2);
    printf("%s: there and back: rank 0 moves to another region and back, "
           "twice, each drain "
           "begun under a put and a 64 MiB message each way, each region "
           "mapped at a new address: every byte once (%llu ms)\n",
           f ? "FAIL" : "ok", (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* rank 2 moves from region B (rank 3's) to region A (ranks 0 and
       1's): both its new pairs go back to the region */
    region_path = t_region(8, 0);
    region_b = t_region(8, 0);
    unlink(link_path);
    REQ(link(region_b, link_path) == 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             region_path);
    snprintf(env_b, sizeof env_b, "FI_IVSHM_REGION=%s;FI_IVSHM_REPORT=1",
             region_b);
    const char *env_four[] = {env, env, env_link, env_b};
    t0 = t_now_ms();
    f = t_run(4, four_body, env_four, 90, tmpl);
    nph = phases(tmpl, 2, ph);
    long long sw[4];
    for (int i = 0; i < 4; i++)
        sw[i] = field(tmpl, i, " switched ");
    /* rank 2 sent only to ranks 0 and 1 after its rejoin: the region
       only; (2,3) moved once each way, (0,2) and (1,2) once */
    if (!f && !(nph == 3 && ph[2][0] > 0 && ph[2][1] == 0 && sw[2] == 3 &&
                sw[0] == 1 && sw[1] == 1 && sw[3] == 1)) {
        fprintf(stderr, "report lines: rank 2 %d phases, after %lld/%lld; "
                "switched %lld %lld %lld %lld\n", nph,
                nph > 2 ? ph[2][0] : -1, nph > 2 ? ph[2][1] : -1, sw[0], sw[1],
                sw[2], sw[3]);
        f = 1;
    }
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 4);
    printf("%s: rank 2 moves from rank 3's region to ranks 0 and 1's: both "
           "new pairs on the region after (rank 2 region/core after: "
           "%lld/%lld) (%llu ms)\n", f ? "FAIL" : "ok",
           nph > 2 ? ph[2][0] : -1, nph > 2 ? ph[2][1] : -1,
           (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* rings of 4096 small slots: the whole flood fits */
    static char deep[96];
    snprintf(deep, sizeof deep, "/dev/shm/fiv-drain-deep-%d", (int)getpid());
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 4096, .slot_size = 256,
                        .fast_channels = 2};
    unlink(deep);
    REQ_RC(ivshm_format_file(deep, ivshm_min_region_size(&g), &g, 0600), 0);
    t_track(deep);
    region_path = deep;
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s", region_path);
    /* rank 0 reads its ring slowly, the core at once (tests only) */
    char slow[480];
    /* a deadline its own slow reading cannot reach on a loaded machine */
    snprintf(slow, sizeof slow, "%s;FIV_TEST_SLOW_REGION=2000;"
             "FI_IVSHM_DRAIN_MS=30000", env);
    const char *env_slow[] = {slow, env};
    t0 = t_now_ms();
    f = t_run(2, backlog, env_slow, 60, tmpl);
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 2);
    printf("%s: %d region messages ahead of the SWITCH, %d core messages "
           "behind it arriving meanwhile: delivered in order (%llu ms)\n",
           f ? "FAIL" : "ok", FLOOD, AFTER,
           (unsigned long long)(t_now_ms() - t0));
    failed += f;

    region_path = t_region(8, 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_DRAIN_MS=1000",
             region_path);
    t0 = t_now_ms();
    f = t_run(2, never_answers, env2, 30, tmpl);
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 2);
    printf("%s: a peer that never answers the switch: the drain ends at its "
           "deadline, what waits on the pair fails (%llu ms)\n",
           f ? "FAIL" : "ok", (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* V's region BACK cannot go: P reads nothing of its region, whose
       queue a co-tenant keeps full */
    ivshm_geometry gq = {.max_peers = 4, .fast_channels = IVSHM_FAST_NONE};
    char env_stuck[2][480];
    const char *envs_stuck[2];
    for (int i = 0; i < 2; i++) {
        snprintf(stuck_region[i], sizeof stuck_region[i],
                 "/dev/shm/fiv-drain-stuck-%d-%d", (int)getpid(), i);
        snprintf(stuck_link[i], sizeof stuck_link[i],
                 "/dev/shm/fiv-drain-stuck-link-%d-%d", (int)getpid(), i);
        unlink(stuck_region[i]);
        unlink(stuck_link[i]);
        REQ_RC(ivshm_format_file(stuck_region[i], ivshm_min_region_size(&gq),
                                 &gq, 0600), 0);
        t_track(stuck_region[i]);
        REQ(link(stuck_region[i], stuck_link[i]) == 0);
        t_track(stuck_link[i]);
        /* its region polled never (the 4e9th call), the core always */
        snprintf(env_stuck[i], sizeof env_stuck[i],
                 "FI_IVSHM_REGION=%s;FIV_TEST_SLOW_REGION=4000000000;"
                 "FI_IVSHM_DRAIN_MS=1000;FI_LOG_LEVEL=warn", stuck_link[i]);
        envs_stuck[i] = env_stuck[i];
    }
    t0 = t_now_ms();
    f = t_run(2, back_stuck, envs_stuck, 20, tmpl);
    if (!f && !seen(tmpl, 2, "our back switch could not go to it")) {
        fprintf(stderr, "no rank broke the pair for its back switch\n");
        f = 1;
    }
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 2);
    printf("%s: a back switch whose region BACK cannot go (the peer's "
           "queue kept full): what waits on the pair fails by the deadline "
           "(%llu ms)\n", f ? "FAIL" : "ok",
           (unsigned long long)(t_now_ms() - t0));
    failed += f;

    /* ranks 0 and 1 on region A, rank 2 on region B: the core to both */
    region_path = t_region(8, 0);
    region_b = t_region(8, 0);
    char env_big[480];
    snprintf(env_big, sizeof env_big, "FI_IVSHM_REGION=%s;FIV_TEST_CQ_SIZE=%d",
             region_path, FLOOD_W);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s", region_path);
    snprintf(env_b, sizeof env_b, "FI_IVSHM_REGION=%s", region_b);
    const char *env_flood[] = {env_big, env, env_b};
    t0 = t_now_ms();
    f = t_run(3, core_beside_flood, env_flood, 40, tmpl);
    if (f || getenv("FIV_DRAIN_SHOW"))
        show(tmpl, 3);
    printf("%s: a core peer's writes with data beside a region co-tenant's "
           "%d that filled the CQ: they land, its pair whole (%llu ms)\n",
           f ? "FAIL" : "ok", FLOOD_W, (unsigned long long)(t_now_ms() - t0));
    failed += f;

    printf("%s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}
