/* ivshm_recv_each, the fast path of a progress loop (docs/fast-path.md):
   order and contents across the queue -> fast channel switch and many
   ring wraps, with multi-slot messages it must leave to the general
   path and a sender kept on the queue that it must not starve; an
   upcall that receives or releases on the handle itself; and a receiver that never
   gives its slots back (it never moves its read position, then writes
   garbage there), against which our sends fail by their deadlines while
   our own fast path keeps working. Real processes. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static const char *path;
static uint64_t job = 0xeac0;

#define E_TAG 0xeac00000u
#define E_BIG 700u /* a multi-slot message: slots of 256 bytes */

/* Message i of sender `who`: its length and bytes. */
static uint32_t e_len(int who, uint32_t i)
{
    if (who == 1 && i % 50 == 49)
        return E_BIG;
    return 8 + (i * 7u + (uint32_t)who) % 150;
}

static void e_fill(uint8_t *m, int who, uint32_t i, uint32_t len)
{
    uint32_t x = i * 2654435761u ^ (uint32_t)who * 40503u;
    memcpy(m, &i, 4);
    for (uint32_t k = 4; k < len; k++)
        m[k] = (uint8_t)(x + k * 13u);
}

struct e_sender {
    int rank;
    uint32_t count;
};

/* Shared by the senders of test_each_order: e_go[1], rank 2 is
   attached and waiting; e_go[0], rank 1 has its fast channel (it waits
   there for rank 2). Then both stream at once however late the
   scheduler starts either (rank 2 first would hold the queue that rank
   1's first messages need). */
static _Atomic int *e_go;

static int e_send(void *arg)
{
    const struct e_sender *s = arg;
    if (s->rank == 2) /* kept on the queue: never asks for a channel */
        setenv("IVSHM_FAST_AFTER", "1000000", 1);
    ivshm *h = tu_attach(path, job, (uint32_t)s->rank, 0);
    int r = tu_await_peer(h, job, 0, 10000);
    if (r < 0)
        return 1;
    uint8_t m[E_BIG];
    if (s->rank == 2) {
        atomic_store(&e_go[1], 1);
        for (uint64_t until = tu_now_ms() + 20000;
             !atomic_load(&e_go[0]) && tu_now_ms() < until;)
            sched_yield();
    }
    for (uint32_t i = 0; i < s->count; i++) {
        if (s->rank == 1 && i == 32) { /* past IVSHM_FAST_AFTER: on the ring */
            atomic_store(&e_go[0], 1);
            for (uint64_t until = tu_now_ms() + 20000;
                 !atomic_load(&e_go[1]) && tu_now_ms() < until;)
                sched_yield();
        }
        uint32_t len = e_len(s->rank, i);
        e_fill(m, s->rank, i, len);
        int rc;
        if (len > 200) {
            rc = ivshm_send_timeout(h, r, E_TAG + (uint32_t)s->rank, m, len,
                                    20000);
        } else {
            /* the BTL's way: a header and its payload in one call */
            uint64_t until = tu_now_ms() + 20000;
            while ((rc = ivshm_send_small(h, r, E_TAG + (uint32_t)s->rank, m,
                                          4, m + 4, len - 4)) == -EAGAIN &&
                   tu_now_ms() < until)
                sched_yield();
        }
        if (rc != 0) {
            fprintf(stderr, "e_send %d: message %u: %s\n", s->rank, i,
                    ivshm_strerror(rc));
            return 1;
        }
    }
    /* stay until the receiver has it all (a departed sender's channel
       is drained too, but this test is about live ones) */
    tu_sleep_ms(3000);
    ivshm_detach(h);
    return 0;
}

struct e_tally {
    int slot[3];           /* registry slot of rank 1, 2 */
    uint32_t next[3];      /* next index expected per rank */
    uint32_t bad, fast, general;
    uint32_t a_at_b_done;  /* rank 1's messages taken when rank 2 was done */
    uint32_t b_during_a;   /* rank 2's taken while rank 1's were under way */
    uint32_t counts[3];
};

static void e_take(struct e_tally *t, int src, uint32_t tag, const uint8_t *m,
                   ssize_t len)
{
    int who = src == t->slot[1] ? 1 : src == t->slot[2] ? 2 : 0;
    uint32_t i = 0;
    uint8_t want[E_BIG];
    if (who && len >= 4)
        memcpy(&i, m, 4);
    if (!who || tag != E_TAG + (uint32_t)who || i != t->next[who] ||
        len != (ssize_t)e_len(who, i)) {
        fprintf(stderr, "each: from slot %d tag %#x index %u (want %u) "
                "len %zd\n", src, tag, i, who ? t->next[who] : 0, len);
        t->bad++;
        return;
    }
    e_fill(want, who, i, (uint32_t)len);
    if (memcmp(m, want, (size_t)len) != 0) {
        t->bad++;
        return;
    }
    t->next[who]++;
    if (who == 2 && t->next[1] > 0 && t->next[1] < t->counts[1])
        t->b_during_a++;
    if (who == 2 && t->next[2] == t->counts[2])
        t->a_at_b_done = t->next[1];
}

