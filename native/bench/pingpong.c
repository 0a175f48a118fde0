/*
 * libivshm ping-pong benchmark. One process formats a fresh region file in
 * /dev/shm, forks its partner(s), and prints one JSON line per measurement
 * on stdout (read by `ivcloud bench p2p`).
 *
 *   --mode msg      ivshm_send/ivshm_recv ping-pong, one line per size
 *   --mode put      window put + flush, then a flag word bumped in the
 *                   target's segment that the target polls
 *   --mode memcpy   private-memory memcpy reference, one line per size
 *   --mode oversub  two ping-pong pairs on two CPUs (four processes):
 *                   wall time for a fixed number of 8 B round trips;
 *                   --placement pair|split|none picks the CPU pinning
 *   --mode blocked  CPU used by a peer that waits past its spin budget
 *
 * --spin NS sets the spin budget (<0 never block, 0 library default); the
 * JSON "mode" is "spin" or "spin-then-block" accordingly.
 * One-way latency is half a round trip; bandwidth = size / one-way latency
 * (bytes per microsecond = MB/s).
 *
 * Every wait is bounded: receives have timeouts, an alarm kills a stuck
 * run, children die with their parent, and the region file is unlinked
 * as soon as every process has it mapped.
 */
#define _GNU_SOURCE
#include "ivshm.h"
#include "bench_util.h"

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define RECV_TIMEOUT_MS 20000
#define FLAG_BYTES 64 /* put mode: a segment's first line holds its flag */

struct opts {
    const char *mode;
    size_t sizes[BENCH_MAX_SIZES];
    int nsizes;
    long iters;         /* round trips for the smallest sizes          */
    uint64_t budget;    /* bytes per size and direction, caps the iters */
    int64_t spin_ns;
    long rounds;        /* oversub: round trips per pair               */
    int wait_ms;        /* blocked: how long the peer waits            */
    const char *placement; /* oversub: pair | split | none             */
    int timeout_s;      /* hard bound on the whole run                 */
    const char *dir;    /* where the region file lives                 */
};

static char region_path[256];
static pid_t region_owner;

static void remove_region(void)
{
    if (region_path[0] && getpid() == region_owner) {
        unlink(region_path);
        region_path[0] = 0;
    }
}

static void on_fatal_signal(int sig)
{
    remove_region();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "ivshm-pingpong[%d]: %s: %s\n", (int)getpid(), what,
            rc ? ivshm_strerror(rc) : "failed");
    remove_region();
    exit(1);
}

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *spin_mode(int64_t spin_ns)
{
    return spin_ns < 0 ? "spin" : "spin-then-block";
}

static size_t max_size(const struct opts *o)
{
    return bench_max_size(o->sizes, o->nsizes);
}

/* ---- setup shared by the multi-process modes ---- */

static void make_region(const struct opts *o, uint32_t max_peers,
                        uint64_t heap_bytes)
{
    ivshm_geometry g = {.max_peers = max_peers};
    uint64_t size = ivshm_min_region_size(&g) + heap_bytes;
    size = (size + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    snprintf(region_path, sizeof region_path, "%s/ivshm-bench-%d", o->dir,
             (int)getpid());
    region_owner = getpid();
    atexit(remove_region);
    signal(SIGINT, on_fatal_signal);
    signal(SIGTERM, on_fatal_signal);
    signal(SIGALRM, on_fatal_signal);
    int rc = ivshm_format_file(region_path, size, &g, 0600);
    if (rc < 0)
        die("format region", rc);
}

static ivshm *attach(uint64_t job, uint32_t rank, int64_t spin_ns)
{
    ivshm_config cfg = {.job_id = job, .rank = rank, .spin_ns = spin_ns,
                        .name = "bench"};
    ivshm *h = NULL;
    int rc = ivshm_attach_path(region_path, &cfg, &h);
    if (rc < 0)
        die("attach", rc);
    return h;
}

/* Find the partner (bounded), then exchange one message each way so both
   sides know the other is attached and talking. */
static int connect_partner(ivshm *h, uint64_t job, uint32_t rank)
{
    uint64_t deadline = bench_now_ns() + 10000000000ull;
    int peer;
    while ((peer = ivshm_find(h, job, rank ^ 1u)) < 0) {
        if (bench_now_ns() > deadline)
            die("partner never attached", peer);
        usleep(200);
    }
    char b = 0;
    int rc;
    if (rank == 0) {
        if ((rc = ivshm_send(h, peer, 1, &b, 1)) < 0)
            die("hello send", rc);
        if ((rc = (int)ivshm_recv(h, peer, NULL, NULL, &b, 1, RECV_TIMEOUT_MS)) < 0)
            die("hello recv", rc);
    } else {
        if ((rc = (int)ivshm_recv(h, peer, NULL, NULL, &b, 1, RECV_TIMEOUT_MS)) < 0)
            die("hello recv", rc);
        if ((rc = ivshm_send(h, peer, 1, &b, 1)) < 0)
            die("hello send", rc);
    }
    return peer;
}

static pid_t fork_child(void)
{
    fflush(stdout);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        die("fork", -errno);
    if (pid == 0) {
        /* never outlive the parent (it may have died before the prctl),
           never remove its file */
        region_owner = 0;
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
    }
    return pid;
}

static int reap_children(int n)
{
    int failed = 0;
    for (int i = 0; i < n; i++) {
        int st;
        pid_t p = wait(&st);
        if (p < 0)
            break;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "ivshm-pingpong: child %d failed (status %#x)\n",
                    (int)p, st);
            failed = 1;
        }
    }
    return failed;
}

