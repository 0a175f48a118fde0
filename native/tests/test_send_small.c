/* ivshm_send_small: the one-call small send (two parts into one slot).
   Its results against the other sends (bytes, order, errors, the queue
   before a fast ring exists), its repairs (a new incarnation of the
   receiver, a forged tail, slots forged "full"), and a hostile
   co-tenant process scribbling the ring's tail while we send. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *path;
static uint64_t job = 0x5e11;

struct duo {
    ivshm *a, *b;
    int sa, sb;
};

static void duo_open(struct duo *d, const ivshm_geometry *g)
{
    job++;
    path = tu_region(ivshm_min_region_size(g), g);
    d->a = tu_attach(path, job, 0, 0);
    d->b = tu_attach(path, job, 1, 0);
    d->sa = ivshm_self(d->a);
    d->sb = ivshm_self(d->b);
}

static void duo_close(struct duo *d)
{
    ivshm_detach(d->a);
    ivshm_detach(d->b);
}

static void fill(uint8_t *b, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(seed * 31u + i * 7u + (i >> 8));
}

/* Receive one message from `from` and check it is a ++ b. */
static bool got(ivshm *rx, int from, uint32_t tag, const uint8_t *a,
                size_t alen, const uint8_t *b, size_t blen)
{
    uint8_t in[4096];
    uint32_t t = 0;
    ssize_t n = ivshm_recv(rx, from, NULL, &t, in, sizeof in, 1000);
    return n == (ssize_t)(alen + blen) && t == tag &&
           (!alen || memcmp(in, a, alen) == 0) &&
           (!blen || memcmp(in + alen, b, blen) == 0);
}

static struct ivshm_ring_ctrl *ring_ctrl(ivshm *h, int from, int to)
{
    struct ivshm_ring_ctrl *c =
        (struct ivshm_ring_ctrl *)ivshm_fast_ring_of(h, from, to);
    REQUIRE(c);
    return c;
}

/* Every split of the sizes that matter to the inline copies (0..33 on
   either side, both around the 8/16/32-byte moves) and some larger
   ones, first through the queue, then on the fast ring. */
static void test_bytes_and_paths(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    struct duo d;
    duo_open(&d, &g);
    const uint32_t P = 256 - IVSHM_SLOT_HDR;
    uint8_t a[256], b[256];
    fill(a, sizeof a, 1);
    fill(b, sizeof b, 2);
    bool ok = true;
    /* IVSHM_FAST_AFTER=4 (main): the first messages go through the queue */
    for (uint32_t i = 0; i < 3; i++) {
        ok &= ivshm_send_small(d.a, d.sb, 10 + i, a, 14, b, i * 5) == 0;
        ok &= got(d.b, d.sa, 10 + i, a, 14, b, i * 5);
    }
    CHECK(ok);
    CHECK(ivshm_fast_ring_of(d.a, d.sa, d.sb) == NULL);
    for (uint32_t i = 0; i < 4; i++) /* opens the fast ring */
        ok &= ivshm_send_small(d.a, d.sb, 20, a, 3, b, 3) == 0 &&
              got(d.b, d.sa, 20, a, 3, b, 3);
    CHECK(ok);
    CHECK(ivshm_fast_ring_of(d.a, d.sa, d.sb) != NULL);
    static const size_t big[] = {40, 64, 100, 200, 224};
    for (size_t al = 0; al <= 33; al++)
        for (size_t bl = 0; bl <= 33; bl++) {
            ok &= ivshm_send_small(d.a, d.sb, (uint32_t)(al * 100 + bl),
                                   al ? a + al : NULL, al, bl ? b + bl : NULL,
                                   bl) == 0;
            ok &= got(d.b, d.sa, (uint32_t)(al * 100 + bl), a + al, al,
                      b + bl, bl);
        }
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        size_t al = big[i] / 3, bl = big[i] - big[i] / 3;
        ok &= ivshm_send_small(d.a, d.sb, 7, a, al, b, bl) == 0;
        ok &= got(d.b, d.sa, 7, a, al, b, bl);
    }
    /* exactly one slot: fine; one byte more: -EMSGSIZE, nothing sent */
    ok &= ivshm_send_small(d.a, d.sb, 8, a, 30, b, P - 30) == 0;
    ok &= got(d.b, d.sa, 8, a, 30, b, P - 30);
    CHECK(ok);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, 30, b, P - 29), -EMSGSIZE);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, P + 1, NULL, 0), -EMSGSIZE);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, SIZE_MAX, b, 2), -EMSGSIZE);
    /* bad arguments */
    CHECK_RC(ivshm_send_small(NULL, d.sb, 9, a, 1, b, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, d.sa, 9, a, 1, b, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, -1, 9, a, 1, b, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, 4, 9, a, 1, b, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, NULL, 1, b, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, 1, NULL, 1), -EINVAL);
    CHECK_RC(ivshm_send_small(d.a, 2, 9, a, 1, b, 1), IVSHM_EPEERDEAD);
    const void *data;
    CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, NULL, NULL, &data), -EAGAIN);

    /* full ring: -EAGAIN, no trace; one released position, one send */
    for (uint32_t i = 0; i < 8; i++)
        ok &= ivshm_send_small(d.a, d.sb, 30 + i, a, 14, b, 8) == 0;
    CHECK(ok);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 99, a, 14, b, 8), -EAGAIN);
    CHECK(got(d.b, d.sa, 30, a, 14, b, 8));
    CHECK_RC(ivshm_send_small(d.a, d.sb, 38, a, 14, b, 8), 0);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 99, a, 14, b, 8), -EAGAIN);
    for (uint32_t i = 1; i <= 8; i++)
        ok &= got(d.b, d.sa, 30 + i, a, 14, b, 8);
    CHECK(ok);

    /* it ends an open reservation (the slot is the same one) */
    int err;
    CHECK(ivshm_send_reserve(d.a, d.sb, 8, &err) != NULL);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 40, a, 2, b, 2), 0);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 41, 8), -EINVAL);
    CHECK(got(d.b, d.sa, 40, a, 2, b, 2));

    /* interleaved with the other sends, in order */
    CHECK_RC(ivshm_send_small(d.a, d.sb, 50, a, 5, b, 5), 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 51, a, 9), 0);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 52, NULL, 0, NULL, 0), 0);
    CHECK(got(d.b, d.sa, 50, a, 5, b, 5) && got(d.b, d.sa, 51, a, 9, NULL, 0) &&
          got(d.b, d.sa, 52, NULL, 0, NULL, 0));
    duo_close(&d);
}

