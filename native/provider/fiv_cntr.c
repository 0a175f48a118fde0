/*
 * Counters: completions counted per kind (send, recv, read, write,
 * remote read, remote write); reading one drives progress. What the
 * application adds or sets counts toward triggered operations too
 * (fiv_trigger.c): they wait on the counter's list, which only the
 * domain's serialization touches.
 */
#include <sched.h>
#include <stdlib.h>

#include "fiv_complete.h"

void fiv_cntr_add_ep(struct fiv_cntr *c, struct fiv_ep *ep)
{
    for (size_t i = 0; i < c->neps; i++)
        if (c->eps[i] == ep)
            return;
    void *p = realloc(c->eps, (c->neps + 1) * sizeof *c->eps);
    if (!p)
        return;
    c->eps = p;
    c->eps[c->neps++] = ep;
    c->refs++;
}

void fiv_cntr_del_ep(struct fiv_cntr *c, struct fiv_ep *ep)
{
    for (size_t i = 0; i < c->neps; i++)
        if (c->eps[i] == ep) {
            c->eps[i] = c->eps[--c->neps];
            c->refs--;
            return;
        }
}

static void drive(struct fiv_cntr *c)
{
    struct fiv_domain *d = c->dom;
    fiv_lock(d);
    /* A counter that a registration counts into (FI_RMA_EVENT; its refs
       beyond the endpoints bound) is reached by a remote write through
       any endpoint of the domain: waiting on it alone must move them all,
       or an application that waits only on it (fabtests' fi_multi_mr)
       waits for a write its own endpoint never takes. */
    if (c->refs > (int)c->neps)
        fiv_progress_eps(d->eps, d->neps);
    else
        fiv_progress_eps(c->eps, c->neps);
    fiv_unlock(d);
}

static uint64_t cntr_read(struct fid_cntr *f)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    drive(c);
    return __atomic_load_n(&c->val, __ATOMIC_ACQUIRE);
}

static uint64_t cntr_readerr(struct fid_cntr *f)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    drive(c);
    return __atomic_load_n(&c->err, __ATOMIC_ACQUIRE);
}

static int cntr_add(struct fid_cntr *f, uint64_t v)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    fiv_lock(c->dom);
    __atomic_add_fetch(&c->val, v, __ATOMIC_RELEASE);
    if (c->trig)
        fiv_cntr_reached(c);
    fiv_unlock(c->dom);
    return 0;
}

static int cntr_set(struct fid_cntr *f, uint64_t v)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    fiv_lock(c->dom);
    __atomic_store_n(&c->val, v, __ATOMIC_RELEASE);
    if (c->trig)
        fiv_cntr_reached(c);
    fiv_unlock(c->dom);
    return 0;
}

static int cntr_adderr(struct fid_cntr *f, uint64_t v)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    __atomic_add_fetch(&c->err, v, __ATOMIC_RELEASE);
    return 0;
}

static int cntr_seterr(struct fid_cntr *f, uint64_t v)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    __atomic_store_n(&c->err, v, __ATOMIC_RELEASE);
    return 0;
}

/* Waits by driving progress: -FI_ETIMEDOUT at the deadline, -FI_EAVAIL
   as soon as an error is counted (the caller then looks at the errors). */
static int cntr_wait(struct fid_cntr *f, uint64_t threshold, int timeout)
{
    struct fiv_cntr *c = container_of(f, struct fiv_cntr, cntr);
    uint64_t err0 = __atomic_load_n(&c->err, __ATOMIC_ACQUIRE);
    uint64_t deadline = fiv_deadline(timeout);
    for (unsigned spins = 0;; spins++) {
        drive(c);
        if (__atomic_load_n(&c->val, __ATOMIC_ACQUIRE) >= threshold)
            return 0;
        if (__atomic_load_n(&c->err, __ATOMIC_ACQUIRE) != err0)
            return -FI_EAVAIL;
        if (fiv_now_ns() >= deadline)
            return -FI_ETIMEDOUT;
        if (spins > 1000)
            sched_yield();
    }
}

static int cntr_close(struct fid *fid)
{
    struct fiv_cntr *c = container_of(fid, struct fiv_cntr, cntr.fid);
    /* registrations bind and release it under the lock; a triggered
       operation waiting on it would be left with a counter gone */
    fiv_lock(c->dom);
    bool busy = c->refs || c->trig;
    if (!busy)
        fiv_domain_del_cntr(c->dom, c);
    fiv_unlock(c->dom);
    if (busy)
        return -FI_EBUSY;
    fiv_domain_ref(c->dom, -1);
    free(c->eps);
    free(c);
    return 0;
}

static int cntr_control(struct fid *fid, int cmd, void *arg)
{
    (void)fid;
    (void)arg;
    return cmd == FI_GETWAIT ? -FI_ENODATA : -FI_ENOSYS;
}

static struct fi_ops cntr_fi_ops = {
    .size = sizeof(struct fi_ops),
    .close = cntr_close,
    .bind = fiv_no_bind,
    .control = cntr_control,
    .ops_open = fiv_no_ops_open,
};

static struct fi_ops_cntr cntr_ops = {
    .size = sizeof(struct fi_ops_cntr),
    .read = cntr_read,
    .readerr = cntr_readerr,
    .add = cntr_add,
    .set = cntr_set,
    .wait = cntr_wait,
    .adderr = cntr_adderr,
    .seterr = cntr_seterr,
};

int fiv_cntr_open(struct fid_domain *domain, struct fi_cntr_attr *attr,
                  struct fid_cntr **cntr, void *context)
{
    if (attr && attr->events != FI_CNTR_EVENTS_COMP)
        return -FI_ENOSYS;
    if (attr && attr->wait_obj != FI_WAIT_NONE &&
        attr->wait_obj != FI_WAIT_UNSPEC)
        return -FI_ENOSYS;
    struct fiv_cntr *c = calloc(1, sizeof *c);
    if (!c)
        return -FI_ENOMEM;
    c->dom = container_of(domain, struct fiv_domain, dom);
    c->trig_at = UINT64_MAX;
    fiv_lock(c->dom);
    bool added = fiv_domain_add_cntr(c->dom, c);
    fiv_unlock(c->dom);
    if (!added) {
        free(c);
        return -FI_ENOMEM;
    }
    c->cntr.fid.fclass = FI_CLASS_CNTR;
    c->cntr.fid.context = context;
    c->cntr.fid.ops = &cntr_fi_ops;
    c->cntr.ops = &cntr_ops;
    fiv_domain_ref(c->dom, 1);
    *cntr = &c->cntr;
    return 0;
}