/* ---- timing driver shared by msg, put and memcpy ----
 *
 * Each size runs a warm-up, then timed batches (bench_plan_for); the
 * median batch is the result. Both sides of a ping-pong run the same
 * loop; only rank 0 prints.
 */

struct step {
    /* one round trip (or one copy) of `size` bytes; dies on error */
    void (*fn)(struct step *st, size_t size);
    ivshm *h;
    ivshm_window *w;
    int peer;
    uint32_t rank;
    char *buf, *buf2;
    size_t cap;
    _Atomic uint64_t *flag;
    uint64_t seq;
};

/* `hops`: one-way trips per step (2 for a round trip, 1 for a copy). */
static void measure_sizes(const struct opts *o, struct step *st,
                          const char *transport, const char *mode, int hops,
                          bool report)
{
    for (int s = 0; s < o->nsizes; s++) {
        size_t size = o->sizes[s];
        struct bench_plan p = bench_plan_for(size, o->iters, o->budget);
        for (long i = 0; i < p.warm; i++)
            st->fn(st, size);
        uint64_t batch[BENCH_NBATCH];
        for (int b = 0; b < p.nb; b++) {
            uint64_t t0 = bench_now_ns();
            for (long i = 0; i < p.per; i++)
                st->fn(st, size);
            batch[b] = bench_now_ns() - t0;
        }
        if (report)
            bench_report_ns(transport, mode, size, batch, p.nb, p.per, hops);
    }
}

/* ---- msg: ring ping-pong ---- */

static void msg_step(struct step *st, size_t size)
{
    int rc;
    if (st->rank == 0 && (rc = ivshm_send(st->h, st->peer, 0, st->buf, size)) < 0)
        die("send", rc);
    ssize_t n = ivshm_recv(st->h, st->peer, NULL, NULL, st->buf, st->cap,
                           RECV_TIMEOUT_MS);
    if (n < 0)
        die("recv", (int)n);
    if ((size_t)n != size)
        die("recv: wrong length", 0);
    if (st->rank == 1 && (rc = ivshm_send(st->h, st->peer, 0, st->buf, size)) < 0)
        die("send", rc);
}

static void msg_side(const struct opts *o, uint64_t job, uint32_t rank)
{
    struct step st = {.fn = msg_step, .rank = rank, .cap = max_size(o)};
    st.h = attach(job, rank, o->spin_ns);
    st.peer = connect_partner(st.h, job, rank);
    remove_region(); /* both mapped: the name is no longer needed */
    st.buf = malloc(st.cap);
    if (!st.buf)
        die("malloc", -ENOMEM);
    memset(st.buf, 0x5a, st.cap);
    measure_sizes(o, &st, "ivshm", spin_mode(o->spin_ns), 2, rank == 0);
    free(st.buf);
    ivshm_detach(st.h);
}

static int run_msg(const struct opts *o)
{
    make_region(o, 2, 0);
    uint64_t job = (uint64_t)getpid();
    pid_t c = fork_child();
    if (c == 0) {
        msg_side(o, job, 1);
        _exit(0);
    }
    msg_side(o, job, 0);
    return reap_children(1);
}

/* ---- put: window put + flush + flag ---- */

/* Spin until our flag word reaches `want`; bounded by a timeout (the
   partner's death shows up as the flag never moving). */
