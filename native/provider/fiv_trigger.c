/*
 * Triggered operations (fi_trigger(3), FI_TRIGGER_THRESHOLD): a send,
 * RMA or atomic built whole when posted, started once a counter of the
 * domain reaches the threshold its context names. It waits on the
 * counter's list, lowest threshold first; the increment that reaches
 * it (fiv_complete.h, a layer below the sends) only moves it to its
 * endpoint's ready list, and that endpoint's next progress starts it as
 * any send starts (fiv_tx_start): nothing is sent from inside the
 * completion that counted, and a counter with nothing waiting costs an
 * increment one compare with zero.
 *
 * What the application chose bounds it all: the context is read once,
 * the counter is found among the domain's open ones by its pointer
 * (never read through it), at most FIV_TRIGGER_MAX wait per endpoint.
 * Nothing here outlives its objects: a counter with operations waiting
 * on it does not close (-FI_EBUSY, fi_cntr(3)); closing an endpoint
 * cancels its own (FI_ECANCELED completions, as its queued sends get).
 */
#include <stdlib.h>

#include <rdma/fi_trigger.h>

#include "fiv.h"

/* Insert t into c's list, after those of its threshold or lower (their
   order is the order they were posted in). */
static void wait_on(struct fiv_cntr *c, struct fiv_trig *t)
{
    struct fiv_trig **pp = &c->trig;
    while (*pp && (*pp)->threshold <= t->threshold)
        pp = &(*pp)->next;
    t->next = *pp;
    *pp = t;
    c->trig_at = c->trig->threshold;
}

int fiv_trigger_post(struct fiv_ep *ep, struct fiv_op_req *r)
{
    struct fi_triggered_context tc = {0};
    if (r->context) /* once: the application's */
        memcpy(&tc, r->context, sizeof tc);
    struct fiv_cntr *c = NULL;
    int rc = 0;
    if (!(ep->caps & FI_TRIGGER) || !r->context)
        rc = -FI_EINVAL;
    else if (tc.event_type != FI_TRIGGER_THRESHOLD)
        rc = -FI_ENOSYS;
    else if (!(c = fiv_domain_cntr(ep->dom, tc.trigger.threshold.cntr)))
        rc = -FI_EINVAL;
    uint64_t threshold = tc.trigger.threshold.threshold;
    if (!rc && __atomic_load_n(&c->val, __ATOMIC_ACQUIRE) >= threshold)
        return fiv_tx_start(ep, r); /* waits for nothing: not capped */
    if (!rc && ep->trig_count >= FIV_TRIGGER_MAX)
        rc = -FI_EAGAIN;
    if (rc) {
        fiv_req_free(r);
        return rc;
    }
    struct fiv_trig *t = malloc(sizeof *t);
    if (!t) {
        fiv_req_free(r);
        return -FI_ENOMEM;
    }
    *t = (struct fiv_trig){.ep = ep, .threshold = threshold, .req = r};
    ep->trig_count++;
    wait_on(c, t);
    return 0;
}

void fiv_trigger_start(struct fiv_ep *ep)
{
    struct fiv_trig *t = ep->trig_ready;
    ep->trig_ready = ep->trig_ready_tail = NULL;
    ep->txq_peers--; /* the one the ready list held (fiv.h) */
    while (t) {
        struct fiv_trig *next = t->next;
        ep->trig_count--;
        fiv_tx_start(ep, t->req);
        free(t);
        t = next;
    }
}

/* Take ep's operations off c's list (those with `context` only, unless
   `all`), onto *out. */
static void take_from(struct fiv_cntr *c, struct fiv_ep *ep, bool all,
                      void *context, struct fiv_trig **out)
{
    struct fiv_trig **pp = &c->trig;
    while (*pp) {
        struct fiv_trig *t = *pp;
        if (t->ep == ep && (all || t->req->context == context)) {
            *pp = t->next;
            t->next = *out;
            *out = t;
            if (!all)
                break;
        } else {
            pp = &t->next;
        }
    }
    c->trig_at = c->trig ? c->trig->threshold : UINT64_MAX;
}

static void end_all(struct fiv_ep *ep, struct fiv_trig *t, int err)
{
    while (t) {
        struct fiv_trig *next = t->next;
        ep->trig_count--;
        fiv_tx_done(ep, t->req, err);
        free(t);
        t = next;
    }
}

void fiv_trigger_drop(struct fiv_ep *ep, int err)
{
    if (!ep->trig_count)
        return;
    struct fiv_trig *gone = NULL;
    struct fiv_domain *d = ep->dom;
    for (size_t i = 0; i < d->ncntrs; i++)
        take_from(d->cntrs[i], ep, true, NULL, &gone);
    end_all(ep, gone, err);
    if (ep->trig_ready) {
        gone = ep->trig_ready;
        ep->trig_ready = ep->trig_ready_tail = NULL;
        ep->txq_peers--;
        end_all(ep, gone, err);
    }
}

/* Take the operation with `context` off ep's ready list (reached, not
   yet started), onto *out. */
static void take_ready(struct fiv_ep *ep, void *context, struct fiv_trig **out)
{
    struct fiv_trig **pp = &ep->trig_ready, *prev = NULL;
    while (*pp && (*pp)->req->context != context) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    struct fiv_trig *t = *pp;
    if (!t)
        return;
    *pp = t->next;
    if (ep->trig_ready_tail == t)
        ep->trig_ready_tail = prev;
    if (!ep->trig_ready)
        ep->txq_peers--; /* the one the ready list held (fiv.h) */
    t->next = *out;
    *out = t;
}

int fiv_trigger_cancel(struct fiv_ep *ep, void *context)
{
    if (!ep->trig_count)
        return -FI_ENOENT;
    struct fiv_trig *gone = NULL;
    struct fiv_domain *d = ep->dom;
    for (size_t i = 0; i < d->ncntrs && !gone; i++)
        take_from(d->cntrs[i], ep, false, context, &gone);
    if (!gone)
        take_ready(ep, context, &gone);
    if (!gone)
        return -FI_ENOENT;
    end_all(ep, gone, FI_ECANCELED);
    return 0;
}
