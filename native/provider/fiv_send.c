/*
 * One message out on a peer's path, nothing queued and nothing waited
 * for: into a region slot (with the wire check in its tag, counted for
 * the pair) or a core provider's bounce buffer (with the operation word
 * and the pair's sequence number in front). Fragments, queues and
 * introductions are the callers' (fiv_tx.c, fiv_intro.c, fiv_probe.c).
 */
#include <errno.h>
#include <string.h>

#include "fiv.h"

int fiv_region_send(struct fiv_ep *ep, int slot, uint32_t gen, uint32_t op,
                    const void *hdr, size_t hlen, const void *buf, size_t len)
{
    uint32_t tag;
    if (hlen >= FIV_WIRE_CHECKED) {
        /* every first part of a message: the check covers the header */
        tag = fiv_wire_tag(op, hdr, hlen + len);
    } else {
        uint8_t start[FIV_WIRE_CHECKED];
        size_t k = hlen;
        memcpy(start, hdr, k);
        if (len)
            memcpy(start + k, buf,
                   len < sizeof start - k ? len : sizeof start - k);
        tag = fiv_wire_tag(op, start, hlen + len);
    }
    struct fiv_pair *pr = fiv_tx_pair(ep, slot, gen);
    if (fiv_lost_on_purpose(pr, op)) {
        pr->tx++;
        return 0;
    }
    int rc = hlen ? ivshm_send_small(ep->h, slot, tag, hdr, hlen, buf, len)
                  : ivshm_try_send(ep->h, slot, tag, buf, len);
    if (rc == 0 && fiv_pair_counts(op))
        pr->tx++;
    return rc;
}

size_t fiv_core_frag(struct fiv_ep *ep)
{
    (void)ep;
    return CORE_BUF - CORE_WORD;
}

ssize_t fiv_core_send(struct fiv_ep *ep, struct fiv_peer *p, uint32_t op,
                      const void *hdr, size_t hlen, const void *buf,
                      size_t len)
{
    fi_addr_t core_addr = p->core_addr;
    struct fiv_core *c = ep->core;
    if (!c)
        return -FI_EHOSTUNREACH;
    if (CORE_WORD + hlen + len > CORE_BUF)
        return -FI_EMSGSIZE;
    /* no progress from here: a send may be the answer to a message that
       progress is delivering, or come from the loop over queued sends;
       the next progress call frees buffers and retries */
    struct core_buf *b = c->free_tx;
    if (!b)
        return -EAGAIN;
    memcpy(b->mem, &op, sizeof op);
    memcpy(b->mem + sizeof op, &p->core_tx_seq, sizeof p->core_tx_seq);
    memcpy(b->mem + CORE_WORD, hdr, hlen);
    if (len)
        memcpy(b->mem + CORE_WORD + hlen, buf, len);
    ssize_t rc = fi_send(c->ep, b->mem, CORE_WORD + hlen + len, b->desc,
                         core_addr, &b->ctx);
    if (rc == -FI_EAGAIN)
        return -EAGAIN;
    if (rc)
        return rc;
    c->free_tx = b->next_free;
    b->busy = true;
    p->core_tx_seq++;
    return 0;
}
