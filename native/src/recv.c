/*
 * Receiving: where the next message of a sender lies (its backlog, its
 * fast ring, or our queue's head), reassembly of a message of several
 * fragments, and the receive API of ivshm.h. The structures themselves
 * are ring.h, queue.h and channel.h; backlogs and the stage of a message
 * in progress peer_local.h; the repairs of the whole area rx_area.c.
 *
 * The consumer keeps its position locally (q_head). A receive from one
 * sender that finds other senders' cells at the head moves them to
 * per-sender backlogs in local memory (bounded), delivered later in
 * order. IVSHM_ANY polls the backlogs, the active fast channels and the
 * queue head round robin: O(backlogs + channels), never O(peers).
 *
 * Zero-copy: recv_peek hands out the payload of the message where it
 * lies (ring slot, queue cell or backlog) and recv_release consumes it.
 */
#define _GNU_SOURCE
#include "channel.h"
#include "clock.h"
#include "doorbell.h"
#include "peer_local.h"
#include "queue.h"
#include "ring.h"
#include "rx_area.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Empty receive polls between two looks at the clock for a sweep of
   descriptors left by departed senders. */
#define SWEEP_POLLS 4096
#define SWEEP_EVERY_MS 200
#define SWEEP_EVERY_NS (SWEEP_EVERY_MS * 1000000ull)

/* ------------------------------------------------------------------ */
/* receiving: our area                                                */
/* ------------------------------------------------------------------ */

/* The next cell of one sender, wherever it lies. */
struct cref {
    int kind;            /* SRC_* */
    struct frag f;       /* validated by the caller before use */
    const uint8_t *data; /* payload: backlog record, ring slot or cell */
};

/* Move the head cell (of q->src) to its sender's backlog. Refused while
   a peeked message lies at the head (its pointer must stay good), when
   the backlogs are at their bound, or out of memory. */
static int q_to_backlog(ivshm *h, const struct qhead *q)
{
    if (h->q_peek_src >= 0)
        return -EAGAIN;
    /* a sender we hear through the queue only costs us no memory: its
       cell waits at the head for a receive from any sender */
    if (h->listen_mode == IVSHM_LISTEN_OTHERS_QUEUED &&
        !ivshm_listened(h, q->src, q->f.gen))
        return -EAGAIN;
    int rc = ivshm_bl_push(h, q->src, &q->f, q->data);
    if (rc == 0)
        q_advance(h, 0, false);
    return rc;
}

/* ---- the next cell of one sender ---- */

/* The next cell of sender `slot`: its backlog first, then its fast ring
   if it has one, else our queue's head if it is that sender's. `drain`:
   other senders' cells at the head are moved to their backlogs to get
   at this sender's. 1 with *c filled, 0 if there is none (yet). A ring
   found empty gets its tail checked (rx_heal_tail); a departed sender's
   drained ring is freed. */

IVSHM_HOT_INLINE int next_cell(ivshm *h, int slot, enum rx_view view,
                               bool drain, struct cref *c)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    if (p->bl_head) {
        const struct ivshm_backlog *b = p->bl_head;
        c->kind = SRC_BACKLOG;
        c->f = (struct frag){b->len, b->tag, b->gen, b->flags, b->total};
        c->data = b->data;
        return 1;
    }
    if (p->rx_chan >= 0) {
        uint8_t *ring = rx_ring(h, slot);
        struct ivshm_slot *s = slot_at(h, ring, p->rx_tail);
        if (slot_full(s, p->rx_tail)) {
            c->kind = SRC_RING;
            frag_read(s, &c->f);
            c->data = slot_data(s);
            return 1;
        }
        if (view == RX_LIVE) {
            rx_heal_tail(h, slot, ring);
            return 0;
        }
        if (ivshm_ring_unhide_gone(h, slot)) {
            c->kind = SRC_RING;
            frag_read(s, &c->f);
            c->data = slot_data(s);
            return 1;
        }
        ivshm_chan_free(h, slot);
    }
    for (;;) {
        struct qhead q;
        if (ivshm_q_front(h, &q) != Q_FULL)
            return 0;
        if (q.src == slot) {
            c->kind = SRC_QUEUE;
            c->f = q.f;
            c->data = q.data;
            return 1;
        }
        /* one unit a cell moved aside: peers decide how many wait */
        if (!drain || !ivshm_work(h) || q_to_backlog(h, &q) < 0)
            return 0;
    }
}

/* The cell next_cell returned is done with. */
static inline void consume_cell(ivshm *h, int slot, const struct cref *c,
                         enum rx_view view)
{
    h->peers[slot].peeked = false;
    switch (c->kind) {
    case SRC_BACKLOG:
        ivshm_bl_pop(h, slot);
        break;
    case SRC_RING:
        rx_consume(h, slot, rx_ring(h, slot), view);
        break;
    case SRC_QUEUE:
        q_advance(h, 0, false);
        break;
    }
}

/* An OPEN cell of `slot`: from now on it sends on fast channel k of our
   area (if the descriptor says so: ivshm_chan_accept). */
