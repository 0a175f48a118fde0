/*
 * ivshmem-server: options, daemonizing, pid file and signals. The
 * protocol and the peer table are in server.c.
 *
 * Bad command lines exit 2 with one line on stderr; runtime failures
 * (socket in use, region exists, ...) exit 1. In daemon mode the parent
 * exits 0 only once the child listens and has written its pid file, so
 * "ivshmem-server ... && qemu ..." never races the socket.
 */
#define _GNU_SOURCE
#include "log.h"
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <grp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <syslog.h>
#include <unistd.h>

#define DEFAULT_SIZE (64ull << 20)
/* New connections per second (docs/server-protocol.md, "Budgets"): a
   process's rate well below its uid's, so that one process cannot
   spend what the uid's other processes (a tenant's QEMUs) need. */
#define DEFAULT_UID_RATE 64
#define DEFAULT_PID_RATE 8
#define MAX_SIZE (1ull << 46) /* ivshm_format_file's limit */

static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig)
{
    stop_signal = sig;
}

static void usage(FILE *f)
{
    fprintf(f,
"usage: ivshmem-server -S SOCKET [options]\n"
"  -S, --socket PATH     UNIX socket to listen on (required)\n"
"  -M, --shm PATH        host-file mode: create the region as this file (unsealed:\n"
"                        single-user only); default: a sealed memfd, no file\n"
"  -l, --size BYTES      region size, power of two, K/M/G suffix (default 64M)\n"
"  -n, --vectors N       interrupt vectors per peer, 1..%d (default 1)\n"
"      --max-peers N     registry slots of the region, 2..%d (default 8)\n"
"      --ring-slots N    slots per fast channel, power of two (default 64)\n"
"      --slot-size N     bytes per slot / queue cell, multiple of 64 (default 4096)\n"
"      --queue-slots N   cells of each peer's receive queue, a power of two\n"
"                        2..65536 (default 64)\n"
"      --fast-channels N fast per-pair channels per receiver, 0..%d (default 8;\n"
"                        0: none, every message through the queues)\n"
"      --max-clients N   connections at once, 1..%d (default 2 x max-peers)\n"
"      --max-clients-per-uid N  connections at once from one uid (default max-clients)\n"
"      --max-clients-per-pid N  connections at once from one process\n"
"                        (default max-peers / 2, at least 1)\n"
"      --connect-rate-per-uid N  new connections per second from one uid\n"
"                        (default %d; 0: no limit)\n"
"      --connect-rate-per-pid N  new connections per second from one process\n"
"                        (default %d; 0: no limit)\n"
"      --ids-per-pid N   ids one process may leave unusable (default max-ids / 16;\n"
"                        0: no limit)\n"
"      --max-ids N       hand out ids 0..N-1, 2..%d (default %d)\n"
"  -F, --foreground      do not daemonize\n"
"  -p, --pidfile PATH    write the server's pid there\n"
"  -s, --state PATH      JSON state file, rewritten on every join/leave\n"
"  -g, --group NAME      socket and region mode 0660 with this group (default 0600)\n"
"      --keep-shm        leave the region file (--shm) in place at shutdown\n"
"      --no-leave-notices  never tell clients that a peer left (its registry\n"
"                        entries are still marked dead): only for a server whose\n"
"                        clients are all QEMU ivshmem-doorbell devices, which\n"
"                        crash at unplug after a leave notice\n"
"  -v, --verbose         log joins and leaves\n"
"  -h, --help            this text\n"
"Each client holds one eventfd per vector of every other client: with many\n"
"peers raise the clients' RLIMIT_NOFILE (ulimit -n) above max-clients x vectors.\n",
            IVS_MAX_VECTORS, IVS_MAX_PEERS, IVS_MAX_FAST, IVS_MAX_CLIENTS,
            DEFAULT_UID_RATE, DEFAULT_PID_RATE, IVS_MAX_IDS, IVS_MAX_IDS);
}

