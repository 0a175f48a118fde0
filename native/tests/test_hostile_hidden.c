/* One co-tenant write into a pair's ring: a published message made to
   look empty, a forged producer head, a lost OPEN cell, a hidden
   continuation fragment, a tail written forward, a departed sender's
   hidden last message. Each stalled a pair for good before its repair
   (docs/ARCHITECTURE.md, "Where a message goes", step 6). */
#include "hostile.h"

/* ---- a published message made to look empty ---- */

/* A co-tenant rewrites the seq of a slot the producer published back to
   an "empty" value: nothing in the slot tells it from an empty one, so
   the receiver would wait there for good, and the producer, once the
   ring is full, too; the pair never recovered. The producer's published
   head tells (rx_heal_hidden). Processes: the receiver (us), an honest
   sender and a hostile one, driven step by step through pipes. */

struct hide_pipes {
    int cmd[2], ack[2]; /* to the child / back */
};

/* One step of a child, acknowledged within 20 s (a child that died or
   hangs fails the step instead of holding us). */
static void hide_ack(struct hide_pipes *p, char c)
{
    char a = 0;
    struct pollfd pf = {.fd = p->ack[0], .events = POLLIN};
    CHECK(poll(&pf, 1, 20000) == 1 && read(p->ack[0], &a, 1) == 1 && a == c);
}

static void hide_step(struct hide_pipes *p, char c)
{
    CHECK(write(p->cmd[1], &c, 1) == 1);
    hide_ack(p, c);
}

/* A step that needs us to receive meanwhile: acknowledged later. */
static void hide_start(struct hide_pipes *p, char c)
{
    CHECK(write(p->cmd[1], &c, 1) == 1);
}

/* A message of three fragments (slots of 256 bytes): its number, then
   bytes that depend on it. */
#define HIDE_LONG 600
#define HIDE_LONG_TAG 41

static void hide_long_fill(uint8_t *m, uint32_t n)
{
    memcpy(m, &n, sizeof n);
    for (uint32_t i = sizeof n; i < HIDE_LONG; i++)
        m[i] = (uint8_t)(n * 7 + i);
}

/* Sender: 'a' .. 'z' sends that many messages (1 .. 26), numbered on;
   'M' one long message (HIDE_LONG), numbered on; 'R' one message,
   sending it again while the send says IVSHM_ECORRUPT (at most 5 s).
   It leaves (detaches) when the receiver closes the command pipe. */
static int hide_sender(void *arg)
{
    struct hide_pipes *p = arg;
    close(p->cmd[1]); /* our reads end when the receiver closes it */
    ivshm *h = tu_attach(path, job, 1, 0);
    int r = tu_await_peer(h, job, 0, 10000);
    REQUIRE(r >= 0);
    uint32_t next = 0;
    char c;
    while (read(p->cmd[0], &c, 1) == 1) {
        if (c == 'M') {
            uint8_t m[HIDE_LONG];
            hide_long_fill(m, next++);
            REQUIRE(ivshm_send_timeout(h, r, HIDE_LONG_TAG, m, sizeof m,
                                       10000) == 0);
        } else if (c == 'R') {
            uint64_t t0 = tu_now_ms();
            int rc;
            while ((rc = ivshm_send_timeout(h, r, 40, &next, sizeof next,
                                            10000)) == IVSHM_ECORRUPT &&
                   tu_now_ms() - t0 < 5000)
                tu_sleep_ms(10);
            REQUIRE(rc == 0);
            next++;
        }
        for (int k = 0; k <= c - 'a'; k++, next++)
            REQUIRE(ivshm_send_timeout(h, r, 40, &next, sizeof next, 10000) ==
                    0);
        REQUIRE(write(p->ack[1], &c, 1) == 1);
    }
    ivshm_detach(h);
    return 0;
}

/* Hostile: 'h' waits for the message at the receiver's tail and makes it
   look empty; 'C' does so with the slot after the tail (a long message's
   second fragment); 'f' forges the producer's head one past the tail;
   'F' writes the tail forward to the producer's head (what the receiver
   has not read looks consumed); 'L' writes the head back to 0; 'E' forges a message (number
   HIDE_FORGED) at the tail, and 'X' later makes its slot say "empty"
   (the evidence of what the receiver took is gone); 'o' makes the
   sender's OPEN cell vanish from the receiver's queue (cell and
   enqueue_pos say "empty"). */
