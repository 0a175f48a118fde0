/* libFuzzer: receive from a receive area whose every byte a hostile peer
   chose.

   A region is formatted in a heap buffer (small geometry: 3 peers, a
   queue of 4 cells, 2 fast rings of 4 slots) and a handle is built for it
   by hand, as slot 0, with a doorbell that never blocks. The input is
   sprayed over our receive area (queue ctrl, cells, channel descriptors,
   fast rings), the registry entries of slots 1 and 2 and slot 1's receive
   area (where our sends go); then we receive (copying, or peek + release)
   and send (copying, or reserve + commit) a few times. Any outcome but a
   crash or an out-of-bounds access is fine.

   Input: byte 0 = slot 1's state (ACTIVE, DEAD, FREE), the receive
   capacity, whether a peek or a copying receive comes first, and whether
   we hear only listed senders (slot 1, or nobody); byte 1 =
   our starting queue position, whether slot 1 already uses fast channel
   0 or 1 of ours and our position in it; byte 2 = our starting send
   position and whether we already own a channel of slot 1; the rest is
   sprayed in the order above. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static ivshm *h;

/* ivshm_recv_each's callback: `arg` is our receive area. */
static void each_check(void *arg, int src, uint32_t gen, uint32_t tag,
                       const void *msg, size_t len)
{
    const uint8_t *area = arg, *m = msg;
    (void)gen;
    (void)tag;
    if (src < 1 || src > 2 || !m || m < area ||
        m + len > area + h->rx_bytes || len > h->slot_size - IVSHM_SLOT_HDR)
        __builtin_trap();
    volatile uint8_t sink = 0;
    for (size_t k = 0; k < len; k++)
        sink ^= m[k];
    (void)sink;
}

static uint8_t *pristine; /* registry + rings as formatted */
static uint64_t shared_off, shared_len;
static uint8_t rxbuf[1024];

/* A doorbell that returns at once: a wait for a fragment of a dead
   sender ends at the first liveness check instead of a 20 ms slice. */
static int fake_ring(struct ivshm_doorbell *db, ivshm *hh, int slot, int32_t id)
{
    return 0;
}
static uint64_t fake_arm(struct ivshm_doorbell *db, ivshm *hh)
{
    return 0;
}
static int fake_wait(struct ivshm_doorbell *db, ivshm *hh, uint64_t token,
                     int timeout_ms)
{
    return -ETIMEDOUT;
}
static int fake_fd(struct ivshm_doorbell *db)
{
    return -1;
}
static int fake_notices(struct ivshm_doorbell *db, ivshm *hh)
{
    return 0;
}
static void fake_destroy(struct ivshm_doorbell *db)
{
}
static struct ivshm_doorbell fake_db = {
    .kind = DB_FUTEX, .ring = fake_ring, .arm = fake_arm, .wait = fake_wait,
    .fd = fake_fd, .poll_notices = fake_notices, .destroy = fake_destroy};

static void setup(void)
{
    ivshm_geometry g = {.max_peers = 3, .ring_slots = 4, .slot_size = 128,
                        .max_windows = 1, .queue_slots = 4,
                        .fast_channels = 2};
    uint64_t size = ivshm_min_region_size(&g);
    uint8_t *base = aligned_alloc(IVSHM_PAGE, size);
    if (!base || ivshm_format(base, size, &g) < 0)
        __builtin_trap();
    const struct ivshm_header *hdr = (const void *)base;
    h = calloc(1, sizeof *h);
    if (!h)
        __builtin_trap();
    /* we formatted it ourselves: the header is trustworthy here */
    h->base = base;
    h->size = size;
    h->map_fd = -1;
    h->max_peers = hdr->max_peers;
    h->ring_slots = hdr->ring_slots;
    h->slot_size = hdr->slot_size;
    h->max_windows = hdr->max_windows;
    h->queue_slots = hdr->queue_slots;
    h->fast_channels = hdr->fast_channels;
    h->registry_off = hdr->registry_off;
    h->rx_off = hdr->rx_off;
    h->rx_bytes = hdr->rx_bytes;
    h->ring_bytes = hdr->ring_bytes;
    h->windir_off = hdr->windir_off;
    h->wctl_off = hdr->wctl_off;
    h->heap_off = hdr->heap_off;
    h->heap_size = hdr->heap_size;
    h->peers = calloc(h->max_peers, sizeof *h->peers);
    h->bl_list = calloc(h->max_peers, sizeof *h->bl_list);
    h->listen_gen = calloc(h->max_peers, sizeof *h->listen_gen);
    if (!h->peers || !h->bl_list || !h->listen_gen)
        __builtin_trap();
    h->spin_ns = 1;
    h->pidns = 1;
    h->fast_after = 2;
    h->db = &fake_db;
    /* both receive areas as their owners leave them when they join */
    h->self = 1;
    ivshm_rx_area_reset(h);
    h->self = 0;
    ivshm_rx_area_reset(h);
    h->self_gen = 1;

    struct ivshm_peer_entry *me = ivshm_entry(h, 0);
    atomic_store(&me->gen, 1);
    me->pid = (int32_t)getpid();
    me->pidns = h->pidns;
    atomic_store(&me->state, PEER_ACTIVE);

    shared_off = h->registry_off;
    shared_len = h->windir_off - h->registry_off;
    pristine = malloc(shared_len);
    if (!pristine)
        __builtin_trap();
    memcpy(pristine, base + shared_off, shared_len);
}