static int rx_open(ivshm *h, int slot, const struct cref *c, enum rx_view view)
{
    uint64_t k = c->f.total;
    consume_cell(h, slot, c, view);
    if (!ivshm_listened(h, slot, c->f.gen)) {
        /* Not heard on a ring of ours (IVSHM_LISTEN_OTHERS_QUEUED): its
           ring is never read. Kept for ivshm_listen, which adopts the
           channel then: everything it sends after this cell is there. */
        h->peers[slot].open_refused =
            k < h->fast_channels ? (uint16_t)(k + 1) : 0;
        h->stats.dropped++;
        return 0;
    }
    if (!ivshm_chan_accept(h, slot, k)) {
        /* a departed sender's descriptor may have been swept already */
        h->stats.dropped++;
        return view == RX_LIVE ? IVSHM_ECORRUPT : 0;
    }
    return 0;
}

/* ---- reassembly ---- */

/* Store what fits of a validated fragment (len <= payload) below `keep`. */
static inline void copy_out(void *buf, uint64_t keep, uint64_t *stored,
                            const uint8_t *data, uint32_t len)
{
    if (*stored >= keep || len == 0)
        return;
    uint64_t n = keep - *stored < len ? keep - *stored : len;
    memcpy((uint8_t *)buf + *stored, data, n);
    *stored += n;
}

static inline bool flags_bad(uint32_t flags)
{
    return (flags & ~(uint32_t)(SLOT_FIRST | SLOT_LAST)) != 0;
}

struct cell_wait {
    int slot;
    enum rx_view view;
};

static bool cell_ready(ivshm *h, void *arg)
{
    const struct cell_wait *w = arg;
    struct cref c = {0};
    return next_cell(h, w->slot, w->view, true, &c) > 0;
}

/* Mid-message: wait for the next fragment until `deadline` (0: not at
   all), spinning as a receive between messages would, in slices of at
   most SWEEP_EVERY_MS each followed by ivshm_ring_heal: a fragment a
   co-tenant hid would otherwise hold a receive without deadline for
   good (and one with a deadline until then, every time). 0 when it is
   there, -ETIMEDOUT, IVSHM_ECORRUPT when the producer overwrote what we
   had not read (ivshm_ring_heal: the message is lost), IVSHM_EPEERDEAD
   once a dead sender's last published fragment is gone (a death turns
   *view into RX_GONE). */
static int rx_wait_fragment(ivshm *h, int slot, enum rx_view *view,
                            uint64_t deadline)
{
    struct cell_wait w = {slot, *view};
    while (*view == RX_LIVE) {
        int ms = deadline == 0 ? -ETIMEDOUT : ms_left(deadline);
        if (ms == -ETIMEDOUT)
            return -ETIMEDOUT;
        const bool sliced = ms < 0 || ms > SWEEP_EVERY_MS;
        int rc = ivshm_wait(h, cell_ready, &w, slot, h->peers[slot].gen,
                            sliced ? SWEEP_EVERY_MS : ms);
        if (rc == -ETIMEDOUT) {
            /* the wait saw the sender alive in the incarnation we know:
               its ring (if it has one) is the one we read */
            if (h->peers[slot].rx_chan >= 0 && ivshm_ring_heal(h, slot)) {
                ivshm_rx_lost(&h->peers[slot]);
                return IVSHM_ECORRUPT;
            }
            if (sliced)
                continue;
        }
        if (rc != IVSHM_EPEERDEAD)
            return rc;
        *view = w.view = RX_GONE;
    }
    /* gone: what it published before dying is still ours, also what
       waits behind a cell another producer is still writing (then "not
       yet": the caller keeps the message in progress and looks again) */
    if (cell_ready(h, &w))
        return 0;
    return *view == RX_GONE && ivshm_q_holds(h, slot) ? -ETIMEDOUT
                                                      : IVSHM_EPEERDEAD;
}

/* Consume the continuation fragments of the message in progress from
   `slot` (p->rx_partial: its FIRST fragment is consumed). A fresh message
   (!staged) is stored straight into buf after the `stored` bytes there; a
   resumed one goes to the stage and is copied to buf once complete.
   Waits for late fragments until `deadline` (0: never; UINT64_MAX:
   forever); when it passes -- checked also between long runs of
   fragments, so a sender streaming without end cannot hold us -- the
   message stays in progress (the stored prefix staged) and the call
   returns -EAGAIN. Invariant: rx_left = bytes not consumed yet. */
