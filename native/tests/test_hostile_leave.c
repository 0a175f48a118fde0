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
#include <stdlib.h>
#include <fcntl.h>
#include <signal.h>
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
    struct ct_work wk;
    ct_work_begin(v, &wk);
    int dead = ivshm_reap(v);
    ct_work_end(v, &wk);
    uint64_t ms = (tu_now_ns() - t0) / 1000000ull;
    printf("reap: %d entries of a dead co-tenant in %llu ms, %llu units\n",
           dead, (unsigned long long)ms, (unsigned long long)wk.total);
    CHECK(dead >= 1000);
    /* ivshm.h: O(max_peers) entries and probes, the channels' sweep */
    CHECK(wk.total <= 2ull * v->max_peers + 2 * IVSHM_MAX_FAST);
    CHECK(ms <= LEAVE_BOUND_MS);
    ivshm_detach(v);
}

/* The server's side: a fresh region whose free entries all carry one
   server id, and the server's handle on it. */
static ivshm_admin *forged_for_admin(void)
{
    path = tu_region(ivshm_min_region_size(&big) + (1 << 20), &big);
    ivshm *raw = ct_map(path);
    forge(raw, 1, 0xdead, FORGED_DOORBELL);
    ct_unmap(raw);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    ivshm_admin *a = NULL;
    CHECK_RC(ivshm_admin_open(fd, &a), 0);
    close(fd);
    return a;
}

/* Marking the entries of an id that left, alone or in a batch of ids (a
   server handling many departures): O(max_peers), whatever the leaver
   wrote. */
static void test_admin_mark_dead(bool batch)
{
    ivshm_admin *a = forged_for_admin();
    if (!a)
        return;
    static int32_t ids[4096];
    for (int i = 0; i < 4096; i++)
        ids[i] = i % 3 ? 5000 + i : -i; /* strangers and negatives */
    ids[4095] = FORGED_DOORBELL;
    uint64_t t0 = tu_now_ns();
    int marked = batch ? ivshm_admin_mark_dead_ids(a, ids, 4096)
                       : ivshm_admin_mark_dead(a, FORGED_DOORBELL);
    uint64_t ms = (tu_now_ns() - t0) / 1000000ull;
    printf("admin mark dead: %d entries of %s in %llu ms\n", marked,
           batch ? "a batch of 4096 ids" : "one id", (unsigned long long)ms);
    CHECK(marked == 1024);
    CHECK(ms <= LEAVE_BOUND_MS);
    if (batch)
        CHECK_RC(ivshm_admin_mark_dead_ids(a, NULL, 0), 0);
    ivshm_admin_close(a);
}

/* ---- through a server: a peer draining the leave notice ---- */

static char sock_path[108], state_path[128];
static pid_t server_pid = -1;

static void stop_server(void)
{
    if (server_pid > 0) {
        kill(server_pid, SIGKILL);
        tu_wait(server_pid, 5000);
        server_pid = -1;
    }
    unlink(sock_path);
    unlink(state_path);
}

/* The server's geometry: 1024 peers, small queues, no fast channels,
   the default 32 windows. */
static bool start_server(void)
{
    const char *bin = tu_server_bin();
    if (!bin)
        return false;
    snprintf(sock_path, sizeof sock_path, "/tmp/ivshm-leave-%d.sock",
             (int)getpid());
    snprintf(state_path, sizeof state_path, "/tmp/ivshm-leave-%d.state",
             (int)getpid());
    ivshm_geometry g = big;
    g.max_windows = 32;
    uint64_t size = 1;
    while (size < ivshm_min_region_size(&g) + (1 << 20))
        size <<= 1;
    char sz[32];
    snprintf(sz, sizeof sz, "%llu", (unsigned long long)size);
    unlink(state_path);
    fflush(NULL);
    server_pid = tu_fork_child();
    if (server_pid == 0) {
        execl(bin, "ivshmem-server", "-F", "-S", sock_path, "-s", state_path,
              "-l", sz, "--max-peers", "1024", "--ring-slots", "2",
              "--slot-size", "128", "--queue-slots", "2", "--fast-channels",
              "0", (char *)NULL);
        _exit(127);
    }
    bool up = TU_EVENTUALLY(tu_exists(state_path), 10000);
    CHECK(up);
    return up;
}

static ivshm *attach_server(uint32_t rank)
{
    ivshm_config cfg = {.job_id = job, .rank = rank};
    ivshm *h = NULL;
    int rc = ivshm_attach_server(sock_path, &cfg, &h);
    if (rc < 0) {
        fprintf(stderr, "[pid %d] attach_server: %s\n", (int)getpid(),
                ivshm_strerror(rc));
        _exit(98);
    }
    return h;
}

