/*
 * One-sided windows: named shared segments in the region heap, with
 * put/get, 64-bit atomics, per-segment passive-target locks and a barrier.
 *
 * Shared state (docs/region-layout.md, "Windows"; read through
 * window_table.h):
 * - descriptor[i] in the window directory: state, geometry, barrier
 *   counters. Geometry and state change only under alloc_lock.
 * - the extent [data_off, data_off + data_bytes) inside the heap: ctl
 *   pages (a members bitmap and one readers bitmap per segment, one bit
 *   per registry slot, so any of up to 1024 slots can take part), then
 *   the segments. Members bits are set under alloc_lock and cleared by
 *   their owner (or, for a dead owner, by whoever finds it dead) with
 *   atomic AND; reader bits by their holder (or the breaker of a dead
 *   holder's hold).
 * - lock line (i, seg): writer = holder slot + 1.
 *
 * Everything above can be scribbled on by a co-tenant. A descriptor is
 * copied once, validated, and the local `ivshm_window` keeps the validated
 * copy: data operations never re-read data_off or sizes from the region.
 * Lock words and barrier counters are validated at every read (holder
 * slot in range, reader bits below max_peers, count <= nseg).
 *
 * Freeing: a READY descriptor without a present member (a bit whose
 * registry entry is ACTIVE, ivshm_win_members_present) is free, and so is
 * a BUSY one found under alloc_lock (its creator held the lock and died).
 * ivshm_win_close frees it at once under alloc_lock; a member that died
 * or left without closing is not cleared by anyone but itself (or the
 * next incarnation of its slot, ivshm_windows_on_leave), so the
 * allocator reclaims windows left without a present member lazily. `gen` bumps at every
 * create, so a late closer never frees a reused descriptor, and a
 * snapshot taken while a create runs is told by its changed gen or state.
 */
#define _GNU_SOURCE
#include "window.h"

#include "clock.h"
#include "doorbell.h"
#include "registry.h"
#include "window_table.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A dead or stuck alloc_lock holder is normally broken within ~1 ms; the
   bound only matters when a live co-tenant holds it and never lets go. */
#define ALLOC_LOCK_TIMEOUT_NS (5ull * 1000000000ull)
/* Window locks may legitimately be held for a long epoch; a dead holder
   is broken within ~1 ms, so h->lock_timeout_ns (IVSHM_LOCK_TIMEOUT_MS,
   default 30 s) only bounds a live, stuck holder, or a co-tenant that
   writes a live slot's number into the lock word. */
static uint64_t win_lock_timeout(const ivshm *h)
{
    return h->lock_timeout_ns ? h->lock_timeout_ns : 30ull * 1000000000ull;
}

static uint64_t alloc_lock_timeout(const ivshm *h)
{
    uint64_t t = win_lock_timeout(h);
    return t < ALLOC_LOCK_TIMEOUT_NS ? t : ALLOC_LOCK_TIMEOUT_NS;
}
/* How often a lock waiter probes the holder's liveness. */
#define LIVENESS_PROBE_NS 1000000ull
/* Barrier waits block in slices of this length, then re-check members. */
#define BARRIER_SLICE_MS 20

enum { HELD_NONE = 0, HELD_SHARED = 1, HELD_EXCLUSIVE = 2 };

struct ivshm_window {
    ivshm *h;
    struct ivshm_win_desc *desc;
    struct ivshm_win_lock *locks; /* max_peers lines of this window */
    _Atomic uint64_t *members;    /* validated: the ctl in the heap  */
    _Atomic uint64_t *readers;    /* nseg bitmaps after members      */
    uint8_t *data;                /* validated: inside the heap      */
    uint64_t seg_size;
    uint32_t nseg;                /* 1..max_peers                    */
    uint32_t index;
    uint32_t gen;                 /* descriptor generation we joined */
    bool bar_pending;             /* arrived, barrier not yet passed */
    uint32_t bar_phase;           /* phase we arrived in             */
    uint8_t held[IVSHM_MAX_PEERS];/* HELD_* per segment              */
    uint32_t probe_from;          /* members_ok's next probe (probe_bits) */
};

/* Slot live for the purpose of holding locks and barrier membership.
   ivshm_peer_alive probes the pid and marks a dead peer (O(1)): what it
   held is broken by the waiter that found it (break_stale_writer,
   break_stale_readers, the alloc lock) or not counted (members). */
