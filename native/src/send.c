/*
 * Sending: the path to `slot` is its fast ring once we hold one of its
 * channels (ring.h), else its queue (queue.h); after fast_after queued
 * messages we take one of its channels (channel.h) and announce it with
 * an OPEN cell in its queue.
 *
 * Zero-copy: on a fast ring send_reserve hands out the payload of the
 * slot at tx_head (nothing moves) and send_commit publishes it; through
 * the queue a reservation is staged in local memory and the commit
 * copies it into a cell (claiming a cell early would block the queue for
 * everybody while the caller fills it).
 */
#define _GNU_SOURCE
#include "send.h"

#include "channel.h"
#include "clock.h"
#include "peer_local.h"
#include "queue.h"
#include "ring.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>

/* No channel was free: queue sends before we look again. */
#define OPEN_RETRY 64

/* Checks every send starts with. */
static int tx_begin(ivshm *h, int slot, size_t len)
{
    if (!h || h->self < 0 || !ivshm_slot_ok(h, slot) || slot == h->self)
        return -EINVAL;
    if (len > (size_t)SSIZE_MAX) /* recv reports the length as ssize_t */
        return -EMSGSIZE;
    /* also resets our view if a new incarnation took the slot */
    if (!ivshm_peer_current(h, slot))
        return IVSHM_EPEERDEAD;
    ivshm_work_start(h); /* for the loops peers drive (queue claims) */
    return 0;
}

static inline bool want_channel(const ivshm *h, const struct ivshm_peer_local *p)
{
    return p->tx_chan < 0 && h->fast_channels && p->tx_queued >= h->fast_after;
}

/* Enough messages went to `j` through its queue: take one of its fast
   channels and announce it with an OPEN cell. From then on everything
   goes on that ring; the OPEN cell orders it after what we queued. */
static __attribute__((noinline)) void tx_try_open(ivshm *h, int j,
                                                  int timeout_ms,
                                                  uint64_t deadline)
{
    struct ivshm_peer_local *p = &h->peers[j];
    if (p->tx_retry) {
        p->tx_retry--;
        return;
    }
    int k = ivshm_chan_claim(h, j);
    if (k < 0) {
        p->tx_retry = OPEN_RETRY;
        return;
    }
    int rc = ivshm_q_send(h, j, 0, NULL, 0, CELL_OPEN, (uint64_t)k, timeout_ms,
                          deadline);
    if (rc < 0) {
        /* not announced: give it back */
        ivshm_chan_giveback(h, j, (uint32_t)k);
        p->tx_retry = 8;
        return;
    }
    ivshm_chan_use(h, j, (uint32_t)k);
}

static int send_msg(ivshm *h, int slot, uint32_t tag, const void *buf,
                    size_t len, int timeout_ms)
{
    if (len && !buf)
        return -EINVAL;
    int rc = tx_begin(h, slot, len);
    if (rc < 0)
        return rc;
    struct ivshm_peer_local *p = &h->peers[slot];
    p->reserved = false; /* we publish that slot: an open reservation ends */
    /* no clock read on the try_send / send fast paths */
    const uint64_t deadline = ivshm_deadline(timeout_ms);
    /* Hot path once the channel is open: one compare, then the ring. */
    if (p->tx_chan >= 0)
        return ivshm_ring_send(h, slot, tag, buf, len, timeout_ms, deadline);
    if (want_channel(h, p)) {
        tx_try_open(h, slot, timeout_ms, deadline);
        if (p->tx_chan >= 0)
            return ivshm_ring_send(h, slot, tag, buf, len, timeout_ms,
                                   deadline);
    }
    rc = ivshm_q_send(h, slot, tag, buf, len, 0, 0, timeout_ms, deadline);
    if (rc == 0) {
        if (p->tx_queued != UINT32_MAX)
            p->tx_queued++;
        count_sent(h, len);
    }
    return rc;
}

int ivshm_fast_open(ivshm *h, int slot)
{
    int rc = tx_begin(h, slot, 0);
    if (rc < 0 || !h->fast_channels)
        return rc < 0 ? rc : -ENOTSUP;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->tx_chan < 0) {
        p->tx_retry = 0;
        tx_try_open(h, slot, -1, UINT64_MAX);
    }
    return p->tx_chan >= 0 ? 0 : -EAGAIN;
}

int ivshm_send(ivshm *h, int slot, uint32_t tag, const void *buf, size_t len)
{
    return send_msg(h, slot, tag, buf, len, -1);
}

int ivshm_try_send(ivshm *h, int slot, uint32_t tag, const void *buf,
                   size_t len)
{
    return send_msg(h, slot, tag, buf, len, 0);
}

int ivshm_send_timeout(ivshm *h, int slot, uint32_t tag, const void *buf,
                       size_t len, int timeout_ms)
{
    return send_msg(h, slot, tag, buf, len, timeout_ms < 0 ? -1 : timeout_ms);
}

/* On a fast ring: the payload of the slot at tx_head, if the ring has
   room for it; tx_head does not move, so an abandoned reservation costs
   nothing. Through the queue: a local stage, if the queue has room now. */
