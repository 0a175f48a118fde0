/* Waking sleepers when peers announce whether they may block at all
   (doorbell.c, "blocking announced"): a peer that only spins publishes
   may_sleep = 0 and its senders skip the fence and the doorbell; one
   that turns blocking back on must still be woken by every message,
   also by one sent while it was announcing; and a co-tenant clearing the
   flag of a sleeping victim delays it by at most a slice, never loses a
   message or hangs it. Real processes throughout. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ROUNDS 300
#define TAG_READY 1u
#define TAG_STAMP 2u
#define TAG_STOP 3u

static const char *path;
static uint64_t job = 0x3a6e;

static uint32_t entry_may_sleep(const ivshm *h, int slot)
{
    return atomic_load(&ivshm_entry(h, slot)->may_sleep);
}

/* What the flag says follows the spin budget; a fresh attachment with a
   finite budget says 1, so nothing changes for plain libivshm users. */
static void test_flag_follows_spin(void)
{
    path = tu_region(ivshm_min_region_size(NULL), NULL);
    ivshm *a = tu_attach(path, ++job, 0, 0);
    ivshm *b = tu_attach(path, job, 1, -1);
    int sa = ivshm_self(a), sb = ivshm_self(b);
    CHECK(entry_may_sleep(a, sa) == 1);
    CHECK(entry_may_sleep(a, sb) == 0);
    ivshm_set_spin(a, -1);
    CHECK(entry_may_sleep(b, sa) == 0);
    ivshm_set_spin(a, 5000);
    CHECK(entry_may_sleep(b, sa) == 1);
    /* a spinner is never rung: its senders do not even look */
    for (int i = 0; i < 10; i++)
        CHECK_RC(ivshm_try_send(a, sb, 7, &i, sizeof i), 0);
    for (int i = 0; i < 10; i++)
        CHECK_RC(ivshm_recv(b, sa, NULL, NULL, NULL, 0, 1000), sizeof i);
    ivshm_stats st;
    ivshm_get_stats(a, &st);
    CHECK(st.rings == 0);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* The receiver spins, asks for a message, turns blocking on and waits;
   the sender sends a time stamp after a varying delay, so some messages
   land while the receiver announces, some while it spins its grace and
   most while it sleeps. A lost wake would cost a 20 ms liveness slice. */
static int announcer_child(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, -1);
    int parent = tu_await_peer(h, job, 0, 10000);
    REQUIRE(parent >= 0);
    uint64_t late = 0, worst = 0;
    for (int r = 0; r < ROUNDS; r++) {
        ivshm_set_spin(h, -1);
        REQUIRE(ivshm_send(h, parent, TAG_READY, &r, sizeof r) == 0);
        ivshm_set_spin(h, 1000);
        uint64_t stamp = 0;
        uint32_t tag = 0;
        ssize_t n = ivshm_recv(h, parent, NULL, &tag, &stamp, sizeof stamp,
                               10000);
        uint64_t delay = ivshm_now_ns() - stamp;
        REQUIRE(n == sizeof stamp && tag == TAG_STAMP);
        late += delay > 15000000ull;
        worst = delay > worst ? delay : worst;
    }
    printf("  %d announce-then-block rounds: worst wake %.2f ms, %llu over 15 ms\n",
           ROUNDS, (double)worst / 1e6, (unsigned long long)late);
    fflush(stdout);
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    REQUIRE(st.sleeps > 0);
    /* scheduling on a loaded host may delay a few; a lost wake delays
       every message that meets the race */
    REQUIRE(late <= ROUNDS / 20);
    ivshm_detach(h);
    return 0;
}

static void test_announce_then_block(void)
{
    path = tu_region(ivshm_min_region_size(NULL), NULL);
    job++;
    ivshm *h = tu_attach(path, job, 0, 0);
    pid_t pid = tu_fork(announcer_child, NULL);
    int child = tu_await_peer(h, job, 1, 10000);
    CHECK(child >= 0);
    for (int r = 0; r < ROUNDS && child >= 0; r++) {
        int got = -1;
        CHECK_RC(ivshm_recv(h, child, NULL, NULL, &got, sizeof got, 10000),
                 sizeof got);
        /* 0..~400 us: across the announcement, the grace and the sleep */
        uint64_t until = ivshm_now_ns() + (uint64_t)(r % 8) * 50000ull;
        while (ivshm_now_ns() < until)
            ivshm_cpu_relax();
        uint64_t stamp = ivshm_now_ns();
        CHECK_RC(ivshm_send(h, child, TAG_STAMP, &stamp, sizeof stamp), 0);
    }
    CHECK(tu_wait(pid, 60000) == 0);
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    CHECK(st.rings > 0); /* it slept, and we rang */
    ivshm_detach(h);
}

/* A co-tenant that keeps writing 0 over a sleeping victim's flags. */
static int scribbler_child(void *arg)
{
    int victim_rank = *(int *)arg;
    ivshm *h = tu_attach(path, job, 2, -1);
    int victim = tu_await_peer(h, job, (uint32_t)victim_rank, 10000);
    REQUIRE(victim >= 0);
    struct ivshm_peer_entry *e = ivshm_entry(h, victim);
    for (;;) {
        atomic_store(&e->may_sleep, 0);
        atomic_store(&e->sleeping, 0);
        ivshm_cpu_relax();
    }
    return 0;
}

static void test_hostile_clears_flag(void)
{
    path = tu_region(ivshm_min_region_size(NULL), NULL);
    job++;
    ivshm *victim = tu_attach(path, job, 0, 1000);
    ivshm *sender = tu_attach(path, job, 1, 0);
    int rank = 0;
    pid_t pid = tu_fork(scribbler_child, &rank);
    CHECK(tu_await_peer(victim, job, 2, 10000) >= 0);
    int sv = ivshm_self(victim), ss = ivshm_self(sender);
    /* the victim receives in a child of its own so that this process
       can send while it sleeps */
    pid_t rx = tu_fork_child();
    if (rx == 0) {
        uint64_t worst = 0;
        for (int i = 0; i < 20; i++) {
            uint64_t stamp = 0;
            ssize_t n = ivshm_recv(victim, ss, NULL, NULL, &stamp,
                                   sizeof stamp, 5000);
            REQUIRE(n == sizeof stamp);
            uint64_t d = ivshm_now_ns() - stamp;
            worst = d > worst ? d : worst;
        }
        printf("  victim of a flag scribbler: worst delay %.1f ms\n",
               (double)worst / 1e6);
        fflush(stdout);
        /* bounded by the liveness slice (20 ms), with room for a loaded
           host */
        REQUIRE(worst < 500000000ull);
        _exit(0);
    }
    for (int i = 0; i < 20; i++) {
        tu_sleep_ms(5);
        uint64_t stamp = ivshm_now_ns();
        CHECK_RC(ivshm_send(sender, sv, TAG_STAMP, &stamp, sizeof stamp), 0);
    }
    CHECK(tu_wait(rx, 30000) == 0);
    kill(pid, SIGKILL);
    tu_wait(pid, 5000);
    ivshm_detach(sender);
    ivshm_detach(victim);
}

int main(void)
{
    test_flag_follows_spin();
    test_announce_then_block();
    test_hostile_clears_flag();
    return tu_summary("test_wake");
}
