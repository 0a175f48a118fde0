/* Deadlines against a co-tenant (docs/security.md, "libivshm"; the bounds
   in ivshm.h), each attack replayed by real hostile processes:
   - a departed sender's fast ring kept "advancing" by a co-tenant that
     moves its head just ahead of the receiver: ivshm_recv(from, 0), and
     the BTL's peek -> -EMSGSIZE -> ivshm_recv(src, 0), must not block;
   - a window lock whose two phases (the writer word, then the readers'
     drain) are each held by a live co-tenant almost to the bound: the
     lock must give up by IVSHM_LOCK_TIMEOUT_MS, not by twice that.
   Time bounds leave room for a shared machine: they tell "returned by
   its deadline" from "held for the co-tenant's pleasure". */
#define _GNU_SOURCE
#include "cotenant.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const uint64_t job = 0xdead11;
static const char *path;

/* Slack for a loaded machine on top of a stated bound. */
#define SLACK_MS 300

/* ---- a departed sender whose ring a co-tenant keeps "publishing" ---- */

static struct ct_gate opened, leave, ready;
static int r_slot;

/* The sender: takes a fast channel of the receiver's area, waits until
   the receiver adopted it, leaves (its entry FREE, its generation kept:
   what it published is still delivered, read-only). */
static int gone_sender(void *arg)
{
    (void)arg;
    ivshm *s = tu_attach(path, job, 1, 0);
    REQUIRE(ivshm_fast_open(s, r_slot) == 0);
    ct_signal(&opened);
    REQUIRE(ct_await(&leave, 10000));
    ivshm_detach(s);
    return 0;
}

/* The co-tenant: makes the departed sender's ring describe one endless
   message (a FIRST with a huge total, then fragments of it) and keeps
   the producer head just ahead of the receiver. It sees where the
   receiver is by the slots the receiver showed again (their seq set to
   position + 1 by rx_unhide_gone). Runs `ms` milliseconds. */
static int gone_streamer(void *arg)
{
    int s_slot = *(int *)arg;
    ct_pin(1);
    ivshm *raw = ct_map(path);
    uint8_t *ring = ct_ring(raw, s_slot, r_slot);
    REQUIRE(ring);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    const uint32_t S = raw->ring_slots;
    const uint32_t gen = atomic_load(&ivshm_entry(raw, s_slot)->gen);
    const uint32_t payload = raw->slot_size - IVSHM_SLOT_HDR;
    for (uint32_t i = 0; i < S; i++) {
        struct ivshm_slot *sl = ct_slot(raw, ring, i);
        sl->len = payload;
        sl->tag = 7;
        sl->gen = gen;
        sl->flags = i == 0 ? SLOT_FIRST : 0;
        sl->total = 1ull << 40;
        atomic_store(&sl->seq, 0);
    }
    atomic_store(&ctrl->head, S);
    ct_signal(&ready);
    uint64_t end = tu_now_ms() + 3000, seen = UINT64_MAX;
    while (tu_now_ms() < end) {
        /* the receiver's position, by the slots it showed again: long
           strides first (it takes thousands of fragments a millisecond) */
        for (uint64_t stride = S / 2; stride; stride /= 2) {
            uint64_t at = seen + stride;
            while (atomic_load(&ct_slot(raw, ring, at)->seq) == at + 1) {
                seen = at;
                at += stride;
            }
        }
        if (seen != UINT64_MAX) {
            /* one FIRST is enough: once the receiver showed position 1,
               it has read position 0 */
            if (seen >= 1)
                ct_slot(raw, ring, 0)->flags = 0;
            atomic_store(&ctrl->head, seen + 1 + S - 1);
        }
    }
    return 0;
}

/* One round: sender and co-tenant set up, then the receiver's calls
   with timeout 0 for 1.5 s, each timed. btl: as the BTL's progress takes
   messages (peek any sender; a message spanning slots: -EMSGSIZE, then a
   copying receive from that sender with timeout 0). */
