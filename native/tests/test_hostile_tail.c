/* A co-tenant rewriting a fast ring's consumer tail: rewound behind the
   producer's back, and scribbled for a while by a process that then
   dies. Sends return by their deadlines, refusals are repaired, the
   pair gets back in step. */
#include "hostile.h"

/* ---- the ring's tail rewound ---- */

struct rewinder {
    _Atomic uint64_t *tail;
    uint64_t value;
    atomic_bool stop;
};

static void *rewind_tail(void *arg)
{
    struct rewinder *r = arg;
    while (!atomic_load(&r->stop)) {
        atomic_store(r->tail, r->value);
        sched_yield();
    }
    return NULL;
}

struct blocked_send {
    ivshm *h;
    int to;
    int rc;
    atomic_bool done;
};

static void *do_send(void *arg)
{
    struct blocked_send *s = arg;
    s->rc = ivshm_send(s->h, s->to, 3, "late", 4);
    atomic_store(&s->done, true);
    return NULL;
}

static void test_tail_rewind(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    ivshm *a = tu_attach(path, job, 0, 0), *b = tu_attach(path, job, 1, 0);
    int sa = ivshm_self(a), sb = ivshm_self(b);
    CHECK_RC(ivshm_fast_open(a, sb), 0);
    struct ivshm_ring_ctrl *ctrl = ring_ctrl(a, sa, sb);
    char in[8];
    /* fill the ring, the receiver drains it all */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "x", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);

    /* one write rewinds the tail to "full"; a hostile thread keeps it so */
    struct rewinder r = {.tail = &ctrl->tail, .value = 0};
    atomic_init(&r.stop, false);
    /* rewound before the thread runs: on a loaded host it may not get a
       CPU before our send looks at the tail */
    atomic_store(&ctrl->tail, r.value);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, rewind_tail, &r) == 0);
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_send_timeout(a, sb, 0, "x", 1, 100), -ETIMEDOUT);
    uint64_t el = tu_now_ms() - t0;
    CHECK(el >= 95 && el < 3000);
    /* a message longer than the ring streams: the deadline still holds */
    static uint8_t big[8 * 256];
    t0 = tu_now_ms();
    CHECK_RC(ivshm_send_timeout(a, sb, 0, big, sizeof big, 100), -ETIMEDOUT);
    el = tu_now_ms() - t0;
    CHECK(el >= 95 && el < 3000);
    CHECK_RC(ivshm_send_timeout(a, sb, 0, "x", 1, 0), -EAGAIN);
    atomic_store(&r.stop, true);
    pthread_join(th, NULL);

    /* Without a deadline: the consumer's next receive finds its ring
       empty, puts its tail back and wakes the sender. */
    struct blocked_send bs = {.h = a, .to = sb, .rc = 1};
    atomic_init(&bs.done, false);
    atomic_store(&ctrl->tail, 0);
    pthread_t st;
    CHECK(pthread_create(&st, NULL, do_send, &bs) == 0);
    tu_sleep_ms(30);
    CHECK(!atomic_load(&bs.done)); /* blocked on the rewound tail */
    uint32_t tag = 0;
    CHECK_RC(ivshm_recv(b, sa, NULL, &tag, in, sizeof in, 5000), 4);
    CHECK(tag == 3 && memcmp(in, "late", 4) == 0);
    pthread_join(st, NULL);
    CHECK_RC(bs.rc, 0);

    /* A receiver that polls with ivshm_recv_idle first (the BTL's
       progress) peeks fully at least every 64th poll, and that peek
       heals the tail too. */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "w", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);
    atomic_store(&ctrl->tail, atomic_load(&ctrl->tail) - 8);
    atomic_init(&bs.done, false);
    bs.rc = 1;
    CHECK(pthread_create(&st, NULL, do_send, &bs) == 0);
    tu_sleep_ms(30);
    CHECK(!atomic_load(&bs.done)); /* blocked on the rewound tail */
    t0 = tu_now_ms();
    int got = 0;
    while (!got && tu_now_ms() - t0 < 5000) {
        const void *data;
        int from;
        if (ivshm_recv_idle(b))
            continue;
        if (ivshm_recv_peek(b, IVSHM_ANY, &from, NULL, &data) == 4) {
            got = memcmp(data, "late", 4) == 0;
            CHECK_RC(ivshm_recv_release(b, from), 0);
        }
    }
    CHECK(got);
    pthread_join(st, NULL);
    CHECK_RC(bs.rc, 0);

    /* A tail below one the sender saw before is proof of tampering. */
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_send(a, sb, 0, "y", 1), 0);
    for (int i = 0; i < 8; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, in, sizeof in, 0), 1);
    CHECK_RC(ivshm_send(a, sb, 0, "y", 1), 0); /* reads tail 17 */
    atomic_store(&ctrl->tail, 12);             /* plausible, but rewound */
    for (int i = 0; i < 7; i++)
        CHECK_RC(ivshm_try_send(a, sb, 0, "z", 1), 0);
    t0 = tu_now_ms();
    CHECK_RC(ivshm_send(a, sb, 0, "z", 1), IVSHM_ECORRUPT);
    CHECK(tu_now_ms() - t0 < 1000);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- tails scribbled for a while, then the writer dies ---- */

struct tail_board {
    _Atomic int phase;         /* 0: hostile at work; 1: it is dead      */
    _Atomic uint32_t sent;     /* messages whose send returned 0         */
    _Atomic uint32_t p2_first; /* first number sent in phase 1           */
    _Atomic uint32_t refused;  /* sends refused (ECORRUPT, deadline)     */
    _Atomic uint32_t p2_bad;   /* phase 1 sends that did not go through  */
    _Atomic uint64_t hits;
};
static struct tail_board *tboard;

