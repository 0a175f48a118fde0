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
 * core; each pair's round trip before and after is printed). Another
 * puts thousands of region messages ahead of a SWITCH while the core
 * messages behind it arrive first.
 *
 * Hostile: a peer that never answers the SWITCH (away from libfabric
 * past the deadline): the drain ends at FI_IVSHM_DRAIN_MS, the pair's
 * waiting receive fails with an error instead of hanging, the status
 * says -ETIMEDOUT, and the rank has left the region. Forged SWITCH and
 * BACK messages are fiv_forge's cases ("forged_switch_*",
 * "forged_back_unasked").
 */
#include "fiv_test.h"

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
        uint64_t end = t_now_ms() + 200;
        while (t_now_ms() < end)
            (void)fi_cntr_read(r->rcntr);
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
    uint64_t end = t_now_ms() + 100;
    while (t_now_ms() < end) /* the request read, our SWITCH out */
        (void)fi_cntr_read(r->rcntr);
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
    uint64_t until = t_now_ms() + 1500;
    while (t_now_ms() < until)
        (void)fi_cntr_read(r->rcntr);
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

    printf("%s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}
