/* Multi-process stress of the message rings: 10^6 messages of random
   sizes, every byte checked, nothing lost, per-pair order kept.

   rank 0          consumer: receives from ranks 1..3 with IVSHM_ANY
   ranks 1, 2, 3   producers: blocking sends to rank 0, sometimes messages
                   much larger than the ring (streamed)
   ranks 4 <-> 5   a pair exchanging both ways at once: try_send, and drain
                   our own ring whenever the other side's is full (blocking
                   sends both ways can deadlock, as with any bounded channel)

   Six processes on two cores: the default spin-then-block waiting keeps
   oversubscription from wasting whole time slices. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NPROD 3
#define PROD_MSGS 200000u /* per producer */
#define PAIR_MSGS 200000u /* per direction */
#define TOTAL_MSGS (NPROD * PROD_MSGS + 2 * PAIR_MSGS)
#define RANK_CONSUMER 0
#define RANK_PAIR_A 4
#define RANK_PAIR_B 5
#define NRANKS 6
#define LARGE_MAX (256u * 1024u + 32768u)

static const ivshm_geometry geom = {
    .max_peers = 8, .ring_slots = 64, .slot_size = 512, .max_windows = 4};
static const uint32_t payload = 512 - IVSHM_SLOT_HDR;
static const char *path;
static uint64_t job;

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t msg_seed(uint32_t src, uint32_t dst, uint32_t seq)
{
    return mix(((uint64_t)src << 48) ^ ((uint64_t)dst << 40) ^ seq);
}

/* Length of message `seq` from src to dst: mostly tiny, a fifth up to
   three slots, and (if allowed) one in a thousand far beyond the ring. */
static size_t msg_len(uint32_t src, uint32_t dst, uint32_t seq, bool large)
{
    uint64_t r = msg_seed(src, dst, seq);
    unsigned cls = (unsigned)(r % 1000);
    r >>= 10;
    if (large && cls == 0)
        return 32768 + r % (256 * 1024);
    if (cls < 200)
        return r % (3 * payload + 1);
    return r % 65;
}

static void msg_fill(uint8_t *b, size_t n, uint64_t seed)
{
    uint64_t x = seed;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        memcpy(b + i, &x, 8);
    }
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    memcpy(b + i, &x, n - i);
}

/* Checks one received message against what `src_rank` must have sent. */
struct checker {
    uint32_t self_rank;
    uint32_t next_seq[NRANKS];
    uint8_t *want;
    unsigned errors;
};

static void check_msg(struct checker *c, uint32_t src_rank, uint32_t tag,
                      const uint8_t *got, ssize_t n, bool large)
{
    const char *what = NULL;
    uint32_t seq = c->next_seq[src_rank]++;
    size_t len = msg_len(src_rank, c->self_rank, seq, large);
    if (tag != seq) {
        what = "sequence (lost, duplicated or reordered)";
    } else if (n != (ssize_t)len) {
        what = "length";
    } else {
        msg_fill(c->want, len, msg_seed(src_rank, c->self_rank, seq));
        if (memcmp(c->want, got, len) != 0)
            what = "content";
    }
    if (what && c->errors++ < 5)
        fprintf(stderr, "rank %u: message %u from rank %u: bad %s (tag %u, len %zd, want %zu)\n",
                c->self_rank, seq, src_rank, what, tag, n, len);
}

static int consumer(void)
{
    ivshm *h = tu_attach(path, job, RANK_CONSUMER, 0);
    int rank_of[IVSHM_MAX_PEERS];
    for (int i = 0; i < (int)IVSHM_MAX_PEERS; i++)
        rank_of[i] = -1;
    for (uint32_t r = 1; r <= NPROD; r++) {
        int s = tu_await_peer(h, job, r, 10000);
        REQUIRE(s >= 0);
        rank_of[s] = (int)r;
    }
    struct checker c = {.self_rank = RANK_CONSUMER, .want = malloc(LARGE_MAX)};
    uint8_t *buf = malloc(LARGE_MAX);
    for (uint32_t i = 0; i < NPROD * PROD_MSGS; i++) {
        int src = -1;
        uint32_t tag;
        ssize_t n = ivshm_recv(h, IVSHM_ANY, &src, &tag, buf, LARGE_MAX, 30000);
        if (n < 0) {
            fprintf(stderr, "consumer: recv %u: %s\n", i, ivshm_strerror((int)n));
            return 2;
        }
        REQUIRE(src >= 0 && src < (int)IVSHM_MAX_PEERS && rank_of[src] > 0);
        check_msg(&c, (uint32_t)rank_of[src], tag, buf, n, true);
    }
    for (uint32_t r = 1; r <= NPROD; r++)
        REQUIRE(c.next_seq[r] == PROD_MSGS);
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    printf("  consumer: %llu msgs, %.1f MB, slept %llu times, rang %llu\n",
           (unsigned long long)st.recvs, st.bytes_recv / 1e6,
           (unsigned long long)st.sleeps, (unsigned long long)st.rings);
    fflush(stdout); /* children leave with _exit */
    ivshm_detach(h);
    return c.errors ? 1 : 0;
}