static void run_gone_stream(bool btl)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 65536, .slot_size = 128,
                        .queue_slots = 16, .fast_channels = 1};
    path = tu_region(ivshm_min_region_size(&g) + (1 << 20), &g);
    ct_pin(0);
    ivshm *r = tu_attach(path, job, 0, 0);
    r_slot = ivshm_self(r);
    ct_gate_init(&opened);
    ct_gate_init(&leave);
    ct_gate_init(&ready);
    pid_t sender = tu_fork(gone_sender, NULL);
    CHECK(ct_await(&opened, 10000));
    int s_slot = tu_await_peer(r, job, 1, 5000);
    CHECK(s_slot >= 0);
    if (s_slot < 0)
        return;
    /* take the OPEN cell: the receiver reads that ring from now on */
    uint8_t buf[65536];
    for (int i = 0; i < 1000 && r->peers[s_slot].rx_chan < 0; i++) {
        (void)ivshm_recv(r, s_slot, NULL, NULL, buf, sizeof buf, 0);
        tu_sleep_ms(1);
    }
    CHECK(r->peers[s_slot].rx_chan >= 0);
    ct_signal(&leave);
    CHECK_RC(tu_wait(sender, 10000), 0);
    pid_t streamer = tu_fork(gone_streamer, &s_slot);
    CHECK(ct_await(&ready, 10000));

    struct ct_timing t = {0};
    struct ct_work wk;
    uint64_t most = 0; /* units of the costliest call */
    uint64_t end = tu_now_ms() + 1500;
    while (tu_now_ms() < end) {
        uint64_t t0 = tu_now_ns();
        ct_work_begin(r, &wk);
        if (btl) {
            int src = -1;
            uint32_t tag;
            const void *data;
            ssize_t n = ivshm_recv_peek(r, IVSHM_ANY, &src, &tag, &data);
            if (n >= 0)
                ivshm_recv_release(r, src);
            else if (n == -EMSGSIZE && src >= 0) {
                ct_work_end(r, &wk);
                most = wk.total > most ? wk.total : most;
                ct_work_begin(r, &wk);
                (void)ivshm_recv(r, src, NULL, &tag, buf, sizeof buf, 0);
            }
        } else {
            (void)ivshm_recv(r, s_slot, NULL, NULL, buf, sizeof buf, 0);
        }
        ct_work_end(r, &wk);
        most = wk.total > most ? wk.total : most;
        ct_note(&t, tu_now_ns() - t0);
    }
    kill(streamer, SIGKILL);
    tu_wait(streamer, 5000);
    ct_unpin();
    printf("gone stream (%s): %llu calls, worst %.1f ms, %llu units "
           "(bound %llu)\n", btl ? "btl peek/recv" : "recv(from, 0)",
           (unsigned long long)t.calls, t.worst_ns / 1e6,
           (unsigned long long)most, (unsigned long long)ct_bound_nowait(r));
    /* timeout 0 never waits: one budget of work (milliseconds at most) */
    CHECK(most <= ct_bound_nowait(r));
    CHECK(t.worst_ns < (uint64_t)SLACK_MS * 1000000ull);
    CHECK(t.calls > 10);
    ivshm_detach(r);
}

static void test_gone_stream(void)
{
    run_gone_stream(false);
    run_gone_stream(true);
}

/* ---- a window lock held through both of its phases ---- */

#define LOCK_BOUND_MS 1000

struct lock_plan {
    bool exclusive; /* the victim wants it exclusive (both phases) */
};

/* The co-tenant, a live member of the window: holds the writer word
   almost to the bound, then lets it go but leaves a reader bit of its
   own (live) slot set. */
static int lock_holder(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 2, 0);
    ivshm_window *w;
    REQUIRE(ivshm_win_open(h, "held", 2, 4096, &w) == 0);
    REQUIRE(ivshm_win_lock(w, 0, IVSHM_LOCK_EXCLUSIVE) == 0);
    _Atomic uint64_t *readers = NULL;
    for (uint32_t i = 0; i < h->max_windows && !readers; i++)
        readers = ivshm_win_bitmap(h, i, 0);
    REQUIRE(readers);
    atomic_fetch_or(&readers[ivshm_self(h) / 64], 1ull << (ivshm_self(h) % 64));
    ct_signal(&ready);
    tu_sleep_ms(LOCK_BOUND_MS * 9 / 10);
    ivshm_win_unlock(w, 0);
    /* the bit stays: cleared only for a dead slot */
    atomic_fetch_or(&readers[ivshm_self(h) / 64], 1ull << (ivshm_self(h) % 64));
    tu_sleep_ms(4 * LOCK_BOUND_MS);
    return 0;
}

static void run_lock(bool exclusive)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 16, .slot_size = 256,
                        .queue_slots = 16, .fast_channels = 2};
    path = tu_region(ivshm_min_region_size(&g) + (1 << 20), &g);
    char bound[16];
    snprintf(bound, sizeof bound, "%d", LOCK_BOUND_MS);
    setenv("IVSHM_LOCK_TIMEOUT_MS", bound, 1); /* read at attach */
    ivshm *v = tu_attach(path, job, 0, 0);
    unsetenv("IVSHM_LOCK_TIMEOUT_MS");
    ivshm_window *w;
    CHECK_RC(ivshm_win_open(v, "held", 2, 4096, &w), 0);
    ct_gate_init(&ready);
    pid_t holder = tu_fork(lock_holder, NULL);
    CHECK(ct_await(&ready, 10000));
    uint64_t t0 = tu_now_ns();
    int rc = ivshm_win_lock(w, 0, exclusive ? IVSHM_LOCK_EXCLUSIVE
                                            : IVSHM_LOCK_SHARED);
    uint64_t ms = (tu_now_ns() - t0) / 1000000ull;
    printf("lock (%s) held by a live co-tenant: rc %d after %llu ms "
           "(bound %d ms)\n", exclusive ? "exclusive" : "shared", rc,
           (unsigned long long)ms, LOCK_BOUND_MS);
    if (exclusive)
        CHECK_RC(rc, -ETIMEDOUT);
    else if (rc == 0) /* the writer let go: shared is fine with readers */
        ivshm_win_unlock(w, 0);
    CHECK(ms <= LOCK_BOUND_MS + SLACK_MS);
    kill(holder, SIGKILL);
    tu_wait(holder, 5000);
    ivshm_win_close(w);
    ivshm_detach(v);
}

static void test_lock_phases(void)
{
    run_lock(true);
    run_lock(false);
}

int main(void)
{
    ct_pin_init();
    test_gone_stream();
    test_lock_phases();
    return tu_summary("test_hostile_deadline");
}
