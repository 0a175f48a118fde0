/* Work a leaver chooses (docs/security.md, "libivshm"): cleaning up
   after a peer that left must cost O(the entries it held), not
   O(max_peers x windows x max_peers). A co-tenant (a real process) fills
   the registry with entries of its own -- its pid, or its server id --
   and makes every window descriptor look in use, then dies or
   disconnects:
   - a peer's ivshm_reap (the BTL calls it every 100 ms) finds the
     entries dead by their pid;
   - the server's ivshm_admin_mark_dead marks the entries of its id.
   Each must stay within its stated bound (ivshm.h, ivshm_admin.h), here
   checked as time on the largest geometry (1024 peers, 128 windows). */
#define _GNU_SOURCE
#include "cotenant.h"
#include "ivshm_admin.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static const uint64_t job = 0x1ea7e;
static const char *path;
static struct ct_gate ready;

#define FORGED_DOORBELL 4242
/* What cleaning up 1024 entries may take on a shared, sanitized build:
   milliseconds of work, far from the seconds of a O(P x W x P) sweep. */
#define LEAVE_BOUND_MS 100

static const ivshm_geometry big = {
    .max_peers = 1024, .ring_slots = 2, .slot_size = 128, .max_windows = 128,
    .queue_slots = 2, .fast_channels = IVSHM_FAST_NONE};

/* Every free entry made an ACTIVE entry of ours, every window descriptor
   made BUSY (in use). With `pid` and our pid namespace (found dead by a
   pid probe) or another namespace (only a server notice kills them). */
static void forge(ivshm *raw, int32_t pid, uint64_t pidns, int32_t doorbell)
{
    for (uint32_t s = 0; s < raw->max_peers; s++) {
        struct ivshm_peer_entry *e = ivshm_entry(raw, (int)s);
        if (atomic_load(&e->state) != PEER_FREE)
            continue;
        atomic_store(&e->gen, atomic_load(&e->gen) + 1);
        e->job_id = job;
        e->rank = 1000 + s;
        e->doorbell_id = doorbell;
        e->pid = pid;
        e->pidns = pidns;
        e->backend = DB_FUTEX;
        atomic_store(&e->state, PEER_ACTIVE);
    }
    for (uint32_t i = 0; i < raw->max_windows; i++) {
        struct ivshm_win_desc *d =
            (struct ivshm_win_desc *)(raw->base + raw->windir_off) + i;
        atomic_store(&d->state, WIN_BUSY);
    }
}

/* The co-tenant: attaches (a slot of its own, its pid namespace known),
   forges entries with its pid, then dies. */
static int pid_forger(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(path, job, 1, 0);
    ivshm *raw = ct_map(path);
    forge(raw, (int32_t)getpid(), h->pidns, -1);
    ct_signal(&ready);
    _exit(0); /* no detach: found dead */
}

static void test_reap_after_mass_death(void)
{
    path = tu_region(ivshm_min_region_size(&big) + (1 << 20), &big);
    ivshm *v = tu_attach(path, job, 0, 0);
    ct_gate_init(&ready);
    pid_t forger = tu_fork(pid_forger, NULL);
    CHECK(ct_await(&ready, 10000));
    CHECK_RC(tu_wait(forger, 10000), 0);
    uint64_t t0 = tu_now_ns();
    int dead = ivshm_reap(v);
    uint64_t ms = (tu_now_ns() - t0) / 1000000ull;
    printf("reap: %d entries of a dead co-tenant in %llu ms\n", dead,
           (unsigned long long)ms);
    CHECK(dead >= 1000);
    CHECK(ms <= LEAVE_BOUND_MS);
    ivshm_detach(v);
}

/* The server's side: marking the entries of an id that left. */
static void test_admin_mark_dead(void)
{
    path = tu_region(ivshm_min_region_size(&big) + (1 << 20), &big);
    ivshm *raw = ct_map(path);
    forge(raw, 1, 0xdead, FORGED_DOORBELL);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    ivshm_admin *a = NULL;
    CHECK_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    if (!a)
        return;
    uint64_t t0 = tu_now_ns();
    int marked = ivshm_admin_mark_dead(a, FORGED_DOORBELL);
    uint64_t ms = (tu_now_ns() - t0) / 1000000ull;
    printf("admin mark dead: %d entries of one id in %llu ms\n", marked,
           (unsigned long long)ms);
    CHECK(marked == 1024);
    CHECK(ms <= LEAVE_BOUND_MS);
    ivshm_admin_close(a);
    ct_unmap(raw);
}

int main(void)
{
    test_reap_after_mass_death();
    test_admin_mark_dead();
    return tu_summary("test_hostile_leave");
}
