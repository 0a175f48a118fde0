/*
 * The provider's per-message path as Open MPI 5's pml cm + mtl ofi drive
 * it in a message-rate loop (osu's bw at 8 B): two endpoints of this one
 * process in one region, a CQ of FI_CQ_FORMAT_TAGGED bound with
 * FI_SELECTIVE_COMPLETION, windows of W receives posted first (directed,
 * a full tag), W fi_tsenddata of 8 B with a context each, then the
 * completions read in batches of up to 100 on both sides. One thread
 * plays both ends, so no call waits on the other process and every run
 * executes the same instructions: run it under
 *   valgrind --tool=callgrind fiv_rate WINDOWS [W]
 * and divide each phase's inclusive count (post_window, send_window,
 * drain_rx, drain_tx, and idle_polls, W reads that find nothing: out of
 * line for that) by WINDOWS * W
 * (docs/fast-path.md, "The provider's per-message path"). Without
 * valgrind it prints the rate, a figure of one core doing both ends.
 * Usage: FI_PROVIDER_PATH=<dir of libivshm-fi.so> fiv_rate [windows] [W]
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include "ivshm.h"

#define REQ(cond)                                                            \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__,      \
                    #cond);                                                  \
            exit(1);                                                         \
        }                                                                    \
    } while (0)
#define REQ_RC(expr, want)                                                   \
    do {                                                                     \
        long long rc_ = (long long)(expr);                                   \
        if (rc_ != (long long)(want)) {                                      \
            fprintf(stderr, "%s:%d: %s = %lld (%s)\n", __FILE__, __LINE__,   \
                    #expr, rc_, fi_strerror((int)-rc_));                     \
            exit(1);                                                         \
        }                                                                    \
    } while (0)

enum { BATCH = 100, NAMELEN = 64 }; /* mtl ofi's ofi_progress_event_count */

static char region[96];

static void unlink_region(void)
{
    unlink(region);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct end {
    struct fi_info *info;
    struct fid_fabric *fab;
    struct fid_domain *dom;
    struct fid_ep *ep;
    struct fid_av *av;
    struct fid_cq *cq;
    fi_addr_t peer;
};

static void open_end(struct end *e)
{
    struct fi_info *hints = fi_allocinfo();
    REQ(hints);
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->control_progress = FI_PROGRESS_MANUAL;
    hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    hints->tx_attr->op_flags = FI_COMPLETION;
    hints->rx_attr->op_flags = FI_COMPLETION;
    hints->fabric_attr->prov_name = strdup("ivshm");
    REQ_RC(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &e->info), 0);
    fi_freeinfo(hints);
    struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_TAGGED};
    struct fi_av_attr ava = {.type = FI_AV_MAP};
    REQ_RC(fi_fabric(e->info->fabric_attr, &e->fab, NULL), 0);
    REQ_RC(fi_domain(e->fab, e->info, &e->dom, NULL), 0);
    REQ_RC(fi_endpoint(e->dom, e->info, &e->ep, NULL), 0);
    REQ_RC(fi_cq_open(e->dom, &cqa, &e->cq, NULL), 0);
    REQ_RC(fi_av_open(e->dom, &ava, &e->av, NULL), 0);
    REQ_RC(fi_ep_bind(e->ep, &e->cq->fid,
                      FI_TRANSMIT | FI_RECV | FI_SELECTIVE_COMPLETION), 0);
    REQ_RC(fi_ep_bind(e->ep, &e->av->fid, 0), 0);
    REQ_RC(fi_enable(e->ep), 0);
}

static void close_end(struct end *e)
{
    REQ_RC(fi_close(&e->ep->fid), 0);
    REQ_RC(fi_close(&e->av->fid), 0);
    REQ_RC(fi_close(&e->cq->fid), 0);
    REQ_RC(fi_close(&e->dom->fid), 0);
    REQ_RC(fi_close(&e->fab->fid), 0);
    fi_freeinfo(e->info);
}