static struct ct_gate forged, gone;

/* The leaver: a client of the server that forges every free entry with
   its server id (in a pid namespace nobody can probe), makes every
   window look in use, and disconnects. */
static int id_forger(void *arg)
{
    (void)arg;
    ivshm *h = attach_server(1);
    ivshm_peer_info me;
    REQUIRE(ivshm_peer(h, ivshm_self(h), &me) == 0);
    forge(h, 1, 0xdead, me.doorbell_id);
    ct_signal(&forged);
    _exit(0); /* the server sees the connection close */
}

/* A second co-tenant (a client of the server) that puts the leaver's
   entries back to ACTIVE once the server marked them DEAD, so that
   every peer that drains the leave notice later finds them to mark. */
static int reviver(void *arg)
{
    int *id_pipe = arg;
    ivshm *h = attach_server(2); /* before the leaver fills the registry */
    ct_signal(&gone);
    int32_t id = -1;
    if (read(id_pipe[0], &id, sizeof id) != sizeof id)
        return 1;
    int revived = 0;
    for (uint64_t end = tu_now_ms() + 10000; tu_now_ms() < end;) {
        for (uint32_t s = 0; s < h->max_peers; s++) {
            struct ivshm_peer_entry *e = ivshm_entry(h, (int)s);
            if (e->doorbell_id == id && atomic_load(&e->state) == PEER_DEAD) {
                atomic_store(&e->state, PEER_ACTIVE);
                revived++;
            }
        }
        if (revived >= 1000)
            break;
        tu_sleep_ms(1);
    }
    ct_signal(&gone);
    tu_sleep_ms(10000); /* stays connected, idle */
    return 0;
}

static void test_drain_after_mass_leave(void)
{
    if (!start_server())
        return;
    ivshm *v = attach_server(0);
    ct_gate_init(&forged);
    ct_gate_init(&gone);
    int id_pipe[2];
    CHECK(pipe(id_pipe) == 0);
    pid_t r = tu_fork(reviver, id_pipe);
    CHECK(ct_await(&gone, 10000)); /* attached */
    pid_t f = tu_fork(id_forger, NULL);
    CHECK(ct_await(&forged, 10000));
    /* the leaver's id, from any entry it forged */
    int32_t id = -1;
    for (uint32_t s = 0; s < v->max_peers && id < 0; s++)
        if ((int)s != ivshm_self(v))
            id = ivshm_entry(v, (int)s)->doorbell_id;
    CHECK(write(id_pipe[1], &id, sizeof id) == sizeof id);
    CHECK_RC(tu_wait(f, 10000), 0);
    /* the server marked the leaver's entries, the reviver put them back;
       the notice waits in our socket until our next wait drains it */
    CHECK(ct_await(&gone, 15000));
    struct ct_timing t = {0};
    struct ct_work wk;
    uint64_t peak = 0;
    uint8_t buf[64];
    for (uint64_t end = tu_now_ms() + 1000; tu_now_ms() < end;) {
        uint64_t t0 = tu_now_ns();
        ct_work_begin(v, &wk);
        (void)ivshm_recv(v, IVSHM_ANY, NULL, NULL, buf, sizeof buf, 20);
        ct_work_end(v, &wk);
        peak = wk.peak > peak ? wk.peak : peak;
        ct_note(&t, tu_now_ns() - t0);
    }
    printf("drain: receives of 20 ms while 1000 entries of a leaver are "
           "marked and revived: %llu calls, worst %.1f ms, at most %llu "
           "units between looks at the clock (bound %llu)\n",
           (unsigned long long)t.calls, t.worst_ns / 1e6,
           (unsigned long long)peak,
           (unsigned long long)ct_bound_per_look(v));
    /* the drain marks the leaver's entries in one pass: O(max_peers) */
    CHECK(peak <= ct_bound_per_look(v));
    CHECK(t.worst_ns <= (20 + LEAVE_BOUND_MS) * 1000000ull);
    kill(r, SIGKILL);
    tu_wait(r, 10000);
    close(id_pipe[0]);
    close(id_pipe[1]);
    ivshm_detach(v);
    stop_server();
}

int main(void)
{
    atexit(stop_server);
    test_reap_after_mass_death();
    test_admin_mark_dead(false);
    test_admin_mark_dead(true);
    test_drain_after_mass_leave();
    return tu_summary("test_hostile_leave");
}
