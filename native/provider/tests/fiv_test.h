/* Helpers of the provider's C tests: a unique region file, N real
   processes that open the provider through libfabric's public API and
   swap their names through the parent, completion waits with deadlines,
   checks that count. Header-only: each test is one file. */
#ifndef FIV_TEST_H
#define FIV_TEST_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include "ivshm.h"

#define MAXR 4
#define NAMELEN 64


#define REQ(cond)                                                            \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: [pid %d] failed: %s\n", __FILE__,        \
                    __LINE__, (int)getpid(), #cond);                         \
            _exit(99);                                                       \
        }                                                                    \
    } while (0)
#define REQ_RC(expr, want)                                                   \
    do {                                                                     \
        long long rc_ = (long long)(expr);                                   \
        if (rc_ != (long long)(want)) {                                      \
            fprintf(stderr, "%s:%d: [pid %d] %s = %lld (%s), wanted %lld\n", \
                    __FILE__, __LINE__, (int)getpid(), #expr, rc_,           \
                    fi_strerror((int)-rc_), (long long)(want));              \
            _exit(99);                                                       \
        }                                                                    \
    } while (0)

static uint64_t t_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

#define T_REGIONS 64
static char t_regions[T_REGIONS][320];
static int t_nregions;

static pid_t t_parent;

static void t_unlink_regions(void)
{
    if (getpid() != t_parent)
        return; /* a forked rank leaves the parent's files alone */
    for (int i = 0; i < t_nregions; i++)
        unlink(t_regions[i]);
}

/* Killed by a timeout (SIGTERM), ^C or a closed pipe: the files go too. */
static void t_on_signal(int sig)
{
    t_unlink_regions();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void t_track(const char *path);

/* A fresh region file for up to `peers` endpoints; removed at exit. */
static const char *t_region(uint32_t peers, uint32_t slot_size)
{
    ivshm_geometry g = {.max_peers = peers, .slot_size = slot_size};
    char p[96];
    snprintf(p, sizeof p, "/dev/shm/fiv-test-%d-%d", (int)getpid(), t_nregions);
    unlink(p);
    int rc = ivshm_format_file(p, ivshm_min_region_size(&g), &g, 0600);
    if (rc < 0) {
        fprintf(stderr, "cannot format %s: %s\n", p, ivshm_strerror(rc));
        exit(1);
    }
    t_track(p);
    return t_regions[t_nregions - 1];
}

/* Remove `path` at exit (or when killed), as the regions are. */
static void t_track(const char *path)
{
    if (t_nregions >= T_REGIONS) {
        /* untracked, it would outlive the test */
        fprintf(stderr, "more than %d regions in one test\n", T_REGIONS);
        unlink(path);
        exit(1);
    }
    snprintf(t_regions[t_nregions], sizeof t_regions[0], "%s", path);
    if (t_nregions++ == 0) {
        t_parent = getpid();
        atexit(t_unlink_regions);
        signal(SIGTERM, t_on_signal);
        signal(SIGINT, t_on_signal);
        signal(SIGPIPE, t_on_signal);
    }
}

struct rank {
    int me, n;
    int sock;                  /* to the parent                           */
    struct fi_info *info;
    struct fid_fabric *fab;
    struct fid_domain *dom;
    struct fid_ep *ep;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_cntr *rcntr, *wcntr;
    fi_addr_t addr[MAXR];      /* FI_ADDR_NOTAVAIL: not inserted (yet)   */
    char names[MAXR * NAMELEN];
};

/* t_open's endpoint: a datagram one (FI_MSG only) when set */
static bool t_dgram;

static void t_open(struct rank *r, uint32_t version)
{
    struct fi_info *hints = fi_allocinfo();
    REQ(hints);
    hints->caps = t_dgram ? FI_MSG | FI_DIRECTED_RECV | FI_SOURCE
                          : FI_TAGGED | FI_MSG | FI_RMA | FI_ATOMIC |
                                FI_DIRECTED_RECV | FI_SOURCE;
    hints->ep_attr->type = t_dgram ? FI_EP_DGRAM : FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    if (getenv("FIV_TEST_AUTO")) /* a target that answers on its own */
        hints->domain_attr->data_progress = FI_PROGRESS_AUTO;
    const char *prov = getenv("FIV_TEST_PROVIDER"); /* the benchmark's shm */
    hints->fabric_attr->prov_name = strdup(prov ? prov : "ivshm");
    REQ_RC(fi_getinfo(version, NULL, NULL, 0, hints, &r->info), 0);
    fi_freeinfo(hints);
    /* FIV_TEST_CQ_SIZE: a case about the CQ's size (fiv_drain_test) */
    const char *cqs = getenv("FIV_TEST_CQ_SIZE");
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED,
                             .size = cqs ? (size_t)atol(cqs) : 256};
    struct fi_av_attr ava = {.type = getenv("FIV_TEST_AV_MAP") ? FI_AV_MAP
                                                                : FI_AV_TABLE};
    struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP};
    REQ_RC(fi_fabric(r->info->fabric_attr, &r->fab, NULL), 0);
    REQ_RC(fi_domain(r->fab, r->info, &r->dom, NULL), 0);
    REQ_RC(fi_endpoint(r->dom, r->info, &r->ep, NULL), 0);
    REQ_RC(fi_cq_open(r->dom, &cqa, &r->cq, NULL), 0);
    REQ_RC(fi_av_open(r->dom, &ava, &r->av, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->rcntr, NULL), 0);
    REQ_RC(fi_cntr_open(r->dom, &ca, &r->wcntr, NULL), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->av->fid, 0), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->rcntr->fid, FI_READ), 0);
    REQ_RC(fi_ep_bind(r->ep, &r->wcntr->fid, FI_WRITE), 0);
    REQ_RC(fi_enable(r->ep), 0);
}

