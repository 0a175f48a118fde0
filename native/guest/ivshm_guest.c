/*
 * ivshm-guest: libivshm from inside a VM (or from the host, through the
 * ivshmem-server socket), for tests and operators. Statically linked so
 * that it runs in the busybox initramfs of `ivcloud vm`.
 *
 *   ivshm-guest COMMAND [options]
 *     info     attach, print our slot, doorbell id and the live peers
 *     pong     answer --count messages of the partner, echoing them
 *     ping     send --count messages of --size bytes, wait for each echo;
 *              round-trip times (median/min/max)
 *     window   put a pattern into the partner's segment, barrier, check
 *              ours, get theirs back, --count rounds
 *     atomic   --count fetch-and-adds on one window word, racing the
 *              partner's; prints the total (a lost update shows there)
 *     wait     block for a message for --timeout-ms (CPU use of a
 *              blocked guest; with --spin -1 it spins instead)
 *     watch    receive from the partner until it dies: reports
 *              IVSHM_EPEERDEAD (the server marked it dead)
 *     position print the device's IVPosition, read from BAR0 (--bar0)
 *              without attaching: for ivshm-bind, before vfio-pci
 *              claims the BAR
 *
 *   Attach (guest defaults come from the environment the guest's init
 *   writes: IVSHM_BAR2, IVSHM_UIO, IVSHM_BAR0):
 *     --server SOCK      host side: attach through ivshmem-server
 *     --region PATH      region file (resource2 inside a guest)
 *     --uio DEV          /dev/uioN or /dev/vfio/G (doorbell interrupts)
 *     --bar0 PATH        sysfs resource0 of the device
 *     --job N --rank N --peer-rank N --name S --spin NS
 *   Other: --count N --size BYTES --timeout-ms MS --gap-ms MS
 *
 * Prints one JSON line on success (exit 0). Errors: one line on stderr,
 * exit 1; bad usage exit 2. Every wait is bounded by --timeout-ms.
 */
#define _GNU_SOURCE
#include "ivshm.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_COUNT 1000000L
#define UNKNOWN_COMMAND                                                     \
    "unknown command (info, ping, pong, window, atomic, wait, watch, "     \
    "position)"
#define MAX_SIZE (1u << 20)

struct opts {
    const char *cmd;
    const char *server, *region, *uio, *bar0, *name;
    uint64_t job;
    uint32_t rank, peer_rank;
    bool have_peer_rank;
    int64_t spin_ns;
    long count;
    size_t size;
    int timeout_ms;
    int gap_ms;
};

static const char *prog = "ivshm-guest";

static void usage_error(const char *what)
{
    fprintf(stderr, "%s: %s (see the header of native/guest/ivshm_guest.c)\n",
            prog, what);
    exit(2);
}

static void fail(const char *what, int rc)
{
    fprintf(stderr, "%s: %s: %s\n", prog, what,
            rc ? ivshm_strerror(rc) : "failed");
    exit(1);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static long parse_long(const char *opt, const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 0);
    if (end == s || *end || errno || v < lo || v > hi) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s: '%s' is not an integer in %ld..%ld",
                 opt, s, lo, hi);
        usage_error(msg);
    }
    return (long)v;
}

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

static void parse(int argc, char **argv, struct opts *o)
{
    if (argc < 2)
        usage_error("missing command");
    static const char *const commands[] = {"info", "ping", "pong", "window",
                                           "atomic", "wait", "watch",
                                           "position"};
    bool known = false;
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
        known |= strcmp(argv[1], commands[i]) == 0;
    if (!known)
        usage_error(UNKNOWN_COMMAND);
    *o = (struct opts){
        .cmd = argv[1],
        .region = env_or("IVSHM_BAR2", NULL),
        .uio = env_or("IVSHM_UIO", NULL),
        .bar0 = env_or("IVSHM_BAR0", NULL),
        .name = "ivshm-guest",
        .job = 1,
        .count = 10,
        .size = 64,
        .timeout_ms = 20000,
    };
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) {
            char msg[96];
            snprintf(msg, sizeof msg, "%s needs a value", a);
            usage_error(msg);
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--server"))
            o->server = v;
        else if (!strcmp(a, "--region"))
            o->region = v;
        else if (!strcmp(a, "--uio"))
            o->uio = v;
        else if (!strcmp(a, "--bar0"))
            o->bar0 = v;
        else if (!strcmp(a, "--name"))
            o->name = v;
        else if (!strcmp(a, "--job"))
            o->job = (uint64_t)parse_long(a, v, 0, INT64_MAX);
        else if (!strcmp(a, "--rank"))
            o->rank = (uint32_t)parse_long(a, v, 0, UINT32_MAX);
        else if (!strcmp(a, "--peer-rank")) {
            o->peer_rank = (uint32_t)parse_long(a, v, 0, UINT32_MAX);
            o->have_peer_rank = true;
        } else if (!strcmp(a, "--spin"))
            o->spin_ns = parse_long(a, v, -1, 10000000000L);
        else if (!strcmp(a, "--count"))
            o->count = parse_long(a, v, 1, MAX_COUNT);
        else if (!strcmp(a, "--size"))
            o->size = (size_t)parse_long(a, v, 1, MAX_SIZE);
        else if (!strcmp(a, "--timeout-ms"))
            o->timeout_ms = (int)parse_long(a, v, 1, 3600000);
        else if (!strcmp(a, "--gap-ms"))
            o->gap_ms = (int)parse_long(a, v, 0, 60000);
        else {
            char msg[96];
            snprintf(msg, sizeof msg, "unknown option %s", a);
            usage_error(msg);
        }
    }
    if (!strcmp(o->cmd, "position")) {
        if (!o->bar0)
            usage_error("position needs --bar0 (or IVSHM_BAR0)");
    } else if (!o->server && !o->region) {
        usage_error("no region: give --server or --region (or IVSHM_BAR2)");
    }
    if (!o->have_peer_rank)
        o->peer_rank = o->rank ^ 1u;
}