/* One line on stderr, exit 2: the contract for a bad command line. */
static void __attribute__((noreturn, format(printf, 1, 2)))
bad_usage(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "ivshmem-server: %s (see --help)\n", line);
    exit(2);
}

static bool parse_uint(const char *s, unsigned long long max,
                       unsigned long long *out)
{
    if (!s || *s < '0' || *s > '9')
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return false;
    *out = v;
    return true;
}

static bool parse_size(const char *s, unsigned long long *out)
{
    if (!s || *s < '0' || *s > '9')
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return false;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    default: return false;
    }
    if (*end || (shift && v > (~0ull >> shift)))
        return false;
    *out = v << shift;
    return true;
}

/* The daemon chdirs to "/": every path it keeps must be absolute. The
   result lives in `buf` (static storage in main: alive until exit). */
static const char *absolute(const char *path, char *buf, size_t cap)
{
    char cwd[PATH_MAX];
    int n;
    if (path[0] == '/')
        n = snprintf(buf, cap, "%s", path);
    else if (getcwd(cwd, sizeof cwd))
        n = snprintf(buf, cap, "%s/%s", cwd, path);
    else
        bad_usage("cannot resolve path %s: %s", path, strerror(errno));
    if (n < 0 || (size_t)n >= cap)
        bad_usage("path too long: %s", path);
    return buf;
}

static int write_pidfile(const char *path)
{
    char line[32];
    int len = snprintf(line, sizeof line, "%d\n", (int)getpid());
    return ivs_write_file_atomic(path, line, (size_t)len);
}

/* Descriptors the server holds besides its clients': listener, spare,
   region, pid/state files being written, syslog, stdio. */
#define FD_SLACK 32u

/* More clients need more fds: each holds its socket and its `vectors`
   eventfds. The soft limit is raised to the hard one; if even that
   cannot hold the clients, a --max-clients the operator asked for is a
   bad command line (exit 2), and the default (2 x max-peers) shrinks to
   what fits, as long as every registry slot still can connect. */
static void fit_fd_limit(struct ivs_config *cfg, bool clients_given)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            (void)getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur == RLIM_INFINITY)
        return;
    const unsigned long long per_client = 1ull + cfg->vectors;
    const unsigned long long need = cfg->max_clients * per_client + FD_SLACK;
    if (need <= rl.rlim_cur)
        return;
    unsigned long long fit =
        rl.rlim_cur > FD_SLACK ? (rl.rlim_cur - FD_SLACK) / per_client : 0;
    unsigned slots = cfg->geometry.max_peers ? cfg->geometry.max_peers : 8;
    if (clients_given)
        bad_usage("--max-clients %u with %u vector(s) needs %llu file "
                  "descriptors but RLIMIT_NOFILE is %llu (raise ulimit -n / "
                  "LimitNOFILE=, or lower --max-clients)",
                  cfg->max_clients, cfg->vectors, need,
                  (unsigned long long)rl.rlim_cur);
    if (fit < slots)
        bad_usage("--max-peers %u with %u vector(s) needs %llu file "
                  "descriptors but RLIMIT_NOFILE is %llu (raise ulimit -n / "
                  "LimitNOFILE=)",
                  slots, cfg->vectors, slots * per_client + FD_SLACK,
                  (unsigned long long)rl.rlim_cur);
    ivs_log_info("RLIMIT_NOFILE %llu: at most %llu clients at once",
                 (unsigned long long)rl.rlim_cur, fit);
    cfg->max_clients = (unsigned)fit;
    if (cfg->max_per_uid > cfg->max_clients)
        cfg->max_per_uid = cfg->max_clients;
}