static void t_close(struct rank *r)
{
    REQ_RC(fi_close(&r->ep->fid), 0);
    REQ_RC(fi_close(&r->av->fid), 0);
    REQ_RC(fi_close(&r->cq->fid), 0);
    REQ_RC(fi_close(&r->rcntr->fid), 0);
    REQ_RC(fi_close(&r->wcntr->fid), 0);
    REQ_RC(fi_close(&r->dom->fid), 0);
    REQ_RC(fi_close(&r->fab->fid), 0);
    fi_freeinfo(r->info);
}

static void t_read_full(int fd, void *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        REQ(n > 0);
        got += (size_t)n;
    }
}

/* Everyone's names, in rank order, inserted into the AV (after
   t_insert_delay_ms, for the rank that sets it), those of t_insert_mask
   (default: all); t_insert adds one later. */
static int t_insert_delay_ms;
static unsigned t_insert_mask = ~0u;

static void t_insert(struct rank *r, int i)
{
    /* one at a time: names of other providers differ in length */
    REQ_RC(fi_av_insert(r->av, r->names + i * NAMELEN, 1, &r->addr[i], 0,
                        NULL), 1);
}

static void t_exchange(struct rank *r)
{
    char name[NAMELEN] = {0};
    size_t len = sizeof name;
    REQ_RC(fi_getname(&r->ep->fid, name, &len), 0);
    REQ(len <= NAMELEN);
    char msg[1 + NAMELEN] = {'N'};
    memcpy(msg + 1, name, NAMELEN);
    REQ(write(r->sock, msg, sizeof msg) == (ssize_t)sizeof msg);
    t_read_full(r->sock, r->names, (size_t)r->n * NAMELEN);
    if (t_insert_delay_ms)
        usleep((useconds_t)t_insert_delay_ms * 1000);
    for (int i = 0; i < r->n; i++) {
        r->addr[i] = FI_ADDR_NOTAVAIL;
        if (t_insert_mask & (1u << i))
            t_insert(r, i);
    }
}

/* A barrier through the parent that does not drive progress. */
static inline void t_barrier_plain(struct rank *r)
{
    char c = 'B';
    REQ(write(r->sock, &c, 1) == 1);
    t_read_full(r->sock, &c, 1);
}

/* A barrier that drives progress while it waits (through a counter read,
   which consumes no completion): a target answers RMA meanwhile. */
static inline void t_barrier(struct rank *r)
{
    char c = 'B';
    REQ(write(r->sock, &c, 1) == 1);
    struct pollfd pfd = {.fd = r->sock, .events = POLLIN};
    while (poll(&pfd, 1, 0) == 0)
        (void)fi_cntr_read(r->rcntr);
    t_read_full(r->sock, &c, 1);
}

/* Progress for `ms` (through a counter read, which consumes no
   completion): what a peer asked for meanwhile is taken and answered,
   e.g. a drain request read and its SWITCH sent (fiv_drain, fiv_conform). */
static inline void t_progress_ms(struct rank *r, unsigned ms)
{
    for (uint64_t end = t_now_ms() + ms; t_now_ms() < end;)
        (void)fi_cntr_read(r->rcntr);
}