static ssize_t rx_fragments(ivshm *h, int slot, enum rx_view view,
                            uint32_t *tag, void *buf, size_t cap,
                            uint64_t stored, uint64_t deadline, bool staged)
{
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);
    /* The incarnation the message is from. Looking at the queue can meet
       a cell of the sender's next incarnation (a co-tenant's store of its
       generation is enough), which resets our view of it under us: the
       message in progress is gone then, nothing of it is ours to keep,
       and the cell is the new incarnation's to deliver. */
    const uint32_t gen = p->gen;
    while (p->rx_left) {
        struct cref c = {0};
        int rc = 1; /* 1: look again, 0: a fragment in c, < 0: stop */
        /* One unit a fragment: a sender streaming without end spends the
           budget, and then the deadline decides (a poll's has passed). */
        if (!ivshm_work(h)) {
            if (deadline != UINT64_MAX &&
                (deadline == 0 || ivshm_now_ns() >= deadline))
                rc = -ETIMEDOUT;
            else
                ivshm_work_start(h);
        } else if (next_cell(h, slot, view, true, &c)) {
            rc = 0;
        } else {
            rc = rx_wait_fragment(h, slot, &view, deadline);
            if (rc == IVSHM_EPEERDEAD || rc == IVSHM_ECORRUPT) {
                rx_abandon(p);
                return rc;
            }
            if (rc == 0)
                rc = 1; /* there now: take it through next_cell */
        }
        if (p->gen != gen || !p->rx_partial)
            return IVSHM_EPEERDEAD; /* reset meanwhile: see above */
        if (rc > 0)
            continue;
        if (rc < 0) {
            /* cut: keep what this call stored, for the next one */
            if (!staged && stored && ivshm_stage_room(p, stored)) {
                memcpy(p->rx_stage, buf, stored);
                p->rx_kept = stored;
            }
            return rc == -ETIMEDOUT ? -EAGAIN : rc;
        }
        if (c.kind == SRC_RING && c.f.gen != p->gen) {
            rx_abandon(p);
            if (c.f.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                                memory_order_relaxed))
                return IVSHM_EPEERDEAD; /* new incarnation; leave its slot */
            consume_cell(h, slot, &c, view);
            return IVSHM_ECORRUPT;
        }
        if (c.f.flags & (SLOT_FIRST | CELL_OPEN)) {
            /* the sender gave up on this message (send deadline): leave
               the cell, it may start a good message */
            rx_abandon(p);
            return IVSHM_ECORRUPT;
        }
        bool is_last = c.f.flags & SLOT_LAST;
        if (flags_bad(c.f.flags) || c.f.len == 0 || c.f.len > payload ||
            c.f.len > p->rx_left || is_last != (c.f.len == p->rx_left) ||
            c.f.tag != p->rx_tag || c.f.total != p->rx_total) {
            rx_abandon(p);
            consume_cell(h, slot, &c, view);
            return IVSHM_ECORRUPT;
        }
        if (staged)
            ivshm_stage_append(p, c.data, c.f.len);
        else
            copy_out(buf, p->rx_keep, &stored, c.data, c.f.len);
        consume_cell(h, slot, &c, view);
        p->rx_left -= c.f.len;
    }
    bool nomem = p->rx_nomem;
    /* An earlier call with a smaller cap dropped bytes this caller would
       expect: returning the length would pass stale buffer bytes off as
       the message's. */
    bool lost = p->rx_keep < p->rx_total && p->rx_keep < cap;
    if (staged && !nomem && !lost) {
        uint64_t n = p->rx_kept < p->rx_keep ? p->rx_kept : p->rx_keep;
        if (n)
            memcpy(buf, p->rx_stage, n);
    }
    rx_abandon(p); /* complete: nothing in progress any more */
    if (nomem)
        return -ENOMEM;
    if (lost)
        return -EMSGSIZE;
    *tag = p->rx_tag;
    return (ssize_t)p->rx_total;
}

/* ---- messages ---- */

/* Receive one whole message from `slot` if its first fragment is there.
   Returns the message length, -EAGAIN if there is none (or it is still
   incomplete at `deadline`, see rx_fragments), or an error. A malformed
   cell is consumed and reported as IVSHM_ECORRUPT, so a scribbled ring
   costs the scribbler's messages, not a stuck receiver. peek non-NULL: a
   valid single-slot message is left in place and *peek points at its
   payload; a longer one (or one in progress) is left: -EMSGSIZE. `drain`
   as in next_cell. */
