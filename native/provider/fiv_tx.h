/* A message's send on the per-message path, inline (docs/fast-path.md,
   "The provider's per-message path"): in a header of fiv_tx.c's layer,
   since it calls the layers below (introductions, region and core
   sends). */
#ifndef FIV_TX_H
#define FIV_TX_H

#include "fiv.h"

/* A send's error as the sender's layers answer it: -EAGAIN (queue it),
   the peer gone (-FI_EHOSTUNREACH), or its path broken (-FI_EIO). */
static inline int fiv_tx_err(int rc)
{
    if (rc == -EAGAIN)
        return -EAGAIN;
    return rc == IVSHM_EPEERDEAD ? -FI_EHOSTUNREACH : -FI_EIO;
}
/* fiv_region_send of a message's first part with the header alone in
   what the wire check covers (struct fiv_msg_hdr), inline in the small
   send (fiv_msg_ops.c, send_plain): with the header's size a constant
   the check reads the header where it lies, and the call with its eight
   arguments, its frame and its case for shorter headers go. The steps
   and their order are fiv_region_send's. */
static inline __attribute__((always_inline)) int
fiv_region_send_msg(struct fiv_ep *ep, int slot, uint32_t gen, uint32_t op,
                    const struct fiv_msg_hdr *hdr, const void *buf,
                    size_t len)
{
    _Static_assert(sizeof *hdr == FIV_WIRE_CHECKED,
                   "the check covers the header");
    uint32_t tag = fiv_wire_tag(op, hdr, sizeof *hdr + len);
    struct fiv_pair *pr = fiv_tx_pair(ep, slot, gen);
    if (fiv_lost_on_purpose(pr, op)) {
        pr->tx++;
        return 0;
    }
    int rc = ivshm_send_small(ep->h, slot, tag, hdr, sizeof *hdr, buf, len);
    if (rc == 0 && fiv_pair_counts(op))
        pr->tx++;
    return rc;
}
/* The hot path: one fragment, nothing queued before it. 0 sent,
   -EAGAIN (queue it), or an -FI_E* error. Inline: its one caller is
   the send every MPI makes per message (fiv_msg_ops.c). */
static inline ssize_t fiv_tx_small(struct fiv_ep *ep, struct fiv_peer *p,
                                   uint32_t op, const void *hdr, size_t hlen,
                                   const void *buf, size_t len)
{
    /* sw_pause: the pair is switching paths (fiv_drain.c): what is sent
       meanwhile waits for the path it will take */
    if (p->txq || p->dead || p->sw_pause)
        return -EAGAIN;
    int rc;
    if (p->path == PATH_REGION) {
        if (hlen + len > ep->frag)
            return -EAGAIN;
        rc = fiv_introduce(ep, p);
        if (rc == 0)
            rc = fiv_region_send(ep, p->slot, p->generation, op, hdr, hlen,
                                 buf, len);
        if (rc < 0)
            return fiv_tx_err(rc);
        ep->sent++;
        return 0;
    }
    if (p->path == PATH_CORE) {
        if (hlen + len > fiv_core_frag(ep))
            return -EAGAIN;
        rc = (int)fiv_core_send(ep, p, op, hdr, hlen, buf, len);
        if (rc == 0)
            ep->delegated++;
        return rc;
    }
    return -EAGAIN;
}

#endif