static void e_cb(void *arg, int src, uint32_t gen, uint32_t tag,
                 const void *data, size_t len)
{
    struct e_tally *t = arg;
    (void)gen;
    uint8_t m[E_BIG];
    if (len > sizeof m) {
        t->bad++;
        return;
    }
    memcpy(m, data, len);
    t->fast++;
    e_take(t, src, tag, m, (ssize_t)len);
}

static void test_each_order(void)
{
    /* a short ring (many wraps), one fast channel per receiver: rank 1
       takes it, rank 2 stays on the queue */
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256,
                        .queue_slots = 16, .fast_channels = 1};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *r = tu_attach(path, job, 0, -1);
    e_go = mmap(NULL, 2 * sizeof *e_go, PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(e_go != MAP_FAILED);
    atomic_store(&e_go[0], 0);
    atomic_store(&e_go[1], 0);
    struct e_sender sa = {1, 4000}, sb = {2, 600};
    pid_t pa = tu_fork(e_send, &sa), pb = tu_fork(e_send, &sb);
    struct e_tally t = {.counts = {0, sa.count, sb.count}};
    t.slot[1] = tu_await_peer(r, job, 1, 10000);
    t.slot[2] = tu_await_peer(r, job, 2, 10000);
    CHECK(t.slot[1] >= 0 && t.slot[2] >= 0);
    unsigned idle_run = 0, max_idle_run = 0;
    uint64_t end = tu_now_ms() + 60000;
    uint8_t m[E_BIG];
    for (unsigned n = 0; tu_now_ms() < end; n++) {
        if (t.next[1] == sa.count && t.next[2] == sb.count)
            break;
        int got = ivshm_recv_each(r, e_cb, &t, 1 + (int)(n % 16));
        if (got > 0) {
            idle_run = 0;
            continue;
        }
        if (got == -EAGAIN) {
            if (++idle_run > max_idle_run)
                max_idle_run = idle_run;
            if (n % 64 == 0)
                sched_yield();
            continue;
        }
        CHECK_RC(got, 0);
        idle_run = 0;
        /* "look elsewhere": the general path, as the BTL's poll_region */
        const void *data;
        int src = -1;
        uint32_t tag = 0;
        ssize_t rc = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
        if (rc >= 0) {
            memcpy(m, data, (size_t)rc < sizeof m ? (size_t)rc : sizeof m);
            CHECK_RC(ivshm_recv_release(r, src), 0);
            t.general++;
            e_take(&t, src, tag, m, rc);
        } else if (rc == -EMSGSIZE) {
            rc = ivshm_recv(r, src, NULL, &tag, m, sizeof m, 1000);
            if (rc >= 0) {
                t.general++;
                e_take(&t, src, tag, m, rc);
            }
        } else if (rc != -EAGAIN) {
            CHECK_RC((int)rc, 0);
        }
    }
    CHECK(tu_wait(pa, 20000) == 0);
    CHECK(tu_wait(pb, 20000) == 0);
    printf("each: %u + %u messages, %u by the fast path, %u by the general "
           "path, rank 1 had %u through when rank 2 was done, %u of rank "
           "2's while rank 1's were under way, longest idle run %u\n",
           t.next[1], t.next[2], t.fast, t.general, t.a_at_b_done,
           t.b_during_a, max_idle_run);
    CHECK(t.bad == 0);
    CHECK(t.next[1] == sa.count && t.next[2] == sb.count);
    CHECK(t.fast > sa.count / 2);  /* the ring's messages went fast */
    CHECK(t.general >= sb.count);  /* the queue's, and the big ones, not */
    CHECK(max_idle_run <= 63);
    /* the queued sender was not starved by the busy channel: some of its
       messages came through between the channel's. (Not "it finished
       first": after HOT_RUN_MAX messages of the channels the fast path
       lets one general-path call run, and the general path itself goes
       round robin, so a channel kept full gets the larger share.) */
    CHECK(t.b_during_a > 0);
    munmap((void *)e_go, 2 * sizeof *e_go);
    ivshm_detach(r);
}

/* ---- an upcall that receives on the handle ---- */

struct rx_ctx {
    ivshm *r;
    int from;
    uint32_t seen[24];
    uint32_t n;
};

