/*
 * One attachment (`ivshm`, the handle of ivshm.h) in local memory: the
 * validated copy of the geometry, our registry slot, what we keep about
 * every peer, and where each part of the region lies for us. Types and
 * address arithmetic only: the helpers here call nothing.
 */
#ifndef IVSHM_ATTACHMENT_H
#define IVSHM_ATTACHMENT_H

#include "layout.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Private to libivshm: not exported from libivshm.so, and a direct call
   (no PLT) from the other files of the library. */
#define IVSHM_INTERNAL __attribute__((visibility("hidden")))
/* A helper of a hot path folded into its callers, whose constant
   arguments then remove most of its branches. */
#define IVSHM_HOT_INLINE static inline __attribute__((always_inline))

struct ivshm_doorbell; /* doorbell.h */

/* A cell taken out of our queue ahead of its turn (a receive from
   another sender had to get past it): kept per sender, in order
   (peer_local.c). */
struct ivshm_backlog {
    struct ivshm_backlog *next;
    uint32_t len, tag, gen, flags;
    uint64_t total;
    uint8_t data[];
};

/* per-peer local view kept by one attachment (peer_local.c) */
struct ivshm_peer_local {
    uint32_t gen;             /* generation we last talked to; 0 = none   */
    int16_t tx_chan;          /* fast channel of its area we own, or -1   */
    int16_t rx_chan;          /* fast channel of our area it uses, or -1  */
    /* those channels' rings (ivshm_fring), kept with tx_chan / rx_chan:
       the hot paths need no address arithmetic */
    uint8_t *tx_ring, *rx_ring;
    uint32_t tx_queued;       /* messages sent to it through its queue    */
    uint32_t tx_retry;        /* queue sends before trying to open again  */
    uint64_t tx_head;         /* our producer position in the fast ring   */
    uint64_t tx_tail_cache;   /* last validated tail of that ring         */
    uint64_t rx_tail;         /* our consumer position in its fast ring   */
    bool reserved;            /* send_reserve handed out a slot           */
    bool peeked;              /* recv_peek handed out a message           */
    uint8_t reserve_kind;     /* SRC_RING: slot at tx_head; SRC_QUEUE: stage */
    uint8_t peek_kind;        /* SRC_*: where the peeked message lies     */
    bool tx_streak;           /* a small send to it since we last took a
                                 message of its ring (ring.h,
                                 ring_put_small)                          */
    /* Lifetimes: what we hand out stays ours to keep until its release,
       whatever a reset (a new incarnation of the peer) or a copying
       receive does meanwhile (peer_local.c). */
    uint8_t *tx_stage;        /* queue reservations are staged here; kept
                                 across resets, freed at detach          */
    struct ivshm_backlog *peek_rec; /* the backlog record a peek handed
                                 out, or NULL                            */
    bool peek_orphan;         /* ... and it left the backlog (consumed,
                                 or the backlog was cleared): freed by the
                                 release, the sender's next peek, detach */
    struct ivshm_backlog *bl_head, *bl_tail;
    uint32_t bl_count;
    /* A message from this peer whose receive was cut by the caller's
       deadline: its FIRST fragment and maybe more are consumed, the rest
       follows in the ring and the next receive from it continues it,
       storing into rx_stage and copying to the caller once complete.
       Only these local copies describe it (never re-read from the slot). */
    bool rx_partial;
    bool rx_nomem;            /* staging failed: deliver -ENOMEM at the end */
    uint32_t rx_tag;
    uint64_t rx_total;        /* its length (FIRST fragment, validated)    */
    uint64_t rx_left;         /* bytes still to consume, > 0               */
    uint64_t rx_keep;         /* bytes delivered: min(total, every cap)    */
    uint64_t rx_kept;         /* bytes of it in rx_stage so far            */
    uint64_t rx_stage_cap;    /* allocated bytes of rx_stage               */
    uint8_t *rx_stage;        /* malloc'd: the stored prefix, then the rest
                                 of what is stored, until it completes     */
    /* Repairs only (cold, kept off the lines the hot paths use): */
    /* a tail ahead of tx_head that we refused, and since when (ns; 0 =
       none): followed once it has stood that long (ring.c, tail_ahead) */
    uint64_t tx_odd_tail, tx_odd_since;
    /* its producer overwrote messages we had not read (ring.c,
       ivshm_ring_heal): the next receive from it reports IVSHM_ECORRUPT */
    bool rx_lost;
    /* channel + 1 that it announced while we did not listen to it
       (IVSHM_LISTEN_OTHERS_QUEUED: recv.c rx_open; IVSHM_LISTEN_LISTED:
       queue.c ivshm_q_front): adopted when we start to, 0 none */
    uint16_t open_refused;
};
/* where a message lies */
enum { SRC_NONE = 0, SRC_BACKLOG = 1, SRC_RING = 2, SRC_QUEUE = 3 };

/* Which incarnation of a sender we read from (peer_local.h, ivshm_rx_view). */
enum rx_view {
    RX_NONE, /* nobody: free since we joined, or being claimed */
    RX_LIVE, /* ACTIVE: we free slots and wake it */
    RX_GONE, /* left or died: drain what it published, read-only */
};

/* ---- one attachment ---- */
struct ivshm {
    uint8_t *base;
    uint64_t size;
    int map_fd;               /* -1 once closed                          */
    /* validated copy of the geometry */
    uint32_t max_peers, ring_slots, slot_size, max_windows;
    uint32_t queue_slots, fast_channels;
    uint64_t registry_off, rx_off, rx_bytes, ring_bytes, windir_off, wctl_off;
    uint64_t heap_off, heap_size;