IVSHM_HOT_INLINE ssize_t rx_message(ivshm *h, int slot, uint32_t *tag,
                                    void *buf, size_t cap, const void **peek,
                                    uint64_t deadline, bool drain)
{
    enum rx_view view = ivshm_rx_view(h, slot);
    if (view == RX_NONE)
        return -EAGAIN;
    struct ivshm_peer_local *p = &h->peers[slot];
    const uint32_t payload = slot_payload(h);

    if (p->rx_partial) {
        if (p->rx_lost) { /* overwritten (ivshm_ring_heal): say so once */
            rx_abandon(p);
            return IVSHM_ECORRUPT;
        }
        if (peek)
            return -EMSGSIZE;
        /* Resume into the stage. The bytes delivered never grow past an
           earlier call's cap: those beyond it are gone. */
        if (p->rx_keep > cap)
            p->rx_keep = cap;
        return rx_fragments(h, slot, view, tag, buf, cap, 0, deadline, true);
    }

    struct cref c;
    /* a unit a cell after the first: stale cells and OPENs (each
       `continue`) are peers' doing */
    for (bool again = false;; again = true) {
        if ((again && !ivshm_work(h)) || !next_cell(h, slot, view, drain, &c))
            return -EAGAIN;
        if (c.kind == SRC_RING && c.f.gen != p->gen) {
            if (c.f.gen == atomic_load_explicit(&ivshm_entry(h, slot)->gen,
                                                memory_order_relaxed))
                return -EAGAIN; /* the slot changed hands just now: our
                                   next call sees the new generation */
            /* written by an earlier incarnation of the sender */
            consume_cell(h, slot, &c, view);
            h->stats.dropped++;
            continue;
        }
        if (c.kind != SRC_RING && (c.f.flags & CELL_OPEN)) {
            int rc = rx_open(h, slot, &c, view);
            if (rc < 0)
                return rc;
            continue; /* its next message is on the ring */
        }
        break;
    }

    /* FIRST fragment: the whole message is described here. */
    bool last = c.f.flags & SLOT_LAST;
    if (flags_bad(c.f.flags) || !(c.f.flags & SLOT_FIRST) ||
        c.f.len > payload || c.f.total > (uint64_t)SSIZE_MAX ||
        (last ? c.f.total != c.f.len
              : (c.f.len == 0 || c.f.total <= c.f.len))) {
        consume_cell(h, slot, &c, view);
        return IVSHM_ECORRUPT;
    }
    if (peek) {
        if (!last)
            return -EMSGSIZE;
        /* a backlog record is ours until the caller releases it */
        ivshm_peek_begin(p, c.kind == SRC_BACKLOG ? p->bl_head : NULL);
        *peek = c.data;
        *tag = c.f.tag;
        p->peek_kind = (uint8_t)c.kind;
        if (c.kind == SRC_QUEUE)
            h->q_peek_src = slot;
        return (ssize_t)c.f.len;
    }
    p->rx_partial = true;
    p->rx_tag = c.f.tag;
    p->rx_total = c.f.total;
    p->rx_keep = c.f.total < cap ? c.f.total : cap;
    p->rx_kept = 0;
    uint64_t stored = 0;
    copy_out(buf, p->rx_keep, &stored, c.data, c.f.len);
    consume_cell(h, slot, &c, view);
    p->rx_left = c.f.total - c.f.len;
    return rx_fragments(h, slot, view, tag, buf, cap, stored, deadline, false);
}

/* Messages an IVSHM_ANY peek takes in a row from the last sender's fast
   ring before it goes round robin again. */
#define HOT_RUN_MAX 16

/*
 * Hot path of IVSHM_ANY: a whole single-slot message at the head of the
 * fast ring of the sender we last took a message from (rx_hot). Only the
 * plain case is handled here; anything else (a backlog, a message in
 * progress, several fragments, another generation, a malformed header)
 * returns -EAGAIN and the general path (rx_any) sees it. Invariants:
 * the header is read once (frag_read) and checked as rx_message would
 * for a FIRST|LAST fragment; a sender's backlog is older than its ring,
 * so a sender with one is not taken here; after HOT_RUN_MAX messages the
 * round robin gets its turn, so a busy sender cannot starve the others.
 */
static inline ssize_t rx_hot_peek(ivshm *h, int *src, uint32_t *tag,
                                  const void **data)
{
    const int slot = h->rx_hot;
    struct ivshm_peer_local *p = &h->peers[slot];
    if (h->rx_hot_run >= HOT_RUN_MAX || p->rx_chan < 0 || p->bl_head ||
        p->rx_partial || p->peeked || p->peek_rec)
        return -EAGAIN;
    struct ivshm_slot *s = slot_at(h, p->rx_ring, p->rx_tail);
    if (!slot_full(s, p->rx_tail) || !ivshm_peer_current(h, slot) ||
        p->rx_chan < 0) /* (a new incarnation reset our view) */
        return -EAGAIN;
    struct frag f;
    frag_read(s, &f);
    if (f.gen != p->gen || f.flags != (SLOT_FIRST | SLOT_LAST) ||
        f.len > slot_payload(h) || f.total != f.len)
        return -EAGAIN;
    h->rx_hot_run++;
    p->peek_kind = SRC_RING;
    p->peeked = true;
    h->stats.recvs++;
    h->stats.bytes_recv += f.len;
    *src = slot;
    *tag = f.tag;
    *data = slot_data(s);
    return (ssize_t)f.len;
}

/*
 * Hot path of an IVSHM_ANY poll that finds nothing, which is what an
 * application polling with MPI_Test between bits of its own work does
 * most of the time: true only if no backlog, no live sender's fast ring
 * and not our queue has anything, and no sender on a fast ring is in the
 * middle of a message (a peek reports that one), in a few loads and no
 * calls. Each ring found empty gets its tail checked as in next_cell (a
 * co-tenant's rewind is healed). A departed sender's channel, a queue
 * cell taken but not yet claimed, or anything else unusual: false, and
 * the general path (rx_any) deals with it. Without `full_check`
 * (ivshm_recv_idle) only the heads are looked at: no incarnation check,
 * no tail healing.
 */