static void recv_in_cb(void *arg, int src, uint32_t gen, uint32_t tag,
                       const void *data, size_t len)
{
    struct rx_ctx *c = arg;
    (void)gen;
    (void)tag;
    (void)src;
    uint32_t i;
    memcpy(&i, data, 4);
    (void)len;
    c->seen[c->n++] = i;
    if (i == 5) /* releases it itself, as after a peek: consumed once */
        c->seen[c->n++] = ivshm_recv_release(c->r, c->from) == 0 ? 200 : 201;
    if (i == 3) {
        /* takes message 3 itself (it is still at the head) */
        uint8_t m[64];
        ssize_t k = ivshm_recv(c->r, c->from, NULL, NULL, m, sizeof m, 0);
        uint32_t j = ~0u;
        if (k >= 4)
            memcpy(&j, m, 4);
        c->seen[c->n++] = 100 + j;
    }
}

static void test_each_upcall_receives(void)
{
    ivshm_geometry g = {.max_peers = 2, .ring_slots = 8, .slot_size = 128};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *s = tu_attach(path, job, 0, -1), *r = tu_attach(path, job, 1, -1);
    int sr = ivshm_self(r), ss = ivshm_self(s);
    CHECK_RC(ivshm_fast_open(s, sr), 0);
    /* the OPEN cell is the general path's: then the ring is ours */
    const void *d;
    int from;
    uint32_t tg;
    CHECK_RC((int)ivshm_recv_peek(r, IVSHM_ANY, &from, &tg, &d), -EAGAIN);
    CHECK(r->n_act == 1);
    for (uint32_t i = 0; i < 8; i++)
        CHECK_RC(ivshm_send_small(s, sr, 1, &i, 4, NULL, 0), 0);
    struct rx_ctx c = {.r = r, .from = ss};
    CHECK_RC(ivshm_recv_each(r, recv_in_cb, &c, 16), 4); /* 0..3, then stops */
    CHECK_RC(ivshm_recv_each(r, recv_in_cb, &c, 16), 2); /* 4, 5 */
    CHECK_RC(ivshm_recv_each(r, recv_in_cb, &c, 16), 2); /* 6, 7 */
    const uint32_t want[] = {0, 1, 2, 3, 103, 4, 5, 200, 6, 7};
    CHECK(c.n == 10);
    for (uint32_t k = 0; k < 10 && k < c.n; k++)
        CHECK(c.seen[k] == want[k]);
    /* nothing is left, and the ring goes on */
    int got;
    while ((got = ivshm_recv_each(r, recv_in_cb, &c, 16)) == 0)
        ;
    CHECK_RC(got, -EAGAIN);
    uint32_t nine = 9;
    CHECK_RC(ivshm_send_small(s, sr, 1, &nine, 4, NULL, 0), 0);
    CHECK_RC(ivshm_recv_each(r, recv_in_cb, &c, 16), 1);
    CHECK(c.n == 11 && c.seen[10] == 9);
    ivshm_detach(r);
    ivshm_detach(s);
}

/* ---- a receiver that never gives its slots back ---- */

struct stuck_board {
    _Atomic int step;       /* the test's: 1 our channel is open, 2 write
                               garbage into its position, 3 stop       */
    _Atomic int ready;      /* the hostile's: 1 attached, 2 garbage on   */
};
static struct stuck_board *sb_board;

/* The hostile receiver: attached as rank 1, it lets us take one of its
   fast channels and never receives (its read position never moves);
   then it writes garbage into that position. */
static int stuck_receiver(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, -1);
    int us = tu_await_peer(h, job, 0, 10000);
    atomic_store(&sb_board->ready, 1);
    while (atomic_load(&sb_board->step) < 1)
        tu_sleep_ms(1);
    uint8_t *ring = NULL;
    while (!(ring = ivshm_fast_ring_of(h, us, ivshm_self(h))))
        tu_sleep_ms(1);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    atomic_store(&sb_board->ready, 2);
    while (atomic_load(&sb_board->step) < 2)
        tu_sleep_ms(1);
    const uint64_t junk[] = {~0ull, 1ull << 50, 12345, 0};
    for (unsigned n = 0; atomic_load(&sb_board->step) < 3; n++) {
        atomic_store(&ctrl->tail, junk[n % 4]);
        if (n % 64 == 0)
            tu_sleep_ms(1);
    }
    ivshm_detach(h);
    return 0;
}

/* rank 2: sends us messages all along, for our own fast path */
static int stuck_bystander(void *arg)
{
    uint32_t count = (uint32_t)(intptr_t)arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    int us = tu_await_peer(h, job, 0, 10000);
    if (us < 0 || ivshm_fast_open(h, us) != 0)
        return 1;
    for (uint32_t i = 0; i < count; i++)
        if (ivshm_send_timeout(h, us, 7, &i, 4, 20000) != 0)
            return 1;
    tu_sleep_ms(2000);
    ivshm_detach(h);
    return 0;
}

struct stuck_rx {
    uint32_t next, bad;
};

