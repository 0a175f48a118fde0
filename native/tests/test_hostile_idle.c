/* Garbage in exactly what ivshm_recv_idle and the fast path of
   ivshm_recv_each read (ring head slots: the word the sender stores
   last; the ring's tail, our lazily read position; the queue head cell
   and enqueue_pos) while honest processes send and the receiver polls
   idle-then-peek or each-then-peek (as the progress of the BTL and of
   the libfabric provider). */
#include "hostile.h"

/* ---- garbage in exactly what ivshm_recv_idle reads ---- */

/* ivshm_recv_idle loads the seq of the head slot of each active fast
   ring and our queue head cell's seq and enqueue_pos. Here a hostile
   PROCESS of the same job keeps writing garbage there (and rewinds a
   ring tail) while two honest processes send, one on a fast ring, one
   through the queue, and the receiver polls idle-then-peek as the BTL's
   progress does. */

enum { IS_RING = 0, IS_QUEUE = 1, IS_N = 2 };
#define IS_LEN 48u
#define IS_TAG 0x1d1e0000u
/* hostile modes, counted in the board */
enum {
    HM_RING_EMPTY, /* garbage "empty" seq at the ring head (CAS on free) */
    HM_RING_FULL,  /* a forged slot published at the ring head           */
    HM_RING_HIDE,  /* the message at the ring head made to look empty    */
    HM_TAIL,       /* ring tail rewound                                   */
    HM_Q_GARBAGE,  /* garbage seq in a free queue head cell               */
    HM_Q_FULL,     /* a forged cell at the queue head                     */
    HM_Q_EMPTY,    /* a full queue head cell made free, enqueue_pos too   */
    HM_ENQ,        /* garbage enqueue_pos                                 */
    HM_N
};

struct idle_board {
    _Atomic int phase;         /* 0: hostile at work; 1: it is dead     */
    _Atomic uint32_t sent[IS_N];       /* messages sent (send returned 0) */
    _Atomic uint32_t phase2_first[IS_N]; /* first index sent in phase 1: set
                                            before it is sent, else MAX */
    _Atomic uint32_t done[IS_N];
    _Atomic uint32_t refused[IS_N];    /* -ETIMEDOUT / ECORRUPT: sent again */
    _Atomic uint32_t refused_dead[IS_N]; /* ECORRUPT after the death: a tail
                                            it left behind, sent again   */
    _Atomic uint32_t bad_rc[IS_N];     /* any other result                */
    _Atomic uint32_t late[IS_N];       /* a call outlived its deadline    */
    _Atomic uint64_t max_call_ms[IS_N];
    _Atomic uint64_t max_dead_ms[IS_N]; /* after the death: a message's
                                           first try to its send       */
    _Atomic uint64_t hits[HM_N];       /* hostile writes that landed      */
};

static struct idle_board *board;

static void is_fill(uint8_t *m, int who, uint32_t i)
{
    memset(m, 0, IS_LEN);
    uint32_t w = (uint32_t)who, chk = i * 2654435761u ^ (w + 1) * 40503u;
    memcpy(m, &w, 4);
    memcpy(m + 4, &i, 4);
    memcpy(m + 8, &chk, 4);
    for (uint32_t k = 12; k < IS_LEN; k++)
        m[k] = (uint8_t)(chk + k);
}

/* Is `m` (a private copy) honest message i of `who`? */
static bool is_honest(const uint8_t *m, uint32_t len, uint32_t tag, int who,
                      uint32_t *index)
{
    if (len != IS_LEN || tag != IS_TAG + (uint32_t)who)
        return false;
    uint32_t i;
    memcpy(&i, m + 4, 4);
    uint8_t want[IS_LEN];
    is_fill(want, who, i);
    if (memcmp(m, want, IS_LEN) != 0)
        return false;
    *index = i;
    return true;
}

static void note_max(_Atomic uint64_t *m, uint64_t v)
{
    uint64_t old = atomic_load(m);
    while (v > old && !atomic_compare_exchange_weak(m, &old, v))
        ;
}