static inline bool rx_nothing(ivshm *h, bool full_check)
{
    if (h->n_bl)
        return false;
    for (int x = 0; x < h->n_act; x++) {
        int slot = h->act[x];
        struct ivshm_peer_local *p = &h->peers[slot];
        if (p->rx_chan < 0 || p->rx_partial ||
            slot_full(slot_at(h, p->rx_ring, p->rx_tail), p->rx_tail))
            return false;
        if (!full_check)
            continue;
        if (!ivshm_peer_current(h, slot) || p->rx_chan < 0)
            return false;
        rx_heal_tail(h, slot, p->rx_ring);
    }
    return q_empty(h);
}

/* ivshm_recv_idle answers "nothing" at most this many times in a row (a
   power of two), so that a caller polling with it still makes a full
   peek, with its checks, every so often. */
#define IDLE_RUN_MAX 64

/*
 * The cheapest answer to "would an IVSHM_ANY peek find something now?"
 * for a caller that polls between bits of other work (the BTL's
 * progress, called by every MPI_Test): the seq of the head slot of each
 * fast ring and of our queue's head cell, a few loads. Invariant: true
 * only when each of them says empty, and never IDLE_RUN_MAX times in a
 * row: what only a full peek looks at (a sender's new incarnation,
 * whose ring restarts where we do not look; a rewound tail to heal)
 * waits at most that many polls. (The fast-channel sweep counts full
 * empty peeks, so it comes later too, but it is also paced by time.)
 */
int ivshm_recv_idle(ivshm *h)
{
    if (!h || h->self < 0)
        return 0;
    if ((++h->idle_polls & (IDLE_RUN_MAX - 1)) == 0)
        return 0;
    /* the head loads only: incarnations and tails are the full peek's */
    return rx_nothing(h, false);
}

/*
 * The fast path of a progress loop (docs/fast-path.md): the whole
 * single-slot messages at the heads of our fast channels, handed to the
 * caller where they lie (ring_take, ring.h) and consumed after it returns,
 * without the peek/release bookkeeping. Invariants:
 *  - each sender's messages in its order: a sender with a backlog, a
 *    message in progress or a peeked one is left to the general path
 *    (all of them are older than its ring's head), and so is one whose
 *    peeked backlog record the caller may still hold (lifetimes until
 *    release, peer_local.h);
 *  - bounded: at most `max` messages; after HOT_RUN_MAX in a row the
 *    general path gets a turn whenever the queue or a backlog holds
 *    something, so queued senders are not starved by busy channels, and
 *    the walk over the channels starts after the last one that gave;
 *  - "nothing at all" is never answered IDLE_RUN_MAX times in a row, as
 *    ivshm_recv_idle: what only the full peek sees still gets seen.
 * ring_take keeps the rest (one copy of each header, the sender's
 * incarnation, consuming only what fn left alone).
 */
static __attribute__((noinline)) int each_walk(ivshm *h, ivshm_recv_fn fn,
                                               void *arg, int max)
{
    if (!fn || max < 1)
        return -EINVAL;
    if (h->each_run >= HOT_RUN_MAX) {
        h->each_run = 0;
        if (h->n_bl || !q_empty(h))
            return 0;
    }
    int n = 0;
    bool elsewhere = false;
    const int nact = h->n_act;
    int x = h->each_next < nact ? h->each_next : 0;
    for (int k = 0; k < nact; k++, x = x + 1 < nact ? x + 1 : 0) {
        if (x >= h->n_act) /* a sender's channel was freed on the way */
            break;
        const int slot = h->act[x];
        const struct ivshm_peer_local *p = &h->peers[slot];
        if (p->rx_chan < 0 || p->rx_partial) {
            elsewhere = true;
            continue;
        }
        if (!slot_full(slot_at(h, p->rx_ring, p->rx_tail), p->rx_tail))
            continue;
        /* (a backlog record a peek handed out: a new hand-out ends it,
           which the general path does, ivshm_peek_begin) */
        if (p->peeked || p->bl_head || p->peek_rec) {
            elsewhere = true;
            continue;
        }
        /* one message at a time is the usual case of a caller whose
           looks are paused (ping-pong): its own copy of the take, without
           the loop, holds less across fn */
        n += max - n == 1 ? ring_take(h, slot, fn, arg, 1, &elsewhere)
                          : ring_take(h, slot, fn, arg, max - n, &elsewhere);
        if (n >= max) {
            h->each_next = x + 1; /* the next call starts after this one */
            break;
        }
    }
    if (n) {
        h->each_run += (uint32_t)n;
        return n;
    }
    h->each_run = 0;
    if (elsewhere || h->n_bl || !q_empty(h) ||
        (++h->idle_polls & (IDLE_RUN_MAX - 1)) == 0)
        return 0;
    return -EAGAIN;
}

/* The usual answer first: every head empty, in a few loads and no frame
   (a peeked message lies at its head; a backlog is seen below); the
   walk, out of line, once a head says "full" or a sender is mid-way. */
