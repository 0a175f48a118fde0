/*
 * The window tables (docs/region-layout.md, "Windows"): the directory of
 * window descriptors, the lock lines, and the slot bitmaps at the start
 * of each window's heap extent; how to read them safely, and how to
 * release what a departed slot held in them (window_table.c). The
 * window API over them is window.c.
 */
#ifndef IVSHM_WINDOW_TABLE_H
#define IVSHM_WINDOW_TABLE_H

#include "attachment.h"

/* Set in bar_count when a member left without closing: no round of this
   window can complete any more. Far above any real count (<= 1024). */
#define BAR_BROKEN 0x80000000u

/* Snapshot of a descriptor: read once, then validated and used. */
struct desc_snap {
    uint32_t state, nseg, gen;
    uint64_t job_id, data_off, data_bytes, seg_size;
    char name[IVSHM_NAME_LEN];
};

static inline struct ivshm_win_desc *win_desc(const ivshm *h, uint32_t index)
{
    return (struct ivshm_win_desc *)(h->base + h->windir_off) + index;
}

static inline struct ivshm_win_lock *win_locks(const ivshm *h, uint32_t index)
{
    return (struct ivshm_win_lock *)(h->base + h->wctl_off) +
           (uint64_t)index * h->max_peers;
}

/* ---- slot bitmaps: one bit per registry slot, words of 64 ---- */

static inline uint32_t bm_words(const ivshm *h)
{
    return (h->max_peers + 63) / 64;
}

/* Bytes of ctl ahead of a window's segments: members + nseg readers. */
static inline uint64_t ctl_bytes(const ivshm *h, uint32_t nseg)
{
    uint64_t b = (uint64_t)(1 + nseg) * bm_words(h) * 8;
    return (b + IVSHM_PAGE - 1) & ~(uint64_t)(IVSHM_PAGE - 1);
}

static inline bool bm_test(_Atomic uint64_t *bm, int slot)
{
    return atomic_load_explicit(&bm[slot / 64], memory_order_relaxed) &
           (1ull << (slot % 64));
}

/* Set / clear our bit; returns whether it was set before. */
static inline bool bm_set(_Atomic uint64_t *bm, int slot, memory_order mo)
{
    uint64_t bit = 1ull << (slot % 64);
    return atomic_fetch_or_explicit(&bm[slot / 64], bit, mo) & bit;
}

static inline bool bm_clear(_Atomic uint64_t *bm, int slot, memory_order mo)
{
    uint64_t bit = 1ull << (slot % 64);
    return atomic_fetch_and_explicit(&bm[slot / 64], ~bit, mo) & bit;
}

/* Each word loaded once: bits set (into *count), and whether a bit
   names no slot (garbage). */
static inline bool bm_scan(const ivshm *h, _Atomic uint64_t *bm,
                           uint32_t *count, memory_order mo)
{
    uint32_t n = 0, words = bm_words(h);
    bool bad = false;
    for (uint32_t w = 0; w < words; w++) {
        uint64_t v = atomic_load_explicit(&bm[w], mo);
        if (w == words - 1 && h->max_peers % 64)
            bad |= (v >> (h->max_peers % 64)) != 0;
        n += (uint32_t)__builtin_popcountll(v);
    }
    if (count)
        *count = n;
    return bad;
}

/* Bitmap `which` of the extent a validated snapshot describes: 0 the
   members, 1 + seg the readers of segment seg. */
static inline _Atomic uint64_t *snap_bitmap(const ivshm *h,
                                            const struct desc_snap *s,
                                            uint32_t which)
{
    return (_Atomic uint64_t *)(h->base + s->data_off) +
           (uint64_t)which * bm_words(h);
}

/* Read every field of a descriptor once. */
IVSHM_INTERNAL void ivshm_win_snap(const struct ivshm_win_desc *d,
                                   struct desc_snap *s);
/* Does the snapshot describe memory we may touch? */
IVSHM_INTERNAL bool ivshm_win_snap_extent_ok(const ivshm *h,
                                             const struct desc_snap *s);
/* A snapshot of the READY window in entry `index`, not torn by a create
   running meanwhile; false if there is none. */
IVSHM_INTERNAL bool ivshm_win_snap_ready(const ivshm *h, uint32_t index,
                                         struct desc_snap *s);
/* The members bitmap (seg < 0) or the readers bitmap of `seg` of the
   READY window in directory entry `index`, validated; NULL if there is
   none. For tests and diagnostics. */
IVSHM_INTERNAL _Atomic uint64_t *ivshm_win_bitmap(ivshm *h, uint32_t index,
                                                  int seg);
/* Members in `bm` whose registry entry is ACTIVE (each word and each
   entry's state loaded once): a member found dead, or gone without
   closing, is not counted, so its window can be freed and reused
   without anyone clearing its bit first. Whether a bit names no slot
   (garbage) is returned, as bm_scan does. O(words + bits set). */
IVSHM_INTERNAL bool ivshm_win_members_present(const ivshm *h,
                                              _Atomic uint64_t *bm,
                                              uint32_t *count);
/* Release what our own slot held in the window tables: at a leave, and
   at a claim, for the incarnation before us (whose bits name our slot,
   and which nobody else can tell from us once we are ACTIVE): the
   allocation lock, and in each window whose members bitmap has our bit
   that bit (which breaks the window's barrier), our reader bits and the
   lock lines naming us. Clears bits only, takes no lock: it runs inside
   registry paths (registry.c). O(windows + the segments of the windows
   we were in): what a peer held is its own to release. A peer found
   dead by others is only marked: what it held is broken by whoever
   waits for it (its liveness is probed) or ignores it (a window's
   members are counted by ivshm_win_members_present). */
IVSHM_INTERNAL void ivshm_windows_on_leave(ivshm *h, int slot);

#endif
