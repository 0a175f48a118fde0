/*
 * Private to libivshm: the region layout (see docs/region-layout.md), the
 * local state of one attachment, and the doorbell backend interface.
 *
 * Rule for every file: the region is shared with untrusted co-tenants.
 * Geometry is copied out of the header once at attach and validated; at
 * run time only the local copy is used for addressing. Anything else read
 * from the region (ring seq/len, tails, registry fields, window
 * descriptors) is validated before it indexes or sizes anything.
 */
#ifndef IVSHM_INTERNAL_H
#define IVSHM_INTERNAL_H

#include "ivshm.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define IVSHM_MAGIC 0x4d48535649435649ULL /* "IVCIVSHM" little-endian */
#define IVSHM_LAYOUT_VERSION 3u
#define IVSHM_CACHELINE 64u
#define IVSHM_PAGE 4096u
#define IVSHM_HEADER_BYTES IVSHM_PAGE
#define IVSHM_MAX_PEERS 1024u
#define IVSHM_MAX_FAST 64u     /* fast channels per receiver, at most      */
#define IVSHM_SLOT_HDR 32u
#define IVSHM_NAME_LEN 32u

/* header.state */
enum { REGION_BLANK = 0, REGION_FORMATTING = 1, REGION_READY = 2 };

/* ---- offset 0: header (one page) ---- */
struct ivshm_header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint64_t region_size;
    _Atomic uint32_t state;   /* READY is stored last, with release */
    uint32_t max_peers;
    uint32_t ring_slots;
    uint32_t slot_size;
    uint32_t max_windows;
    uint32_t queue_slots;     /* cells of each receiver's shared queue       */
    uint32_t fast_channels;   /* fast rings per receiver (0: none)           */
    uint32_t reserved0;
    uint64_t registry_off;    /* max_peers * sizeof(struct ivshm_peer_entry) */
    uint64_t rx_off;          /* max_peers receive areas of rx_bytes each    */
    uint64_t rx_bytes;        /* queue ctrl + cells + descriptors + rings    */
    uint64_t ring_bytes;      /* IVSHM_RING_CTRL + ring_slots * slot_size     */
    uint64_t windir_off;      /* max_windows * sizeof(struct ivshm_win_desc) */
    uint64_t wctl_off;        /* max_windows * max_peers lock lines          */
    uint64_t heap_off;        /* window data, page aligned                   */
    uint64_t heap_size;
    _Atomic uint64_t alloc_lock; /* 0 free, else owner slot+1 (heap + windir) */
};

/* registry entry state */
enum { PEER_FREE = 0, PEER_CLAIMING = 1, PEER_ACTIVE = 2, PEER_DEAD = 3 };
/* how a peer can be woken */
enum { DB_FUTEX = 1, DB_EVENTFD = 2, DB_UIO = 3,
       /* in a guest whose device another process holds: can neither be
          rung nor ring (doorbell_uio.c) */
       DB_NONE = 4 };

/* ---- registry: max_peers entries, two cache lines each ---- */
struct ivshm_peer_entry {
    /* line 0: identity, written by the owner while CLAIMING */
    _Atomic uint32_t state;
    _Atomic uint32_t gen;
    uint64_t job_id;
    uint32_t rank;
    int32_t doorbell_id;      /* server id / IVPosition, -1 none      */
    int32_t pid;
    uint32_t backend;         /* DB_*                                  */
    uint64_t pidns;           /* inode of the owner's pid namespace    */
    char name[IVSHM_NAME_LEN - 8];
    /* line 1: hot, touched by wakers */
    _Atomic uint32_t sleeping __attribute__((aligned(64))); /* 1 = blocked */
    _Atomic uint32_t wake;    /* futex word, bumped by every ring       */
    _Atomic uint64_t heartbeat;
    /* 0 = the owner never blocks (it spins), so wakers skip the fence
       and the look at `sleeping` (wait.c, "blocking announced") */
    _Atomic uint32_t may_sleep;
    uint8_t pad[44];
};
_Static_assert(sizeof(struct ivshm_peer_entry) == 128, "entry is 2 lines");

/* ---- receive area of peer j at rx_off + j * rx_bytes ----
   [queue ctrl | queue_slots cells | fast_channels descriptors |
    fast_channels rings], every part a multiple of 64 bytes. */