#define HIDE_FORGED 0xfeedbeefu
static int hide_hostile(void *arg)
{
    struct hide_pipes *p = arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    int r = tu_await_peer(h, job, 0, 10000), s = tu_await_peer(h, job, 1, 10000);
    REQUIRE(r >= 0 && s >= 0);
    char c;
    struct ivshm_slot *forged = NULL;
    while (read(p->cmd[0], &c, 1) == 1) {
        uint8_t *ring = ivshm_fast_ring_of(h, s, r);
        REQUIRE(ring);
        struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
        uint64_t tail = atomic_load(&ctrl->tail);
        uint64_t at = c == 'C' ? tail + 1 : tail;
        struct ivshm_slot *sl =
            (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                  (at & (h->ring_slots - 1)) * h->slot_size);
        if (c == 'C') {
            REQUIRE(TU_EVENTUALLY(atomic_load(&sl->seq) == at + 1, 5000));
            atomic_store(&sl->seq, at);
        } else if (c == 'L') {
            atomic_store(&ctrl->head, 0);
        } else if (c == 'F') {
            atomic_store(&ctrl->tail, atomic_load(&ctrl->head));
        } else if (c == 'E') {
            uint32_t v = HIDE_FORGED;
            sl->len = sizeof v;
            sl->tag = 40;
            sl->gen = atomic_load(&ivshm_entry(h, s)->gen);
            sl->flags = SLOT_FIRST | SLOT_LAST;
            sl->total = sizeof v;
            memcpy((uint8_t *)sl + IVSHM_SLOT_HDR, &v, sizeof v);
            atomic_store(&sl->seq, tail + 1);
            forged = sl;
        } else if (c == 'X') {
            REQUIRE(forged);
            atomic_store(&forged->seq, 0);
        } else if (c == 'o') {
            struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, r);
            uint64_t pos = atomic_load(&qc->head);
            struct ivshm_cell *cell = ivshm_qcell(h, r, pos);
            REQUIRE(TU_EVENTUALLY(atomic_load(&cell->seq) == pos + 1, 5000));
            REQUIRE(cell->flags & CELL_OPEN);
            atomic_store(&cell->seq, pos);
            atomic_store(&qc->enqueue_pos, pos);
        } else if (c == 'h') {
            REQUIRE(TU_EVENTUALLY(atomic_load(&sl->seq) == tail + 1, 5000));
            atomic_store(&sl->seq, tail);
        } else {
            atomic_store(&ctrl->head, tail + 1);
        }
        REQUIRE(write(p->ack[1], &c, 1) == 1);
    }
    for (;;)
        pause(); /* until SIGKILL */
}

/* The receiver (us, rank 0), a hide_sender and a hide_hostile process
   on a fresh region, driven through pipes. */
struct hide_run {
    ivshm *r;
    int s; /* the sender's slot */
    struct hide_pipes sp, hp;
    pid_t sender, hostile;
};

static void hide_begin(struct hide_run *t, int64_t spin_ns)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    t->r = tu_attach(path, job, 0, spin_ns);
    CHECK(pipe(t->sp.cmd) == 0 && pipe(t->sp.ack) == 0 &&
          pipe(t->hp.cmd) == 0 && pipe(t->hp.ack) == 0);
    t->sender = tu_fork(hide_sender, &t->sp);
    t->hostile = tu_fork(hide_hostile, &t->hp);
    t->s = tu_await_peer(t->r, job, 1, 10000);
    CHECK(t->s >= 0 && tu_await_peer(t->r, job, 2, 10000) >= 0);
}

/* Kill the hostile process (it holds the sender's command pipe open
   too), then close that pipe: the sender detaches and exits. */
static void hide_kill_hostile(struct hide_run *t)
{
    CHECK(kill(t->hostile, SIGKILL) == 0);
    CHECK(tu_wait(t->hostile, 5000) == -1);
    t->hostile = -1;
}

static void hide_sender_leaves(struct hide_run *t)
{
    close(t->sp.cmd[1]);
    t->sp.cmd[1] = -1;
    CHECK(tu_wait(t->sender, 10000) == 0);
    t->sender = -1;
}