/* An honest sender: while the hostile one works, each send has a 100 ms
   deadline and is sent again when refused (a message that fits the ring
   is all or nothing); once it is dead, 100 more with 5 s each, which
   must all go through. A send that loads a tail the hostile process wrote
   just before its death is refused at once (IVSHM_ECORRUPT, nothing sent,
   as ivshm.h documents) until the receiver puts the tail back or, if it
   is ahead of our head, it has stood 200 ms: sent again within the same
   5 s, as tail_sender does. */
static int idle_sender(void *arg)
{
    int who = (int)(intptr_t)arg;
    if (who == IS_QUEUE) /* stays on the receiver's queue */
        setenv("IVSHM_FAST_AFTER", "1000000000", 1);
    ivshm *h = tu_attach(path, job, 1 + (uint32_t)who, 0);
    int to = tu_await_peer(h, job, 0, 10000);
    REQUIRE(to >= 0);
    uint8_t m[IS_LEN];
    uint32_t i = 0, end = UINT32_MAX;
    uint64_t msg_t0 = tu_now_ms(); /* when message i was first tried */
    while (i < end) {
        int phase = atomic_load(&board->phase);
        if (phase >= 1 && end == UINT32_MAX) {
            atomic_store(&board->phase2_first[who], i);
            end = i + 100;
        }
        const int timeout = phase ? 5000 : 100;
        is_fill(m, who, i);
        uint64_t t0 = tu_now_ms();
        int rc = ivshm_send_timeout(h, to, IS_TAG + (uint32_t)who, m, IS_LEN,
                                    timeout);
        uint64_t el = tu_now_ms() - t0;
        note_max(&board->max_call_ms[who], el);
        if (el > (uint64_t)timeout + 2000)
            atomic_fetch_add(&board->late[who], 1);
        if (rc == 0) {
            if (phase)
                note_max(&board->max_dead_ms[who], tu_now_ms() - msg_t0);
            atomic_store(&board->sent[who], ++i);
            msg_t0 = tu_now_ms();
        } else if (phase == 0 && (rc == -ETIMEDOUT || rc == IVSHM_ECORRUPT)) {
            atomic_fetch_add(&board->refused[who], 1);
        } else if (phase && rc == IVSHM_ECORRUPT &&
                   tu_now_ms() - msg_t0 < (uint64_t)timeout) {
            atomic_fetch_add(&board->refused_dead[who], 1);
            sched_yield(); /* returned at once: no busy loop */
        } else {
            fprintf(stderr, "idle sender %d: message %u: %s (phase %d)\n",
                    who, i, ivshm_strerror(rc), phase);
            atomic_fetch_add(&board->bad_rc[who], 1);
            if (phase)
                break;
        }
    }
    atomic_store(&board->done[who], 1);
    /* stay attached until the receiver has looked at everything: a
       departed sender's ring is drained, but its slot could be reused */
    while (atomic_load(&board->phase) != 2)
        tu_sleep_ms(5);
    ivshm_detach(h);
    return 0;
}

struct idle_targets {
    int r, s_ring, s_queue;
    uint32_t gen_ring, gen_queue;
};

/* The hostile co-tenant: a peer of the job (rank 3) writing, in turns,
   garbage into the head slot of the ring from s_ring, the receiver's
   queue head cell and enqueue_pos, and the ring's tail. It runs until
   SIGKILL. */