static void stuck_cb(void *arg, int src, uint32_t gen, uint32_t tag,
                     const void *data, size_t len)
{
    struct stuck_rx *x = arg;
    (void)src;
    (void)gen;
    uint32_t i = ~0u;
    if (len == 4)
        memcpy(&i, data, 4);
    if (tag != 7 || i != x->next)
        x->bad++;
    else
        x->next++;
}

/* Take what the bystander sent so far with the fast path (and the
   general path when told to look elsewhere). */
static void stuck_drain(ivshm *h, struct stuck_rx *x)
{
    for (int k = 0; k < 64; k++) {
        int got = ivshm_recv_each(h, stuck_cb, x, 16);
        if (got == -EAGAIN)
            return;
        if (got == 0) {
            uint32_t i, tag;
            int src;
            ssize_t n = ivshm_recv(h, IVSHM_ANY, &src, &tag, &i, 4, 0);
            if (n == 4)
                stuck_cb(x, src, 0, tag, &i, 4);
        }
    }
}

static void test_stuck_receiver(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 128};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    sb_board = mmap(NULL, sizeof *sb_board, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(sb_board != MAP_FAILED);
    memset(sb_board, 0, sizeof *sb_board);
    ivshm *h = tu_attach(path, job, 0, 0);
    const uint32_t nby = 20000;
    pid_t hostile = tu_fork(stuck_receiver, NULL);
    pid_t by = tu_fork(stuck_bystander, (void *)(intptr_t)nby);
    int victim = tu_await_peer(h, job, 1, 10000);
    CHECK(victim >= 0);
    CHECK(TU_EVENTUALLY(atomic_load(&sb_board->ready) >= 1, 10000));
    CHECK_RC(ivshm_fast_open(h, victim), 0);
    atomic_store(&sb_board->step, 1);
    struct stuck_rx x = {0};

    /* it never receives: after a ring's worth, sends fail without
       waiting, or by their deadline */
    uint32_t sent = 0, i = 0;
    int rc;
    while ((rc = ivshm_send_small(h, victim, 1, &i, 4, NULL, 0)) == 0)
        sent++;
    CHECK_RC(rc, -EAGAIN);
    CHECK(sent == g.ring_slots);
    for (int k = 0; k < 3; k++) {
        uint64_t t0 = tu_now_ms();
        CHECK_RC(ivshm_send_small(h, victim, 1, &i, 4, NULL, 0), -EAGAIN);
        CHECK_RC(ivshm_try_send(h, victim, 1, &i, 4), -EAGAIN);
        rc = ivshm_send_timeout(h, victim, 1, &i, 4, 50);
        uint64_t el = tu_now_ms() - t0;
        CHECK(rc == -ETIMEDOUT || rc == -EAGAIN);
        CHECK(el < 2000);
        stuck_drain(h, &x); /* our own receiving is not held up */
    }
    uint32_t before = x.next;

    /* garbage where we read its position: refused or "no room", never a
       hang, never a crash; our fast path keeps going */
    CHECK(TU_EVENTUALLY(atomic_load(&sb_board->ready) >= 2, 10000));
    atomic_store(&sb_board->step, 2);
    uint32_t refused = 0, none = 0, other = 0;
    uint64_t t_end = tu_now_ms() + 1000, max_ms = 0;
    while (tu_now_ms() < t_end) {
        uint64_t t0 = tu_now_ms();
        rc = ivshm_send_timeout(h, victim, 1, &i, 4, 20);
        uint64_t el = tu_now_ms() - t0;
        if (el > max_ms)
            max_ms = el;
        if (rc == IVSHM_ECORRUPT)
            refused++;
        else if (rc == -ETIMEDOUT || rc == -EAGAIN)
            none++;
        else if (rc != 0)
            other++;
        stuck_drain(h, &x);
    }
    atomic_store(&sb_board->step, 3);
    CHECK(tu_wait(hostile, 10000) == 0);
    uint64_t by_end = tu_now_ms() + 30000;
    while (x.next < nby && tu_now_ms() < by_end)
        stuck_drain(h, &x);
    CHECK(tu_wait(by, 20000) == 0);
    printf("stuck receiver: %u sent before the ring was full; with garbage "
           "in its position %u refused, %u no room, longest send %llu ms; "
           "the bystander's %u messages arrived (%u while it was stuck)\n",
           sent, refused, none, (unsigned long long)max_ms, x.next, before);
    CHECK(other == 0);
    CHECK(refused + none > 0);
    CHECK(max_ms < 2000);
    CHECK(x.bad == 0 && x.next == nby);
    ivshm_detach(h);
    munmap(sb_board, sizeof *sb_board);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    test_each_upcall_receives();
    test_each_order();
    test_stuck_receiver();
    return tu_summary("test_recv_each");
}