static void hide_end(struct hide_run *t)
{
    if (t->hostile > 0)
        hide_kill_hostile(t);
    if (t->sender > 0)
        hide_sender_leaves(t);
    int *fds[] = {t->sp.cmd, t->sp.ack, t->hp.cmd, t->hp.ack};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++)
            if (fds[i][j] >= 0)
                close(fds[i][j]);
    CHECK(TU_EVENTUALLY(ivshm_reap(t->r) >= 0 && ivshm_find(t->r, job, 2) < 0,
                        5000));
    ivshm_detach(t->r);
}

/* Poll as the BTL does until a message arrives or `ms` pass: its
   number, or -1. */
static int64_t idle_poll(ivshm *r, int ms, uint64_t *took_ms)
{
    uint64_t t0 = tu_now_ms();
    while (tu_now_ms() - t0 < (uint64_t)ms) {
        if (ivshm_recv_idle(r))
            continue;
        const void *data;
        int src;
        uint32_t tag;
        ssize_t rc = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
        if (rc == -EAGAIN)
            continue;
        uint32_t v = UINT32_MAX;
        if (rc == (ssize_t)sizeof v && tag == 40)
            memcpy(&v, data, sizeof v);
        if (rc >= 0)
            CHECK_RC(ivshm_recv_release(r, src), 0);
        *took_ms = tu_now_ms() - t0;
        return rc >= 0 ? (int64_t)v : rc;
    }
    *took_ms = tu_now_ms() - t0;
    return -1;
}

static void test_hidden_slot(void)
{
    struct hide_run t;
    hide_begin(&t, -1);
    ivshm *r = t.r;
    const int s = t.s;
    uint32_t v = 0;
    uint64_t took = 0;
    /* message 0 opens the fast ring, but its OPEN cell vanishes before
       we look: the sender is on a ring we were never told of, and its
       message arrives all the same (the sweep adopts the channel) */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'o');
    hide_step(&t.hp, 'h'); /* and position 0 of that ring looks empty */
    CHECK(idle_poll(r, 5000, &took) == 0);
    printf("hidden slot: lost OPEN: the ring's message after %llu ms\n",
           (unsigned long long)took);
    CHECK(ivshm_fast_ring_of(r, s, ivshm_self(r)) != NULL);

    /* polling idle-then-peek: message 1, hidden, is shown again */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 0), -EAGAIN);
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    CHECK(idle_poll(r, 5000, &took) == 1);
    printf("hidden slot: shown to the poller after %llu ms\n",
           (unsigned long long)took);
    /* a blocking receive, from anyone and from the sender */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    uint64_t t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(r, IVSHM_ANY, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == 2);
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    /* a progress engine's long wait for "some message" sees it too
       (it waits in slices), then takes it */
    uint64_t t1 = tu_now_ms();
    CHECK_RC(ivshm_wait_message(r, 5000), 0);
    CHECK(tu_now_ms() - t1 < 2000);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, -1), 4);
    CHECK(v == 3);
    printf("hidden slot: shown to blocking receives within %llu ms\n",
           (unsigned long long)(tu_now_ms() - t0));
    /* a full ring's worth and more goes through: the pair is in step */
    hide_start(&t.sp, 'l'); /* 4 .. 15 */
    for (uint32_t i = 4; i < 16; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == i);
    }
    hide_ack(&t.sp, 'l');

    /* A forged head: we take what lies in the slot (a message of the
       ring's last lap, replayed, or a stale one, dropped) and are one
       ahead of the producer, which follows (tail_ahead): at most the
       message it sent into the skipped position is lost. */
    hide_step(&t.hp, 'f');
    int64_t stale = idle_poll(r, 600, &took);
    CHECK(stale == -1 || (stale >= 0 && stale < 16)); /* nothing, or a replay */
    hide_start(&t.sp, 't'); /* 16 .. 35 */
    uint32_t got = 0, last = 15;
    bool in_order = true;
    while (last < 35) {
        ssize_t n = ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000);
        CHECK_RC(n, 4);
        if (n != 4)
            break;
        in_order &= v > last;
        last = v;
        got++;
    }
    CHECK(in_order && last == 35 && got >= 19);
    hide_ack(&t.sp, 't');
    hide_start(&t.sp, 'z'); /* 36 .. 61: nothing lost any more */
    for (uint32_t i = 36; i < 62; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == i);
    }
    hide_ack(&t.sp, 'z');
    printf("hidden slot: forged head: took %lld from the slot, then %u of 20 "
           "arrived, in order\n", (long long)stale, got);

    hide_end(&t);
}