static void meet(struct end *a, struct end *b)
{
    char na[NAMELEN] = {0}, nb[NAMELEN] = {0};
    size_t la = sizeof na, lb = sizeof nb;
    REQ_RC(fi_getname(&a->ep->fid, na, &la), 0);
    REQ_RC(fi_getname(&b->ep->fid, nb, &lb), 0);
    REQ_RC(fi_av_insert(a->av, nb, 1, &a->peer, 0, NULL), 1);
    REQ_RC(fi_av_insert(b->av, na, 1, &b->peer, 0, NULL), 1);
}

static uint64_t rbuf[1024], sbuf = 7;
static struct fi_context2 rctx[1024], sctx[1024];
static struct fi_cq_tagged_entry ents[BATCH];

__attribute__((noipa)) static void post_window(struct end *r, int w,
                                                  uint64_t tag)
{
    for (int k = 0; k < w; k++)
        REQ_RC(fi_trecv(r->ep, &rbuf[k], 8, NULL, r->peer, tag, 0, &rctx[k]), 0);
}

__attribute__((noipa)) static void send_window(struct end *s, int w,
                                                  uint64_t tag)
{
    for (int k = 0; k < w; k++)
        REQ_RC(fi_tsenddata(s->ep, &sbuf, 8, NULL, 1, s->peer, tag, &sctx[k]),
               0);
}

/* Reads until `want` completions came: a bounded number of calls, since
   the messages are in the region already (or, tx, completed). */
static void drain(struct end *e, int want)
{
    int got = 0;
    for (int calls = 0; got < want; calls++) {
        REQ(calls < 100000);
        ssize_t n = fi_cq_read(e->cq, ents, BATCH);
        if (n == -FI_EAGAIN)
            continue;
        REQ(n > 0);
        got += (int)n;
    }
    REQ(got == want);
}

__attribute__((noipa)) static void drain_rx(struct end *r, int w)
{
    drain(r, w);
}

__attribute__((noipa)) static void drain_tx(struct end *s, int w)
{
    drain(s, w);
}

/* A read that finds nothing, as mtl ofi's progress makes while it waits:
   W of them per window, so that its count reads per call. */
__attribute__((noipa)) static void idle_polls(struct end *e, int w)
{
    for (int k = 0; k < w; k++)
        REQ_RC(fi_cq_read(e->cq, ents, BATCH), -FI_EAGAIN);
}

int main(int argc, char **argv)
{
    int windows = argc > 1 ? atoi(argv[1]) : 20000;
    int w = argc > 2 ? atoi(argv[2]) : 64;
    if (windows < 1 || w < 1 || w > 1024 || !getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "usage: FI_PROVIDER_PATH=DIR fiv_rate [windows] "
                        "[W 1..1024]\n");
        return 2;
    }
    ivshm_geometry g = {.max_peers = 4, .slot_size = 16384 + 64};
    snprintf(region, sizeof region, "/dev/shm/fiv-rate-%d", (int)getpid());
    int rc = ivshm_format_file(region, ivshm_min_region_size(&g), &g, 0600);
    if (rc < 0) {
        fprintf(stderr, "cannot format %s: %s\n", region, ivshm_strerror(rc));
        return 1;
    }
    atexit(unlink_region);
    setenv("FI_IVSHM_REGION", region, 1);
    setenv("FI_IVSHM_CORE", "none", 1);
    struct end s = {0}, r = {0};
    open_end(&s);
    open_end(&r);
    meet(&s, &r);
    /* a warm-up window: introductions, the fast channel, the caches */
    for (int i = 0; i < 4; i++) {
        post_window(&r, w, 5);
        send_window(&s, w, 5);
        drain_rx(&r, w);
        drain_tx(&s, w);
    }
    double t0 = now_s();
    for (int i = 0; i < windows; i++) {
        post_window(&r, w, 9);
        send_window(&s, w, 9);
        drain_rx(&r, w);
        drain_tx(&s, w);
        idle_polls(&s, w);
        REQ(rbuf[0] == 7 && rbuf[w - 1] == 7);
    }
    double dt = now_s() - t0;
    printf("%d windows of %d: %.3f Mmsg/s (one core plays both ends)\n",
           windows, w, (double)windows * w / dt / 1e6);
    close_end(&r);
    close_end(&s);
    return 0;
}