void *ivshm_send_reserve(ivshm *h, int slot, size_t len, int *err)
{
    int rc = tx_begin(h, slot, len);
    if (rc == 0 && len > slot_payload(h))
        rc = -EMSGSIZE;
    struct ivshm_peer_local *p = rc == 0 ? &h->peers[slot] : NULL;
    void *out = NULL;
    if (rc == 0 && want_channel(h, p))
        tx_try_open(h, slot, 0, 0);
    if (rc == 0 && p->tx_chan >= 0) {
        uint8_t *ring = tx_ring(h, slot);
        rc = ivshm_tx_reserve(h, slot, (struct ivshm_ring_ctrl *)ring, 1);
        if (rc == 0) {
            p->reserve_kind = SRC_RING;
            out = slot_data(slot_at(h, ring, p->tx_head));
        }
    } else if (rc == 0) {
        if (!q_room(h, slot, 1))
            rc = -EAGAIN;
        else if (!p->tx_stage && !(p->tx_stage = malloc(slot_payload(h))))
            rc = -ENOMEM;
        p->reserve_kind = SRC_QUEUE;
        out = p->tx_stage;
    }
    if (err)
        *err = rc;
    if (rc < 0)
        return NULL;
    p->reserved = true;
    return out;
}

/* Publish the reservation as one message of `len` bytes: the same
   release store and kick as a copying send. On a ring the reservation
   proved the room (the tail only moves forward); through the queue the
   staged bytes are copied into a cell, and if other senders took the
   room meanwhile it is -EAGAIN with the reservation kept. */
int ivshm_send_commit(ivshm *h, int slot, uint32_t tag, size_t len)
{
    int rc = tx_begin(h, slot, len);
    if (rc < 0)
        return rc;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (!p->reserved || len > slot_payload(h))
        return -EINVAL;
    if (p->reserve_kind == SRC_QUEUE) {
        if (!p->tx_stage)
            return -EINVAL;
        rc = ivshm_q_send(h, slot, tag, p->tx_stage, len, 0, 0, 0, 0);
        if (rc == -EAGAIN)
            return rc;
        p->reserved = false;
        if (rc == 0) {
            if (p->tx_queued != UINT32_MAX)
                p->tx_queued++;
            count_sent(h, len);
        }
        return rc;
    }
    if (p->tx_chan < 0)
        return -EINVAL;
    uint8_t *ring = tx_ring(h, slot);
    struct ivshm_ring_ctrl *ctrl = (struct ivshm_ring_ctrl *)ring;
    p->reserved = false;
    tx_publish(h, ring, p->tx_head, tag, SLOT_FIRST | SLOT_LAST, len, NULL,
               (uint32_t)len);
    p->tx_head++;
    tx_done(h, slot, ctrl, len);
    return 0;
}

/* Everything ivshm_send_small's hot path leaves: the checks with their
   own errors, a new incarnation of the peer (tx_begin resets our view),
   a ring our cached tail calls full (ivshm_tx_reserve looks at the real
   one), larger parts (copied with memcpy), and no ring yet: then the two
   parts are joined in our stage and go the way of a try_send, through
   the queue, counting towards opening a channel as any message does. */
static __attribute__((noinline)) int send_small_general(ivshm *h, int slot,
                                                        uint32_t tag,
                                                        const void *a,
                                                        size_t alen,
                                                        const void *b,
                                                        size_t blen)
{
    int rc = tx_begin(h, slot, alen);
    if (rc < 0)
        return rc;
    struct ivshm_peer_local *p = &h->peers[slot];
    p->reserved = false; /* as in send_msg: this send ends a reservation */
    if ((alen && !a) || (blen && !b))
        return -EINVAL;
    if (alen > slot_payload(h) || blen > slot_payload(h) - alen)
        return -EMSGSIZE;
    if (p->tx_chan >= 0) {
        rc = ivshm_tx_reserve(h, slot, (struct ivshm_ring_ctrl *)p->tx_ring, 1);
        if (rc < 0)
            return rc;
        const struct ivshm_peer_entry *e = ivshm_entry(h, slot);
        if (ring_small_ready(h, slot, e, a, alen, b, blen, false)) {
            if (ring_put_small(h, slot, e, tag, a, alen, b, blen))
                ivshm_kick(h, slot);
            return 0;
        }
    }
    if (!blen)
        return send_msg(h, slot, tag, a, alen, 0);
    /* the stage may hold a queue reservation's bytes: ended above (the
       header says `a` and `b` must not point into a reservation) */
    if (!p->tx_stage && !(p->tx_stage = malloc(slot_payload(h))))
        return -ENOMEM;
    if (alen)
        memcpy(p->tx_stage, a, alen);
    memcpy(p->tx_stage + alen, b, blen);
    return send_msg(h, slot, tag, p->tx_stage, alen + blen, 0);
}

/* Hot path of a small send (a protocol header and its payload): one
   check of the arguments and of the peer, both parts copied straight
   into the slot at tx_head, one release store. What reserve + commit did
   in two calls, each with its own checks. The general path and the wake
   are tail calls, so that nothing of the hot path is kept across a
   call. Always inline where its body is seen: in a module optimized as
   one (the libfabric provider's, docs/fast-path.md) a send that knows
   its header's size gets the copies for that size, in its own frame;
   elsewhere (the BTL, libivshm.so) it is an ordinary call. */
inline __attribute__((always_inline)) int
ivshm_send_small(ivshm *h, int slot, uint32_t tag, const void *a, size_t alen,
                 const void *b, size_t blen)
{
    if (__builtin_expect(!h || h->self < 0 || !ivshm_slot_ok(h, slot) ||
                             slot == h->self,
                         0))
        return -EINVAL;
    const struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (__builtin_expect(!ring_small_ready(h, slot, e, a, alen, b, blen, true),
                         0))
        return send_small_general(h, slot, tag, a, alen, b, blen);
    if (ring_put_small(h, slot, e, tag, a, alen, b, blen))
        return ring_kick_sent(h, slot); /* else no wake is owed (doorbell.c) */
    return 0;
}