static void wait_flag(_Atomic uint64_t *flag, uint64_t want)
{
    uint64_t deadline = 0;
    for (unsigned spins = 0;; spins++) {
        if (atomic_load_explicit(flag, memory_order_acquire) >= want)
            return;
        if ((spins & 0xffff) == 0xffff) {
            uint64_t t = bench_now_ns();
            if (!deadline)
                deadline = t + (uint64_t)RECV_TIMEOUT_MS * 1000000ull;
            else if (t > deadline)
                die("put: partner stopped signalling", -ETIMEDOUT);
        }
    }
}

static void put_step(struct step *st, size_t size)
{
    uint32_t theirs = st->rank ^ 1u;
    int rc;
    /* flag values are cumulative over all sizes: no reset races */
    st->seq++;
    if (st->rank == 1)
        wait_flag(st->flag, st->seq);
    /* data, flush, then the flag: the flag is the only thing the target
       polls, so it must be published last */
    if ((rc = ivshm_win_put(st->w, theirs, FLAG_BYTES, st->buf, size)) < 0)
        die("win_put", rc);
    if ((rc = ivshm_win_flush(st->w, theirs)) < 0)
        die("win_flush", rc);
    if ((rc = ivshm_win_fetch_add(st->w, theirs, 0, 1, NULL)) < 0)
        die("win_fetch_add", rc);
    if (st->rank == 0)
        wait_flag(st->flag, st->seq);
}

static void put_side(const struct opts *o, uint64_t job, uint32_t rank,
                     uint64_t seg_size)
{
    struct step st = {.fn = put_step, .rank = rank, .cap = max_size(o)};
    st.h = attach(job, rank, o->spin_ns);
    connect_partner(st.h, job, rank);
    int rc = ivshm_win_open(st.h, "bench-put", 2, seg_size, &st.w);
    if (rc < 0)
        die("win_open", rc);
    if ((rc = ivshm_win_barrier(st.w, RECV_TIMEOUT_MS)) < 0)
        die("win_barrier", rc);
    remove_region();
    st.flag = ivshm_win_ptr(st.w, rank);
    if (!st.flag)
        die("win_ptr", -EINVAL);
    st.buf = malloc(st.cap);
    if (!st.buf)
        die("malloc", -ENOMEM);
    memset(st.buf, 0xa5, st.cap);
    measure_sizes(o, &st, "ivshm", "put", 2, rank == 0);
    /* neither side may free the window while the other still polls it */
    if ((rc = ivshm_win_barrier(st.w, RECV_TIMEOUT_MS)) < 0)
        die("win_barrier", rc);
    free(st.buf);
    ivshm_win_close(st.w);
    ivshm_detach(st.h);
}

static int run_put(const struct opts *o)
{
    uint64_t seg = (FLAG_BYTES + max_size(o) + 4095) & ~(uint64_t)4095;
    make_region(o, 2, 2 * seg + (4u << 20));
    uint64_t job = (uint64_t)getpid();
    pid_t c = fork_child();
    if (c == 0) {
        put_side(o, job, 1, seg);
        _exit(0);
    }
    put_side(o, job, 0, seg);
    return reap_children(1);
}

/* ---- memcpy reference ---- */

static void memcpy_step(struct step *st, size_t size)
{
    memcpy(st->buf2, st->buf, size);
    /* the copy must happen every time, not be hoisted or elided */
    __asm__ volatile("" : : "r"(st->buf2), "r"(st->buf) : "memory");
}

static int run_memcpy(const struct opts *o)
{
    struct step st = {.fn = memcpy_step, .cap = max_size(o)};
    st.buf = malloc(st.cap);
    st.buf2 = malloc(st.cap);
    if (!st.buf || !st.buf2)
        die("malloc", -ENOMEM);
    memset(st.buf, 1, st.cap);
    memset(st.buf2, 2, st.cap);
    measure_sizes(o, &st, "memcpy", "memcpy", 1, true);
    free(st.buf);
    free(st.buf2);
    return 0;
}

/* ---- oversub: two pairs, four processes, two CPUs ---- */

struct oversub_shared {
    _Atomic int ready;
    _Atomic int go;
    _Atomic uint64_t end_ns[2];
};

/* The first two CPUs we may run on; -1 if there are fewer. */
static void two_cpus(int cpu[2])
{
    cpu_set_t set;
    cpu[0] = cpu[1] = -1;
    if (sched_getaffinity(0, sizeof set, &set) < 0)
        return;
    for (int c = 0, k = 0; c < CPU_SETSIZE && k < 2; c++)
        if (CPU_ISSET(c, &set))
            cpu[k++] = c;
}