static bool slot_alive(ivshm *h, int slot)
{
    if (slot == h->self)
        return true;
    return ivshm_peer_alive(h, slot, 0);
}

/* ---- waiting with backoff ---- */

struct backoff {
    uint32_t n;
    uint64_t deadline;
    uint64_t next_probe;
    uint32_t probe_from; /* the slot the next round of probes starts at */
};

static void backoff_init(struct backoff *b, uint64_t timeout_ns)
{
    b->n = 0;
    b->deadline = ivshm_now_ns() + timeout_ns;
    b->next_probe = 0;
    b->probe_from = 0;
}

/* The next phase of the same wait (an exclusive lock's readers' drain
   after its writer word): spin again first, under the same deadline. */
static void backoff_next_phase(struct backoff *b)
{
    b->n = 0;
    b->next_probe = 0;
}

/* True when the caller should probe holder liveness: once early (after a
   short spin, so a dead or stale holder costs microseconds, not a sleep),
   then every LIVENESS_PROBE_NS. */
static bool backoff_probe_due(struct backoff *b)
{
    if (b->n < 16)
        return false;
    uint64_t now = ivshm_now_ns();
    if (now < b->next_probe)
        return false;
    b->next_probe = now + LIVENESS_PROBE_NS;
    return true;
}

/* Spin, then yield, then sleep with growing naps (up to 1 ms). The lock
   holders never ring doorbells, so waiters poll; the naps keep a waiter
   from stealing the CPU a holder sharing its core needs. */
static int backoff_pause(struct backoff *b)
{
    uint32_t n = b->n++;
    if (n < 16) {
        for (int i = 0; i < 32; i++)
            ivshm_cpu_relax();
        return 0;
    }
    uint64_t now = ivshm_now_ns();
    if (now >= b->deadline)
        return -ETIMEDOUT;
    if (n < 48) {
        sched_yield();
        return 0;
    }
    /* never past the deadline: the caller looks once more, then gives up */
    uint64_t ns = n < 200 ? 20000 : n < 1000 ? 200000 : 1000000;
    if (ns > b->deadline - now)
        ns = b->deadline - now;
    struct timespec ts = {0, (long)ns};
    nanosleep(&ts, NULL);
    return 0;
}

/* Liveness probes of the slots whose bits are set in `bm`, at most
   PROBES_PER_ROUND of them from *from on (round robin over calls): a
   probe may cost system calls (ivshm_peer_alive), and a co-tenant can
   set every bit. `dead` is called for each slot found dead; a nonzero
   return stops the round and is returned. */
#define PROBES_PER_ROUND 32u
static int probe_bits(ivshm *h, _Atomic uint64_t *bm, uint32_t *from,
                      int (*dead)(ivshm *h, _Atomic uint64_t *bm, int slot))
{
    uint32_t words = bm_words(h), start = *from % (words * 64), probed = 0;
    for (uint32_t k = 0; k < words + 1 && probed < PROBES_PER_ROUND; k++) {
        uint32_t wd = (start / 64 + k) % words;
        uint64_t m = atomic_load_explicit(&bm[wd], memory_order_relaxed);
        if (k == 0)
            m &= ~0ull << (start % 64);       /* from `start` on */
        else if (k == words)
            m &= (1ull << (start % 64)) - 1;  /* back below `start` */
        for (; m && probed < PROBES_PER_ROUND; m &= m - 1, probed++) {
            uint32_t s = wd * 64 + (uint32_t)__builtin_ctzll(m);
            *from = s + 1;
            if (s < h->max_peers && !slot_alive(h, (int)s)) {
                int rc = dead(h, bm, (int)s);
                if (rc)
                    return rc;
            }
        }
    }
    return 0;
}

/* ---- alloc lock (heap + window directory) ---- */