static int idle_hostile(void *arg)
{
    const struct idle_targets *t = arg;
    ivshm *h = tu_attach(path, job, 3, 0);
    const int r = t->r, me = ivshm_self(h);
    uint8_t *ring = NULL;
    while (!(ring = ivshm_fast_ring_of(h, t->s_ring, r)))
        tu_sleep_ms(1);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    struct ivshm_queue_ctrl *qc = ivshm_qctrl(h, r);
    const uint64_t S = h->ring_slots, Q = h->queue_slots;
    const uint32_t pl = h->slot_size - IVSHM_SLOT_HDR;
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    for (unsigned n = 0;; n++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (n % 64 == 0)
            tu_sleep_ms(1); /* leave the honest ones a CPU, too */
        int mode = (int)(x % HM_N);
        /* the receiver's published positions: where it looks next */
        uint64_t tail = atomic_load(&ctrl->tail);
        struct ivshm_slot *s =
            (struct ivshm_slot *)(ring + IVSHM_RING_CTRL +
                                  (tail & (S - 1)) * h->slot_size);
        uint64_t v = atomic_load(&s->seq);
        uint64_t qpos = atomic_load(&qc->head);
        struct ivshm_cell *c = ivshm_qcell(h, r, qpos);
        uint64_t cv = atomic_load(&c->seq);
        bool landed = false;
        switch (mode) {
        case HM_RING_EMPTY: {
            /* only a slot no position >= tail is published in (v <= tail):
               one the producer writes later, with one store */
            const uint64_t junk[] = {tail, tail + 2, ~0ull, tail - S + 1,
                                     0x5a5a5a5a5a5a5a5aull};
            if (v <= tail)
                landed = atomic_compare_exchange_strong(&s->seq, &v,
                                                        junk[(x >> 8) % 5]);
            break;
        }
        case HM_RING_FULL: {
            /* a slot that says "full" at the receiver's position, at most
               one ahead of what the producer published, so the pair can
               catch up; its header is garbage the receiver must report
               (bad flags, a multi-slot FIRST, an oversized length) or a
               plausible header over garbage bytes */
            uint64_t head = atomic_load(&ctrl->head);
            if (v > tail || tail > head)
                break;
            unsigned kind = (unsigned)(x >> 8) % 4;
            s->gen = t->gen_ring;
            s->tag = kind == 3 ? IS_TAG + IS_RING : 0xbad;
            s->flags = kind == 0 ? 0x40 | SLOT_FIRST | SLOT_LAST
                       : kind == 1 ? SLOT_FIRST
                                   : SLOT_FIRST | SLOT_LAST;
            s->len = kind == 2 ? 0xffffff00u : kind == 1 ? pl : IS_LEN;
            s->total = kind == 1 ? 1ull << 40 : kind == 2 ? 0xffffff00u : IS_LEN;
            memset((uint8_t *)s + IVSHM_SLOT_HDR, 0xee, IS_LEN);
            landed = atomic_compare_exchange_strong(&s->seq, &v, tail + 1);
            break;
        }
        case HM_RING_HIDE:
            /* the receiver finds it again (rx_heal_hidden): not lost */
            if (v == tail + 1)
                landed = atomic_compare_exchange_strong(&s->seq, &v, tail);
            break;
        case HM_TAIL: {
            /* backwards only: the ring looks fuller than it is */
            uint64_t k = 1 + (x >> 8) % S;
            if (tail >= k)
                landed = atomic_compare_exchange_strong(&ctrl->tail, &tail,
                                                        tail - k);
            break;
        }
        case HM_Q_GARBAGE: {
            /* values no producer writes, a claim naming no slot, a claim
               in another generation of the queue sender */
            const uint64_t junk[] = {qpos + 12345, ~0ull,
                                     ivshm_claim_word(qpos, 1000, 1),
                                     ivshm_claim_word(qpos, t->s_queue,
                                                      t->gen_queue + 5)};
            if (cv == qpos)
                landed = atomic_compare_exchange_strong(&c->seq, &cv,
                                                        junk[(x >> 8) % 4]);
            break;
        }
        case HM_Q_FULL: {
            /* claimed as a producer would, so no honest cell is touched;
               then published naming the queue sender (plausible or bad
               flags) or a slot that does not exist */
            if (cv != qpos ||
                !atomic_compare_exchange_strong(
                    &c->seq, &cv, ivshm_claim_word(qpos, me, h->self_gen)))
                break;
            unsigned kind = (unsigned)(x >> 8) % 3;
            c->src = kind == 2 ? 1000 : (uint16_t)t->s_queue;
            c->gen = t->gen_queue;
            c->tag = IS_TAG + IS_QUEUE;
            c->flags = kind == 1 ? 0x40 | SLOT_FIRST | SLOT_LAST
                                 : SLOT_FIRST | SLOT_LAST;
            c->len = IS_LEN;
            c->total = IS_LEN;
            memset((uint8_t *)c + IVSHM_SLOT_HDR, 0xdd, IS_LEN);
            atomic_store(&c->seq, qpos + 1);
            landed = true;
            break;
        }
        case HM_Q_EMPTY:
            /* a message at the head vanishes: cell and enqueue_pos say
               "empty" (counted: that message is lost) */
            if (cv == qpos + 1) {
                landed = atomic_compare_exchange_strong(&c->seq, &cv, qpos);
                atomic_store(&qc->enqueue_pos, qpos);
            }
            break;
        case HM_ENQ: {
            const uint64_t junk[] = {qpos + Q + 7, ~0ull >> 1, qpos - 3,
                                     qpos + 1 + (x >> 20) % Q};
            atomic_store(&qc->enqueue_pos, junk[(x >> 8) % 4]);
            landed = true;
            break;
        }
        }
        if (landed)
            atomic_fetch_add(&board->hits[mode], 1);
    }
    return 0; /* not reached: SIGKILL ends it */
}