/* ---- what else one co-tenant write leaves in a pair ---- */

struct watchdog {
    pid_t victim;
    atomic_bool done;
};

/* A receive that hangs would hang the test: after 8 s its sender is
   killed (the checks on the elapsed time have failed by then). */
static void *watchdog_run(void *arg)
{
    struct watchdog *w = arg;
    uint64_t t0 = tu_now_ms();
    while (!atomic_load(&w->done) && tu_now_ms() - t0 < 8000)
        tu_sleep_ms(5);
    if (!atomic_load(&w->done))
        kill(w->victim, SIGKILL);
    return NULL;
}

static bool long_ok(const uint8_t *m, ssize_t n, uint32_t want)
{
    uint8_t e[HIDE_LONG];
    hide_long_fill(e, want);
    return n == HIDE_LONG && memcmp(m, e, HIDE_LONG) == 0;
}

/* A receive of `from` that blocks without deadline, bounded by a
   watchdog on the sender; its time in ms. */
static uint64_t guarded_recv(ivshm *r, int from, pid_t sender, uint8_t *m,
                             ssize_t *n)
{
    struct watchdog w = {.victim = sender};
    atomic_init(&w.done, false);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, watchdog_run, &w) == 0);
    uint64_t t0 = tu_now_ms();
    uint32_t tag = 0;
    *n = ivshm_recv(r, from, NULL, &tag, m, HIDE_LONG, -1);
    uint64_t el = tu_now_ms() - t0;
    atomic_store(&w.done, true);
    pthread_join(th, NULL);
    return el;
}

/* Poll as the BTL does (idle, peek, -EMSGSIZE: ivshm_recv(src, 0))
   until a long message arrives or `ms` pass: its length or error. */
static ssize_t idle_poll_long(ivshm *r, int ms, uint8_t *m, uint64_t *took)
{
    uint64_t t0 = tu_now_ms();
    ssize_t rc = -EAGAIN;
    while (tu_now_ms() - t0 < (uint64_t)ms) {
        if (ivshm_recv_idle(r))
            continue;
        const void *data;
        int src;
        rc = ivshm_recv_peek(r, IVSHM_ANY, &src, NULL, &data);
        if (rc == -EMSGSIZE)
            rc = ivshm_recv(r, src, NULL, NULL, m, HIDE_LONG, 0);
        if (rc != -EAGAIN)
            break;
    }
    *took = tu_now_ms() - t0;
    return rc;
}

/* A hidden continuation fragment, a ring tail written forward (within
   the producer's head, and past it), the hidden last message of a
   sender that left: each stalled a pair for good. Processes: the
   receiver (us), an honest sender and a hostile one. */
