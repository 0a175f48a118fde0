/*
 * A sender's last message is delivered however its departure and our
 * look for departed peers interleave (docs/provider.md, "Failures": a
 * peer that leaves fails only what waits on it, after what it sent).
 *
 * The receiver's progress looks for departed peers (fiv_probe_tick) only
 * in a call whose poll found nothing, and that call gives the CPU away
 * (sched_yield) between its poll and its look: a sender that sends its
 * last message and closes its endpoint in that gap leaves a message the
 * poll did not see and a slot the look finds free. That is where a
 * scheduler put libfabric's fi_flood server now and then. Here the gap
 * is made certain rather than lucky: the receiver's sched_yield is ours
 * (exported from this executable, so the provider the core loads calls
 * it), and the first one while a receive is pending lets the real sender
 * process send and leave, then waits out the provider's interval between
 * looks, so that the look follows in the same call.
 */
#include <sys/syscall.h>

#include "fiv_test.h"

static const uint32_t version = FI_VERSION(1, 17);

/* The receiver's gap: armed with its rank while a receive is pending. */
static struct rank *gap_rank;
static int gap_used;

int sched_yield(void)
{
    struct rank *r = gap_rank;
    if (r) {
        gap_rank = NULL;
        gap_used++;
        t_barrier_plain(r); /* the sender sends and leaves */
        t_barrier_plain(r); /* gone: its slot is free */
        /* past the provider's interval between looks (FIV_CHECK_NS,
           100 ms): the look is due as this call goes on */
        usleep(250 * 1000);
    }
    return (int)syscall(SYS_sched_yield);
}

/* Rank 1 sends a first message (so that the pair has spoken: a receive
   of any source waits on it) and, inside rank 0's gap, its last one,
   then leaves. Rank 0 receives both, the last one `directed` at rank 1
   or from any source. */
static void last_message(struct rank *r, bool directed)
{
    t_open(r, version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    if (r->me == 1) {
        uint64_t first = 1, last = 2;
        REQ_RC(fi_tsend(r->ep, &first, sizeof first, NULL, r->addr[0], 7,
                        &first), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_barrier_plain(r); /* rank 0 is in its gap */
        REQ_RC(fi_tsend(r->ep, &last, sizeof last, NULL, r->addr[0], 7,
                        &last), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_close(r);
        t_barrier_plain(r);
        return;
    }
    uint64_t got = 0;
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], 7, 0, &got), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
    REQ(got == 1);
    got = 0;
    fi_addr_t from = directed ? r->addr[1] : FI_ADDR_UNSPEC;
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, from, 7, 0, &got), 0);
    gap_rank = r;
    struct fi_cq_err_entry err = {0};
    int rc = t_wait(r, &e, &err, NULL, 3000);
    if (rc != 0)
        fprintf(stderr, "the last message: %s\n", fi_strerror(-rc));
    REQ(gap_used == 1); /* the gap was where the race is */
    REQ_RC(rc, 0);
    REQ(e.op_context == &got && got == 2);
    t_close(r);
}

/* Rank 1 sends its last message and leaves; rank 0, before it looks
   for messages, sends to it. That send fails, and the message rank 1
   sent before leaving is still delivered. */
static void send_to_departed(struct rank *r)
{
    t_open(r, version);
    t_exchange(r);
    struct fi_cq_tagged_entry e;
    if (r->me == 1) {
        uint64_t last = 2;
        REQ_RC(fi_tsend(r->ep, &last, sizeof last, NULL, r->addr[0], 7,
                        &last), 0);
        REQ_RC(t_wait(r, &e, NULL, NULL, 5000), 0);
        t_close(r);
        t_barrier_plain(r);
        return;
    }
    t_barrier_plain(r); /* rank 1 has sent and left */
    uint64_t out = 3, got = 0;
    ssize_t rc = fi_tsend(r->ep, &out, sizeof out, NULL, r->addr[1], 7, &out);
    struct fi_cq_err_entry err = {0};
    if (rc == 0) { /* accepted: it completes with an error */
        int w = t_wait(r, &e, &err, NULL, 3000);
        REQ(w < 0 && w != -FI_ETIMEDOUT && err.op_context == &out);
    } else {
        REQ(rc < 0 && rc != -FI_EAGAIN);
    }
    REQ_RC(fi_trecv(r->ep, &got, sizeof got, NULL, r->addr[1], 7, 0, &got), 0);
    REQ_RC(t_wait(r, &e, NULL, NULL, 3000), 0);
    REQ(e.op_context == &got && got == 2);
    t_close(r);
}

static void last_directed(struct rank *r) { last_message(r, true); }
static void last_any(struct rank *r) { last_message(r, false); }

int main(void)
{
    if (!getenv("FI_PROVIDER_PATH")) {
        fprintf(stderr, "FI_PROVIDER_PATH must name the provider's directory\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int failed = 0;
    char env[256];
    const char *reg = t_region(8, 0);
    snprintf(env, sizeof env, "FI_IVSHM_REGION=%s;FI_IVSHM_CORE=none", reg);
    const char *env2[] = {env, env};

    int f = t_run(2, last_any, env2, 30, NULL);
    printf("%s: a sender's last message, sent as it leaves, to a receive of "
           "any source\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, last_directed, env2, 30, NULL);
    printf("%s: the same, to a receive directed at it\n", f ? "FAIL" : "ok");
    failed += f;

    f = t_run(2, send_to_departed, env2, 30, NULL);
    printf("%s: a send to a peer that left does not drop what it sent "
           "before\n", f ? "FAIL" : "ok");
    failed += f;

    printf("%s\n", failed ? "FAILED" : "all passed");
    return failed ? 1 : 0;
}