/* A pair on a fast ring of 8 slots of 256 bytes, and two parts to send. */
static void duo_ring(struct duo *d, uint8_t *a, size_t alen, uint8_t *b,
                     size_t blen, uint32_t seed, uint32_t peers)
{
    ivshm_geometry g = {.max_peers = peers, .ring_slots = 8, .slot_size = 256};
    duo_open(d, &g);
    fill(a, alen, seed);
    fill(b, blen, seed + 1);
    CHECK_RC(ivshm_fast_open(d->a, d->sb), 0);
}

/* What the general path repairs or reports, reached through the hot
   path's "not for me". */
static void test_repairs(void)
{
    struct duo d;
    uint8_t a[64], b[64];
    /* two slots: b's next incarnation below takes b's (a claim prefers
       a slot claimed fewer times, registry.c) */
    duo_ring(&d, a, sizeof a, b, sizeof b, 3, 2);
    bool ok = true;
    for (uint32_t i = 0; i < 8; i++)
        ok &= ivshm_send_small(d.a, d.sb, i, a, 14, b, 8) == 0;
    CHECK(ok);
    /* a forged tail once the cached one says "full": corrupt, not sent */
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(d.a, d.sa, d.sb);
    atomic_store(&ctrl->tail, 1000000);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, 14, b, 8), IVSHM_ECORRUPT);
    atomic_store(&ctrl->tail, 9); /* ahead over slots that are not "full" */
    CHECK_RC(ivshm_send_small(d.a, d.sb, 9, a, 14, b, 8), IVSHM_ECORRUPT);
    atomic_store(&ctrl->tail, 0);
    for (uint32_t i = 0; i < 8; i++)
        ok &= got(d.b, d.sa, i, a, 14, b, 8);
    CHECK(ok);

    /* A tail ahead over slots a co-tenant forged "full" (the consumer
       took them): followed, the next message lands where it looks. */
    uint64_t head = d.a->peers[d.sb].tx_head; /* 8: the ring is empty */
    uint8_t *ring = (uint8_t *)ctrl;
    for (uint64_t pos = head; pos < head + 2; pos++) {
        struct ivshm_slot *s =
            (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                  (pos & 7) * 256u);
        atomic_store(&s->seq, pos + 1);
    }
    /* the consumer takes them (stale bytes of positions 0 and 1, still
       well-formed: delivered) and publishes its tail past our head */
    uint8_t in[256];
    for (int i = 0; i < 2; i++)
        CHECK(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0) >= 0);
    CHECK(atomic_load(&ctrl->tail) == head + 2);
    /* our cached tail says "full": the real one is read and followed */
    for (uint32_t i = 0; i < 7; i++)
        ok &= ivshm_send_small(d.a, d.sb, 60 + i, a, 14, b, 8) == 0;
    CHECK(ok);
    CHECK(d.a->peers[d.sb].tx_head == head + 9);
    for (uint32_t i = 0; i < 7; i++)
        ok &= got(d.b, d.sa, 60 + i, a, 14, b, 8);
    CHECK(ok);

    /* a new incarnation of the receiver in the same slot: our view is
       reset, the message goes to it (through its queue), not into the
       ring the old one had */
    int old = d.sb;
    ivshm_detach(d.b);
    CHECK_RC(ivshm_send_small(d.a, old, 70, a, 14, b, 8), IVSHM_EPEERDEAD);
    d.b = tu_attach(path, job, 1, 0);
    d.sb = ivshm_self(d.b);
    CHECK(d.sb == old);
    CHECK_RC(ivshm_send_small(d.a, d.sb, 71, a, 14, b, 8), 0);
    CHECK(ivshm_fast_ring_of(d.a, d.sa, d.sb) == NULL);
    CHECK(got(d.b, d.sa, 71, a, 14, b, 8));
    duo_close(&d);
}