int ivshm_recv_each(ivshm *h, ivshm_recv_fn fn, void *arg, int max)
{
    if (__builtin_expect(!h || h->self < 0, 0))
        return -EINVAL; /* fn and max are checked where they are used */
    for (int x = 0; x < h->n_act; x++) {
        const struct ivshm_peer_local *p = &h->peers[h->act[x]];
        if (p->rx_chan < 0 || p->rx_partial ||
            slot_full(slot_at(h, p->rx_ring, p->rx_tail), p->rx_tail))
            return each_walk(h, fn, arg, max);
    }
    if (h->n_bl || !q_empty(h) || (++h->idle_polls & (IDLE_RUN_MAX - 1)) == 0)
        return 0;
    return -EAGAIN;
}

/* Round robin over the sources of IVSHM_ANY, from rr_next: the senders
   with a backlog, the senders with a fast channel, and the queue head
   (whose sender's older messages, in its backlog, go first). A busy
   sender cannot starve the others, and the cost is O(backlogs +
   channels), not O(peers). */
static ssize_t rx_any(ivshm *h, int *src, uint32_t *tag, void *buf,
                      size_t cap, const void **peek, uint64_t deadline)
{
    int n = h->n_bl + h->n_act + 1;
    int i = h->rr_next >= 0 && h->rr_next < n ? h->rr_next : 0;
    /* the sources: at most max_peers + fast_channels + 1, a unit each,
       within the bound without a charge (the budget is for the loops
       that peers can make long) */
    ivshm_work_count(h, (uint32_t)n);
    for (int k = 0; k < n; k++, i = i + 1 >= n ? 0 : i + 1) {
        /* the lists may shrink while we go (a backlog emptied, a
           departed sender's channel freed): what is out of range waits
           for the next call */
        int who;
        if (i < h->n_bl) {
            who = h->bl_list[i];
        } else if (i < h->n_bl + h->n_act) {
            who = h->act[i - h->n_bl];
        } else if (i == n - 1) {
            struct qhead q;
            if (ivshm_q_front(h, &q) != Q_FULL)
                continue;
            who = q.src;
            /* A queue cell of a sender on a fast channel is out of order
               (only a co-tenant writes one): through the backlog it is
               validated and delivered, and the queue moves on. */
            if (h->peers[who].rx_chan >= 0 && q_to_backlog(h, &q) < 0)
                continue;
        } else {
            continue;
        }
        ssize_t rc = rx_message(h, who, tag, buf, cap, peek, deadline, false);
        if (rc != -EAGAIN) {
            h->rr_next = i + 1;
            *src = who;
            return rc;
        }
    }
    return -EAGAIN;
}

/* Is there a message (or fragment) of `slot` for us? */
static bool rx_has_message(ivshm *h, int slot)
{
    enum rx_view view = ivshm_rx_view(h, slot);
    if (view == RX_NONE)
        return false;
    struct cref c = {0};
    return next_cell(h, slot, view, true, &c) > 0;
}

static bool any_ready(ivshm *h, void *arg)
{
    (void)arg;
    if (h->n_bl)
        return true;
    for (int x = 0; x < h->n_act; x++)
        if (rx_has_message(h, h->act[x]))
            return true;
    struct qhead q;
    return ivshm_q_front(h, &q) == Q_FULL;
}

static bool one_ready(ivshm *h, void *arg)
{
    return rx_has_message(h, *(const int *)arg);
}

/* A sender whose message we hold half-received, or -1: an IVSHM_ANY
   wait watches its liveness, so its death ends the wait and is reported. */
static int partial_sender(const ivshm *h)
{
    for (int i = 0; i < (int)h->max_peers; i++)
        if (h->peers[i].rx_partial)
            return i;
    return -1;
}

/* At most every SWEEP_EVERY_MS, when a receive finds nothing: free
   descriptors of senders that took one and went away before using it,
   adopt channels whose OPEN was lost, and repair what ivshm_ring_heal
   repairs. */
static void sweep_due(ivshm *h)
{
    uint64_t now = ivshm_now_ns();
    if (now < h->next_sweep_ns)
        return;
    h->next_sweep_ns = now + SWEEP_EVERY_NS;
    ivshm_fast_sweep(h);
    ivshm_rx_heal_hidden(h);
}

/* Counted polls first: the clock is not read on every empty poll. */
static void maybe_sweep(ivshm *h)
{
    if (++h->sweep_polls % SWEEP_POLLS)
        return;
    sweep_due(h);
}

