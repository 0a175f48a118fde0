/* Message rings: unit tests. Single-process tests use two or three
   attachments of one region (each its own registry slot); the others fork
   real peers. Garbage tests scribble over a published slot or the tail,
   the way a hostile co-tenant would. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024u * 1024u)
#define BIG (5u * MIB)
#define TAG_STOP 0xdead0000u

static const char *path;
static uint64_t job = 0x51a6;

static double now_s(void)
{
    return (double)ivshm_now_ns() / 1e9;
}

/* Deterministic bytes, so either side can check them. */
static void fill_pattern(uint8_t *b, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 12345u;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        b[i] = (uint8_t)(x >> 24);
    }
}

static bool pattern_ok(const uint8_t *b, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 12345u;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        if (b[i] != (uint8_t)(x >> 24))
            return false;
    }
    return true;
}

static const char *fresh_region(const ivshm_geometry *g)
{
    job++;
    return path = tu_region(ivshm_min_region_size(g), g);
}

static uint32_t payload_of(const ivshm *h)
{
    return h->slot_size - IVSHM_SLOT_HDR;
}

/* The slot holding the next message `rx` will read from `from`, valid
   once that message is published. */
static struct ivshm_slot *pending_slot(ivshm *rx, int from, uint64_t ahead)
{
    uint64_t pos = rx->peers[from].rx_tail + ahead;
    return (struct ivshm_slot *)(ivshm_fast_ring_of(rx, from, rx->self) +
                                 IVSHM_RING_CTRL +
                                 (pos & (rx->ring_slots - 1)) * rx->slot_size);
}

/* The fast ring from -> to (these tests run with IVSHM_FAST_AFTER=0:
   the first message opens it; test_queue covers the shared queues). */
static struct ivshm_ring_ctrl *ring_ctrl(ivshm *h, int from, int to)
{
    struct ivshm_ring_ctrl *c =
        (struct ivshm_ring_ctrl *)ivshm_fast_ring_of(h, from, to);
    if (!c) {
        fprintf(stderr, "no fast ring %d -> %d\n", from, to);
        exit(1);
    }
    return c;
}

/* ---- single process: two attachments a -> b ---- */

struct duo {
    ivshm *a, *b, *c;
    int sa, sb, sc;
};

static void duo_open(struct duo *d, const ivshm_geometry *g, bool three)
{
    fresh_region(g);
    memset(d, 0, sizeof *d);
    d->a = tu_attach(path, job, 0, 0);
    d->b = tu_attach(path, job, 1, 0);
    d->sa = ivshm_self(d->a);
    d->sb = ivshm_self(d->b);
    d->sc = -1;
    if (three) {
        d->c = tu_attach(path, job, 2, 0);
        d->sc = ivshm_self(d->c);
    }
}

static void duo_close(struct duo *d)
{
    ivshm_detach(d->a);
    ivshm_detach(d->b);
    ivshm_detach(d->c);
}

static void test_small_and_sizes(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    uint32_t P = payload_of(d.a);
    uint8_t *out = malloc(2 * P + 64), *in = malloc(2 * P + 64);
    int src = -1;
    uint32_t tag = 0;

    CHECK_RC(ivshm_send(d.a, d.sb, 7, "hello ivshm", 11), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, &src, &tag, in, 64, 1000), 11);
    CHECK(src == d.sa && tag == 7 && memcmp(in, "hello ivshm", 11) == 0);

    /* zero length: a message with no bytes, buffer untouched */
    memset(in, 0x5a, 16);
    CHECK_RC(ivshm_send(d.a, d.sb, 9, NULL, 0), 0);
    CHECK_RC(ivshm_recv(d.b, d.sa, &src, &tag, in, 16, 1000), 0);
    CHECK(tag == 9 && in[0] == 0x5a);

    /* exactly one slot's payload takes one slot, one more byte two */
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(d.a, d.sa, d.sb);
    uint64_t h0 = atomic_load(&ctrl->head);
    fill_pattern(out, P, 1);
    CHECK_RC(ivshm_send(d.a, d.sb, 1, out, P), 0);
    CHECK(atomic_load(&ctrl->head) == h0 + 1);
    memset(in, 0, P);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, P, 1000), P);
    CHECK(tag == 1 && pattern_ok(in, P, 1));

    fill_pattern(out, P + 1, 2);
    CHECK_RC(ivshm_send(d.a, d.sb, 2, out, P + 1), 0);
    CHECK(atomic_load(&ctrl->head) == h0 + 3);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 1000), P + 1);
    CHECK(tag == 2 && pattern_ok(in, P + 1, 2));
    CHECK(atomic_load(&ring_ctrl(d.a, d.sa, d.sb)->tail) == h0 + 3);

    /* cap 0 and no buffer: just the length, message consumed */
    CHECK_RC(ivshm_send(d.a, d.sb, 3, out, 100), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, NULL, 0, 1000), 100);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, 10, 0), -EAGAIN);

    ivshm_stats st;
    ivshm_get_stats(d.a, &st);
    CHECK(st.sends == 5 && st.bytes_sent == 11 + 0 + P + P + 1 + 100);
    ivshm_get_stats(d.b, &st);
    CHECK(st.recvs == 5 && st.bytes_recv == 11 + 0 + P + P + 1 + 100);
    free(out);
    free(in);
    duo_close(&d);
}