/* Sends numbered messages with 50 ms deadlines, again when refused; once
   the hostile is dead, 100 more, each of which must go through within
   5 s (a refusal may repeat for the 200 ms a tail past our head needs). */
static int tail_sender(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    int r = tu_await_peer(h, job, 0, 10000);
    REQUIRE(r >= 0);
    uint32_t i = 0, end = UINT32_MAX;
    while (i != end) {
        if (end == UINT32_MAX && atomic_load(&tboard->phase) == 1) {
            atomic_store(&tboard->p2_first, i);
            end = i + 100;
        }
        uint64_t t0 = tu_now_ms();
        int rc;
        while ((rc = ivshm_send_timeout(h, r, 40, &i, sizeof i, 50)) != 0) {
            atomic_fetch_add(&tboard->refused, 1);
            if (rc == IVSHM_ECORRUPT) /* returned at once: no busy loop */
                sched_yield();
            if (end != UINT32_MAX && tu_now_ms() - t0 > 5000) {
                atomic_fetch_add(&tboard->p2_bad, 1);
                break;
            }
        }
        atomic_store(&tboard->sent, ++i);
    }
    ivshm_detach(h);
    return 0;
}

/* Writes the receiver's tail of the sender's ring: forward within the
   sender's head (it writes over what the receiver has not read), past
   the head, and back. */
static int tail_hostile(void *arg)
{
    const int *ids = arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    uint8_t *ring;
    while (!(ring = ivshm_fast_ring_of(h, ids[1], ids[0])))
        tu_sleep_ms(1);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint64_t S = h->ring_slots;
    uint64_t x = 0x2545f4914f6cdd1dull ^ (uint64_t)getpid();
    for (unsigned n = 0;; n++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (n % 16 == 0)
            tu_sleep_ms(1);
        uint64_t tail = atomic_load(&ctrl->tail), head = atomic_load(&ctrl->head);
        uint64_t k = 1 + (x >> 8) % S, to;
        switch (x % 3) {
        case 0: to = head > tail ? tail + 1 + (x >> 16) % (head - tail) : tail;
                break;
        case 1: to = head + k; break;
        default: to = tail >= k ? tail - k : tail; break;
        }
        if (atomic_compare_exchange_strong(&ctrl->tail, &tail, to))
            atomic_fetch_add(&tboard->hits, 1);
    }
    return 0; /* not reached: SIGKILL ends it */
}

static void test_tail_scribble(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    tboard = mmap(NULL, sizeof *tboard, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(tboard != MAP_FAILED);
    memset(tboard, 0, sizeof *tboard);
    ivshm *r = tu_attach(path, job, 0, 0);
    pid_t sender = tu_fork(tail_sender, NULL);
    int ids[2] = {ivshm_self(r), tu_await_peer(r, job, 1, 10000)};
    CHECK(ids[1] >= 0);
    pid_t hostile = tu_fork(tail_hostile, ids);
    uint32_t last = 0, got = 0, corrupt = 0, p2_got = 0, longest = 0;
    bool any = false;
    uint64_t t0 = tu_now_ms(), killed_at = 0;
    for (;;) {
        uint64_t now = tu_now_ms();
        if (!killed_at && now - t0 >= 2000) {
            CHECK(kill(hostile, SIGKILL) == 0);
            CHECK(tu_wait(hostile, 5000) == -1);
            atomic_store(&tboard->phase, 1);
            killed_at = tu_now_ms();
        }
        uint32_t v;
        uint64_t c0 = tu_now_ms();
        ssize_t rc = ivshm_recv(r, ids[1], NULL, NULL, &v, sizeof v, 20);
        uint64_t el = tu_now_ms() - c0;
        if (el > longest)
            longest = (uint32_t)el;
        if (rc == IVSHM_ECORRUPT)
            corrupt++;
        if (rc == 4) {
            got++;
            if (!any || v > last) /* else a replay of an earlier lap */
                last = v;
            any = true;
            uint32_t p2 = atomic_load(&tboard->p2_first);
            if (killed_at && p2 && v >= p2)
                p2_got++;
        }
        CHECK(rc == 4 || rc == -ETIMEDOUT || rc == IVSHM_ECORRUPT);
        if (killed_at && atomic_load(&tboard->p2_first) &&
            any && last + 1 == atomic_load(&tboard->p2_first) + 100)
            break; /* the last one arrived */
        if (killed_at && tu_now_ms() - killed_at > 20000)
            break; /* stalled: the checks below fail */
    }
    CHECK(tu_wait(sender, 10000) == 0);
    uint32_t p2 = atomic_load(&tboard->p2_first);
    CHECK(p2 > 0 && last + 1 == p2 + 100);
    CHECK(atomic_load(&tboard->p2_bad) == 0);
    /* after the death at most a ring's worth of the sender's messages
       (overwritten just before it, or their replays) is missing */
    CHECK(p2_got + g.ring_slots >= 100);
    CHECK(longest < 1000);
    printf("tail scribble: %llu hostile writes; %u received (%u after its "
           "death), %u IVSHM_ECORRUPT, %u sends refused; after the death the "
           "last of 100 arrived %llu ms later\n",
           (unsigned long long)atomic_load(&tboard->hits), got, p2_got,
           corrupt, atomic_load(&tboard->refused),
           (unsigned long long)(tu_now_ms() - killed_at));
    CHECK(TU_EVENTUALLY(ivshm_reap(r) >= 0 && ivshm_find(r, job, 2) < 0, 5000));
    ivshm_detach(r);
    munmap(tboard, sizeof *tboard);
    tboard = NULL;
}

int main(void)
{
    hostile_setup();
    test_tail_rewind();
    test_tail_scribble();
    return tu_summary("test_hostile_tail");
}
