/* The completions written on the per-message path, inline (docs/
   fast-path.md, "The provider's per-message path"): in a header of their
   own, of fiv_complete.c's layer, since they call into it. */
#ifndef FIV_COMPLETE_H
#define FIV_COMPLETE_H

#include "fiv.h"

/* A counter with triggered operations waiting moved: those whose
   threshold it reached go to their endpoints' ready lists. */
void fiv_cntr_reached(struct fiv_cntr *c);
/* One success counted. With no triggered operation waiting, one compare
   of a word with zero, never taken, and the increment stays a locked
   add of a constant (a fetch of the new value to compare with
   `trig_at` needs a register more on the send's path). */
static inline void fiv_cntr_inc(struct fiv_cntr *c)
{
    if (c) {
        __atomic_add_fetch(&c->val, 1, __ATOMIC_RELEASE);
        if (__builtin_expect(c->trig != NULL, 0))
            fiv_cntr_reached(c);
    }
}
/* A full ring doubled (false: no memory). */
bool fiv_cq_grow(struct fiv_cq *cq);
/* The next entry of cq, counted and to be filled whole by the caller
   (NULL: no memory to grow the ring): a completion written where it is
   read, not built elsewhere and copied. */
static inline struct fiv_cqe *fiv_cq_claim(struct fiv_cq *cq)
{
    if (__builtin_expect(cq->count == cq->cap, 0) && !fiv_cq_grow(cq))
        return NULL;
    /* cap is a power of two (fiv_cq_grow) */
    return &cq->ring[(cq->head + cq->count++) & (cq->cap - 1)];
}
/* fiv_complete_tx of a message (FI_SEND) that went out whole, inline on
   the send's hot path (fiv_msg_ops.c): a call less per message. */
static inline void fiv_complete_sent(struct fiv_ep *ep, void *context,
                                     uint64_t flags, bool want)
{
    fiv_cntr_inc(ep->cntr_send);
    struct fiv_cqe *to;
    if (want && ep->tx_cq && (to = fiv_cq_claim(ep->tx_cq)))
        *to = (struct fiv_cqe){.context = context, .flags = flags,
                               .src = FI_ADDR_NOTAVAIL};
}

#endif