static void test_truncation(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    uint32_t P = payload_of(d.a);
    size_t n = 3 * (size_t)P + 5;
    uint8_t *out = malloc(n), in[200];
    uint32_t tag;

    fill_pattern(out, 1000, 5);
    CHECK_RC(ivshm_send(d.a, d.sb, 5, out, 1000), 0);
    CHECK_RC(ivshm_send(d.a, d.sb, 6, "next", 4), 0);
    memset(in, 0xaa, sizeof in);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 100, 1000), 1000);
    CHECK(tag == 5 && pattern_ok(in, 100, 5));
    bool canary = true;
    for (size_t i = 100; i < sizeof in; i++)
        canary &= in[i] == 0xaa;
    CHECK(canary);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, sizeof in, 1000), 4);
    CHECK(tag == 6 && memcmp(in, "next", 4) == 0);

    /* a truncated multi-fragment message is consumed whole */
    fill_pattern(out, n, 7);
    CHECK_RC(ivshm_send(d.a, d.sb, 7, out, n), 0);
    CHECK_RC(ivshm_send(d.a, d.sb, 8, "after", 5), 0);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, 10, 1000), n);
    CHECK(tag == 7 && pattern_ok(in, 10, 7));
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 1000), 5);
    CHECK(tag == 8 && memcmp(in, "after", 5) == 0);
    free(out);
    duo_close(&d);
}

static void test_full_ring(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    struct duo d;
    duo_open(&d, &g, false);
    uint32_t P = payload_of(d.a);
    uint8_t buf[8 * 224 + 1], in[8 * 224 + 1];
    uint32_t tag;
    CHECK(P == 224);

    for (uint32_t i = 0; i < 8; i++)
        CHECK_RC(ivshm_try_send(d.a, d.sb, i, &i, sizeof i), 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 8, buf, 8), -EAGAIN);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 8, 0), 4);
    CHECK(tag == 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 8, buf, 8), 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 9, buf, 8), -EAGAIN);
    bool order = true;
    for (uint32_t i = 1; i <= 8; i++) {
        order &= ivshm_recv(d.b, d.sa, NULL, &tag, in, 8, 0) >= 0 && tag == i;
    }
    CHECK(order);

    /* all fragments or nothing */
    fill_pattern(buf, 8 * P, 11);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 20, buf, 8 * P), 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 21, buf, 1), -EAGAIN);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0), 8 * P);
    CHECK(tag == 20 && pattern_ok(in, 8 * P, 11));
    CHECK_RC(ivshm_try_send(d.a, d.sb, 22, buf, 8 * P + 1), -EMSGSIZE);
    for (uint32_t i = 0; i < 7; i++)
        CHECK_RC(ivshm_try_send(d.a, d.sb, i, buf, 1), 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 23, buf, P + 1), -EAGAIN);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 24, buf, P), 0);
    for (uint32_t i = 0; i < 8; i++)
        CHECK(ivshm_recv(d.b, d.sa, NULL, NULL, in, P, 0) >= 0);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, P, 0), -EAGAIN);
    duo_close(&d);
}

static void test_order(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    uint32_t P = payload_of(d.a);
    uint8_t *out = malloc(P), *in = malloc(P);
    for (uint32_t i = 0; i < 60; i++) {
        size_t n = (i * 997u) % (P + 1);
        fill_pattern(out, n, i);
        CHECK_RC(ivshm_try_send(d.a, d.sb, i, out, n), 0);
    }
    bool ok = true;
    for (uint32_t i = 0; i < 60; i++) {
        uint32_t tag = ~0u;
        size_t n = (i * 997u) % (P + 1);
        ssize_t rc = ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, P, 0);
        ok &= rc == (ssize_t)n && tag == i && pattern_ok(in, n, i);
    }
    CHECK(ok);
    free(out);
    free(in);
    duo_close(&d);
}