/* Copy up to `len` input bytes to `dst`, advancing the input. */
static void spray(uint8_t *dst, size_t len, const uint8_t **in, size_t *left)
{
    size_t n = *left < len ? *left : len;
    memcpy(dst, *in, n);
    *in += n;
    *left -= n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!h)
        setup();
    if (size < 3)
        return 0;
    /* forget positions, backlogs, channels and any message an earlier
       input left half received (its staged prefix is freed) */
    for (int x = 0; x < (int)h->max_peers; x++)
        ivshm_peer_local_reset(h, x, 0);
    memcpy(h->base + shared_off, pristine, shared_len);
    ivshm_rx_area_reset(h);

    static const uint32_t states[4] = {PEER_ACTIVE, PEER_ACTIVE, PEER_DEAD,
                                       PEER_FREE};
    static const size_t caps[4] = {0, 7, 200, sizeof rxbuf};
    uint32_t state = states[data[0] & 3];
    size_t cap = caps[(data[0] >> 2) & 3];

    const uint8_t *in = data + 3;
    size_t left = size - 3;
    spray(ivshm_rx_area(h, 0), h->rx_bytes, &in, &left);
    struct ivshm_peer_entry *peer = ivshm_entry(h, 1);
    spray((uint8_t *)peer, sizeof *peer, &in, &left);
    spray((uint8_t *)ivshm_entry(h, 2), sizeof *peer, &in, &left);
    spray(ivshm_rx_area(h, 1), h->rx_bytes, &in, &left);

    /* Considered at all; and when its liveness is probed, found dead, so
       a wait for a fragment that never comes ends. */
    atomic_store(&peer->state, state);
    peer->pidns = h->pidns;
    peer->pid = INT32_MAX;
    struct ivshm_peer_entry *other = ivshm_entry(h, 2);
    other->pidns = h->pidns;
    other->pid = INT32_MAX;

    /* Start our positions where the input says, as if we had talked to
       this generation before. */
    struct ivshm_peer_local *p = &h->peers[1];
    p->gen = atomic_load(&peer->gen);
    /* hearing everyone, only slot 1 (or nobody), or slot 1 everywhere and
       the others through the queue, as the BTL does */
    ivshm_listen_only(h, (data[0] >> 5) % 3);
    ivshm_listen(h, 1, (data[0] & 0x40) ? p->gen : 0);
    h->q_head = data[1] & 7;
    if (data[1] & 0x80) {
        int k = (data[1] >> 6) & 1;
        p->rx_chan = (int16_t)k;
        p->rx_ring = ivshm_fring(h, h->self, (uint32_t)k); /* kept together */
        p->rx_tail = (data[1] >> 3) & 7;
        h->chan_user[k] = 1;
        h->act[h->n_act++] = 1;
    }
    if (data[2] & 0x80) {
        uint64_t tx_start = data[2] & 15;
        p->tx_chan = (int16_t)((data[2] >> 4) & 1);
        p->tx_ring = ivshm_fring(h, 1, (uint32_t)p->tx_chan);
        p->tx_head = tx_start;
        p->tx_tail_cache = tx_start > h->ring_slots ? tx_start - h->ring_slots
                                                    : 0;
    } else {
        p->tx_queued = data[2] & 3;
    }

    /* copying receives and zero-copy peeks, interleaved as byte 0 says,
       each after a look and a pass of the fast path */
    const uint8_t *area = ivshm_rx_area(h, 0);
    for (int i = 0; i < 4; i++) {
        int src = -1;
        uint32_t tag = 0;
        int from = i == 3 ? 1 : IVSHM_ANY;
        /* the idle hint reads the same garbage: in bounds, one answer */
        (void)ivshm_recv_idle(h);
        /* the fast path hands out only whole messages inside a ring slot
           of ours, from a sender that can be one */
        int taken = ivshm_recv_each(h, each_check, (void *)area, 1 + i);
        if (taken > 1 + i || (taken < 0 && taken != -EAGAIN))
            __builtin_trap();
        if (((data[0] >> 4) ^ (unsigned)i) & 1) {
            const void *msg = NULL;
            ssize_t rc = ivshm_recv_peek(h, from, &src, &tag, &msg);
            if (rc < 0)
                continue;
            /* a peeked payload lies inside our receive area (a cell or a
               ring slot), or in a backlog record of ours */
            const uint8_t *m = msg;
            bool in_region = m >= h->base && m < h->base + h->size;
            if (src < 1 || src > 2 || !m ||
                (in_region && (m < area || m + rc > area + h->rx_bytes)) ||
                (uint64_t)rc > h->slot_size - IVSHM_SLOT_HDR)
                __builtin_trap();
            volatile uint8_t sink = 0;
            for (ssize_t k = 0; k < rc; k++)
                sink ^= m[k];
            (void)sink;
            /* nobody wrote the area since the peek: it must be there */
            if (ivshm_recv_release(h, src) != 0)
                __builtin_trap();
        } else {
            ssize_t rc = ivshm_recv(h, from, &src, &tag,
                                    cap ? rxbuf : NULL, cap, 0);
            if (rc > 0 && (src < 1 || src > 2 || (uint64_t)rc > (uint64_t)SSIZE_MAX))
                __builtin_trap();
        }
    }
    (void)ivshm_recv_release(h, 1);
    (void)ivshm_recv_release(h, 2);
    ivshm_try_send(h, 1, 5, "fuzz", 4);
    int err = 0;
    uint8_t *slotp = ivshm_send_reserve(h, 1, 16, &err);
    if (slotp) {
        memcpy(slotp, "zero-copy fuzz!", 16);
        ivshm_send_commit(h, 1, 7, 16);
    }
    ivshm_send(h, 1, 6, rxbuf, 300);
    /* a bounded send of a message larger than the ring or queue (4 slots
       of 96): streams, and must give up by its deadline whatever the
       tail or the queue says */
    ivshm_send_timeout(h, 1, 8, rxbuf, 500, 1);
    return 0;
}
