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