static void test_any_vs_specific(void)
{
    struct duo d;
    duo_open(&d, NULL, true);
    uint32_t tag;
    int src;
    char in[16];
    CHECK_RC(ivshm_send(d.a, d.sb, 100, "a0", 2), 0);
    CHECK_RC(ivshm_send(d.a, d.sb, 101, "a1", 2), 0);
    CHECK_RC(ivshm_send(d.c, d.sb, 200, "c0", 2), 0);
    CHECK_RC(ivshm_send(d.c, d.sb, 201, "c1", 2), 0);
    CHECK_RC(ivshm_recv(d.b, d.sc, &src, &tag, in, sizeof in, 0), 2);
    CHECK(src == d.sc && tag == 200);
    CHECK_RC(ivshm_recv(d.b, d.sc, &src, &tag, in, sizeof in, 0), 2);
    CHECK(src == d.sc && tag == 201);
    CHECK_RC(ivshm_recv(d.b, d.sc, &src, &tag, in, sizeof in, 0), -EAGAIN);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, &src, &tag, in, sizeof in, 0), 2);
    CHECK(src == d.sa && tag == 100);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, &src, &tag, in, sizeof in, 0), 2);
    CHECK(src == d.sa && tag == 101);

    /* fairness: two busy senders alternate under IVSHM_ANY */
    for (uint32_t i = 0; i < 4; i++) {
        CHECK_RC(ivshm_send(d.a, d.sb, 10 + i, NULL, 0), 0);
        CHECK_RC(ivshm_send(d.c, d.sb, 20 + i, NULL, 0), 0);
    }
    int last = -1;
    uint32_t next_a = 10, next_c = 20;
    bool alternate = true, ordered = true;
    for (int i = 0; i < 8; i++) {
        CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, &src, &tag, NULL, 0, 0), 0);
        alternate &= src != last;
        last = src;
        if (src == d.sa)
            ordered &= tag == next_a++;
        else
            ordered &= src == d.sc && tag == next_c++;
    }
    CHECK(alternate);
    CHECK(ordered && next_a == 14 && next_c == 24);

    /* The zero-copy peek looks at the last sender's ring first, but a
       sender that keeps its ring full still lets the other one through
       within a bounded run, and each one's order holds. */
    uint32_t sent_a = 0, seen_a = 0, run = 0, longest = 0;
    while (ivshm_try_send(d.a, d.sb, 1000 + sent_a, NULL, 0) == 0)
        sent_a++;
    CHECK(sent_a >= 2);
    bool c_seen = false;
    ordered = true;
    for (int i = 0; i < 200 && !c_seen; i++) {
        if (i == 1) /* once a's ring is the one looked at first */
            CHECK_RC(ivshm_send(d.c, d.sb, 7, NULL, 0), 0);
        const void *data;
        CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, &tag, &data), 0);
        CHECK_RC(ivshm_recv_release(d.b, src), 0);
        if (src == d.sc) {
            c_seen = tag == 7;
        } else {
            ordered &= src == d.sa && tag == 1000 + seen_a++;
            longest = ++run > longest ? run : longest;
            /* keep a's ring full */
            CHECK_RC(ivshm_try_send(d.a, d.sb, 1000 + sent_a++, NULL, 0), 0);
        }
    }
    printf("  a busy sender's longest run before the other got through: %u\n",
           longest);
    CHECK(c_seen && ordered && longest <= 32);
    duo_close(&d);
}

static void test_timeouts_and_args(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    char in[8];
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, sizeof in, 0), -EAGAIN);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0), -EAGAIN);
    double t0 = now_s();
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, sizeof in, 150),
             -ETIMEDOUT);
    double dt = now_s() - t0;
    CHECK(dt >= 0.14 && dt < 2.0);
    t0 = now_s();
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 60), -ETIMEDOUT);
    dt = now_s() - t0;
    CHECK(dt >= 0.055 && dt < 2.0);
    /* waiting for a message does not take it */
    CHECK_RC(ivshm_wait_message(d.b, 30), -ETIMEDOUT);
    CHECK_RC(ivshm_send(d.a, d.sb, 3, "hi", 2), 0);
    CHECK_RC(ivshm_wait_message(d.b, 1000), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, sizeof in, 0), 2);

    int self = d.sa, nobody = 5;
    CHECK_RC(ivshm_send(d.a, self, 0, "x", 1), -EINVAL);
    CHECK_RC(ivshm_send(d.a, -1, 0, "x", 1), -EINVAL);
    CHECK_RC(ivshm_send(d.a, ivshm_max_peers(d.a), 0, "x", 1), -EINVAL);
    CHECK_RC(ivshm_send(d.a, d.sb, 0, NULL, 1), -EINVAL);
    CHECK_RC(ivshm_try_send(d.a, self, 0, "x", 1), -EINVAL);
    CHECK_RC(ivshm_send(d.a, nobody, 0, "x", 1), IVSHM_EPEERDEAD);
    CHECK_RC(ivshm_try_send(d.a, nobody, 0, "x", 1), IVSHM_EPEERDEAD);
    CHECK_RC(ivshm_recv(d.a, self, NULL, NULL, in, sizeof in, 0), -EINVAL);
    CHECK_RC(ivshm_recv(d.a, -5, NULL, NULL, in, sizeof in, 0), -EINVAL);
    CHECK_RC(ivshm_recv(d.a, 64, NULL, NULL, in, sizeof in, 0), -EINVAL);
    CHECK_RC(ivshm_recv(d.a, d.sb, NULL, NULL, NULL, 4, 0), -EINVAL);
    CHECK_RC(ivshm_recv(d.a, nobody, NULL, NULL, in, sizeof in, 100),
             IVSHM_EPEERDEAD);
    duo_close(&d);
}