static ivshm *attach(const struct opts *o)
{
    ivshm_config cfg = {.job_id = o->job, .rank = o->rank, .name = o->name,
                        .spin_ns = o->spin_ns, .doorbell_id = -1};
    ivshm *h = NULL;
    int rc;
    if (o->server) {
        rc = ivshm_attach_server(o->server, &cfg, &h);
    } else {
        /* without both, attach_path falls back to futexes, which cannot
           cross the VM boundary: only useful on a host */
        cfg.uio_dev = o->uio;
        cfg.bar0_path = o->bar0;
        rc = ivshm_attach_path(o->region, &cfg, &h);
    }
    if (rc < 0)
        fail("attach", rc);
    return h;
}

static int self_doorbell(ivshm *h)
{
    ivshm_peer_info me;
    return ivshm_peer(h, ivshm_self(h), &me) == 0 ? me.doorbell_id : -1;
}

/* The partner's slot, waiting (bounded) for it to attach. */
static int find_partner(ivshm *h, const struct opts *o)
{
    uint64_t deadline = now_ns() + (uint64_t)o->timeout_ms * 1000000ull;
    int slot;
    while ((slot = ivshm_find(h, o->job, o->peer_rank)) < 0) {
        if (now_ns() > deadline)
            fail("partner never attached", -ETIMEDOUT);
        ivshm_reap(h);
        sleep_ms(5);
    }
    return slot;
}

/* One message each way, so both sides know the other is listening. The
   lower rank speaks first. */
static void handshake(ivshm *h, const struct opts *o, int peer)
{
    char b = 'h';
    int rc;
    bool first = o->rank < o->peer_rank;
    for (int step = 0; step < 2; step++) {
        if ((step == 0) == first) {
            if ((rc = ivshm_send(h, peer, 1, &b, 1)) < 0)
                fail("handshake send", rc);
        } else {
            ssize_t n = ivshm_recv(h, peer, NULL, NULL, &b, 1, o->timeout_ms);
            if (n < 0)
                fail("handshake recv", (int)n);
        }
    }
}

static void print_stats_tail(ivshm *h)
{
    ivshm_stats st;
    ivshm_get_stats(h, &st);
    printf("\"sends\":%" PRIu64 ",\"recvs\":%" PRIu64 ",\"sleeps\":%" PRIu64
           ",\"rings\":%" PRIu64 "}\n",
           st.sends, st.recvs, st.sleeps, st.rings);
}

/* ---- commands ---- */