/* Every message the receiver meets: honest (in order, intact), forged
   (delivered, but not the sender's next message), or reported. */
struct idle_tally {
    uint32_t next[IS_N];      /* next index expected (last honest + 1) */
    uint32_t honest[IS_N];
    uint32_t phase2_honest[IS_N]; /* of those sent after the hostile died */
    uint32_t forged[IS_N], corrupt[IS_N];
    uint32_t other_src, bad_rc, release_bad, unheard;
};

static void idle_take(struct idle_tally *t, const struct idle_targets *tg,
                      int src, uint32_t tag, const uint8_t *m, ssize_t len)
{
    int who = src == tg->s_ring ? IS_RING : src == tg->s_queue ? IS_QUEUE : -1;
    if (who < 0) {
        t->unheard++; /* listen_only: nobody else is ever delivered */
        return;
    }
    uint32_t i;
    if (len >= 0 && is_honest(m, (uint32_t)len, tag, who, &i) &&
        i >= t->next[who]) {
        t->honest[who]++;
        /* the sender stored this before it sent message i, so a message
           of phase 2 finds it stored */
        t->phase2_honest[who] += i >= atomic_load(&board->phase2_first[who]);
        t->next[who] = i + 1;
    } else {
        t->forged[who]++;
    }
}

/* The fast path's upcall: a private copy of the shared bytes, then the
   same tally as a peeked message. */
struct each_ctx {
    struct idle_tally *t;
    const struct idle_targets *tg;
    uint32_t bad_len;
};

static void each_take_cb(void *arg, int src, uint32_t gen, uint32_t tag,
                         const void *data, size_t len)
{
    struct each_ctx *c = arg;
    (void)gen;
    uint8_t m[IS_LEN];
    memset(m, 0, sizeof m);
    memcpy(m, data, len < sizeof m ? len : sizeof m);
    if (len > 256 - IVSHM_SLOT_HDR) /* never beyond the slot's payload */
        c->bad_len++;
    idle_take(c->t, c->tg, src, tag, m, (ssize_t)len);
}

/* `each`: the receiver polls with ivshm_recv_each first (the BTL's
   progress), the general path (peek) only when it says "look
   elsewhere"; else ivshm_recv_idle first, then peek. */