/* A hostile sender: publish a real message, then rewrite its header. */
static void test_garbage_slots(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    uint32_t P = payload_of(d.a);
    uint8_t *out = malloc(2 * P), *in = malloc(2 * P);
    fill_pattern(out, 2 * P, 3);
    uint32_t tag;
    int src = -1;
    struct ivshm_slot *s;

    /* each case: corrupt, expect ECORRUPT, then a good message passes */
    for (int kase = 0; kase < 9; kase++) {
        size_t n = kase < 5 ? 40 : P + 10;
        CHECK_RC(ivshm_send(d.a, d.sb, 1, out, n), 0);
        s = pending_slot(d.b, d.sa, kase < 5 ? 0 : 1);
        switch (kase) {
        case 0: s->len = 0xffffffffu; s->total = 0xffffffffu; break;
        case 1: s->flags = 0x80 | SLOT_FIRST | SLOT_LAST; break;
        case 2: s->total = 41; break;               /* FIRST|LAST, len != total */
        case 3: s->flags = SLOT_LAST; break;        /* no FIRST */
        case 4: s->flags = SLOT_FIRST; s->total = (uint64_t)1 << 63; break;
        case 5: s->len = 100; break;                /* continuation > remaining */
        case 6: s->flags = 0; break;                /* remaining hits 0, no LAST */
        case 7: s->len = P; s->total = P + 200; break;
        case 8: s->tag = 99; break;                 /* continuation of another */
        }
        CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, &src, &tag, in, 2 * P, 0),
                 IVSHM_ECORRUPT);
        CHECK(src == d.sa);
        /* nothing of the broken message may surface afterwards */
        while (ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, 2 * P, 0) ==
               IVSHM_ECORRUPT)
            ;
        CHECK_RC(ivshm_send(d.a, d.sb, 2, out, 33), 0);
        CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 0), 33);
        CHECK(tag == 2 && pattern_ok(in, 33, 3));
    }

    /* a slot that starts a new message where a continuation belongs:
       the broken message is reported, the new one survives */
    CHECK_RC(ivshm_send(d.a, d.sb, 3, out, P + 10), 0);
    s = pending_slot(d.b, d.sa, 1);
    s->flags = SLOT_FIRST | SLOT_LAST;
    s->len = 10;
    s->total = 10;
    s->tag = 4;
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 0),
             IVSHM_ECORRUPT);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 0), 10);
    CHECK(tag == 4);

    /* a slot of another generation is stale: dropped, counted */
    ivshm_stats st0, st1;
    ivshm_get_stats(d.b, &st0);
    CHECK_RC(ivshm_send(d.a, d.sb, 5, out, 8), 0);
    pending_slot(d.b, d.sa, 0)->gen += 7;
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 0), -EAGAIN);
    ivshm_get_stats(d.b, &st1);
    CHECK(st1.dropped == st0.dropped + 1);
    CHECK_RC(ivshm_send(d.a, d.sb, 6, out, 8), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, &tag, in, 2 * P, 0), 8);
    CHECK(tag == 6);
    free(out);
    free(in);
    duo_close(&d);
}

/* Zero copy: reserve/commit on the send side, peek/release on the
   receive side, mixed freely with the copying calls. */
