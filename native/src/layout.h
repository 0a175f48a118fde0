/*
 * The region's format (docs/region-layout.md): what lies where in the
 * shared memory, as every peer sees it. Types and constants only.
 *
 * Rule for every file: the region is shared with untrusted co-tenants.
 * Geometry is copied out of the header once at attach and validated; at
 * run time only the local copy (struct ivshm, attachment.h) is used for
 * addressing. Anything else read from the region (ring seq/len, tails,
 * registry fields, window descriptors) is validated before it indexes or
 * sizes anything.
 */
#ifndef IVSHM_LAYOUT_H
#define IVSHM_LAYOUT_H

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
    /* line 1: the doorbell (doorbell.c), hot, touched by wakers */
    _Atomic uint32_t sleeping __attribute__((aligned(64))); /* 1 = blocked */
    _Atomic uint32_t wake;    /* futex word, bumped by every ring       */
    _Atomic uint64_t heartbeat;
    /* 0 = the owner never blocks (it spins), so wakers skip the fence
       and the look at `sleeping` (doorbell.c, "blocking announced") */
    _Atomic uint32_t may_sleep;
    /* a drain (docs/migration.md): the host's request number (0: none),
       the last one the owner finished and how; a claim clears them */
    _Atomic uint32_t drain_req;
    _Atomic uint32_t drain_ack;
    _Atomic int32_t drain_status;
    uint8_t pad[32];
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

/* One snapshot of a slot or cell header, in local memory: the producer
   may rewrite the header while we look, so each field is read exactly
   once and only the copy is used. */
struct frag {
    uint32_t len, tag, gen, flags;
    uint64_t total;
};

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

_Static_assert(sizeof(struct ivshm_slot) == IVSHM_SLOT_HDR,
               "slot header is IVSHM_SLOT_HDR bytes");
_Static_assert(sizeof(struct ivshm_cell) == IVSHM_SLOT_HDR,
               "cell header is IVSHM_SLOT_HDR bytes");
_Static_assert(sizeof(struct ivshm_queue_ctrl) == IVSHM_QUEUE_CTRL,
               "queue ctrl size");
_Static_assert(sizeof(struct ivshm_fast_desc) == IVSHM_FAST_DESC,
               "descriptor size");
_Static_assert(IVSHM_MAX_PEERS <= 1024, "CLAIM holds 10 bits of slot");

#endif