static int producer(uint32_t rank)
{
    ivshm *h = tu_attach(path, job, rank, 0);
    int dst = tu_await_peer(h, job, RANK_CONSUMER, 10000);
    REQUIRE(dst >= 0);
    uint8_t *buf = malloc(LARGE_MAX);
    for (uint32_t seq = 0; seq < PROD_MSGS; seq++) {
        size_t len = msg_len(rank, RANK_CONSUMER, seq, true);
        msg_fill(buf, len, msg_seed(rank, RANK_CONSUMER, seq));
        int rc = ivshm_send(h, dst, seq, buf, len);
        if (rc < 0) {
            fprintf(stderr, "producer %u: send %u: %s\n", rank, seq, ivshm_strerror(rc));
            return 2;
        }
    }
    /* stay until the consumer has everything: leaving is fine for the
       protocol, but keeps the consumer's view simple */
    char none;
    ivshm_recv(h, dst, NULL, NULL, &none, 1, 60000);
    ivshm_detach(h);
    return 0;
}

static int pair(uint32_t rank)
{
    ivshm *h = tu_attach(path, job, rank, 0);
    uint32_t other_rank = rank == RANK_PAIR_A ? RANK_PAIR_B : RANK_PAIR_A;
    int other = tu_await_peer(h, job, other_rank, 10000);
    REQUIRE(other >= 0);
    struct checker c = {.self_rank = rank, .want = malloc(4 * payload)};
    uint8_t *out = malloc(4 * payload), *in = malloc(4 * payload);
    uint32_t sent = 0, got = 0;
    size_t len = 0;
    bool prepared = false;
    uint64_t stuck = 0;
    while (sent < PAIR_MSGS || got < PAIR_MSGS) {
        bool progress = false;
        if (sent < PAIR_MSGS) {
            if (!prepared) {
                len = msg_len(rank, other_rank, sent, false);
                msg_fill(out, len, msg_seed(rank, other_rank, sent));
                prepared = true;
            }
            int rc = ivshm_try_send(h, other, sent, out, len);
            if (rc == 0) {
                sent++;
                prepared = false;
                progress = true;
            } else if (rc != -EAGAIN) {
                fprintf(stderr, "pair %u: try_send: %s\n", rank, ivshm_strerror(rc));
                return 2;
            }
        }
        /* Drain, and when neither direction moved, block a little: our
           ring full means the other side has reading to do. */
        int timeout = progress ? 0 : 1;
        for (;;) {
            uint32_t tag;
            ssize_t n = ivshm_recv(h, other, NULL, &tag, in, 4 * payload, timeout);
            if (n == -EAGAIN || n == -ETIMEDOUT)
                break;
            if (n < 0) {
                fprintf(stderr, "pair %u: recv: %s\n", rank, ivshm_strerror((int)n));
                return 2;
            }
            check_msg(&c, other_rank, tag, in, n, false);
            got++;
            timeout = 0;
            progress = true;
        }
        if (!progress && ++stuck > 20000) {
            fprintf(stderr, "pair %u: no progress (sent %u, got %u)\n", rank, sent, got);
            return 3;
        }
    }
    /* the other side may still be reading our last messages */
    char none;
    ivshm_recv(h, other, NULL, NULL, &none, 1, 200);
    ivshm_detach(h);
    return c.errors ? 1 : 0;
}

static int run_rank(void *arg)
{
    uint32_t rank = *(uint32_t *)arg;
    if (rank == RANK_CONSUMER)
        return consumer();
    if (rank <= NPROD)
        return producer(rank);
    return pair(rank);
}

int main(void)
{
    job = (uint64_t)getpid() << 8;
    path = tu_region(ivshm_min_region_size(&geom), &geom);
    uint32_t ranks[NRANKS];
    pid_t pids[NRANKS];
    uint64_t t0 = ivshm_now_ns();
    for (uint32_t r = 0; r < NRANKS; r++) {
        ranks[r] = r;
        pids[r] = tu_fork(run_rank, &ranks[r]);
    }
    /* the producers linger until the consumer finishes; wait for it first */
    int st = tu_wait(pids[RANK_CONSUMER], 120000);
    CHECK(st == 0);
    for (uint32_t r = 1; r < NRANKS; r++) {
        int rst = tu_wait(pids[r], st == 0 ? 120000 : 2000);
        if (rst != 0)
            fprintf(stderr, "rank %u exited with %d\n", r, rst);
        CHECK(rst == 0);
    }
    double dt = (double)(ivshm_now_ns() - t0) / 1e9;
    printf("  %u messages among %d processes in %.1f s (%.0f msgs/s)\n",
           TOTAL_MSGS, NRANKS, dt, TOTAL_MSGS / dt);
    CHECK(dt < 90.0);
    return tu_summary("test_stress");
}