static void test_zero_copy(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    struct duo d;
    duo_open(&d, &g, false);
    uint32_t P = payload_of(d.a);
    uint8_t buf[3 * 224], in[3 * 224];
    const void *data = NULL;
    uint32_t tag = 0;
    int src = -1, err = 0;

    /* reserve -> fill in place -> commit; peek sees it in place */
    uint8_t *slotp = ivshm_send_reserve(d.a, d.sb, P, &err);
    CHECK(slotp && err == 0);
    fill_pattern(slotp, P, 31);
    CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, &tag, &data), -EAGAIN);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 31, P), 0);
    CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, &tag, &data), P);
    /* the same bytes of the region (each attachment maps it elsewhere) */
    const uint64_t slot_off = (uint64_t)(slotp - d.a->base);
    CHECK(src == d.sa && tag == 31 && pattern_ok(data, P, 31));
    CHECK((uint64_t)((const uint8_t *)data - d.b->base) == slot_off);
    /* peeking again gives the same message, until released */
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, &src, &tag, &data), P);
    CHECK((uint64_t)((const uint8_t *)data - d.b->base) == slot_off);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), -EINVAL); /* twice */
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, &src, &tag, &data), -EAGAIN);

    /* commit shorter than reserved; a copying recv reads it too */
    slotp = ivshm_send_reserve(d.a, d.sb, 100, &err);
    CHECK(slotp != NULL);
    memcpy(slotp, "zero", 4);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 32, 4), 0);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0), 4);
    CHECK(tag == 32 && memcmp(in, "zero", 4) == 0);

    /* copying send, zero-copy receive (also zero length) */
    CHECK_RC(ivshm_send(d.a, d.sb, 33, NULL, 0), 0);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 0);
    CHECK(tag == 33);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);

    /* a multi-slot message is left whole: -EMSGSIZE, then ivshm_recv */
    fill_pattern(buf, P + 5, 34);
    CHECK_RC(ivshm_send(d.a, d.sb, 34, buf, P + 5), 0);
    CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, &tag, &data), -EMSGSIZE);
    CHECK(src == d.sa);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), -EINVAL);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0), P + 5);
    CHECK(tag == 34 && pattern_ok(in, P + 5, 34));

    /* reservation limits: too big, ring full, commit without room */
    CHECK(ivshm_send_reserve(d.a, d.sb, P + 1, &err) == NULL && err == -EMSGSIZE);
    CHECK(ivshm_send_reserve(d.a, d.sa, 8, &err) == NULL && err == -EINVAL);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 0, P + 1), -EINVAL);
    CHECK_RC(ivshm_send_commit(d.a, d.sa, 0, 1), -EINVAL);
    for (uint32_t i = 0; i < 8; i++) {
        uint32_t *p = ivshm_send_reserve(d.a, d.sb, sizeof i, &err);
        CHECK(p != NULL);
        if (p)
            *p = i;
        CHECK_RC(ivshm_send_commit(d.a, d.sb, 40 + i, sizeof i), 0);
    }
    CHECK(ivshm_send_reserve(d.a, d.sb, 1, &err) == NULL && err == -EAGAIN);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 0, 1), -EINVAL);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 0, buf, 1), -EAGAIN);
    /* releasing one position makes room for exactly one reservation */
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 4);
    CHECK(tag == 40 && *(const uint32_t *)data == 0);
    CHECK(ivshm_send_reserve(d.a, d.sb, 1, &err) == NULL && err == -EAGAIN);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);
    CHECK(ivshm_send_reserve(d.a, d.sb, 1, &err) != NULL && err == 0);
    bool order = true;
    for (uint32_t i = 1; i < 8; i++) {
        order &= ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data) == 4 &&
                 tag == 40 + i && *(const uint32_t *)data == i;
        order &= ivshm_recv_release(d.b, d.sa) == 0;
    }
    CHECK(order);

    /* misuse of arguments */
    CHECK_RC(ivshm_recv_peek(d.b, d.sb, NULL, NULL, &data), -EINVAL);
    CHECK_RC(ivshm_recv_peek(d.b, 99, NULL, NULL, &data), -EINVAL);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, NULL, NULL), -EINVAL);
    CHECK_RC(ivshm_recv_release(d.b, d.sb), -EINVAL);
    CHECK_RC(ivshm_recv_release(d.b, -1), -EINVAL);
    CHECK_RC(ivshm_recv_release(NULL, d.sa), -EINVAL);
    CHECK(ivshm_send_reserve(NULL, d.sb, 1, &err) == NULL && err == -EINVAL);

    /* garbage in a peeked slot: ECORRUPT, consumed, the next one passes */
    for (int kase = 0; kase < 4; kase++) {
        CHECK_RC(ivshm_send(d.a, d.sb, 50, buf, 40), 0);
        struct ivshm_slot *s = pending_slot(d.b, d.sa, 0);
        switch (kase) {
        case 0: s->len = P + 1; s->total = P + 1; break;
        case 1: s->flags = 0x40 | SLOT_FIRST | SLOT_LAST; break;
        case 2: s->total = 41; break;
        case 3: s->flags = SLOT_LAST; break;
        }
        src = -1;
        CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, &tag, &data),
                 IVSHM_ECORRUPT);
        CHECK(src == d.sa);
        CHECK_RC(ivshm_recv_release(d.b, d.sa), -EINVAL);
        CHECK_RC(ivshm_send(d.a, d.sb, 51, "ok", 2), 0);
        CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 2);
        CHECK(tag == 51 && memcmp(data, "ok", 2) == 0);
        CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);
    }
    /* a peeked slot scribbled before release: the release is decided on
       our own state, so the message cannot stick; a second release and a
       release after a copying receive are misuse */
    CHECK_RC(ivshm_send(d.a, d.sb, 52, buf, 8), 0);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 8);
    pending_slot(d.b, d.sa, 0)->flags = SLOT_FIRST;
    CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), -EINVAL);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), -EAGAIN);
    CHECK_RC(ivshm_send(d.a, d.sb, 54, buf, 8), 0);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 8);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0), 8);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), -EINVAL);
    /* a copying send into a reserved slot ends the reservation */
    CHECK(ivshm_send_reserve(d.a, d.sb, 8, &err) != NULL);
    CHECK_RC(ivshm_send(d.a, d.sb, 55, buf, 8), 0);
    CHECK_RC(ivshm_send_commit(d.a, d.sb, 56, 8), -EINVAL);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, &tag, in, sizeof in, 0), 8);
    CHECK(tag == 55);

    /* a departed sender: its last message is still peeked, then DEAD */
    CHECK_RC(ivshm_send(d.a, d.sb, 53, "bye", 3), 0);
    ivshm_detach(d.a);
    d.a = NULL;
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), 3);
    CHECK(tag == 53 && memcmp(data, "bye", 3) == 0);
    CHECK_RC(ivshm_recv_release(d.b, d.sa), 0);
    CHECK_RC(ivshm_recv_peek(d.b, d.sa, NULL, &tag, &data), IVSHM_EPEERDEAD);
    duo_close(&d);
}