/* Shared multi-producer queue: every peer appends, only j consumes. */
#define IVSHM_QUEUE_CTRL 384u
struct ivshm_queue_ctrl {
    _Atomic uint64_t enqueue_pos; /* next position a producer may take  */
    uint8_t pad0[56];
    _Atomic uint64_t head;        /* consumer's position: a hint only    */
    uint8_t pad1[56];
    _Atomic uint64_t waiters_any; /* non-zero: look at waiters[]         */
    uint8_t pad2[56];
    _Atomic uint64_t waiters[IVSHM_MAX_PEERS / 64]; /* bit s: slot s waits
                                                       for room          */
    uint8_t pad3[64];
};
/* Queue cell header (same size as a ring slot's); payload follows.
   seq: == pos free for the producer of position pos; == pos + 1 full;
   CLAIM(pos, slot, gen) while a producer writes it (see queue.c). */
struct ivshm_cell {
    _Atomic uint64_t seq;
    uint32_t len;             /* payload bytes in this cell               */
    uint32_t tag;
    uint32_t gen;             /* sender's registry generation             */
    uint16_t flags;           /* CELL_*                                   */
    uint16_t src;             /* sender's registry slot                   */
    uint64_t total;           /* message length; CELL_OPEN: channel index */
};
/* FIRST/LAST as in a ring slot; PAD: no message (a producer whose cells
   were skipped); OPEN: the sender uses fast channel `total` from now on. */
enum { CELL_PAD = 4u, CELL_OPEN = 8u };
/* seq of a claimed cell: bit 63 CLAIM, bits 53..62 the claimer's slot,
   bits 32..52 the low 21 bits of its generation, bits 0..31 the low 32
   bits of the position. Free and full values are plain positions, far
   below 2^63. */
#define CELL_CLAIM (1ull << 63)
#define CLAIM_GEN_MASK 0x1fffffu
static inline uint64_t ivshm_claim_word(uint64_t pos, int slot, uint32_t gen)
{
    return CELL_CLAIM | ((uint64_t)slot << 53) |
           ((uint64_t)(gen & CLAIM_GEN_MASK) << 32) | (pos & 0xffffffffull);
}

/* Fast channel descriptor: owner 0 = free, else (slot + 1) | gen << 32. */
#define IVSHM_FAST_DESC 64u
struct ivshm_fast_desc {
    _Atomic uint64_t owner;
    uint8_t pad[56];
};

/* A fast channel is one single-producer ring, as a v1 pair ring was. */
#define IVSHM_RING_CTRL 128u
struct ivshm_ring_ctrl {
    _Atomic uint64_t head;    /* producer's position, published for rejoin */
    uint8_t pad0[56];
    _Atomic uint64_t tail;    /* consumer's position: slots before it free */
    uint8_t pad1[56];
};
/* slot header; payload follows, slot_size - IVSHM_SLOT_HDR bytes */
struct ivshm_slot {
    _Atomic uint64_t seq;     /* = position + 1 when the slot is full     */
    uint32_t len;             /* payload bytes in this fragment           */
    uint32_t tag;
    uint32_t gen;             /* sender's registry generation             */
    uint32_t flags;           /* SLOT_FIRST | SLOT_LAST                   */
    uint64_t total;           /* whole message length (first fragment)    */
};
enum { SLOT_FIRST = 1u, SLOT_LAST = 2u };

/* ---- window directory ---- */
enum { WIN_FREE = 0, WIN_BUSY = 1, WIN_READY = 2 };
struct ivshm_win_desc {
    _Atomic uint32_t state;
    uint32_t nseg;
    uint64_t reserved;        /* v1's members mask: see the window's ctl  */
    uint64_t job_id;
    char name[IVSHM_NAME_LEN];
    uint64_t data_off;        /* from region base, inside the heap       */
    uint64_t data_bytes;      /* ctl + nseg * seg_size rounded to a page */
    uint64_t seg_size;
    uint32_t gen;             /* bumps at every create                   */
    _Atomic uint32_t bar_count;  /* barrier arrivals in this phase        */
    _Atomic uint32_t bar_phase;
    uint8_t pad[128 - 92];
};
_Static_assert(sizeof(struct ivshm_win_desc) == 128, "win desc is 2 lines");
/* A window's heap extent starts with its ctl pages: the members bitmap
   (bit s: slot s has it open; all clear -> freed), then one readers
   bitmap per segment (bit s: slot s holds it shared), each
   ceil(max_peers / 64) words; the segments follow, page aligned. */