ssize_t ivshm_recv(ivshm *h, int from, int *src, uint32_t *tag, void *buf,
                   size_t cap, int timeout_ms)
{
    if (!h || h->self < 0 || (cap && !buf))
        return -EINVAL;
    if (from != IVSHM_ANY && (!ivshm_slot_ok(h, from) || from == h->self))
        return -EINVAL;
    /* 0: poll, the deadline has passed already; UINT64_MAX: forever */
    const uint64_t deadline = ivshm_deadline(timeout_ms);
    bool looked_again = false;

    for (;;) {
        /* each round follows a look at the clock (or a wait) */
        ivshm_work_start(h);
        int got_src = from;
        uint32_t got_tag = 0;
        ssize_t rc =
            from == IVSHM_ANY
                ? rx_any(h, &got_src, &got_tag, buf, cap, NULL, deadline)
                : rx_message(h, from, &got_tag, buf, cap, NULL, deadline,
                             true);
        if (rc != -EAGAIN && src)
            *src = got_src; /* on ECORRUPT too: says who scribbled */
        if (rc >= 0) {
            if (tag)
                *tag = got_tag;
            h->stats.recvs++;
            h->stats.bytes_recv += (uint64_t)rc;
            return rc;
        }
        if (rc != -EAGAIN)
            return rc;
        maybe_sweep(h);
        const enum rx_view view =
            from != IVSHM_ANY ? ivshm_rx_view(h, from) : RX_LIVE;
        if (view != RX_LIVE) {
            /* It may have published and left since rx_message looked:
               one more round for that, then only while the deadline
               allows (a co-tenant that moves a departed sender's head
               makes its ring look endless). */
            if (rx_has_message(h, from)) {
                if (looked_again && ms_left(deadline) == -ETIMEDOUT)
                    return timeout_ms == 0 ? -EAGAIN : -ETIMEDOUT;
                looked_again = true;
                continue;
            }
            /* unless its last cells wait behind one that another
               producer is still writing */
            if (view != RX_GONE || !ivshm_q_holds(h, from)) {
                rx_abandon(&h->peers[from]);
                return IVSHM_EPEERDEAD;
            }
        }
        if (timeout_ms == 0)
            return -EAGAIN;
        int peer = from != IVSHM_ANY ? from : partial_sender(h);
        /* A departed sender we still wait for has cells behind another
           producer's: wait for that producer (its publish kicks us); a
           watch on the departed one's liveness would end every wait at
           once. */
        if (peer >= 0 && ivshm_rx_view(h, peer) == RX_GONE)
            peer = -1;
        uint32_t peer_gen = peer >= 0 ? h->peers[peer].gen : 0;
        int wait_ms = ms_left(deadline);
        if (wait_ms == -ETIMEDOUT)
            return -ETIMEDOUT;
        /* in slices, each followed by a look for hidden messages: a
           co-tenant could otherwise hold a long receive at one forever */
        const bool sliced = wait_ms < 0 || wait_ms > SWEEP_EVERY_MS;
        int w = ivshm_wait(h, from == IVSHM_ANY ? any_ready : one_ready, &from,
                           peer, peer_gen, sliced ? SWEEP_EVERY_MS : wait_ms);
        if (w == -ETIMEDOUT && sliced) {
            /* both repairs of the 200 ms sweep: a poller gets them from
               maybe_sweep, a long blocking receive only here */
            ivshm_fast_sweep(h);
            ivshm_rx_heal_hidden(h);
            continue;
        }
        if (w == -ETIMEDOUT) {
            /* a caller that receives with short deadlines in a loop
               never polls 4096 times: the sweep is due by time alone */
            sweep_due(h);
            return -ETIMEDOUT;
        }
        if (w < 0 && w != IVSHM_EPEERDEAD)
            return w;
        /* A partial sender whose slot is being claimed again (or whose
           state a co-tenant keeps at CLAIMING) will never continue that
           message: drop it, or this loop would spin on its "death". */
        if (w == IVSHM_EPEERDEAD && from == IVSHM_ANY && peer >= 0 &&
            ivshm_rx_view(h, peer) == RX_NONE)
            rx_abandon(&h->peers[peer]);
        /* ready or dead: the next round drains what is left, then the
           view check above reports the death */
    }
}

int ivshm_listen_only(ivshm *h, int mode)
{
    if (!h || mode < IVSHM_LISTEN_ALL || mode > IVSHM_LISTEN_OTHERS_QUEUED)
        return -EINVAL;
    h->listen_mode = (uint8_t)mode;
    return 0;
}

int ivshm_listen(ivshm *h, int slot, uint32_t generation)
{
    if (!h || !ivshm_slot_ok(h, slot))
        return -EINVAL;
    h->listen_gen[slot] = generation;
    /* A channel it announced before we listened: from now on we read it
       (the OPEN was its last queue cell: order holds). Only if the slot
       still holds that incarnation and the descriptor still names it. */
    struct ivshm_peer_local *p = &h->peers[slot];
    if (generation && p->open_refused && h->self >= 0 && slot != h->self &&
        ivshm_peer_current(h, slot) && p->gen == generation) {
        uint64_t k = p->open_refused - 1u;
        p->open_refused = 0;
        (void)ivshm_chan_accept(h, slot, k);
    }
    return 0;
}