static void test_garbage_tail(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    struct duo d;
    duo_open(&d, &g, false);
    char in[8];
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "x", 1), 0);
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(d.a, d.sa, d.sb);
    atomic_store(&ctrl->tail, 1000000); /* beyond anything published */
    CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "x", 1), IVSHM_ECORRUPT);
    CHECK_RC(ivshm_send(d.a, d.sb, 0, "x", 1), IVSHM_ECORRUPT);
    atomic_store(&ctrl->tail, 9);
    CHECK_RC(ivshm_send(d.a, d.sb, 0, "x", 1), IVSHM_ECORRUPT);
    atomic_store(&ctrl->tail, 0);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "x", 1), -EAGAIN);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0), 1);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "y", 1), 0);
    /* head 16: a tail of 3 would claim 13 slots in use in a ring of 8 */
    atomic_store(&ctrl->tail, 3);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "x", 1), IVSHM_ECORRUPT);
    atomic_store(&ctrl->tail, 8);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0), 1);
    CHECK_RC(ivshm_try_send(d.a, d.sb, 0, "z", 1), 0);
    CHECK_RC(ivshm_recv(d.b, d.sa, NULL, NULL, in, sizeof in, 0), 1);
    CHECK(in[0] == 'z');
    duo_close(&d);
}

/* ---- forked peers ---- */

/* Echo every message back to rank 0 until TAG_STOP. */
static int echo_child(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int parent = tu_await_peer(h, job, 0, 10000);
    REQUIRE(parent >= 0);
    uint8_t *buf = malloc(BIG + 1);
    REQUIRE(buf);
    for (;;) {
        uint32_t tag;
        ssize_t n = ivshm_recv(h, parent, NULL, &tag, buf, BIG + 1, 20000);
        REQUIRE(n >= 0 && n <= (ssize_t)BIG);
        if (tag == TAG_STOP)
            break;
        REQUIRE(ivshm_send(h, parent, tag, buf, (size_t)n) == 0);
    }
    free(buf);
    ivshm_detach(h);
    return 0;
}

static void test_echo_process(void)
{
    fresh_region(NULL);
    ivshm *h = tu_attach(path, job, 0, 0);
    pid_t pid = tu_fork(echo_child, NULL);
    int child = tu_await_peer(h, job, 1, 10000);
    CHECK(child >= 0);
    uint32_t P = payload_of(h);
    size_t sizes[] = {11, 0, P, P + 1, 3 * (size_t)P - 1, 100000, BIG};
    uint8_t *out = malloc(BIG), *in = malloc(BIG + 16);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0] && child >= 0; k++) {
        size_t n = sizes[k];
        fill_pattern(out, n, (uint32_t)k);
        double t0 = now_s();
        CHECK_RC(ivshm_send(h, child, (uint32_t)k, out, n), 0);
        uint32_t tag = ~0u;
        int src = -1;
        memset(in, 0, 64);
        CHECK_RC(ivshm_recv(h, IVSHM_ANY, &src, &tag, in, BIG + 16, 20000), n);
        double dt = now_s() - t0;
        CHECK(src == child && tag == k && pattern_ok(in, n, (uint32_t)k));
        if (n == BIG)
            printf("  5 MiB round trip through a %u-slot ring: %.1f ms (%.0f MB/s each way)\n",
                   h->ring_slots, dt * 1e3, 2 * n / dt / 1e6);
    }
    if (child >= 0)
        CHECK_RC(ivshm_send(h, child, TAG_STOP, NULL, 0), 0);
    CHECK(tu_wait(pid, 30000) == 0);
    free(out);
    free(in);
    ivshm_detach(h);
}