/* Send / receive a small blob through the parent (keys, addresses). */
static inline void t_bcast(struct rank *r, int root, void *buf, size_t len)
{
    char msg[1 + 1024];
    REQ(len <= 1024);
    msg[0] = r->me == root ? 'R' : 'r';
    memcpy(msg + 1, buf, len);
    REQ(write(r->sock, msg, 1 + len) == (ssize_t)(1 + len));
    /* progress meanwhile, as an MPI rank does in its collectives */
    struct pollfd pfd = {.fd = r->sock, .events = POLLIN};
    while (r->rcntr && poll(&pfd, 1, 0) == 0)
        (void)fi_cntr_read(r->rcntr);
    t_read_full(r->sock, buf, len);
}

/* The next completion (or error, returned as -err with *e filled). */
static int t_wait(struct rank *r, struct fi_cq_tagged_entry *e,
                  struct fi_cq_err_entry *err, fi_addr_t *src, int ms)
{
    uint64_t end = t_now_ms() + (uint64_t)ms;
    for (;;) {
        fi_addr_t from = FI_ADDR_NOTAVAIL;
        ssize_t n = fi_cq_readfrom(r->cq, e, 1, &from);
        if (n == 1) {
            if (src)
                *src = from;
            return 0;
        }
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry tmp;
            memset(&tmp, 0, sizeof tmp);
            REQ_RC(fi_cq_readerr(r->cq, &tmp, 0), 1);
            if (err)
                *err = tmp;
            return -tmp.err;
        }
        REQ(n == -FI_EAGAIN);
        if (t_now_ms() > end)
            return -FI_ETIMEDOUT;
    }
}

typedef void (*t_body)(struct rank *r);

/* Run body in n processes; env[i] (may be NULL) is "K=V;K=V" for rank i.
   The parent relays names, barriers and broadcasts. Returns the number of
   ranks that failed. `deadline_s` bounds the whole run. */
static int t_run_ex(int n, t_body body, const char *const *env, int deadline_s,
                    const char *stderr_to, unsigned killed_mask)
{
    int socks[MAXR];
    pid_t pids[MAXR];
    for (int i = 0; i < n; i++) {
        int sv[2];
        REQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        pid_t p = fork();
        REQ(p >= 0);
        if (p == 0) {
            close(sv[0]);
            if (env && env[i]) {
                char *e = strdup(env[i]);
                for (char *s, *kv = strtok_r(e, ";", &s); kv;
                     kv = strtok_r(NULL, ";", &s))
                    putenv(strdup(kv));
            }
            if (stderr_to) {
                char path[256];
                snprintf(path, sizeof path, "%s.%d", stderr_to, i);
                int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
                if (fd >= 0) {
                    dup2(fd, 2);
                    close(fd);
                }
            }
            alarm((unsigned)deadline_s);
            struct rank r = {.me = i, .n = n, .sock = sv[1]};
            body(&r);
            _exit(0);
        }
        close(sv[1]);
        socks[i] = sv[0];
        pids[i] = p;
    }
    /* relay: one message from every rank per step, by its first byte:
       'N' names (all of them go to all), 'B' barrier, 'R'/'r' broadcast
       (the root's bytes go to all) */
    int alive = n, failed = 0;
    for (;;) {
        char buf[MAXR][4096];
        ssize_t len[MAXR];
        bool done = false;
        for (int i = 0; i < n; i++) {
            len[i] = read(socks[i], buf[i], sizeof buf[i]);
            if (len[i] <= 0)
                done = true;
        }
        if (done)
            break;
        if (buf[0][0] == 'N') {
            char all[MAXR * NAMELEN];
            for (int i = 0; i < n; i++)
                memcpy(all + i * NAMELEN, buf[i] + 1, NAMELEN);
            for (int i = 0; i < n; i++)
                REQ(write(socks[i], all, (size_t)n * NAMELEN) > 0);
        } else if (buf[0][0] == 'B') {
            for (int i = 0; i < n; i++)
                REQ(write(socks[i], "B", 1) == 1);
        } else {
            int root = 0;
            for (int i = 0; i < n; i++)
                if (buf[i][0] == 'R')
                    root = i;
            for (int i = 0; i < n; i++)
                REQ(write(socks[i], buf[root] + 1, (size_t)len[root] - 1) > 0);
        }
    }
    for (int i = 0; i < n; i++) {
        int st = 0;
        waitpid(pids[i], &st, 0);
        if (killed_mask & (1u << i)) {
            if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGKILL) {
                fprintf(stderr, "rank %d should have been killed (status %#x)\n",
                        i, st);
                failed++;
            }
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "rank %d failed (status %#x)\n", i, st);
            failed++;
        }
        close(socks[i]);
        alive--;
    }
    (void)alive;
    return failed;
}

static int t_run(int n, t_body body, const char *const *env, int deadline_s,
                 const char *stderr_to)
{
    return t_run_ex(n, body, env, deadline_s, stderr_to, 0);
}

#endif
