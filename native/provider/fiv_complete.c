/*
 * Completions as the engine writes them: into the endpoint's CQs (kept
 * in one wide form, never refused: the queue grows) and counters. The
 * CQ object (fiv_cq.c) reads them out in the format asked for.
 */
#include <stdlib.h>

#include "fiv_complete.h"

static bool grow(struct fiv_cqe **ring, size_t *cap, size_t head, size_t count)
{
    size_t n = *cap ? 2 * *cap : 64;
    struct fiv_cqe *p = malloc(n * sizeof *p);
    if (!p)
        return false;
    for (size_t i = 0; i < count; i++)
        p[i] = (*ring)[(head + i) % *cap];
    free(*ring);
    *ring = p;
    *cap = n;
    return true;
}

/* The source the application sees: a peer it has not inserted (heard
   through its introduction) has no address of its own. */
static void store(struct fiv_cqe *to, const struct fiv_cqe *e)
{
    *to = *e;
    if (to->src >= FIV_HIDDEN)
        to->src = FI_ADDR_NOTAVAIL;
}

bool fiv_cq_grow(struct fiv_cq *cq)
{
    if (!grow(&cq->ring, &cq->cap, cq->head, cq->count))
        return false;
    cq->head = 0;
    return true;
}

int fiv_cq_push(struct fiv_cq *cq, const struct fiv_cqe *e)
{
    struct fiv_cqe *to = fiv_cq_claim(cq);
    if (!to)
        return -FI_ENOMEM;
    store(to, e);
    return 0;
}

int fiv_cq_push_err(struct fiv_cq *cq, const struct fiv_cqe *e)
{
    if (cq->errcount == cq->errcap) {
        if (!grow(&cq->errs, &cq->errcap, cq->errhead, cq->errcount))
            return -FI_ENOMEM;
        cq->errhead = 0;
    }
    store(&cq->errs[(cq->errhead + cq->errcount) % cq->errcap], e);
    cq->errcount++;
    return 0;
}

void fiv_cntr_reached(struct fiv_cntr *c)
{
    uint64_t v = __atomic_load_n(&c->val, __ATOMIC_ACQUIRE);
    if (v < c->trig_at)
        return;
    struct fiv_trig *t;
    while ((t = c->trig) && t->threshold <= v) {
        c->trig = t->next;
        t->next = NULL;
        struct fiv_ep *ep = t->ep;
        if (ep->trig_ready) {
            ep->trig_ready_tail->next = t;
        } else {
            ep->trig_ready = t;
            ep->txq_peers++; /* its progress looks (fiv.h) */
        }
        ep->trig_ready_tail = t;
    }
    c->trig_at = t ? t->threshold : UINT64_MAX;
}

/* A send-side completion: counted always, reported when asked. */
void fiv_complete_tx(struct fiv_ep *ep, void *context, uint64_t flags,
                     bool want, int err)
{
    struct fiv_cntr *c = flags & FI_READ ? ep->cntr_read
                         : flags & FI_WRITE ? ep->cntr_write
                         : flags & FI_ATOMIC ? ep->cntr_write
                                             : ep->cntr_send;
    if (flags & FI_ATOMIC && flags & FI_READ)
        c = ep->cntr_read;
    if (err) {
        fiv_cntr_inc_err(c);
        if (ep->tx_cq) {
            struct fiv_cqe e = {.context = context, .flags = flags,
                                .err = err, .src = FI_ADDR_NOTAVAIL};
            fiv_cq_push_err(ep->tx_cq, &e);
        }
        return;
    }
    fiv_cntr_inc(c);
    struct fiv_cqe *to;
    if (want && ep->tx_cq && (to = fiv_cq_claim(ep->tx_cq)))
        *to = (struct fiv_cqe){.context = context, .flags = flags,
                               .src = FI_ADDR_NOTAVAIL};
}

void fiv_complete_rx(struct fiv_ep *ep, const struct fiv_cqe *e, bool want)
{
    if (e->err) {
        fiv_cntr_inc_err(ep->cntr_recv);
        if (ep->rx_cq)
            fiv_cq_push_err(ep->rx_cq, e);
        return;
    }
    fiv_cntr_inc(ep->cntr_recv);
    if (want && ep->rx_cq)
        fiv_cq_push(ep->rx_cq, e);
}