/* ---- a hostile co-tenant ---- */

struct scribbler {
    uint64_t tail_off; /* of the ring a -> b, from the region base */
    uint64_t stop_ms;
};

/* Attach as a third peer and keep writing garbage into the consumer's
   tail of the ring a -> b: rewound, far ahead, a little ahead. */
static int scribble_child(void *arg)
{
    struct scribbler *s = arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    _Atomic uint64_t *tail = (_Atomic uint64_t *)(h->base + s->tail_off);
    uint64_t x = 88172645463325252ull;
    while (tu_now_ms() < s->stop_ms) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint64_t cur = atomic_load(tail);
        switch (x & 3) {
        case 0: atomic_store(tail, cur - 1 - (x >> 60)); break;
        case 1: atomic_store(tail, x >> 8); break;
        case 2: atomic_store(tail, cur + 1 + (x >> 62)); break;
        default: atomic_store(tail, 0); break;
        }
    }
    ivshm_detach(h);
    return 0;
}

/* While a co-tenant process scribbles the tail, every send_small returns
   at once with 0, -EAGAIN or IVSHM_ECORRUPT (never hangs, never
   crashes), and what the receiver takes is either a whole message we
   sent or reported as corrupt. After the scribbler is gone, the
   receiver's empty polls put its tail back and the pair talks again. */
static void test_hostile_tail(void)
{
    struct duo d;
    uint8_t a[16], b[8];
    duo_ring(&d, a, sizeof a, b, sizeof b, 5, 4);
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(d.a, d.sa, d.sb);
    struct scribbler s = {(uint64_t)((uint8_t *)&ctrl->tail - d.a->base),
                          tu_now_ms() + 1500};
    pid_t pid = tu_fork(scribble_child, &s);
    uint64_t sent = 0, again = 0, corrupt = 0, other = 0, bad_rx = 0;
    uint64_t longest = 0;
    while (tu_now_ms() < s.stop_ms) {
        uint64_t t0 = tu_now_ns();
        int rc = ivshm_send_small(d.a, d.sb, 1, a, sizeof a, b, sizeof b);
        uint64_t dt = tu_now_ns() - t0;
        longest = dt > longest ? dt : longest;
        sent += rc == 0;
        again += rc == -EAGAIN;
        corrupt += rc == IVSHM_ECORRUPT;
        other += rc != 0 && rc != -EAGAIN && rc != IVSHM_ECORRUPT;
        uint8_t in[256];
        uint32_t tag;
        ssize_t n = ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0);
        if (n >= 0 && (n != 24 || tag != 1 || memcmp(in, a, 16) != 0 ||
                       memcmp(in + 16, b, 8) != 0))
            bad_rx++;
    }
    CHECK(tu_wait(pid, 10000) == 0);
    printf("  under a scribbled tail: %llu sent, %llu full, %llu corrupt, "
           "longest call %.1f us\n",
           (unsigned long long)sent, (unsigned long long)again,
           (unsigned long long)corrupt, (double)longest / 1e3);
    CHECK(other == 0);
    CHECK(bad_rx == 0);
    CHECK(longest < 2000000000ull); /* no call waits (a stall: 2 s) */
    /* the co-tenant is gone: drain, and the consumer's empty polls heal
       the tail; sends go through again */
    uint8_t in[256];
    for (int i = 0; i < 64; i++)
        (void)ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0);
    bool ok = false;
    for (int i = 0; i < 1000 && !ok; i++) {
        (void)ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0);
        ok = ivshm_send_small(d.a, d.sb, 2, a, sizeof a, b, sizeof b) == 0;
    }
    CHECK(ok);
    CHECK(got(d.b, d.sa, 2, a, sizeof a, b, sizeof b));
    duo_close(&d);
}

int main(void)
{
    setenv("IVSHM_FAST_AFTER", "4", 1);
    test_bytes_and_paths();
    test_repairs();
    test_hostile_tail();
    return tu_summary("test_send_small");
}