/* Parent side of daemonizing: wait for the child's "ready" byte. */
static int __attribute__((noreturn)) wait_for_daemon(pid_t child, int ready_fd)
{
    char c;
    ssize_t n;
    do
        n = read(ready_fd, &c, 1);
    while (n < 0 && errno == EINTR);
    if (n == 1)
        _exit(0);
    /* The child closed the pipe without "ready": it failed and said why
       on the stderr we share; pass its status on. */
    int st;
    if (waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st))
        _exit(WEXITSTATUS(st));
    _exit(1);
}



struct options {
    struct ivs_config cfg;
    const char *pidfile;
    bool foreground;
    bool clients_given; /* --max-clients on the command line */
    bool per_pid_given, uid_rate_given, pid_rate_given, ids_given;
};

static void resolve_group(const char *arg, struct ivs_config *cfg)
{
    unsigned long long v;
    struct group *gr = getgrnam(arg);
    if (gr)
        cfg->gid = gr->gr_gid;
    else if (parse_uint(arg, UINT32_MAX - 1, &v))
        cfg->gid = (gid_t)v;
    else
        bad_usage("unknown group '%s'", arg);
    cfg->shared_group = true;
}

/* Cross-option checks and defaults, once every option is read. */
static void check_config(struct ivs_config *cfg)
{
    if (cfg->size & (cfg->size - 1) || cfg->size == 0)
        bad_usage("size %llu is not a power of two (QEMU maps it as a PCI BAR)",
                  (unsigned long long)cfg->size);
    if (cfg->size > MAX_SIZE)
        bad_usage("size %llu is too large", (unsigned long long)cfg->size);
    uint64_t need = ivshm_min_region_size(&cfg->geometry);
    if (need == 0)
        bad_usage("invalid region geometry (ring-slots a power of two, "
                  "slot-size a multiple of 64 >= 128, a message of one "
                  "slot fitting the queue)");
    if (cfg->size < need)
        bad_usage("size %llu too small for this geometry (needs %llu)",
                  (unsigned long long)cfg->size, (unsigned long long)need);
    if (cfg->keep_shm && !cfg->shm_path)
        bad_usage("--keep-shm needs a region file (--shm)");
    unsigned slots = cfg->geometry.max_peers ? cfg->geometry.max_peers : 8;
    if (!cfg->max_clients)
        cfg->max_clients = 2 * slots <= IVS_MAX_CLIENTS ? 2 * slots
                                                        : IVS_MAX_CLIENTS;
    if (!cfg->max_per_uid || cfg->max_per_uid > cfg->max_clients)
        cfg->max_per_uid = cfg->max_clients;
    if (!cfg->max_ids)
        cfg->max_ids = IVS_MAX_IDS;
    if (cfg->max_ids < cfg->max_clients)
        bad_usage("--max-ids %u is below --max-clients %u", cfg->max_ids,
                  cfg->max_clients);
}

/* The budgets' defaults, once the caps they are sized against are
   final (fit_fd_limit may lower max-clients): a process gets at most
   half the registry's slots, so the others of its uid keep room for a
   full registry (max-clients is 2 x max-peers by default). */
static void default_budgets(struct options *o)
{
    struct ivs_config *cfg = &o->cfg;
    unsigned slots = cfg->geometry.max_peers ? cfg->geometry.max_peers : 8;
    if (!o->per_pid_given)
        cfg->max_per_pid = slots / 2 ? slots / 2 : 1;
    if (cfg->max_per_pid > cfg->max_per_uid)
        cfg->max_per_pid = cfg->max_per_uid;
    if (!o->uid_rate_given)
        cfg->uid_rate = DEFAULT_UID_RATE;
    if (!o->pid_rate_given)
        cfg->pid_rate = DEFAULT_PID_RATE;
    if (!o->ids_given)
        cfg->ids_per_pid = cfg->max_ids / 16;
}