/* per (window, segment) lock line at wctl_off + (win*max_peers + seg)*64 */
struct ivshm_win_lock {
    _Atomic uint64_t writer;  /* 0 free, else holder slot + 1             */
    uint64_t reserved;        /* v1's readers mask: see the window's ctl  */
    uint8_t pad[48];
};

/* ---- doorbells ---- */
struct ivshm_doorbell {
    int kind;                 /* DB_* */
    /* Wake the peer in `slot` whose registry says `doorbell_id`. */
    int (*ring)(struct ivshm_doorbell *db, ivshm *h, int slot,
                int32_t doorbell_id);
    /* Called before announcing sleep; returns a token for wait(). */
    uint64_t (*arm)(struct ivshm_doorbell *db, ivshm *h);
    /* Block until rung (since arm) or timeout; 0, or -errno. */
    int (*wait)(struct ivshm_doorbell *db, ivshm *h, uint64_t token,
                int timeout_ms);
    /* Pollable fd, or -1. */
    int (*fd)(struct ivshm_doorbell *db);
    /* Drain out-of-band notices (server join/leave): returns number of
       peers that left since the last call and marks them dead. */
    int (*poll_notices)(struct ivshm_doorbell *db, ivshm *h);
    void (*destroy)(struct ivshm_doorbell *db);
};

struct ivshm_doorbell *ivshm_db_futex_new(void);
/* The guest backend. When the device's vfio group is held by another
   process of the guest (EBUSY) and *doorbell_id is known (>= 0), returns
   a DB_NONE doorbell instead: the region is shared, interrupts are not. */
struct ivshm_doorbell *ivshm_db_uio_new(const char *uio_dev,
                                        const char *bar0_path,
                                        int32_t *doorbell_id, int *err);
/* eventfd backend built by the server client (client.c) */
struct ivshm_doorbell *ivshm_db_server_new(int sock, int32_t my_id,
                                           int *err);
int ivshm_db_server_peers(struct ivshm_doorbell *db, int32_t *ids,
                          int *vectors, int n);

/* A cell taken out of our queue ahead of its turn (a receive from
   another sender had to get past it): kept per sender, in order. */
struct ivshm_backlog {
    struct ivshm_backlog *next;
    uint32_t len, tag, gen, flags;
    uint64_t total;
    uint8_t data[];
};

/* per-peer local view kept by one attachment */
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
    uint8_t *tx_stage;        /* queue reservations are staged here       */
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
    /* its producer overwrote messages we had not read (recv.c,
       rx_heal_ring): the next receive from it reports IVSHM_ECORRUPT */
    bool rx_lost;
};
/* where a message lies */
enum { SRC_NONE = 0, SRC_BACKLOG = 1, SRC_RING = 2, SRC_QUEUE = 3 };

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
    bool listen_only;         /* drop queue cells of senders not listed   */
    uint32_t *listen_gen;     /* max_peers: generation heard, 0 = none    */
    uint64_t bl_bytes;
    uint64_t next_sweep_ns;
    unsigned sweep_polls;
    unsigned idle_polls;      /* ivshm_recv_idle calls (its run limit)    */
    ivshm_stats stats;
};

/* ---- helpers shared between files ---- */
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

uint64_t ivshm_now_ns(void);
static inline void ivshm_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* region.c: ivshm_format for memory known to be all zero (a file or
   memfd just grown from empty): the receive areas are not written, so a
   large region's pages are only allocated as peers use them. */
int ivshm_format_fresh(void *base, uint64_t size, const ivshm_geometry *g);
/* region.c: map `fd` (size from fstat), validate the header, copy the
   geometry into a new handle with no registry slot (self = -1). Used by
   the attach paths and by the server. */
int ivshm_region_map(int fd, ivshm **out);
void ivshm_region_unmap(ivshm *h);

/* registry.c */
int ivshm_registry_join(ivshm *h, const ivshm_config *cfg, int32_t doorbell_id,
                        int backend);