int ivshm_alloc_lock(ivshm *h)
{
    if (!h || !ivshm_slot_ok(h, h->self))
        return -EINVAL;
    _Atomic uint64_t *lock = &ivshm_hdr(h)->alloc_lock;
    const uint64_t me = (uint64_t)h->self + 1;
    struct backoff b;
    backoff_init(&b, alloc_lock_timeout(h));
    for (;;) {
        uint64_t cur = 0;
        if (atomic_compare_exchange_strong_explicit(lock, &cur, me,
                                                    memory_order_acquire,
                                                    memory_order_relaxed))
            return 0;
        /* Never re-entered, so our own value is a dead incarnation's, and
           a value naming no slot is garbage: both held by nobody. */
        bool stale = cur == me || cur > h->max_peers;
        if (!stale && backoff_probe_due(&b))
            stale = !slot_alive(h, (int)(cur - 1));
        if (stale) /* CAS: if the holder changed meanwhile, it is theirs */
            atomic_compare_exchange_strong_explicit(lock, &cur, 0,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed);
        /* paused even after breaking: a co-tenant rewriting the word
           forever must still run into the deadline */
        int rc = backoff_pause(&b);
        if (rc < 0)
            return rc;
    }
}

void ivshm_alloc_unlock(ivshm *h)
{
    uint64_t me = (uint64_t)h->self + 1;
    /* CAS, not a store: if our hold was broken (we were thought dead),
       the lock now belongs to someone else. */
    atomic_compare_exchange_strong_explicit(&ivshm_hdr(h)->alloc_lock, &me, 0,
                                            memory_order_release,
                                            memory_order_relaxed);
}

/* ---- open / close ---- */

/* Under alloc_lock no legitimate create is in progress except ours (a
   BUSY one was left by a creator that died holding the lock), and an
   empty window has no member left to use it: both may be reused. A
   READY one describing no valid extent stays: joining it by name
   reports the corruption. */
static bool snap_reusable(const ivshm *h, const struct desc_snap *s)
{
    if (s->state == WIN_FREE || s->state == WIN_BUSY)
        return true;
    if (s->state != WIN_READY || !ivshm_win_snap_extent_ok(h, s))
        return false;
    uint32_t n;
    ivshm_win_members_present(h, snap_bitmap(h, s, 0), &n);
    return n == 0;
}

struct extent {
    uint64_t start, end; /* relative to heap_off */
};