static void parse_options(int argc, char **argv, struct options *o)
{
    enum { OPT_MAX_PEERS = 256, OPT_RING_SLOTS, OPT_SLOT_SIZE, OPT_KEEP_SHM,
           OPT_MAX_CLIENTS, OPT_MAX_PER_UID, OPT_QUEUE_SLOTS,
           OPT_FAST_CHANNELS, OPT_MAX_PER_PID, OPT_UID_RATE, OPT_PID_RATE,
           OPT_IDS_PER_PID, OPT_MAX_IDS, OPT_NO_LEAVE_NOTICES };
    static const struct option longopts[] = {
        {"socket", required_argument, NULL, 'S'},
        {"shm", required_argument, NULL, 'M'},
        {"size", required_argument, NULL, 'l'},
        {"vectors", required_argument, NULL, 'n'},
        {"max-peers", required_argument, NULL, OPT_MAX_PEERS},
        {"ring-slots", required_argument, NULL, OPT_RING_SLOTS},
        {"slot-size", required_argument, NULL, OPT_SLOT_SIZE},
        {"queue-slots", required_argument, NULL, OPT_QUEUE_SLOTS},
        {"fast-channels", required_argument, NULL, OPT_FAST_CHANNELS},
        {"max-clients", required_argument, NULL, OPT_MAX_CLIENTS},
        {"max-clients-per-uid", required_argument, NULL, OPT_MAX_PER_UID},
        {"max-clients-per-pid", required_argument, NULL, OPT_MAX_PER_PID},
        {"connect-rate-per-uid", required_argument, NULL, OPT_UID_RATE},
        {"connect-rate-per-pid", required_argument, NULL, OPT_PID_RATE},
        {"ids-per-pid", required_argument, NULL, OPT_IDS_PER_PID},
        {"max-ids", required_argument, NULL, OPT_MAX_IDS},
        {"foreground", no_argument, NULL, 'F'},
        {"pidfile", required_argument, NULL, 'p'},
        {"state", required_argument, NULL, 's'},
        {"group", required_argument, NULL, 'g'},
        {"keep-shm", no_argument, NULL, OPT_KEEP_SHM},
        {"no-leave-notices", no_argument, NULL, OPT_NO_LEAVE_NOTICES},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    /* static: the daemon keeps these paths until exit */
    static char socket_buf[PATH_MAX], shm_buf[PATH_MAX], state_buf[PATH_MAX],
        pid_buf[PATH_MAX];
    struct ivs_config *cfg = &o->cfg;
    const char *socket_arg = NULL;
    unsigned long long v;

    opterr = 0; /* our own one-line messages */
    int opt;
    while ((opt = getopt_long(argc, argv, ":S:M:l:n:Fp:s:g:vh", longopts,
                              NULL)) != -1) {
        switch (opt) {
        case 'S': socket_arg = optarg; break;
        case 'M':
            if (!*optarg)
                bad_usage("empty --shm path");
            cfg->shm_path = absolute(optarg, shm_buf, sizeof shm_buf);
            break;
        case 'l':
            if (!parse_size(optarg, &v))
                bad_usage("bad size '%s'", optarg);
            cfg->size = v;
            break;
        case 'n':
            if (!parse_uint(optarg, IVS_MAX_VECTORS, &v) || v < 1)
                bad_usage("vectors must be 1..%d, not '%s'", IVS_MAX_VECTORS,
                          optarg);
            cfg->vectors = (unsigned)v;
            break;
        case OPT_MAX_PEERS:
            if (!parse_uint(optarg, IVS_MAX_PEERS, &v) || v < 2)
                bad_usage("--max-peers must be 2..%d, not '%s'", IVS_MAX_PEERS,
                          optarg);
            cfg->geometry.max_peers = (uint32_t)v;
            break;
        case OPT_RING_SLOTS:
            if (!parse_uint(optarg, UINT32_MAX, &v) || v < 1)
                bad_usage("bad --ring-slots '%s'", optarg);
            cfg->geometry.ring_slots = (uint32_t)v;
            break;
        case OPT_SLOT_SIZE:
            if (!parse_uint(optarg, UINT32_MAX, &v) || v < 1)
                bad_usage("bad --slot-size '%s'", optarg);
            cfg->geometry.slot_size = (uint32_t)v;
            break;
        case OPT_QUEUE_SLOTS:
            if (!parse_uint(optarg, IVS_MAX_QUEUE, &v) || v < 2 || (v & (v - 1)))
                bad_usage("--queue-slots must be a power of two in 2..%d, "
                          "not '%s'", IVS_MAX_QUEUE, optarg);
            cfg->geometry.queue_slots = (uint32_t)v;
            break;
        case OPT_FAST_CHANNELS:
            if (!parse_uint(optarg, IVS_MAX_FAST, &v))
                bad_usage("--fast-channels must be 0..%d, not '%s'",
                          IVS_MAX_FAST, optarg);
            /* 0 on the command line: none (0 in the geometry: default) */
            cfg->geometry.fast_channels = v ? (uint32_t)v : IVSHM_FAST_NONE;
            break;
        case OPT_MAX_CLIENTS:
            if (!parse_uint(optarg, IVS_MAX_CLIENTS, &v) || v < 1)
                bad_usage("--max-clients must be 1..%d, not '%s'",
                          IVS_MAX_CLIENTS, optarg);
            cfg->max_clients = (unsigned)v;
            o->clients_given = true;
            break;
        case OPT_MAX_PER_UID:
            if (!parse_uint(optarg, IVS_MAX_CLIENTS, &v) || v < 1)
                bad_usage("--max-clients-per-uid must be 1..%d, not '%s'",
                          IVS_MAX_CLIENTS, optarg);
            cfg->max_per_uid = (unsigned)v;
            break;
        case OPT_MAX_PER_PID:
            if (!parse_uint(optarg, IVS_MAX_CLIENTS, &v) || v < 1)
                bad_usage("--max-clients-per-pid must be 1..%d, not '%s'",
                          IVS_MAX_CLIENTS, optarg);
            cfg->max_per_pid = (unsigned)v;
            o->per_pid_given = true;
            break;
        case OPT_UID_RATE:
        case OPT_PID_RATE:
            if (!parse_uint(optarg, 1000000, &v))
                bad_usage("%s must be 0..1000000, not '%s'",
                          opt == OPT_UID_RATE ? "--connect-rate-per-uid"
                                              : "--connect-rate-per-pid",
                          optarg);
            if (opt == OPT_UID_RATE) {
                cfg->uid_rate = (unsigned)v;
                o->uid_rate_given = true;
            } else {
                cfg->pid_rate = (unsigned)v;
                o->pid_rate_given = true;
            }
            break;
        case OPT_IDS_PER_PID:
            if (!parse_uint(optarg, IVS_MAX_IDS, &v))
                bad_usage("--ids-per-pid must be 0..%d, not '%s'", IVS_MAX_IDS,
                          optarg);
            cfg->ids_per_pid = (unsigned)v;
            o->ids_given = true;
            break;
        case OPT_MAX_IDS:
            if (!parse_uint(optarg, IVS_MAX_IDS, &v) || v < 2)
                bad_usage("--max-ids must be 2..%d, not '%s'", IVS_MAX_IDS,
                          optarg);
            cfg->max_ids = (uint32_t)v;
            break;
        case 'F': o->foreground = true; break;
        case 'p': o->pidfile = absolute(optarg, pid_buf, sizeof pid_buf); break;
        case 's':
            cfg->state_path = absolute(optarg, state_buf, sizeof state_buf);
            break;
        case 'g': resolve_group(optarg, cfg); break;
        case OPT_KEEP_SHM: cfg->keep_shm = true; break;
        case OPT_NO_LEAVE_NOTICES: cfg->no_leave_notices = true; break;
        case 'v': ivs_verbose = 1; break;
        case 'h':
            usage(stdout);
            exit(0);
        case ':':
            bad_usage("option %s needs an argument", argv[optind - 1]);
        default:
            if (optopt)
                bad_usage("unknown option -%c", optopt);
            bad_usage("unknown option %s", argv[optind - 1]);
        }
    }
    if (optind < argc)
        bad_usage("unexpected argument '%s'", argv[optind]);
    if (!socket_arg || !*socket_arg)
        bad_usage("--socket is required");
    cfg->socket_path = absolute(socket_arg, socket_buf, sizeof socket_buf);
    if (strlen(cfg->socket_path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        bad_usage("socket path too long: %s", cfg->socket_path);
    check_config(cfg);
    fit_fd_limit(cfg, o->clients_given);
    default_budgets(o);
}

/* Fork; the parent waits for "ready" and exits. Returns, in the child,
   the fd to write "ready" to. */
static int daemonize(void)
{
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) < 0) {
        perror("ivshmem-server: pipe");
        exit(1);
    }
    fflush(NULL);
    pid_t child = fork();
    if (child < 0) {
        perror("ivshmem-server: fork");
        exit(1);
    }
    if (child > 0) {
        close(pipefd[1]);
        wait_for_daemon(child, pipefd[0]);
    }
    close(pipefd[0]);
    setsid();
    if (chdir("/") < 0)
        exit(1);
    return pipefd[1];
}

/* Stop signals stay blocked except inside ppoll (`wait_mask`), so they
   are seen exactly there and never interrupt a half-done join. */
static void setup_signals(sigset_t *wait_mask)
{
    static const int stops[] = {SIGTERM, SIGINT, SIGHUP};
    struct sigaction sa = {.sa_handler = on_stop_signal};
    sigemptyset(&sa.sa_mask);
    sigset_t set;
    sigemptyset(&set);
    for (size_t i = 0; i < sizeof stops / sizeof *stops; i++) {
        sigaction(stops[i], &sa, NULL);
        sigaddset(&set, stops[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    sigprocmask(SIG_BLOCK, &set, wait_mask);
    for (size_t i = 0; i < sizeof stops / sizeof *stops; i++)
        sigdelset(wait_mask, stops[i]);
}

/* Daemon: from here on nobody reads our stderr (a caller capturing it
   would otherwise wait for EOF as long as we run): syslog, then tell the
   parent we are ready. */
static void detach_stdio(int ready_fd)
{
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        close(null);
    }
    openlog("ivshmem-server", LOG_PID, LOG_DAEMON);
    ivs_log_target = IVS_LOG_SYSLOG;
    ssize_t n = write(ready_fd, "1", 1);
    (void)n;
    close(ready_fd);
}

int main(int argc, char **argv)
{
    struct options o = {.cfg = {.size = DEFAULT_SIZE, .vectors = 1}};
    parse_options(argc, argv, &o);
    int ready_fd = o.foreground ? -1 : daemonize();
    sigset_t wait_mask;
    setup_signals(&wait_mask);

    struct ivs_server *srv;
    int rc = ivs_server_start(&o.cfg, &srv);
    if (rc < 0) {
        if (rc == -ENAMETOOLONG || rc == -EINVAL || rc == -ENOMEM)
            ivs_log_error("%s", ivshm_strerror(rc));
        return 1;
    }
    if (o.pidfile && (rc = write_pidfile(o.pidfile)) < 0) {
        ivs_log_error("pid file %s: %s", o.pidfile, strerror(-rc));
        ivs_server_stop(srv);
        return 1;
    }
    ivs_server_publish(srv);
    if (ready_fd >= 0)
        detach_stdio(ready_fd);

    rc = ivs_server_run(srv, &stop_signal, &wait_mask);
    if (rc < 0)
        ivs_log_error("poll: %s", strerror(-rc));
    else
        ivs_log_info("signal %d: shutting down", (int)stop_signal);
    ivs_server_stop(srv);
    if (o.pidfile)
        unlink(o.pidfile);
    return rc < 0 ? 1 : 0;
}