    int self;                 /* our registry slot                       */
    uint32_t self_gen;
    uint64_t job_id;
    uint32_t rank;
    int64_t spin_ns;
    bool may_sleep;           /* what our entry's may_sleep says           */
    uint64_t announced_ns;    /* when it last went from 0 to 1             */
    uint64_t lock_timeout_ns; /* bound on a live, stuck lock holder       */
    uint64_t pidns;
    uint32_t fast_after;      /* queue messages to a peer before a channel */

    struct ivshm_doorbell *db;
    struct ivshm_peer_local *peers; /* max_peers entries                  */
    int rr_next;              /* round-robin start for IVSHM_ANY receive  */
    int rx_hot;               /* sender whose fast ring IVSHM_ANY looks at
                                 first (recv.c, rx_hot_peek), or -1       */
    uint32_t rx_hot_run;      /* messages taken that way in a row         */
    /* our queue, consumer side (local: the shared head is a hint); its
       ctrl and cells, set when we claim our slot */
    struct ivshm_queue_ctrl *my_qctrl;
    uint8_t *my_cells;
    uint64_t q_head;
    uint64_t q_stuck_seq;     /* seq value seen at q_head while waiting   */
    uint64_t q_stuck_since;   /* ... since then (ns), 0 = not waiting     */
    uint64_t q_skip_until;    /* free cells below it are skipped at once  */
    int q_peek_src;           /* sender whose peeked message is at q_head */
    /* senders using a fast channel of our area (peers[x].rx_chan >= 0) */
    int n_act;
    int act[IVSHM_MAX_FAST];
    int chan_user[IVSHM_MAX_FAST]; /* sender using channel k, or -1       */
    /* senders with a backlog, and its size */
    int n_bl;
    int *bl_list;             /* max_peers entries                        */
    uint8_t listen_mode;      /* IVSHM_LISTEN_*: whom we hear (recv.c)     */
    uint32_t *listen_gen;     /* max_peers: generation heard, 0 = none    */
    uint64_t bl_bytes;
    uint64_t next_sweep_ns;
    unsigned sweep_polls;
    unsigned idle_polls;      /* ivshm_recv_idle calls (its run limit)    */
    /* ivshm_recv_each: messages taken in a row (the general path's turn
       after HOT_RUN_MAX), and the active channel it starts at */
    uint32_t each_run;
    int each_next;
    /* Work budget (clock.h): units of work driven by region contents
       left before the call looks at the clock again, and a whole one. */
    uint32_t work_left, work_budget;
    /* Counted only by a build with IVSHM_WORK_COUNT (the hostile-peer
       harness): units charged in all, at the last look at the clock, and
       the most charged between two looks since work_peak was cleared. */
    uint64_t work_units, work_mark, work_peak;
    ivshm_stats stats;
};

/* Do we hear `src` in generation `gen` on every path (ivshm_listen)? */
static inline bool ivshm_listened(const ivshm *h, int src, uint32_t gen)
{
    return h->listen_mode == IVSHM_LISTEN_ALL || h->listen_gen[src] == gen;
}

/* ---- where things lie, from the validated geometry ---- */
static inline struct ivshm_header *ivshm_hdr(const ivshm *h)
{
    return (struct ivshm_header *)h->base;
}
static inline struct ivshm_peer_entry *ivshm_entry(const ivshm *h, int slot)
{
    /* slot must already be validated: 0 <= slot < max_peers */
    return (struct ivshm_peer_entry *)(h->base + h->registry_off) + slot;
}
/* receive area of `slot` (validated) and its parts */
static inline uint8_t *ivshm_rx_area(const ivshm *h, int slot)
{
    return h->base + h->rx_off + (uint64_t)slot * h->rx_bytes;
}
static inline struct ivshm_queue_ctrl *ivshm_qctrl(const ivshm *h, int slot)
{
    return (struct ivshm_queue_ctrl *)ivshm_rx_area(h, slot);
}
static inline struct ivshm_cell *ivshm_qcell(const ivshm *h, int slot,
                                             uint64_t pos)
{
    return (struct ivshm_cell *)(ivshm_rx_area(h, slot) + IVSHM_QUEUE_CTRL +
                                 (pos & (h->queue_slots - 1)) *
                                     (uint64_t)h->slot_size);
}
/* a cell of our own queue: the consumer's hot path */
static inline struct ivshm_cell *ivshm_my_qcell(const ivshm *h, uint64_t pos)
{
    return (struct ivshm_cell *)(h->my_cells + (pos & (h->queue_slots - 1)) *
                                                   (uint64_t)h->slot_size);
}
static inline struct ivshm_fast_desc *ivshm_fdesc(const ivshm *h, int slot,
                                                  uint32_t k)
{
    return (struct ivshm_fast_desc *)(ivshm_rx_area(h, slot) +
                                      IVSHM_QUEUE_CTRL +
                                      (uint64_t)h->queue_slots * h->slot_size) +
           k;
}
/* fast ring k (< fast_channels) of `slot`'s receive area */
static inline uint8_t *ivshm_fring(const ivshm *h, int slot, uint32_t k)
{
    return (uint8_t *)ivshm_fdesc(h, slot, h->fast_channels) +
           (uint64_t)k * h->ring_bytes;
}
static inline bool ivshm_slot_ok(const ivshm *h, int slot)
{
    return slot >= 0 && (uint32_t)slot < h->max_peers;
}

/* Payload bytes of a ring slot or queue cell, and where they start. */
static inline uint32_t slot_payload(const ivshm *h)
{
    return h->slot_size - IVSHM_SLOT_HDR;
}

static inline uint8_t *slot_data(void *s)
{
    return (uint8_t *)s + IVSHM_SLOT_HDR;
}

static inline void count_sent(ivshm *h, size_t len)
{
    h->stats.sends++;
    h->stats.bytes_sent += len;
}

#endif