/* Messages published right before a clean exit are still delivered. */
static int send_and_leave_child(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int parent = tu_await_peer(h, job, 0, 10000);
    REQUIRE(parent >= 0);
    uint8_t *buf = malloc(100000);
    fill_pattern(buf, 100000, 77);
    REQUIRE(ivshm_send(h, parent, 1, "one", 3) == 0);
    REQUIRE(ivshm_send(h, parent, 2, buf, 100000) == 0);
    REQUIRE(ivshm_send(h, parent, 3, "three", 5) == 0);
    free(buf);
    ivshm_detach(h);
    return 0;
}

/* A second incarnation in the same slot: positions restart. */
static int recv_one_child(void *arg)
{
    uint32_t want = *(uint32_t *)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int parent = tu_await_peer(h, job, 0, 10000);
    REQUIRE(parent >= 0);
    uint32_t tag;
    char in[8];
    for (uint32_t i = 0; i < want; i++)
        REQUIRE(ivshm_recv(h, parent, NULL, &tag, in, sizeof in, 10000) == 2 &&
                tag == i);
    REQUIRE(ivshm_send(h, parent, 42, "ok", 2) == 0);
    ivshm_detach(h);
    return 0;
}

static void test_departed_and_rejoined(void)
{
    /* two slots: the child's next incarnations take its slot (a claim
       prefers a slot claimed fewer times, registry.c) */
    const ivshm_geometry two = {.max_peers = 2};
    fresh_region(&two);
    ivshm *h = tu_attach(path, job, 0, 0);
    pid_t pid = tu_fork(send_and_leave_child, NULL);
    CHECK(tu_wait(pid, 20000) == 0); /* gone before we read anything */
    uint8_t *in = malloc(100000);
    uint32_t tag;
    int src = -1, src2 = -2;
    CHECK_RC(ivshm_recv(h, IVSHM_ANY, &src, &tag, in, 100000, 1000), 3);
    CHECK(tag == 1 && memcmp(in, "one", 3) == 0);
    CHECK_RC(ivshm_recv(h, src, &src2, &tag, in, 100000, 1000), 100000);
    CHECK(tag == 2 && pattern_ok(in, 100000, 77) && src2 == src);
    CHECK_RC(ivshm_recv(h, src, NULL, &tag, in, 100000, 1000), 5);
    CHECK(tag == 3);
    CHECK_RC(ivshm_recv(h, src, NULL, &tag, in, 100000, 1000), IVSHM_EPEERDEAD);
    CHECK_RC(ivshm_send(h, src, 0, "x", 1), IVSHM_EPEERDEAD);

    /* two incarnations in a row; we send to both from one local view */
    for (int round = 0; round < 2; round++) {
        uint32_t want = round ? 3 : 20;
        pid = tu_fork(recv_one_child, &want);
        int child = tu_await_peer(h, job, 1, 10000);
        CHECK(child == src);
        for (uint32_t i = 0; i < want && child >= 0; i++)
            CHECK_RC(ivshm_send(h, child, i, "hi", 2), 0);
        CHECK_RC(ivshm_recv(h, child, NULL, &tag, in, 8, 10000), 2);
        CHECK(tag == 42);
        CHECK(tu_wait(pid, 10000) == 0);
    }
    free(in);
    ivshm_detach(h);
}

struct victim {
    int pipe_w;
    bool send_big;
};

/* Attach, tell the parent our slot, then either idle or push a big
   message at the parent (which blocks once the ring is full). */
static int victim_child(void *arg)
{
    struct victim *v = arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int me = ivshm_self(h);
    REQUIRE(write(v->pipe_w, &me, sizeof me) == sizeof me);
    if (v->send_big) {
        int parent = tu_await_peer(h, job, 0, 10000);
        uint8_t *buf = malloc(BIG);
        fill_pattern(buf, BIG, 9);
        ivshm_send(h, parent, 1, buf, BIG);
    }
    for (;;)
        pause();
}

static int killer_child(void *arg)
{
    tu_sleep_ms(300);
    kill(*(pid_t *)arg, SIGKILL);
    return 0;
}

static pid_t spawn_victim(bool send_big, int *slot)
{
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    struct victim v = {fds[1], send_big};
    pid_t pid = tu_fork(victim_child, &v);
    *slot = -1;
    if (read(fds[0], slot, sizeof *slot) != sizeof *slot)
        *slot = -1;
    close(fds[0]);
    close(fds[1]);
    return pid;
}