static int cmd_info(const struct opts *o)
{
    ivshm *h = attach(o);
    printf("{\"cmd\":\"info\",\"slot\":%d,\"doorbell_id\":%d,\"peers\":[",
           ivshm_self(h), self_doorbell(h));
    bool first = true;
    for (int s = 0; s < ivshm_max_peers(h); s++) {
        ivshm_peer_info p;
        if (ivshm_peer(h, s, &p) < 0)
            continue;
        printf("%s{\"slot\":%d,\"job\":%" PRIu64 ",\"rank\":%u,"
               "\"doorbell_id\":%d}",
               first ? "" : ",", p.slot, p.job_id, p.rank, p.doorbell_id);
        first = false;
    }
    printf("]}\n");
    ivshm_detach(h);
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int cmd_ping(const struct opts *o, bool initiator)
{
    ivshm *h = attach(o);
    int peer = find_partner(h, o);
    handshake(h, o, peer);
    char *buf = malloc(o->size);
    uint64_t *rtt = calloc((size_t)o->count, sizeof *rtt);
    if (!buf || !rtt)
        fail("malloc", -ENOMEM);
    for (long i = 0; i < o->count; i++) {
        int rc;
        ssize_t n;
        if (initiator) {
            if (o->gap_ms)
                sleep_ms(o->gap_ms); /* let the partner fall asleep */
            memset(buf, (int)(i & 0xff), o->size);
            uint64_t t0 = now_ns();
            if ((rc = ivshm_send(h, peer, (uint32_t)i, buf, o->size)) < 0)
                fail("send", rc);
            uint32_t tag = 0;
            n = ivshm_recv(h, peer, NULL, &tag, buf, o->size, o->timeout_ms);
            rtt[i] = now_ns() - t0;
            if (n < 0)
                fail("recv", (int)n);
            if ((size_t)n != o->size || tag != (uint32_t)i ||
                buf[0] != (char)(i & 0xff) || buf[n - 1] != (char)(i & 0xff))
                fail("echo does not match what was sent", -EBADMSG);
        } else {
            uint32_t tag = 0;
            n = ivshm_recv(h, peer, NULL, &tag, buf, o->size, o->timeout_ms);
            if (n < 0)
                fail("recv", (int)n);
            if ((size_t)n > o->size)
                fail("message longer than --size", -EMSGSIZE);
            if ((rc = ivshm_send(h, peer, tag, buf, (size_t)n)) < 0)
                fail("send", rc);
        }
    }
    if (initiator) {
        qsort(rtt, (size_t)o->count, sizeof *rtt, cmp_u64);
        printf("{\"cmd\":\"ping\",\"count\":%ld,\"size\":%zu,"
               "\"rtt_us_median\":%.1f,\"rtt_us_min\":%.1f,"
               "\"rtt_us_max\":%.1f,",
               o->count, o->size, rtt[o->count / 2] / 1e3, rtt[0] / 1e3,
               rtt[o->count - 1] / 1e3);
    } else {
        printf("{\"cmd\":\"pong\",\"count\":%ld,", o->count);
    }
    print_stats_tail(h);
    free(buf);
    free(rtt);
    ivshm_detach(h);
    return 0;
}

static uint8_t pattern(uint32_t rank, long round, uint64_t i)
{
    return (uint8_t)(rank * 131u + (uint64_t)round * 17u + i * 7u + 1u);
}

/* One segment per rank up to the higher of the pair's two. */
static uint32_t window_segments(const struct opts *o)
{
    return (o->rank > o->peer_rank ? o->rank : o->peer_rank) + 1;
}

static int cmd_window(const struct opts *o)
{
    ivshm *h = attach(o);
    find_partner(h, o);
    uint32_t nseg = window_segments(o);
    ivshm_window *w;
    int rc = ivshm_win_open(h, "ivshm-guest", nseg, o->size, &w);
    if (rc < 0)
        fail("win_open", rc);
    uint8_t *buf = malloc(o->size);
    if (!buf)
        fail("malloc", -ENOMEM);
    for (long r = 0; r < o->count; r++) {
        /* write what the partner will find in its own segment */
        for (size_t i = 0; i < o->size; i++)
            buf[i] = pattern(o->rank, r, i);
        if ((rc = ivshm_win_put(w, o->peer_rank, 0, buf, o->size)) < 0)
            fail("win_put", rc);
        if ((rc = ivshm_win_flush(w, o->peer_rank)) < 0)
            fail("win_flush", rc);
        if ((rc = ivshm_win_barrier(w, o->timeout_ms)) < 0)
            fail("win_barrier", rc);
        const uint8_t *mine = ivshm_win_ptr(w, o->rank);
        if (!mine)
            fail("win_ptr", -EINVAL);
        for (size_t i = 0; i < o->size; i++)
            if (mine[i] != pattern(o->peer_rank, r, i))
                fail("own segment does not hold the partner's put", -EBADMSG);
        if ((rc = ivshm_win_get(w, o->peer_rank, 0, buf, o->size)) < 0)
            fail("win_get", rc);
        for (size_t i = 0; i < o->size; i++)
            if (buf[i] != pattern(o->rank, r, i))
                fail("get does not return our put", -EBADMSG);
        /* nobody overwrites a segment the other is still checking */
        if ((rc = ivshm_win_barrier(w, o->timeout_ms)) < 0)
            fail("win_barrier", rc);
    }
    printf("{\"cmd\":\"window\",\"rounds\":%ld,\"bytes\":%zu,", o->count,
           o->size);
    print_stats_tail(h);
    free(buf);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

/* Both ranks add 1 to the same word --count times at once. In a guest
   the atomicity of these adds is QEMU's to keep (TCG emulates `lock`
   instructions), so the total is the check: 2 x count, or updates were
   lost. */
static int cmd_atomic(const struct opts *o)
{
    ivshm *h = attach(o);
    find_partner(h, o);
    uint32_t nseg = window_segments(o);
    ivshm_window *w;
    int rc = ivshm_win_open(h, "ivshm-guest-atomic", nseg, 64, &w);
    if (rc < 0)
        fail("win_open", rc);
    if ((rc = ivshm_win_barrier(w, o->timeout_ms)) < 0) /* start together */
        fail("win_barrier", rc);
    uint64_t t0 = now_ns();
    for (long i = 0; i < o->count; i++)
        if ((rc = ivshm_win_fetch_add(w, 0, 0, 1, NULL)) < 0)
            fail("win_fetch_add", rc);
    uint64_t t1 = now_ns();
    if ((rc = ivshm_win_barrier(w, o->timeout_ms)) < 0)
        fail("win_barrier", rc);
    int64_t total;
    if ((rc = ivshm_win_fetch_add(w, 0, 0, 0, &total)) < 0)
        fail("win_fetch_add", rc);
    printf("{\"cmd\":\"atomic\",\"count\":%ld,\"total\":%" PRId64
           ",\"ns_per_add\":%.1f,", o->count, total,
           (double)(t1 - t0) / (double)o->count);
    print_stats_tail(h);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static int cmd_wait(const struct opts *o)
{
    ivshm *h = attach(o);
    uint64_t t0 = now_ns();
    int rc = ivshm_wait_message(h, o->timeout_ms);
    if (rc < 0 && rc != -ETIMEDOUT)
        fail("wait_message", rc);
    printf("{\"cmd\":\"wait\",\"result\":\"%s\",\"ms\":%.1f,",
           rc == 0 ? "message" : "timeout", (now_ns() - t0) / 1e6);
    print_stats_tail(h);
    ivshm_detach(h);
    return 0;
}

static int cmd_watch(const struct opts *o)
{
    ivshm *h = attach(o);
    int peer = find_partner(h, o);
    handshake(h, o, peer);
    /* Tell whoever drives the test that we are in place. */
    fprintf(stderr, "%s: watching slot %d\n", prog, peer);
    uint64_t t0 = now_ns();
    char b;
    ssize_t n;
    do {
        n = ivshm_recv(h, peer, NULL, NULL, &b, 1, o->timeout_ms);
    } while (n >= 0);
    if (n != IVSHM_EPEERDEAD)
        fail("recv", (int)n);
    printf("{\"cmd\":\"watch\",\"result\":\"peerdead\",\"ms\":%.1f,",
           (now_ns() - t0) / 1e6);
    print_stats_tail(h);
    ivshm_detach(h);
    return 0;
}

#define BAR0_BYTES 256
#define REG_IVPOSITION 8

/* One read of the IVPosition register through a sysfs mapping of BAR0:
   no attachment, no registry entry, no interrupt, so it is quick and
   leaves nothing behind. The register reads all ones until QEMU has the
   server's answer; only 16 bits are usable as a doorbell id. */
static int cmd_position(const struct opts *o)
{
    int fd = open(o->bar0, O_RDWR | O_SYNC | O_CLOEXEC);
    if (fd < 0)
        fail(o->bar0, -errno);
    void *bar = mmap(NULL, BAR0_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (bar == MAP_FAILED)
        fail(o->bar0, -e);
    uint32_t pos = ((volatile uint32_t *)bar)[REG_IVPOSITION / 4];
    munmap(bar, BAR0_BYTES);
    if (pos > 0xffff)
        fail("IVPosition not assigned (no server yet?)", -ENODEV);
    printf("{\"cmd\":\"position\",\"position\":%" PRIu32 "}\n", pos);
    return 0;
}

int main(int argc, char **argv)
{
    struct opts o;
    parse(argc, argv, &o);
    /* results go to a pipe or file: flush each line as it is written */
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    if (!strcmp(o.cmd, "info"))
        return cmd_info(&o);
    if (!strcmp(o.cmd, "ping"))
        return cmd_ping(&o, true);
    if (!strcmp(o.cmd, "pong"))
        return cmd_ping(&o, false);
    if (!strcmp(o.cmd, "window"))
        return cmd_window(&o);
    if (!strcmp(o.cmd, "atomic"))
        return cmd_atomic(&o);
    if (!strcmp(o.cmd, "wait"))
        return cmd_wait(&o);
    if (!strcmp(o.cmd, "watch"))
        return cmd_watch(&o);
    if (!strcmp(o.cmd, "position"))
        return cmd_position(&o);
    usage_error(UNKNOWN_COMMAND); /* parse() refused it already */
    return 2;
}