static void test_idle_scribble(bool each)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 8, .slot_size = 256,
                        .queue_slots = 8};
    job++;
    path = tu_region(ivshm_min_region_size(&g), &g);
    board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(board != MAP_FAILED);
    memset(board, 0, sizeof *board);
    for (int w = 0; w < IS_N; w++)
        atomic_store(&board->phase2_first[w], UINT32_MAX);
    ivshm *r = tu_attach(path, job, 0, -1); /* spins, as the BTL's rank */
    pid_t senders[IS_N];
    for (int w = 0; w < IS_N; w++)
        senders[w] = tu_fork(idle_sender, (void *)(intptr_t)w);
    struct idle_targets tg = {.r = ivshm_self(r)};
    tg.s_ring = tu_await_peer(r, job, 1, 10000);
    tg.s_queue = tu_await_peer(r, job, 2, 10000);
    CHECK(tg.s_ring >= 0 && tg.s_queue >= 0);
    ivshm_peer_info pi;
    CHECK_RC(ivshm_peer(r, tg.s_ring, &pi), 0);
    tg.gen_ring = pi.generation;
    CHECK_RC(ivshm_peer(r, tg.s_queue, &pi), 0);
    tg.gen_queue = pi.generation;
    /* the BTL hears only the ranks it verified */
    CHECK_RC(ivshm_listen_only(r, 1), 0);
    CHECK_RC(ivshm_listen(r, tg.s_ring, tg.gen_ring), 0);
    CHECK_RC(ivshm_listen(r, tg.s_queue, tg.gen_queue), 0);
    pid_t hostile = tu_fork(idle_hostile, &tg);

    struct idle_tally t = {0};
    struct each_ctx ectx = {.t = &t, .tg = &tg};
    uint64_t each_taken = 0;
    unsigned run = 0, max_run = 0, run_there = 0, max_run_there = 0;
    uint64_t polls = 0, peeks = 0, max_call_ns = 0;
    const uint64_t start = tu_now_ms();
    uint64_t phase1_end = start + 3000, end = start + 60000;
    bool killed = false, finished = false;
    uint8_t m[IS_LEN];
    while (tu_now_ms() < end) {
        if ((++polls & 255) == 0) {
            sched_yield();
            if (!killed && tu_now_ms() >= phase1_end) {
                /* the hostile process dies, in the middle of whatever it
                   was writing */
                CHECK(kill(hostile, SIGKILL) == 0);
                CHECK(tu_wait(hostile, 5000) == -1);
                CHECK(kill(hostile, 0) == -1 && errno == ESRCH);
                killed = true;
                atomic_store(&board->phase, 1);
            }
            if (killed && atomic_load(&board->done[0]) &&
                atomic_load(&board->done[1]) &&
                t.next[0] >= atomic_load(&board->sent[0]) &&
                t.next[1] >= atomic_load(&board->sent[1])) {
                finished = true;
                break;
            }
        }
        bool quiet;
        if (each) {
            uint64_t t0 = tu_now_ns();
            int got = ivshm_recv_each(r, each_take_cb, &ectx,
                                      1 + (int)(polls % 16));
            uint64_t el = tu_now_ns() - t0;
            if (el > max_call_ns)
                max_call_ns = el;
            if (got > 0) {
                each_taken += (uint64_t)got;
                run = run_there = 0;
                continue;
            }
            if (got != 0 && got != -EAGAIN) {
                t.bad_rc++;
                continue;
            }
            quiet = got == -EAGAIN;
        } else {
            quiet = ivshm_recv_idle(r);
        }
        if (quiet) {
            run++;
            if (run > max_run)
                max_run = run;
            /* is there something at a head all the same? (our own look,
               after the call's: a message that arrived in between is
               counted once) */
            bool there = false;
            for (int x = 0; x < r->n_act; x++) {
                struct ivshm_peer_local *p = &r->peers[r->act[x]];
                struct ivshm_slot *s =
                    (struct ivshm_slot *)(p->rx_ring + IVSHM_RING_CTRL +
                                          (p->rx_tail & (r->ring_slots - 1)) *
                                              r->slot_size);
                there |= atomic_load(&s->seq) == p->rx_tail + 1;
            }
            there |= atomic_load(&ivshm_my_qcell(r, r->q_head)->seq) ==
                     r->q_head + 1;
            run_there = there ? run_there + 1 : 0;
            if (run_there > max_run_there)
                max_run_there = run_there;
            continue;
        }
        run = run_there = 0;
        peeks++;
        const void *data = NULL;
        int src = -1;
        uint32_t tag = 0;
        uint64_t t0 = tu_now_ns();
        ssize_t rc = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
        if (rc >= 0) {
            /* shared bytes: copy, then check the copy */
            memset(m, 0, sizeof m);
            memcpy(m, data, (size_t)rc < sizeof m ? (size_t)rc : sizeof m);
            if (ivshm_recv_release(r, src) != 0)
                t.release_bad++;
            idle_take(&t, &tg, src, tag, m, rc);
        } else if (rc == -EMSGSIZE) {
            /* the BTL's way with a multi-slot message: a polling recv */
            ssize_t n = ivshm_recv(r, src, NULL, &tag, m, sizeof m, 0);
            if (n >= 0)
                idle_take(&t, &tg, src, tag, m, n);
            else if (n == IVSHM_ECORRUPT && ivshm_slot_ok(r, src))
                t.corrupt[src == tg.s_ring ? IS_RING : IS_QUEUE]++;
            else if (n != -EAGAIN)
                t.bad_rc++;
        } else if (rc == IVSHM_ECORRUPT) {
            if (src == tg.s_ring)
                t.corrupt[IS_RING]++;
            else if (src == tg.s_queue)
                t.corrupt[IS_QUEUE]++;
            else
                t.other_src++;
        } else if (rc != -EAGAIN) {
            fprintf(stderr, "idle scribble: peek: %s\n", ivshm_strerror((int)rc));
            t.bad_rc++;
        }
        uint64_t el = tu_now_ns() - t0;
        if (el > max_call_ns)
            max_call_ns = el;
    }
    if (!killed) {
        kill(hostile, SIGKILL);
        tu_wait(hostile, 5000);
    }
    atomic_store(&board->phase, 2);
    for (int w = 0; w < IS_N; w++)
        CHECK(tu_wait(senders[w], 10000) == 0);

    ivshm_stats st;
    ivshm_get_stats(r, &st);
    printf("idle scribble (%s): %llu polls, %llu peeks, %llu taken by the "
           "fast path, longest idle run %u (%u with a message there), "
           "longest call %.1f ms, %llu dropped\n",
           each ? "each-then-peek" : "idle-then-peek",
           (unsigned long long)polls, (unsigned long long)peeks,
           (unsigned long long)each_taken, max_run, max_run_there,
           max_call_ns / 1e6, (unsigned long long)st.dropped);
    static const char *const hm_name[HM_N] = {
        "ring-empty", "ring-full", "ring-hide", "tail", "q-garbage", "q-full",
        "q-empty",
        "enqueue_pos"};
    printf("idle scribble: hostile writes:");
    for (int k = 0; k < HM_N; k++)
        printf(" %s %llu", hm_name[k],
               (unsigned long long)atomic_load(&board->hits[k]));
    printf("\n");
    for (int w = 0; w < IS_N; w++) {
        uint32_t sent = atomic_load(&board->sent[w]);
        uint32_t p2 = atomic_load(&board->phase2_first[w]);
        uint32_t lost = sent - t.honest[w];
        printf("idle scribble: %s sender: %u sent (%u in phase 2), %u refused "
               "and sent again (%u after the death, the longest for %llu ms), "
               "longest send %llu ms; %u honest, %u lost, %u forged, "
               "%u corrupt\n",
               w == IS_RING ? "ring" : "queue", sent, sent - p2,
               atomic_load(&board->refused[w]),
               atomic_load(&board->refused_dead[w]),
               (unsigned long long)atomic_load(&board->max_dead_ms[w]),
               (unsigned long long)atomic_load(&board->max_call_ms[w]),
               t.honest[w], lost, t.forged[w], t.corrupt[w]);
        CHECK(atomic_load(&board->bad_rc[w]) == 0);
        CHECK(atomic_load(&board->late[w]) == 0);
        CHECK(sent > p2 && sent - p2 == 100); /* phase 2: all went through */
        /* every message lost was reported in its place: a forged one
           delivered, IVSHM_ECORRUPT, or (queue) one the hostile process
           made vanish */
        uint64_t gone = w == IS_QUEUE ? atomic_load(&board->hits[HM_Q_EMPTY])
                                      : 0;
        CHECK(lost <= t.forged[w] + t.corrupt[w] + gone);
        /* once the hostile process is dead, at most what it left at the
           head costs a message */
        CHECK(t.phase2_honest[w] + 1 >= sent - p2);
        CHECK(t.next[w] == sent); /* the last one arrived */
    }
    CHECK(finished);
    CHECK(max_run <= 63);       /* every 64th poll peeks */
    CHECK(max_run_there <= 64); /* never blind to a message at a head */
    CHECK(max_call_ns < 1000000000ull);
    CHECK(t.bad_rc == 0 && t.release_bad == 0 && t.other_src == 0);
    CHECK(t.unheard == 0);
    CHECK(ectx.bad_len == 0);
    CHECK(!each || each_taken > 0);
    /* the dead hostile peer is found dead and its slot reclaimed */
    CHECK(TU_EVENTUALLY(ivshm_reap(r) >= 0 && ivshm_find(r, job, 3) < 0, 5000));
    ivshm_detach(r);
    munmap(board, sizeof *board);
    board = NULL;
}

int main(void)
{
    hostile_setup();
    test_idle_scribble(false);
    test_idle_scribble(true);
    return tu_summary("test_hostile_idle");
}