static int cmp_extent(const void *a, const void *b)
{
    const struct extent *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* First fit for `bytes` (page multiple) among the live descriptors.
   Called under alloc_lock. Descriptors that fail validation are skipped:
   they describe no memory we would ever hand out through them. */
static int heap_first_fit(ivshm *h, uint64_t bytes, uint64_t *off_out)
{
    struct extent *ext = malloc(sizeof *ext * h->max_windows);
    if (!ext)
        return -ENOMEM;
    uint32_t n = 0;
    for (uint32_t i = 0; i < h->max_windows; i++) {
        struct desc_snap s;
        ivshm_win_snap(win_desc(h, i), &s);
        if (snap_reusable(h, &s) || s.state != WIN_READY)
            continue;
        if (!ivshm_win_snap_extent_ok(h, &s))
            continue;
        ext[n].start = s.data_off - h->heap_off;
        ext[n].end = ext[n].start + s.data_bytes;
        n++;
    }
    qsort(ext, n, sizeof *ext, cmp_extent);
    uint64_t cursor = 0;
    int rc = IVSHM_EFULL;
    for (uint32_t i = 0; i <= n; i++) {
        uint64_t next = i < n ? ext[i].start : h->heap_size;
        if (next >= cursor && next - cursor >= bytes) {
            *off_out = h->heap_off + cursor;
            rc = 0;
            break;
        }
        if (i < n && ext[i].end > cursor)
            cursor = ext[i].end; /* extents may overlap if forged */
    }
    free(ext);
    return rc;
}

static ivshm_window *make_handle(ivshm *h, uint32_t index,
                                 const struct desc_snap *s)
{
    ivshm_window *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->h = h;
    w->index = index;
    w->desc = win_desc(h, index);
    w->locks = win_locks(h, index);
    w->members = snap_bitmap(h, s, 0);
    w->readers = snap_bitmap(h, s, 1);
    w->data = h->base + s->data_off + ctl_bytes(h, s->nseg);
    w->seg_size = s->seg_size;
    w->nseg = s->nseg;
    w->gen = s->gen;
    return w;
}

/* Join an existing window (alloc_lock held, `s` is its snapshot). */
static int join_existing(ivshm *h, uint32_t index, const struct desc_snap *s,
                         uint32_t nseg, uint64_t seg_size, ivshm_window **out)
{
    if (!ivshm_win_snap_extent_ok(h, s))
        return IVSHM_ECORRUPT;
    if (s->nseg != nseg || s->seg_size != seg_size)
        return -EINVAL;
    _Atomic uint64_t *members = snap_bitmap(h, s, 0);
    uint32_t n;
    if (ivshm_win_members_present(h, members, &n))
        return IVSHM_ECORRUPT;
    if (bm_test(members, h->self))
        return -EBUSY; /* this attachment already has it open */
    if (n >= nseg)
        return IVSHM_EFULL; /* one member per segment */
    ivshm_window *w = make_handle(h, index, s);
    if (!w)
        return -ENOMEM;
    bm_set(members, h->self, memory_order_acq_rel);
    *out = w;
    return 0;
}

/* Create the window in descriptor `index` (alloc_lock held). */
static int create_window(ivshm *h, uint32_t index, const char *name,
                         uint32_t nseg, uint64_t seg_size, ivshm_window **out)
{
    /* nseg <= 1024 and seg_size <= heap_size < 2^46: no overflow */
    uint64_t need = (uint64_t)nseg * seg_size;
    if (need > h->heap_size)
        return IVSHM_EFULL;
    if (need == 0)
        need = 1; /* a zero-size window still gets a valid extent */
    need += ctl_bytes(h, nseg);
    if (need > h->heap_size)
        return IVSHM_EFULL;
    uint64_t bytes = (need + IVSHM_PAGE - 1) & ~(uint64_t)(IVSHM_PAGE - 1);
    uint64_t data_off;
    int rc = heap_first_fit(h, bytes, &data_off);
    if (rc < 0)
        return rc;

    struct ivshm_win_desc *d = win_desc(h, index);
    /* BUSY first: if we die from here on, the next allocator (under
       alloc_lock, which our death releases) reuses it; nobody clears
       bits in the extent of a window that is not READY. */
    atomic_store_explicit(&d->state, WIN_BUSY, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    d->nseg = nseg;
    d->job_id = h->job_id;
    memset(d->name, 0, sizeof d->name);
    memcpy(d->name, name, strlen(name));
    d->data_off = data_off;
    d->data_bytes = bytes;
    d->seg_size = seg_size;
    uint32_t gen = __atomic_load_n(&d->gen, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&d->gen, gen, __ATOMIC_RELAXED);
    atomic_store_explicit(&d->bar_count, 0, memory_order_relaxed);
    atomic_store_explicit(&d->bar_phase, 0, memory_order_relaxed);
    struct ivshm_win_lock *locks = win_locks(h, index);
    for (uint32_t s = 0; s < h->max_peers; s++)
        atomic_store_explicit(&locks[s].writer, 0, memory_order_relaxed);
    memset(h->base + data_off, 0, bytes); /* ctl bitmaps and data */
    struct desc_snap s = {.state = WIN_READY, .nseg = nseg, .gen = gen,
                          .job_id = h->job_id, .data_off = data_off,
                          .data_bytes = bytes, .seg_size = seg_size};
    bm_set(snap_bitmap(h, &s, 0), h->self, memory_order_relaxed);
    /* Publish: a joiner that sees READY (acquire) sees all of the above. */
    atomic_store_explicit(&d->state, WIN_READY, memory_order_release);

    ivshm_window *w = make_handle(h, index, &s);
    if (!w) {
        atomic_store_explicit(&d->state, WIN_FREE, memory_order_release);
        return -ENOMEM;
    }
    *out = w;
    return 0;
}

int ivshm_win_open(ivshm *h, const char *name, uint32_t nseg,
                   uint64_t seg_size, ivshm_window **out)
{
    if (!h || !name || !out || !ivshm_slot_ok(h, h->self))
        return -EINVAL;
    size_t name_len = strnlen(name, IVSHM_NAME_LEN);
    if (name_len == 0 || name_len >= IVSHM_NAME_LEN)
        return -EINVAL;
    if (nseg == 0 || nseg > h->max_peers)
        return -EINVAL;
    if (seg_size > h->heap_size)
        return IVSHM_EFULL;
    char want[IVSHM_NAME_LEN] = {0};
    memcpy(want, name, name_len);

    int rc = ivshm_alloc_lock(h);
    if (rc < 0)
        return rc;
    int64_t free_index = -1;
    rc = 1; /* 1: not found yet */
    for (uint32_t i = 0; i < h->max_windows && rc == 1; i++) {
        struct desc_snap s;
        ivshm_win_snap(win_desc(h, i), &s);
        if (snap_reusable(h, &s)) {
            if (free_index < 0)
                free_index = i;
            continue;
        }
        if (s.state == WIN_READY && s.job_id == h->job_id &&
            memcmp(s.name, want, IVSHM_NAME_LEN) == 0)
            rc = join_existing(h, i, &s, nseg, seg_size, out);
    }
    if (rc == 1)
        rc = free_index < 0 ? IVSHM_EFULL
                            : create_window(h, (uint32_t)free_index, want,
                                            nseg, seg_size, out);
    ivshm_alloc_unlock(h);
    return rc;
}

static void release_held(ivshm_window *w)
{
    for (uint32_t s = 0; s < w->nseg; s++)
        if (w->held[s] != HELD_NONE)
            ivshm_win_unlock(w, s);
}

void ivshm_win_close(ivshm_window *w)
{
    if (!w)
        return;
    ivshm *h = w->h;
    release_held(w);
    struct ivshm_win_desc *d = w->desc;
    /* If the descriptor was recreated meanwhile (we were thought dead and
       emptied), the bit there is not ours to clear. */
    uint32_t left;
    if (__atomic_load_n(&d->gen, __ATOMIC_RELAXED) == w->gen &&
        atomic_load_explicit(&d->state, memory_order_acquire) == WIN_READY &&
        bm_clear(w->members, h->self, memory_order_acq_rel) &&
        !ivshm_win_members_present(h, w->members, &left) && left == 0) {
        if (ivshm_alloc_lock(h) == 0) {
            /* Recheck under the lock: a joiner may have re-joined it, or
               an allocator reclaimed and recreated it (gen moved). */
            uint32_t st = atomic_load_explicit(&d->state, memory_order_relaxed);
            if (st == WIN_READY &&
                __atomic_load_n(&d->gen, __ATOMIC_RELAXED) == w->gen &&
                !ivshm_win_members_present(h, w->members, &left) &&
                left == 0)
                atomic_store_explicit(&d->state, WIN_FREE, memory_order_release);
            ivshm_alloc_unlock(h);
        }
        /* lock failure: left empty, the allocator reclaims it later */
    }
    free(w);
}

/* ---- data access ---- */

void *ivshm_win_ptr(ivshm_window *w, uint32_t seg)
{
    if (!w || seg >= w->nseg)
        return NULL;
    return w->data + (uint64_t)seg * w->seg_size;
}

uint64_t ivshm_win_seg_size(const ivshm_window *w)
{
    return w ? w->seg_size : 0;
}

/* [off, off+len) inside segment `seg`? Overflow-safe. */
static bool range_ok(const ivshm_window *w, uint32_t seg, uint64_t off,
                     uint64_t len)
{
    return seg < w->nseg && off <= w->seg_size && len <= w->seg_size - off;
}

int ivshm_win_put(ivshm_window *w, uint32_t seg, uint64_t off, const void *buf,
                  size_t len)
{
    if (!w || !range_ok(w, seg, off, len) || (len && !buf))
        return -EINVAL;
    if (len)
        memcpy(w->data + (uint64_t)seg * w->seg_size + off, buf, len);
    return 0;
}

int ivshm_win_get(ivshm_window *w, uint32_t seg, uint64_t off, void *buf,
                  size_t len)
{
    if (!w || !range_ok(w, seg, off, len) || (len && !buf))
        return -EINVAL;
    if (len)
        memcpy(buf, w->data + (uint64_t)seg * w->seg_size + off, len);
    return 0;
}

/* The shared 64-bit word at (seg, off), or NULL if out of range or not
   8-byte aligned (seg_size need not be a multiple of 8). */
static uint64_t *word_at(ivshm_window *w, uint32_t seg, uint64_t off)
{
    if (!w || !range_ok(w, seg, off, 8))
        return NULL;
    uint8_t *p = w->data + (uint64_t)seg * w->seg_size + off;
    return ((uintptr_t)p & 7) ? NULL : (uint64_t *)p;
}

int ivshm_win_fetch_add(ivshm_window *w, uint32_t seg, uint64_t off,
                        int64_t add, int64_t *old)
{
    uint64_t *p = word_at(w, seg, off);
    if (!p)
        return -EINVAL;
    /* unsigned arithmetic: wraps instead of signed-overflow UB */
    uint64_t prev = __atomic_fetch_add(p, (uint64_t)add, __ATOMIC_SEQ_CST);
    if (old)
        *old = (int64_t)prev;
    return 0;
}

int ivshm_win_cas(ivshm_window *w, uint32_t seg, uint64_t off,
                  uint64_t expected, uint64_t desired, uint64_t *old)
{
    uint64_t *p = word_at(w, seg, off);
    if (!p)
        return -EINVAL;
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    if (old)
        *old = expected; /* the value seen: == expected iff swapped */
    return 0;
}

/*
 * Puts are plain stores into cache-coherent shared memory (host RAM, or
 * the ivshmem BAR that QEMU maps write-back into every guest). Nothing is
 * buffered beyond the CPU's store buffer, and a full fence drains it: on
 * x86 (mfence) and arm64 (dmb ish) every store before the fence is visible
 * to every other core before any later access. A peer that then learns of
 * completion (barrier, unlock, a message) with acquire ordering sees the
 * data. So flush needs no per-segment work.
 */
int ivshm_win_flush(ivshm_window *w, uint32_t seg)
{
    if (!w || (seg >= w->nseg && seg != UINT32_MAX))
        return -EINVAL;
    atomic_thread_fence(memory_order_seq_cst);
    return 0;
}

/* ---- passive-target locks ---- */

/* The writer word holds `val` (non-zero) and it is not our hold. Decide
   whether it is stale and break it. Returns <0 for garbage. */
static int break_stale_writer(ivshm_window *w, struct ivshm_win_lock *l,
                              uint64_t val, struct backoff *b)
{
    ivshm *h = w->h;
    if (val > h->max_peers)
        return IVSHM_ECORRUPT;
    /* Our own slot without a local hold: a dead incarnation of our slot. */
    bool stale = val == (uint64_t)h->self + 1;
    if (!stale && backoff_probe_due(b))
        stale = !slot_alive(h, (int)(val - 1));
    if (stale)
        atomic_compare_exchange_strong(&l->writer, &val, 0);
    return 0;
}

static _Atomic uint64_t *seg_readers(const ivshm_window *w, uint32_t seg)
{
    return w->readers + (uint64_t)seg * bm_words(w->h);
}

static int clear_dead_reader(ivshm *h, _Atomic uint64_t *bm, int slot)
{
    (void)h;
    bm_clear(bm, slot, memory_order_relaxed);
    return 0;
}

/* Reader bits of `seg` are set (while we wait to hold exclusive, so
   none of them is ours legitimately). Clear the ones of dead slots. */
static int break_stale_readers(ivshm_window *w, uint32_t seg,
                               struct backoff *b)
{
    ivshm *h = w->h;
    _Atomic uint64_t *r = seg_readers(w, seg);
    if (bm_scan(h, r, NULL, memory_order_relaxed))
        return IVSHM_ECORRUPT;
    if (bm_test(r, h->self))
        bm_clear(r, h->self, memory_order_relaxed);
    if (!backoff_probe_due(b))
        return 0;
    return probe_bits(h, r, &b->probe_from, clear_dead_reader);
}

/* Any reader bit of `seg` set? Each word loaded once. */
static bool readers_present(const ivshm_window *w, uint32_t seg)
{
    _Atomic uint64_t *r = seg_readers(w, seg);
    for (uint32_t wd = 0; wd < bm_words(w->h); wd++)
        if (atomic_load_explicit(&r[wd], memory_order_seq_cst))
            return true;
    return false;
}

/*
 * Exclusive: own `writer`, then wait for the readers to drain. Shared:
 * announce our reader bit, then check `writer`; back off while a writer
 * is present. Both sides store then load (seq_cst), so at least one of a
 * racing reader and writer sees the other and neither proceeds wrongly.
 */
int ivshm_win_lock(ivshm_window *w, uint32_t seg, int kind)
{
    if (!w || seg >= w->nseg ||
        (kind != IVSHM_LOCK_SHARED && kind != IVSHM_LOCK_EXCLUSIVE))
        return -EINVAL;
    if (w->held[seg] != HELD_NONE)
        return -EDEADLK;
    ivshm *h = w->h;
    struct ivshm_win_lock *l = &w->locks[seg];
    const uint64_t me = (uint64_t)h->self + 1;
    _Atomic uint64_t *readers = seg_readers(w, seg);
    struct backoff b;
    backoff_init(&b, win_lock_timeout(h));
    int rc;

    if (kind == IVSHM_LOCK_EXCLUSIVE) {
        for (;;) {
            uint64_t cur = 0;
            if (atomic_compare_exchange_strong_explicit(
                    &l->writer, &cur, me, memory_order_seq_cst,
                    memory_order_seq_cst))
                break;
            if ((rc = break_stale_writer(w, l, cur, &b)) < 0 ||
                (rc = backoff_pause(&b)) < 0)
                return rc;
        }
        /* We own `writer`: new readers back off, existing ones finish,
           by the same deadline (one bound for the whole call) */
        backoff_next_phase(&b);
        for (;;) {
            if (!readers_present(w, seg))
                break;
            if ((rc = break_stale_readers(w, seg, &b)) < 0 ||
                (rc = backoff_pause(&b)) < 0) {
                uint64_t mine = me;
                atomic_compare_exchange_strong(&l->writer, &mine, 0);
                return rc;
            }
        }
        w->held[seg] = HELD_EXCLUSIVE;
        return 0;
    }

    for (;;) {
        bm_set(readers, h->self, memory_order_seq_cst);
        if (bm_scan(h, readers, NULL, memory_order_relaxed)) {
            bm_clear(readers, h->self, memory_order_relaxed);
            return IVSHM_ECORRUPT;
        }
        uint64_t cur = atomic_load_explicit(&l->writer, memory_order_seq_cst);
        if (cur == 0)
            break;
        /* A writer holds or wants it: withdraw so it can drain readers. */
        bm_clear(readers, h->self, memory_order_seq_cst);
        while (cur != 0) {
            if ((rc = break_stale_writer(w, l, cur, &b)) < 0 ||
                (rc = backoff_pause(&b)) < 0)
                return rc;
            cur = atomic_load_explicit(&l->writer, memory_order_seq_cst);
        }
    }
    w->held[seg] = HELD_SHARED;
    return 0;
}

int ivshm_win_unlock(ivshm_window *w, uint32_t seg)
{
    if (!w || seg >= w->nseg || w->held[seg] == HELD_NONE)
        return -EINVAL;
    ivshm *h = w->h;
    struct ivshm_win_lock *l = &w->locks[seg];
    int kind = w->held[seg];
    w->held[seg] = HELD_NONE;
    if (kind == HELD_SHARED) {
        return bm_clear(seg_readers(w, seg), h->self, memory_order_release)
                   ? 0
                   : IVSHM_ECORRUPT;
    }
    /* Release: the epoch's stores are visible before the lock is free. A
       failed CAS means our hold was broken or overwritten meanwhile. */
    uint64_t me = (uint64_t)h->self + 1;
    return atomic_compare_exchange_strong_explicit(&l->writer, &me, 0,
                                                   memory_order_release,
                                                   memory_order_relaxed)
               ? 0
               : IVSHM_ECORRUPT;
}

/* ---- barrier ---- */

struct phase_wait {
    struct ivshm_win_desc *desc;
    uint32_t phase;
};

/* Round over, or the barrier broken by a member's departure. */
static bool phase_moved_or_broken(ivshm *h, void *arg)
{
    struct phase_wait *pw = arg;
    return atomic_load_explicit(&pw->desc->bar_phase, memory_order_acquire) !=
               pw->phase ||
           (atomic_load_explicit(&pw->desc->bar_count, memory_order_relaxed) &
            BAR_BROKEN);
}

/* Can the barrier still complete? Members whose slot is dead, or that
   left while we waited (bit seen then cleared), never arrive. Finding a
   dead one marks it dead, which breaks the barrier for everyone. */
static int member_dead(ivshm *h, _Atomic uint64_t *bm, int slot)
{
    (void)h;
    (void)bm;
    (void)slot;
    return IVSHM_EPEERDEAD;
}

static int members_ok(ivshm_window *w, uint64_t *seen)
{
    ivshm *h = w->h;
    uint32_t set, present;
    if (bm_scan(h, w->members, &set, memory_order_relaxed))
        return IVSHM_ECORRUPT;
    /* a member whose entry is no longer ACTIVE left or was found dead:
       one load per member; pid probes (system calls) below are paced */
    ivshm_win_members_present(h, w->members, &present);
    if (present < set)
        return IVSHM_EPEERDEAD;
    for (uint32_t wd = 0; wd < bm_words(h); wd++) {
        uint64_t m = atomic_load_explicit(&w->members[wd], memory_order_acquire);
        if (seen[wd] & ~m)
            return IVSHM_EPEERDEAD;
        seen[wd] |= m;
    }
    return probe_bits(h, w->members, &w->probe_from, member_dead);
}

/* Waiting is over: passed (0), or the barrier is broken. */
static int barrier_done(ivshm_window *w, struct phase_wait *pw)
{
    w->bar_pending = false;
    if (atomic_load_explicit(&pw->desc->bar_phase, memory_order_acquire) !=
        pw->phase)
        return 0;
    return IVSHM_EPEERDEAD;
}

/*
 * Sense-reversing barrier on (bar_count, bar_phase): read the phase, then
 * arrive (count++). The last of nseg arrivals resets the count before it
 * bumps the phase (release), so the next round's arrivals, ordered after
 * seeing the new phase, start from 0. Everyone else waits for the phase to
 * move. After a timeout our arrival stays counted: calling again resumes
 * waiting for the same round instead of arriving twice.
 *
 * A member that dies or leaves without closing never arrives. Its bit
 * stays set with its registry entry no longer ACTIVE (or its pid gone,
 * found by a paced probe), which every waiter sees each slice (members_ok):
 * IVSHM_EPEERDEAD, also at every later barrier of this window. A member
 * that leaves cleanly, and the next incarnation of a dead member's slot,
 * clear the bit and set BAR_BROKEN in the count (ivshm_windows_on_leave).
 */
int ivshm_win_barrier(ivshm_window *w, int timeout_ms)
{
    if (!w)
        return -EINVAL;
    ivshm *h = w->h;
    struct ivshm_win_desc *d = w->desc;
    struct phase_wait pw = {d, w->bar_phase};
    if (!w->bar_pending) {
        pw.phase = atomic_load_explicit(&d->bar_phase, memory_order_acquire);
        uint32_t arrived =
            atomic_fetch_add_explicit(&d->bar_count, 1, memory_order_acq_rel) + 1;
        if (arrived & BAR_BROKEN)
            return IVSHM_EPEERDEAD;
        if (arrived > w->nseg || arrived == 0)
            return IVSHM_ECORRUPT;
        if (arrived == w->nseg) {
            /* CAS: a concurrent BAR_BROKEN must survive the reset */
            uint32_t full = arrived;
            atomic_compare_exchange_strong_explicit(&d->bar_count, &full, 0,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed);
            atomic_store_explicit(&d->bar_phase, pw.phase + 1,
                                  memory_order_release);
            for (uint32_t wd = 0; wd < bm_words(h); wd++) {
                uint64_t m = atomic_load_explicit(&w->members[wd],
                                                  memory_order_relaxed);
                for (; m; m &= m - 1) {
                    uint32_t s = wd * 64 + (uint32_t)__builtin_ctzll(m);
                    if (s < h->max_peers && (int)s != h->self)
                        ivshm_kick(h, (int)s);
                }
            }
            return 0;
        }
        w->bar_pending = true;
        w->bar_phase = pw.phase;
    }

    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX
                                       : ivshm_now_ns() +
                                             (uint64_t)timeout_ms * 1000000ull;
    uint64_t seen[IVSHM_MAX_PEERS / 64] = {0};
    for (;;) {
        int slice = BARRIER_SLICE_MS;
        if (deadline != UINT64_MAX) {
            uint64_t now = ivshm_now_ns();
            uint64_t left_ms = now >= deadline ? 0 : (deadline - now) / 1000000;
            if (left_ms < (uint64_t)slice)
                slice = (int)left_ms;
        }
        int rc = ivshm_wait(h, phase_moved_or_broken, &pw, -1, 0, slice);
        if (rc == 0)
            return barrier_done(w, &pw);
        if (rc != -ETIMEDOUT)
            return rc;
        rc = members_ok(w, seen);
        /* a member may have passed and left after the round completed */
        if (phase_moved_or_broken(h, &pw))
            return barrier_done(w, &pw);
        if (rc < 0)
            return rc;
        if (ivshm_now_ns() >= deadline)
            return -ETIMEDOUT;
    }
}
