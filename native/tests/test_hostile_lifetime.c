/* Lifetimes against a co-tenant (docs/security.md, "libivshm"; ivshm.h):
   a pointer the API hands out -- a peeked message, a send reservation --
   stays valid until its release, whatever peers or the registry do
   meanwhile. Each case is replayed with real processes; a co-tenant
   (a process mapping the region) bumps a sender's registry generation,
   one store, as an honest new incarnation of the slot would. Run under
   ASan: a use after free is its report. */
#define _GNU_SOURCE
#include "cotenant.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const uint64_t job = 0x11fe;
static const char *path;
static int r_slot;

/* One sending process: a queued message of 64 bytes of its rank to the
   receiver at every byte on its `go` gate, then `sent`. */
struct sender {
    uint32_t rank;
    pid_t pid;
    int slot;
    struct ct_gate go, sent;
};

static int sender_main(void *arg)
{
    struct sender *me = arg;
    ivshm *s = tu_attach(path, job, me->rank, 0);
    uint8_t m[64];
    memset(m, (int)me->rank, sizeof m);
    while (ct_await(&me->go, 10000)) {
        REQUIRE(ivshm_send(s, r_slot, me->rank, m, sizeof m) == 0);
        ct_signal(&me->sent);
    }
    return 0;
}

static bool send_one(struct sender *s)
{
    ct_signal(&s->go);
    return ct_await(&s->sent, 5000);
}

/* The co-tenant: one store into `slot`'s registry entry. */
static int bump_gen(void *arg)
{
    int slot = (int)(intptr_t)arg;
    ivshm *raw = ct_map(path);
    atomic_fetch_add(&ivshm_entry(raw, slot)->gen, 1);
    return 0;
}

static void bump(int slot)
{
    CHECK_RC(tu_wait(tu_fork(bump_gen, (void *)(intptr_t)slot), 5000), 0);
}

struct two {
    ivshm *r;
    struct sender a, b;
};

/* A receiver and two sending processes (queue only: fast channels off,
   so every message lies in the receiver's queue or its backlogs). */
static void setup(struct two *t)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 16, .slot_size = 256,
                        .queue_slots = 16, .fast_channels = IVSHM_FAST_NONE};
    path = tu_region(ivshm_min_region_size(&g) + (1 << 20), &g);
    t->r = tu_attach(path, job, 0, 0);
    r_slot = ivshm_self(t->r);
    struct sender *ss[2] = {&t->a, &t->b};
    for (int i = 0; i < 2; i++) {
        ss[i]->rank = (uint32_t)i + 1;
        ct_gate_init(&ss[i]->go);
        ct_gate_init(&ss[i]->sent);
        ss[i]->pid = tu_fork(sender_main, ss[i]);
        ss[i]->slot = tu_await_peer(t->r, job, ss[i]->rank, 5000);
        CHECK(ss[i]->slot >= 0);
    }
}

static void teardown(struct two *t)
{
    struct sender *ss[2] = {&t->a, &t->b};
    for (int i = 0; i < 2; i++) {
        /* (the other sender holds this gate open too: no EOF to wait for) */
        kill(ss[i]->pid, SIGKILL);
        tu_wait(ss[i]->pid, 15000);
        close(ss[i]->go.fd[1]);
        close(ss[i]->go.fd[0]);
        close(ss[i]->sent.fd[0]);
        close(ss[i]->sent.fd[1]);
    }
    ivshm_detach(t->r);
}

/* b's message, then a's, in the queue; a receive from a moves b's to
   b's backlog (local memory), and the peek of b's message hands out
   that record. */
static const void *peek_backlogged(struct two *t)
{
    CHECK(send_one(&t->b));
    CHECK(send_one(&t->a));
    uint8_t buf[64];
    CHECK_RC(ivshm_recv(t->r, t->a.slot, NULL, NULL, buf, sizeof buf, 1000),
             64);
    const void *data = NULL;
    int src = -1;
    uint32_t tag;
    CHECK_RC(ivshm_recv_peek(t->r, t->b.slot, &src, &tag, &data), 64);
    CHECK(t->r->peers[t->b.slot].peek_kind == SRC_BACKLOG);
    return data;
}

static void read_all(const void *data, size_t n, uint8_t want)
{
    const volatile uint8_t *p = data;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += p[i] != want;
    CHECK(bad == 0);
}

/* The peek's holder replies to the peer (ob1's callback does) after the
   peer's slot got a new generation: our view of it is reset. */
static void test_peek_then_new_incarnation(void)
{
    struct two t;
    setup(&t);
    const void *data = peek_backlogged(&t);
    bump(t.b.slot);
    uint8_t reply = 0;
    /* the send sees the new generation: it fails or goes out, either way
       the peeked bytes must still be there */
    (void)ivshm_try_send(t.r, t.b.slot, 9, &reply, 1);
    if (data)
        read_all(data, 64, 2);
    (void)ivshm_recv_release(t.r, t.b.slot);
    teardown(&t);
}

/* A copying receive from the same sender consumes the peeked message
   (the API allows it); the pointer must survive until the release. */
static void test_peek_then_copying_recv(void)
{
    struct two t;
    setup(&t);
    const void *data = peek_backlogged(&t);
    uint8_t buf[64];
    CHECK_RC(ivshm_recv(t.r, t.b.slot, NULL, NULL, buf, sizeof buf, 0), 64);
    if (data)
        read_all(data, 64, 2);
    (void)ivshm_recv_release(t.r, t.b.slot);
    teardown(&t);
}

/* A reservation towards a peer reached through its queue is a buffer of
   ours; a receive meanwhile meets a cell of that peer after its slot got
   a new generation, which resets our view of the peer. */
static void test_reserve_then_new_incarnation(void)
{
    struct two t;
    setup(&t);
    int err = 0;
    uint8_t *res = ivshm_send_reserve(t.r, t.a.slot, 64, &err);
    CHECK_RC(err, 0);
    CHECK(send_one(&t.a));
    bump(t.a.slot);
    /* the cell is stale now (its generation is not the slot's): the
       receive drops it, after refreshing its view of the sender */
    uint8_t buf[64];
    int src;
    (void)ivshm_recv(t.r, IVSHM_ANY, &src, NULL, buf, sizeof buf, 0);
    if (res)
        memset(res, 0x5a, 64); /* the caller fills its reservation */
    (void)ivshm_send_commit(t.r, t.a.slot, 3, 64);
    teardown(&t);
}

int main(int argc, char **argv)
{
    /* one case by its number (1..3), or all */
    int only = argc > 1 ? atoi(argv[1]) : 0;
    if (!only || only == 1)
        test_peek_then_new_incarnation();
    if (!only || only == 2)
        test_peek_then_copying_recv();
    if (!only || only == 3)
        test_reserve_then_new_incarnation();
    return tu_summary("test_hostile_lifetime");
}