static void pin(int cpu)
{
    if (cpu < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static void oversub_side(const struct opts *o, struct oversub_shared *sh,
                         uint64_t job, int pair, uint32_t rank)
{
    ivshm *h = attach(job, rank, o->spin_ns);
    int peer = connect_partner(h, job, rank);
    atomic_fetch_add(&sh->ready, 1);
    /* sleep, not spin, while the others get ready: the CPUs are shared */
    while (!atomic_load(&sh->go))
        usleep(100);
    char buf[8] = {0};
    int rc;
    for (long i = 0; i < o->rounds; i++) {
        if (rank == 0 && (rc = ivshm_send(h, peer, 0, buf, sizeof buf)) < 0)
            die("send", rc);
        ssize_t n = ivshm_recv(h, peer, NULL, NULL, buf, sizeof buf,
                               RECV_TIMEOUT_MS);
        if (n != (ssize_t)sizeof buf)
            die("recv", n < 0 ? (int)n : 0);
        if (rank == 1 && (rc = ivshm_send(h, peer, 0, buf, sizeof buf)) < 0)
            die("send", rc);
    }
    if (rank == 0)
        atomic_store(&sh->end_ns[pair], bench_now_ns());
    ivshm_detach(h);
}

static int run_oversub(const struct opts *o)
{
    struct oversub_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED)
        die("mmap", -errno);
    memset(sh, 0, sizeof *sh);
    make_region(o, 4, 0);
    int cpu[2];
    two_cpus(cpu);
    uint64_t job = (uint64_t)getpid() << 1;
    for (int p = 0; p < 4; p++) {
        if (fork_child() == 0) {
            int pair = p >> 1;
            uint32_t rank = (uint32_t)(p & 1);
            /* pair: both ends of a pair share one CPU, so a spinning
               waiter holds the very CPU its partner needs (the case
               blocking exists for); split: each CPU runs one end of
               each pair; none: the scheduler decides */
            if (!strcmp(o->placement, "pair"))
                pin(cpu[pair]);
            else if (!strcmp(o->placement, "split"))
                pin(cpu[rank]);
            oversub_side(o, sh, job + (uint64_t)pair, pair, rank);
            _exit(0);
        }
    }
    uint64_t deadline = bench_now_ns() + 20000000000ull;
    while (atomic_load(&sh->ready) < 4) {
        if (bench_now_ns() > deadline)
            die("oversub: children not ready", -ETIMEDOUT);
        usleep(500);
    }
    remove_region();
    uint64_t t0 = bench_now_ns();
    atomic_store(&sh->go, 1);
    int failed = reap_children(4);
    if (failed)
        return 1;
    uint64_t end = sh->end_ns[0] > sh->end_ns[1] ? sh->end_ns[0] : sh->end_ns[1];
    double wall_s = (double)(end - t0) / 1e9;
    char extra[192];
    snprintf(extra, sizeof extra, ",\"wall_s\":%.4f,\"rounds\":%ld,\"pairs\":2,"
             "\"cpus\":%d,\"placement\":\"%s\"", wall_s, o->rounds,
             cpu[1] >= 0 ? 2 : 1, o->placement);
    bench_print_record("ivshm-oversub", spin_mode(o->spin_ns), 8,
                 wall_s * 1e6 / (double)o->rounds, o->rounds, extra);
    munmap(sh, sizeof *sh);
    return 0;
}

/* ---- blocked: CPU use of a waiting peer ---- */

struct blocked_result {
    uint64_t cpu_ns, wall_ns, wake_ns;
};

static int run_blocked(const struct opts *o)
{
    make_region(o, 2, 0);
    uint64_t job = (uint64_t)getpid();
    pid_t c = fork_child();
    ivshm *h = attach(job, c == 0 ? 1 : 0, o->spin_ns);
    int peer = connect_partner(h, job, c == 0 ? 1 : 0);
    int rc;
    if (c == 0) {
        /* the waiter: measure only the wait itself */
        uint64_t sent_at = 0;
        uint64_t c0 = cpu_ns(), t0 = bench_now_ns();
        ssize_t n = ivshm_recv(h, peer, NULL, NULL, &sent_at, sizeof sent_at,
                               o->wait_ms + RECV_TIMEOUT_MS);
        uint64_t t1 = bench_now_ns(), c1 = cpu_ns();
        if (n != (ssize_t)sizeof sent_at)
            die("blocked: recv", n < 0 ? (int)n : 0);
        struct blocked_result r = {c1 - c0, t1 - t0,
                                   t1 > sent_at ? t1 - sent_at : 0};
        if ((rc = ivshm_send(h, peer, 0, &r, sizeof r)) < 0)
            die("blocked: send result", rc);
        ivshm_detach(h);
        _exit(0);
    }
    remove_region();
    usleep((useconds_t)o->wait_ms * 1000u);
    uint64_t sent_at = bench_now_ns();
    if ((rc = ivshm_send(h, peer, 0, &sent_at, sizeof sent_at)) < 0)
        die("blocked: send", rc);
    struct blocked_result r;
    ssize_t n = ivshm_recv(h, peer, NULL, NULL, &r, sizeof r, RECV_TIMEOUT_MS);
    if (n != (ssize_t)sizeof r)
        die("blocked: recv result", n < 0 ? (int)n : 0);
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    ivshm_detach(h);
    if (reap_children(1))
        return 1;
    double frac = r.wall_ns ? (double)r.cpu_ns / (double)r.wall_ns : 0;
    char extra[160];
    snprintf(extra, sizeof extra,
             ",\"cpu_fraction\":%.5f,\"wall_s\":%.4f,\"cpu_s\":%.5f,"
             "\"doorbells_rung\":%" PRIu64, frac, (double)r.wall_ns / 1e9,
             (double)r.cpu_ns / 1e9, st.rings);
    /* latency here is the wake-up latency of the blocked peer */
    bench_print_record("ivshm-blocked", spin_mode(o->spin_ns), 8,
                 (double)r.wake_ns / 1e3, 1, extra);
    return 0;
}

/* ---- command line ---- */

static void usage(void)
{
    fprintf(stderr,
            "usage: ivshm-pingpong [--mode msg|put|memcpy|oversub|blocked]\n"
            "  [--sizes 8,64,...] [--iters N] [--budget BYTES] [--spin NS]\n"
            "  [--rounds N] [--placement pair|split|none] [--wait-ms MS]\n"
            "  [--timeout S] [--dir /dev/shm]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    struct opts o = {.mode = "msg", .iters = 10000, .budget = 256u << 20,
                     .spin_ns = 0, .rounds = 1000, .wait_ms = 1000,
                     .placement = "pair",
                     .timeout_s = 300, .dir = "/dev/shm"};
    bench_parse_sizes(BENCH_DEFAULT_SIZES, o.sizes, &o.nsizes);
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            usage();
        if (!strcmp(a, "--mode"))
            o.mode = v;
        else if (!strcmp(a, "--sizes")) {
            if (bench_parse_sizes(v, o.sizes, &o.nsizes) < 0)
                usage();
        } else if (!strcmp(a, "--iters"))
            o.iters = atol(v);
        else if (!strcmp(a, "--budget"))
            o.budget = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--spin"))
            o.spin_ns = strtoll(v, NULL, 10);
        else if (!strcmp(a, "--rounds"))
            o.rounds = atol(v);
        else if (!strcmp(a, "--placement"))
            o.placement = v;
        else if (!strcmp(a, "--wait-ms"))
            o.wait_ms = atoi(v);
        else if (!strcmp(a, "--timeout"))
            o.timeout_s = atoi(v);
        else if (!strcmp(a, "--dir"))
            o.dir = v;
        else
            usage();
    }
    if (o.iters < 1 || o.rounds < 1 || o.wait_ms < 0 || o.timeout_s < 1 ||
        o.budget < 1 || (strcmp(o.placement, "pair") &&
                         strcmp(o.placement, "split") &&
                         strcmp(o.placement, "none")))
        usage();
    /* Bounds a stuck run. Children do not inherit the alarm, but they die
       with the parent (PR_SET_PDEATHSIG), which waits for them. */
    alarm((unsigned)o.timeout_s);
    if (!strcmp(o.mode, "msg"))
        return run_msg(&o);
    if (!strcmp(o.mode, "put"))
        return run_put(&o);
    if (!strcmp(o.mode, "memcpy"))
        return run_memcpy(&o);
    if (!strcmp(o.mode, "oversub"))
        return run_oversub(&o);
    if (!strcmp(o.mode, "blocked"))
        return run_blocked(&o);
    usage();
    return 2;
}
