/*
 * Reading the window tables safely, and releasing a departed slot's
 * holds in them.
 *
 * Everything here can be scribbled on by a co-tenant. A descriptor is
 * copied once and validated, and the window API (window.c) keeps the
 * validated copy: data operations never re-read data_off or sizes from
 * the region.
 *
 * ivshm_windows_on_leave only clears bits: it runs inside registry paths
 * (our own leave; our own slot while it is still CLAIMING), where waiting
 * for alloc_lock could deadlock or have our hold broken. A window left
 * without a present member is reclaimed by the allocator later
 * (window.c). Nobody clears a departed peer's bits for it: that would
 * cost every peer that learns of one leave O(windows x segments) chosen
 * by the leaver.
 */
#define _GNU_SOURCE
#include "window_table.h"

#include "clock.h"

void ivshm_win_snap(const struct ivshm_win_desc *d, struct desc_snap *s)
{
    s->state = atomic_load_explicit(&d->state, memory_order_acquire);
    s->nseg = __atomic_load_n(&d->nseg, __ATOMIC_RELAXED);
    s->gen = __atomic_load_n(&d->gen, __ATOMIC_RELAXED);
    s->job_id = __atomic_load_n(&d->job_id, __ATOMIC_RELAXED);
    s->data_off = __atomic_load_n(&d->data_off, __ATOMIC_RELAXED);
    s->data_bytes = __atomic_load_n(&d->data_bytes, __ATOMIC_RELAXED);
    s->seg_size = __atomic_load_n(&d->seg_size, __ATOMIC_RELAXED);
    for (unsigned i = 0; i < IVSHM_NAME_LEN; i++)
        s->name[i] = __atomic_load_n(&d->name[i], __ATOMIC_RELAXED);
}

/* Overflow-safe: every comparison is between values already known to be
   <= heap_size. */
bool ivshm_win_snap_extent_ok(const ivshm *h, const struct desc_snap *s)
{
    if (s->nseg == 0 || s->nseg > h->max_peers)
        return false;
    if (s->data_off < h->heap_off || s->data_off % IVSHM_PAGE)
        return false;
    if (s->data_bytes == 0 || s->data_bytes % IVSHM_PAGE ||
        s->data_bytes > h->heap_size)
        return false;
    if (s->data_off - h->heap_off > h->heap_size - s->data_bytes)
        return false;
    /* ctl + nseg * seg_size <= data_bytes, without the multiplication */
    uint64_t ctl = ctl_bytes(h, s->nseg);
    return s->data_bytes > ctl && s->seg_size <= (s->data_bytes - ctl) / s->nseg;
}

/* Untorn: the state and gen read before and after the fields agree (a
   create goes BUSY, rewrites, bumps gen, goes READY). */
bool ivshm_win_snap_ready(const ivshm *h, uint32_t index, struct desc_snap *s)
{
    struct ivshm_win_desc *d = win_desc(h, index);
    ivshm_win_snap(d, s);
    atomic_thread_fence(memory_order_acquire);
    return s->state == WIN_READY && ivshm_win_snap_extent_ok(h, s) &&
           atomic_load_explicit(&d->state, memory_order_relaxed) == WIN_READY &&
           __atomic_load_n(&d->gen, __ATOMIC_RELAXED) == s->gen;
}

_Atomic uint64_t *ivshm_win_bitmap(ivshm *h, uint32_t index, int seg)
{
    struct desc_snap s;
    if (!h || index >= h->max_windows || !ivshm_win_snap_ready(h, index, &s) ||
        (seg >= 0 && (uint32_t)seg >= s.nseg))
        return NULL;
    return snap_bitmap(h, &s, seg < 0 ? 0 : (uint32_t)seg + 1);
}

bool ivshm_win_members_present(const ivshm *h, _Atomic uint64_t *bm,
                               uint32_t *count)
{
    uint32_t n = 0, words = bm_words(h);
    bool bad = false;
    ivshm_work_count((ivshm *)h, words);
    for (uint32_t w = 0; w < words; w++) {
        uint64_t v = atomic_load_explicit(&bm[w], memory_order_acquire);
        if (w == words - 1 && h->max_peers % 64) {
            bad |= (v >> (h->max_peers % 64)) != 0;
            v &= (1ull << (h->max_peers % 64)) - 1;
        }
        ivshm_work_count((ivshm *)h, (uint32_t)__builtin_popcountll(v));
        for (; v; v &= v - 1) {
            int s = (int)(w * 64 + (uint32_t)__builtin_ctzll(v));
            n += atomic_load_explicit(&ivshm_entry(h, s)->state,
                                      memory_order_relaxed) == PEER_ACTIVE;
        }
    }
    if (count)
        *count = n;
    return bad;
}

void ivshm_windows_on_leave(ivshm *h, int slot)
{
    if (!h || !ivshm_slot_ok(h, slot))
        return;
    const uint64_t holder = (uint64_t)slot + 1;
    uint64_t expect = holder;
    atomic_compare_exchange_strong(&ivshm_hdr(h)->alloc_lock, &expect, 0);
    ivshm_work_count(h, h->max_windows);
    for (uint32_t i = 0; i < h->max_windows; i++) {
        /* bits only in a READY window's validated, untorn extent */
        struct desc_snap sn;
        if (!ivshm_win_snap_ready(h, i, &sn))
            continue;
        /* A window we were not in holds nothing of ours (a lock line
           naming us there was written by a co-tenant: it costs its
           waiters the lock bound, as any forged holder does). */
        _Atomic uint64_t *members = snap_bitmap(h, &sn, 0);
        if (!bm_test(members, slot) ||
            !bm_clear(members, slot, memory_order_acq_rel))
            continue;
        /* A member gone without closing can never arrive at a barrier. */
        atomic_fetch_or(&win_desc(h, i)->bar_count, BAR_BROKEN);
        struct ivshm_win_lock *locks = win_locks(h, i);
        ivshm_work_count(h, sn.nseg);
        for (uint32_t seg = 0; seg < sn.nseg; seg++) {
            expect = holder;
            atomic_compare_exchange_strong(&locks[seg].writer, &expect, 0);
            _Atomic uint64_t *r = snap_bitmap(h, &sn, seg + 1);
            if (bm_test(r, slot))
                bm_clear(r, slot, memory_order_relaxed);
        }
    }
}