static void test_hostile_ring(void)
{
    struct hide_run t;
    hide_begin(&t, 0);
    ivshm *r = t.r;
    const int s = t.s;
    uint8_t m[HIDE_LONG];
    uint32_t v = 0, next = 0;
    uint64_t took = 0;
    ssize_t n;
    hide_step(&t.sp, 'a'); /* message 0 opens the fast ring */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);

    /* 1. A long message's second fragment made to look empty: a receive
       without deadline waited at it for good; now it is shown again
       within a 200 ms slice, intact. */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    took = guarded_recv(r, s, t.sender, m, &n);
    CHECK(long_ok(m, n, next++));
    CHECK(took < 3000);
    printf("hostile ring: hidden fragment, blocking receive: %llu ms\n",
           (unsigned long long)took);
    /* from anyone, with a deadline longer than a slice */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    uint64_t t0 = tu_now_ms();
    CHECK(long_ok(m, ivshm_recv(r, IVSHM_ANY, NULL, NULL, m, HIDE_LONG, 3000),
                  next++));
    CHECK(tu_now_ms() - t0 < 2500);
    /* a deadline shorter than a slice is kept, and the next receive
       finds the fragment shown again */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    t0 = tu_now_ms();
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, m, HIDE_LONG, 50), -ETIMEDOUT);
    took = tu_now_ms() - t0;
    CHECK(took >= 45 && took < 2000);
    CHECK(long_ok(m, ivshm_recv(r, s, NULL, NULL, m, HIDE_LONG, 0), next++));
    /* a hidden message under receives with short deadlines, in a loop:
       the sweep comes by time, not only every 4096 empty polls */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    t0 = tu_now_ms();
    while ((n = ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 20)) ==
               -ETIMEDOUT &&
           tu_now_ms() - t0 < 3000)
        ;
    CHECK_RC(n, 4);
    CHECK(v == next++);
    /* polled as the BTL polls */
    hide_step(&t.sp, 'M');
    hide_step(&t.hp, 'C');
    n = idle_poll_long(r, 5000, m, &took);
    CHECK(long_ok(m, n, next++));
    printf("hostile ring: hidden fragment, poller: %llu ms\n",
           (unsigned long long)took);

    /* 2a. The tail written forward over 8 messages we had not read: the
       sender wrote 8 more over them. The 8 are lost (one IVSHM_ECORRUPT
       says so), the next 8 arrive in order, and the pair is in step. */
    hide_step(&t.sp, 'h'); /* 8: the ring is full */
    hide_step(&t.hp, 'F');
    hide_step(&t.sp, 'h'); /* 8 more, over the first 8 */
    next += 8;
    t0 = tu_now_ms();
    int src = -1;
    CHECK_RC(ivshm_recv(r, s, &src, NULL, &v, sizeof v, 5000),
             IVSHM_ECORRUPT);
    CHECK(src == s);
    took = tu_now_ms() - t0;
    for (int i = 0; i < 8; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_step(&t.sp, 'e'); /* 5 */
    for (int i = 0; i < 5; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    printf("hostile ring: tail written forward: reported after %llu ms, "
           "in step again\n", (unsigned long long)took);
    /* the same, and the producer's head written back: the sender's
       refused send shows the receiver its head again */
    hide_step(&t.sp, 'h');
    hide_step(&t.hp, 'F');
    hide_step(&t.sp, 'h');
    hide_step(&t.hp, 'L');
    next += 8;
    /* our ring looks empty: we put our tail back, so the sender's next
       send is refused, before any wait for room could show its head */
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 0), -EAGAIN);
    hide_start(&t.sp, 'R');
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000),
             IVSHM_ECORRUPT);
    for (int i = 0; i < 9; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_ack(&t.sp, 'R');

    /* 2b. We take a message forged at our position, then its slot is
       made to say "empty": the sender finds our tail past its head with
       no forged slot to explain it. It refused every send for good; now
       it follows a tail that stands. */
    hide_step(&t.sp, 'h'); /* 8: the sender's next send reads our tail */
    for (int i = 0; i < 8; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_step(&t.hp, 'E');
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == HIDE_FORGED);
    hide_step(&t.hp, 'X');
    t0 = tu_now_ms();
    hide_step(&t.sp, 'R');
    took = tu_now_ms() - t0;
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);
    hide_start(&t.sp, 'l'); /* 12: more than a ring, in order */
    for (int i = 0; i < 12; i++) {
        CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
        CHECK(v == next++);
    }
    hide_ack(&t.sp, 'l');
    printf("hostile ring: tail past the head: the sender followed after "
           "%llu ms\n", (unsigned long long)took);

    /* 3. The sender's last message made to look empty, then the sender
       leaves: it is still delivered, then IVSHM_EPEERDEAD. */
    hide_step(&t.sp, 'a');
    hide_step(&t.hp, 'h');
    hide_kill_hostile(&t);
    hide_sender_leaves(&t);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 5000), 4);
    CHECK(v == next++);
    CHECK_RC(ivshm_recv(r, s, NULL, NULL, &v, sizeof v, 1000),
             IVSHM_EPEERDEAD);
    hide_end(&t);
}

int main(void)
{
    hostile_setup();
    test_hidden_slot();
    test_hostile_ring();
    return tu_summary("test_hostile_hidden");
}