static void test_peer_death(void)
{
    fresh_region(NULL);
    ivshm *h = tu_attach(path, job, 0, 0);
    uint8_t *buf = malloc(BIG);
    fill_pattern(buf, BIG, 1);

    /* 1. waiting in recv from a peer that gets SIGKILLed */
    int slot;
    pid_t victim = spawn_victim(false, &slot);
    CHECK(slot >= 0);
    pid_t killer = tu_fork(killer_child, &victim);
    double t0 = now_s();
    CHECK_RC(ivshm_recv(h, slot, NULL, NULL, buf, BIG, 20000), IVSHM_EPEERDEAD);
    double dt = now_s() - t0;
    CHECK(dt < 3.0);
    printf("  recv noticed a killed peer after %.0f ms\n", dt * 1e3);
    CHECK(tu_wait(killer, 5000) == 0);
    CHECK(tu_wait(victim, 5000) == -1);

    /* 2. blocked in send to a full ring whose consumer gets killed */
    victim = spawn_victim(false, &slot);
    killer = tu_fork(killer_child, &victim);
    t0 = now_s();
    CHECK_RC(ivshm_send(h, slot, 0, buf, BIG), IVSHM_EPEERDEAD);
    dt = now_s() - t0;
    CHECK(dt < 3.0);
    CHECK(tu_wait(killer, 5000) == 0);
    CHECK(tu_wait(victim, 5000) == -1);

    /* 3. sender killed in the middle of a large message */
    victim = spawn_victim(true, &slot);
    CHECK(slot >= 0);
    struct ivshm_ring_ctrl *ctrl = NULL;
    for (int i = 0; i < 5000 && !ctrl; i++) {
        ctrl = (void *)ivshm_fast_ring_of(h, slot, ivshm_self(h));
        tu_sleep_ms(1);
    }
    CHECK(ctrl != NULL);
    for (int i = 0; ctrl && i < 5000 && atomic_load(&ctrl->head) < h->ring_slots; i++)
        tu_sleep_ms(1);
    CHECK(ctrl && atomic_load(&ctrl->head) == h->ring_slots); /* full, blocked */
    kill(victim, SIGKILL);
    CHECK(tu_wait(victim, 5000) == -1);
    t0 = now_s();
    CHECK_RC(ivshm_recv(h, slot, NULL, NULL, buf, BIG, 20000), IVSHM_EPEERDEAD);
    CHECK(now_s() - t0 < 3.0);
    CHECK(pattern_ok(buf, (size_t)h->ring_slots * payload_of(h), 9));
    CHECK_RC(ivshm_recv(h, IVSHM_ANY, NULL, NULL, buf, BIG, 0), -EAGAIN);
    free(buf);
    ivshm_detach(h);
}

/* ivshm_recv_idle: 1 only when nothing waits, on a fast ring or in the
   queue, and never 64 times in a row. */
static int idle_run(ivshm *h)
{
    int run = 0;
    while (run < 1000 && ivshm_recv_idle(h))
        run++;
    return run;
}

static void test_recv_idle(void)
{
    struct duo d;
    duo_open(&d, NULL, false);
    char in[16];
    CHECK_RC(ivshm_recv_idle(NULL), 0);
    CHECK(idle_run(d.b) < 64);
    CHECK(idle_run(d.b) == 63); /* then a full peek's turn, every 64th */
    CHECK_RC(ivshm_send(d.a, d.sb, 1, "ring", 4), 0); /* opens the ring */
    for (int i = 0; i < 200; i++)
        CHECK_RC(ivshm_recv_idle(d.b), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, sizeof in, 0), 4);
    CHECK(idle_run(d.b) > 0);
    /* on the fast ring now */
    CHECK_RC(ivshm_send(d.a, d.sb, 1, "ring", 4), 0);
    CHECK_RC(ivshm_recv_idle(d.b), 0);
    const void *data;
    int src;
    CHECK_RC(ivshm_recv_peek(d.b, IVSHM_ANY, &src, NULL, &data), 4);
    CHECK_RC(ivshm_recv_idle(d.b), 0); /* peeked, not yet released */
    CHECK_RC(ivshm_recv_release(d.b, src), 0);
    CHECK(idle_run(d.b) > 0);
    duo_close(&d);

    /* without fast channels: the shared queue */
    ivshm_geometry g = {.max_peers = 4, .fast_channels = IVSHM_FAST_NONE};
    duo_open(&d, &g, false);
    CHECK(idle_run(d.b) > 0);
    CHECK_RC(ivshm_send(d.a, d.sb, 2, "queue", 5), 0);
    for (int i = 0; i < 200; i++)
        CHECK_RC(ivshm_recv_idle(d.b), 0);
    CHECK_RC(ivshm_recv(d.b, IVSHM_ANY, NULL, NULL, in, sizeof in, 0), 5);
    CHECK(idle_run(d.b) > 0);
    duo_close(&d);
}

int main(void)
{
    /* every pair on its fast ring from the first message on */
    setenv("IVSHM_FAST_AFTER", "0", 1);
    test_small_and_sizes();
    test_truncation();
    test_full_ring();
    test_order();
    test_any_vs_specific();
    test_timeouts_and_args();
    test_garbage_slots();
    test_garbage_tail();
    test_zero_copy();
    test_echo_process();
    test_departed_and_rejoined();
    test_peer_death();
    test_recv_idle();
    return tu_summary("test_ring");
}