int ivshm_wait_message(ivshm *h, int timeout_ms)
{
    if (!h || h->self < 0)
        return -EINVAL;
    const uint64_t deadline = ivshm_deadline(timeout_ms);
    for (;;) {
        int wait_ms = timeout_ms == 0 ? 0 : ms_left(deadline);
        if (wait_ms == -ETIMEDOUT)
            wait_ms = 0;
        /* in slices, as a long receive: a message a co-tenant hid is not
           "ready", so one long wait would last its whole timeout */
        const bool sliced = wait_ms < 0 || wait_ms > SWEEP_EVERY_MS;
        int rc = ivshm_wait(h, any_ready, NULL, -1, 0,
                            sliced ? SWEEP_EVERY_MS : wait_ms);
        if (rc == -ETIMEDOUT && sliced) {
            ivshm_fast_sweep(h);
            ivshm_rx_heal_hidden(h);
            continue;
        }
        if (rc == -ETIMEDOUT)
            sweep_due(h); /* as ivshm_recv: a message hidden may be why */
        return rc;
    }
}

/* The general path of ivshm_recv_peek, out of line so that its fast
   paths (a hot ring's message, nothing at all) stay short. */
static __attribute__((noinline)) ssize_t peek_general(ivshm *h, int from,
                                                       int *src, uint32_t *tag,
                                                       const void **data)
{
    if (from != IVSHM_ANY && (!ivshm_slot_ok(h, from) || from == h->self))
        return -EINVAL;
    /* one budget for both rounds: a peek never waits */
    ivshm_work_start(h);
    /* two rounds: a sender may publish and leave between them */
    for (int round = 0; round < 2; round++) {
        int got_src = from;
        uint32_t got_tag = 0;
        ssize_t rc =
            from == IVSHM_ANY
                ? rx_any(h, &got_src, &got_tag, NULL, 0, data, 0)
                : rx_message(h, from, &got_tag, NULL, 0, data, 0, true);
        if (rc != -EAGAIN && src)
            *src = got_src;
        if (rc >= 0) {
            if (tag)
                *tag = got_tag;
            h->peers[got_src].peeked = true;
            /* a ring message: look at that ring first next time */
            h->rx_hot = h->peers[got_src].peek_kind == SRC_RING ? got_src : -1;
            h->rx_hot_run = 0;
            h->stats.recvs++;
            h->stats.bytes_recv += (uint64_t)rc;
            return rc;
        }
        if (rc == -EAGAIN)
            maybe_sweep(h);
        if (rc != -EAGAIN || from == IVSHM_ANY)
            return rc;
        const enum rx_view view = ivshm_rx_view(h, from);
        if (view == RX_LIVE)
            return -EAGAIN;
        if (!rx_has_message(h, from))
            return view == RX_GONE && ivshm_q_holds(h, from) ? -EAGAIN
                                                             : IVSHM_EPEERDEAD;
    }
    return -EAGAIN;
}

/* Never waits. Stale cells of an earlier incarnation are dropped and a
   malformed one is consumed (-IVSHM_ECORRUPT), as in ivshm_recv; a valid
   message stays where it is until ivshm_recv_release. */
ssize_t ivshm_recv_peek(ivshm *h, int from, int *src, uint32_t *tag,
                        const void **data)
{
    if (!h || h->self < 0 || !data)
        return -EINVAL;
    if (from == IVSHM_ANY && h->rx_hot >= 0) {
        int hot_src;
        uint32_t hot_tag;
        ssize_t rc = rx_hot_peek(h, &hot_src, &hot_tag, data);
        if (rc >= 0) {
            if (src)
                *src = hot_src;
            if (tag)
                *tag = hot_tag;
            return rc;
        }
    }
    if (from == IVSHM_ANY && rx_nothing(h, true)) {
        h->q_stuck_since = 0; /* as the general path's empty queue does */
        maybe_sweep(h);
        return -EAGAIN;
    }
    return peek_general(h, from, src, tag, data);
}

/* Consume the message ivshm_recv_peek returned for `src`. Decided on
   local state only: a co-tenant rewriting the slot meanwhile cannot make
   the release fail and the message stick. */
int ivshm_recv_release(ivshm *h, int src)
{
    if (!h || h->self < 0 || !ivshm_slot_ok(h, src) || src == h->self)
        return -EINVAL;
    enum rx_view view = ivshm_rx_view(h, src); /* a new incarnation drops it */
    struct ivshm_peer_local *p = &h->peers[src];
    /* whatever became of the message meanwhile, what the peek handed out
       is the caller's no more after this call (ivshm_peek_end) */
    if (view == RX_NONE || !p->peeked) {
        ivshm_peek_end(p);
        return -EINVAL;
    }
    struct cref c = {.kind = p->peek_kind};
    if ((c.kind == SRC_QUEUE && h->q_peek_src != src) ||
        (c.kind == SRC_RING && p->rx_chan < 0) ||
        (c.kind == SRC_BACKLOG && p->bl_head != p->peek_rec)) {
        p->peeked = false;
        ivshm_peek_end(p);
        return -EINVAL;
    }
    consume_cell(h, src, &c, view);
    ivshm_peek_end(p);
    return 0;
}
