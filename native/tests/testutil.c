#define _GNU_SOURCE
#include "testutil.h"

#include <errno.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int tu_failed;
int tu_passed;

static char tu_path[128];
static pid_t tu_owner;

static void tu_cleanup(void)
{
    /* only the creating process removes it, not forked children */
    if (tu_path[0] && getpid() == tu_owner)
        unlink(tu_path);
}

const char *tu_region(uint64_t size, const ivshm_geometry *g)
{
    static unsigned counter;
    if (tu_path[0] && getpid() == tu_owner)
        unlink(tu_path);
    tu_path[0] = '\0';
    tu_owner = getpid();
    static int registered;
    if (!registered) {
        tu_cleanup_on_exit(tu_cleanup);
        registered = 1;
    }
    /* ivshm_format_file never replaces a file: a name left over by a
       crashed run (pid reuse) is skipped, not adopted. */
    int rc = -EEXIST;
    for (int tries = 0; rc == -EEXIST && tries < 100; tries++) {
        snprintf(tu_path, sizeof tu_path, "/dev/shm/ivshm-test-%d-%u",
                 (int)getpid(), counter++);
        rc = ivshm_format_file(tu_path, size, g, 0600);
    }
    if (rc < 0) {
        fprintf(stderr, "format %s: %s\n", tu_path, ivshm_strerror(rc));
        tu_path[0] = '\0';
        exit(1);
    }
    return tu_path;
}

ivshm *tu_attach(const char *path, uint64_t job, uint32_t rank,
                 int64_t spin_ns)
{
    ivshm_config cfg = {.job_id = job, .rank = rank, .spin_ns = spin_ns};
    ivshm *h = NULL;
    int rc = ivshm_attach_path(path, &cfg, &h);
    if (rc < 0) {
        fprintf(stderr, "[pid %d] attach %s: %s\n", (int)getpid(), path,
                ivshm_strerror(rc));
        _exit(98);
    }
    return h;
}

pid_t tu_fork_child(void)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        /* A test killed by ctest's timeout (SIGKILL) cannot reap its
           children: they go with it instead of spinning on as orphans
           (the setting survives exec). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) /* it died before the prctl */
            _exit(97);
    }
    return pid;
}

pid_t tu_fork(int (*fn)(void *), void *arg)
{
    fflush(NULL);
    pid_t pid = tu_fork_child();
    if (pid == 0)
        _exit(fn(arg));
    return pid;
}

int tu_wait(pid_t pid, int timeout_ms)
{
    struct timespec step = {0, 1000000};
    for (int waited = 0;; waited++) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (r < 0)
            return -1;
        if (waited >= timeout_ms) {
            fprintf(stderr, "pid %d still running after %d ms: killed\n",
                    (int)pid, timeout_ms);
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        nanosleep(&step, NULL);
    }
}

int tu_summary(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, tu_passed, tu_failed);
    return tu_failed ? 1 : 0;
}

void tu_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

uint64_t tu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t tu_now_ms(void)
{
    return tu_now_ns() / 1000000ull;
}

int tu_await_peer(ivshm *h, uint64_t job, uint32_t rank, int timeout_ms)
{
    for (int i = 0; i < timeout_ms; i++) {
        int s = ivshm_find(h, job, rank);
        if (s >= 0)
            return s;
        tu_sleep_ms(1);
    }
    return -1;
}

bool tu_exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

char *tu_read_text(const char *path)
{
    static char buf[8192];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0)
        return NULL;
    buf[n] = '\0';
    return buf;
}

const char *tu_server_bin(void)
{
    const char *bin = getenv("IVSHM_SERVER_BIN");
    if (!bin || access(bin, X_OK) < 0) {
        fprintf(stderr, "IVSHM_SERVER_BIN not set or not executable\n");
        return NULL;
    }
    return bin;
}

static void (*exit_cleanups[4])(void);
static unsigned n_exit_cleanups;

static void cleanup_and_die(int sig)
{
    for (unsigned i = 0; i < n_exit_cleanups; i++)
        exit_cleanups[i]();
    signal(sig, SIG_DFL);
    raise(sig);
}

void tu_cleanup_on_exit(void (*cleanup)(void))
{
    if (n_exit_cleanups == sizeof exit_cleanups / sizeof *exit_cleanups) {
        fprintf(stderr, "tu_cleanup_on_exit: too many\n");
        exit(1);
    }
    exit_cleanups[n_exit_cleanups++] = cleanup;
    atexit(cleanup);
    const int sigs[] = {SIGINT, SIGTERM, SIGABRT, SIGALRM};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++)
        signal(sigs[i], cleanup_and_die);
}