void ivshm_registry_leave(ivshm *h);
/* Live peer in `slot` with generation `gen`? Checks pids when we share a
   pid namespace and marks a dead one. */
bool ivshm_peer_alive(ivshm *h, int slot, uint32_t gen);
/* Is `slot` an ACTIVE peer? If its generation differs from the one we
   last talked to, a new incarnation took the slot: reset our local view
   of it (the newcomer emptied its receive area at join). */
/* recv.c: forget everything we know about `slot` (positions, a
   half-received message, its backlog, the fast channel it used in our
   area, which is freed) and start over with generation `gen`. */
void ivshm_peer_local_reset(ivshm *h, int slot, uint32_t gen);
/* Free the local memory kept for `slot` (detach: shared memory untouched). */
void ivshm_peer_local_free(ivshm *h, int slot);
/* recv.c: empty our own receive area (queue, descriptors, fast rings)
   while our slot is CLAIMING. channel.c: free descriptors of departed
   senders. */
void ivshm_rx_area_reset(ivshm *h);
void ivshm_fast_sweep(ivshm *h);
extern __attribute__((visibility("hidden"))) void (*ivshm_sweep_test_hook)(
    ivshm *h); /* channel.c: tests only, not exported by the shared library */
/* send.c: take a fast channel to `slot` now, whatever fast_after says
   (tests, and callers that know a pair will be busy): 0, -EAGAIN if none
   is free. */
int ivshm_fast_open(ivshm *h, int slot);
/* channel.c: the fast ring `from` -> `to` if `from` owns a channel of
   `to`'s area (for tests and diagnostics), else NULL. */
uint8_t *ivshm_fast_ring_of(const ivshm *h, int from, int to);
/* Mark every ACTIVE slot whose doorbell id is `doorbell_id` dead. */
int ivshm_mark_doorbell_dead(ivshm *h, int32_t doorbell_id);

/* wait.c: spin, then declare ourselves asleep and block on the doorbell.
   `ready` is re-checked after announcing sleep so a wake cannot be lost.
   `peer`/`peer_gen` (peer < 0: none) is checked for liveness while blocked.
   Returns 0 when ready, -ETIMEDOUT, -IVSHM_EPEERDEAD. */
typedef bool (*ivshm_ready_fn)(ivshm *h, void *arg);
int ivshm_wait(ivshm *h, ivshm_ready_fn ready, void *arg, int peer,
               uint32_t peer_gen, int timeout_ms);
/* After publishing something `slot` may wait for: ring it if it sleeps.
   The seq_cst fence pairs with the one in ivshm_wait (Dekker). */
void ivshm_kick(ivshm *h, int slot);
/* Tell the peers whether we may block from now on (wait.c). */
void ivshm_announce_blocking(ivshm *h, bool may_sleep);

/* May `slot` block in a wait? If not, nothing we publish needs a wake,
   nor the fence that orders it (wait.c). One load of a word that rarely
   changes. */
static inline bool ivshm_peer_may_sleep(const ivshm *h, int slot)
{
    return atomic_load_explicit(&ivshm_entry(h, slot)->may_sleep,
                                memory_order_relaxed) != 0;
}

/* Is `slot` ACTIVE? On every send and receive, hence inline. A new
   incarnation emptied our rings with it at join: our view of the old
   one is reset (out of line, rare). */
static inline bool ivshm_peer_current(ivshm *h, int slot)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    if (atomic_load_explicit(&e->state, memory_order_acquire) != PEER_ACTIVE)
        return false;
    uint32_t gen = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (__builtin_expect(h->peers[slot].gen != gen, 0))
        ivshm_peer_local_reset(h, slot, gen);
    return true;
}

/* window.c: free windows held by a dead or leaving slot (refs) */
void ivshm_windows_on_leave(ivshm *h, int slot);
/* The members bitmap (seg < 0) or the readers bitmap of `seg` of the
   READY window in directory entry `index`, validated; NULL if there is
   none. For tests and diagnostics. */
_Atomic uint64_t *ivshm_win_bitmap(ivshm *h, uint32_t index, int seg);

/* lock over heap + window directory, dead owner is broken */
int ivshm_alloc_lock(ivshm *h);
void ivshm_alloc_unlock(ivshm *h);

#endif
