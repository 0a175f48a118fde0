/* libFuzzer: window operations on a region whose window directory and
   lock lines are fuzz input. Every call must fail cleanly or work; never
   touch memory outside the region, never block for long.

   Two attachments share one mapping (slots 0 and 1, both "alive" as this
   process). A legitimate window is created first, then the input is laid
   over the directory and lock lines, then both attachments operate. Lock
   and barrier calls run while only the caller's slot is alive, so a lock
   line naming the other slot is broken at once instead of waited on (a
   live holder is legitimately waited for up to the lock bound). */
#define _GNU_SOURCE
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define JOB 0x5151

static ivshm *h0, *h1;   /* slots 0 and 1 on one mapping */
static uint8_t *spray;   /* window directory + lock lines */
static size_t spray_len;

static void set_alive(ivshm *h, int slot, bool alive)
{
    struct ivshm_peer_entry *e = ivshm_entry(h, slot);
    e->job_id = JOB;
    e->rank = (uint32_t)slot;
    e->doorbell_id = -1;
    e->pid = (int32_t)getpid();
    e->backend = DB_FUTEX;
    e->pidns = h->pidns;
    atomic_store(&e->gen, 1);
    atomic_store(&e->sleeping, 0);
    atomic_store(&e->state, alive ? PEER_ACTIVE : PEER_FREE);
}

static void setup(void)
{
    ivshm_geometry g = {.max_peers = 4, .ring_slots = 2, .slot_size = 128,
                        .max_windows = 4};
    uint64_t size = ivshm_min_region_size(&g);
    int fd = memfd_create("fuzz-window", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
        __builtin_trap();
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED || ivshm_format(p, size, &g) < 0)
        __builtin_trap();
    munmap(p, size);
    if (ivshm_region_map(fd, &h0) < 0)
        __builtin_trap();
    h0->db = ivshm_db_futex_new();
    h0->job_id = JOB;
    h0->self = 0;
    h0->self_gen = 1;
    h0->spin_ns = 0;
    /* a second attachment on the same mapping; never unmapped itself */
    h1 = malloc(sizeof *h1);
    if (!h0->db || !h1)
        __builtin_trap();
    *h1 = *h0;
    h1->self = 1;
    spray = h0->base + h0->windir_off;
    /* the lock lines follow the directory directly */
    spray_len = h0->wctl_off - h0->windir_off +
                (size_t)h0->max_windows * h0->max_peers *
                    sizeof(struct ivshm_win_lock);
}

/* Input bytes consumed from the front. */
struct input {
    const uint8_t *p;
    size_t n;
};

static uint64_t take(struct input *in, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes; i++) {
        v = v << 8 | (in->n ? *in->p : 0);
        if (in->n) {
            in->p++;
            in->n--;
        }
    }
    return v;
}

static void exercise(ivshm_window *w, struct input *in)
{
    uint8_t buf[256];
    uint32_t seg = (uint32_t)take(in, 1) % 6;
    uint64_t off = take(in, 2);
    size_t len = (size_t)take(in, 1);
    memset(buf, 0x3c, sizeof buf);
    ivshm_win_put(w, seg, off, buf, len);
    ivshm_win_get(w, seg, off, buf, len);
    ivshm_win_put(w, seg, UINT64_MAX - off, buf, len);
    int64_t old;
    uint64_t uold;
    ivshm_win_fetch_add(w, seg, off, 3, &old);
    ivshm_win_cas(w, seg, off & ~7ull, 0, 1, &uold);
    ivshm_win_flush(w, seg);
    void *p = ivshm_win_ptr(w, seg);
    if (p && ivshm_win_seg_size(w))
        ((volatile uint8_t *)p)[ivshm_win_seg_size(w) - 1] ^= 1;
}

static void locks_and_barrier(ivshm *self, ivshm *other, ivshm_window *w,
                              struct input *in)
{
    set_alive(other, other->self, false);
    set_alive(self, self->self, true);
    uint32_t seg = (uint32_t)take(in, 1) % 5;
    int kind = (int)take(in, 1) % 3;
    if (ivshm_win_lock(w, seg, kind) == 0) {
        ivshm_win_lock(w, seg, IVSHM_LOCK_SHARED); /* -EDEADLK */
        ivshm_win_unlock(w, seg);
    }
    ivshm_win_barrier(w, 0);
    ivshm_win_barrier(w, 0);
    set_alive(other, other->self, true);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!h0)
        setup();
    memset(spray, 0, spray_len);
    atomic_store(&ivshm_hdr(h0)->alloc_lock, 0);
    for (uint32_t s = 0; s < h0->max_peers; s++)
        set_alive(h0, (int)s, s < 2);

    struct input in = {data, size};
    unsigned flags = (unsigned)take(&in, 1);
    uint32_t nseg = (uint32_t)take(&in, 1) % 6;
    uint64_t seg_size = take(&in, 2) % 16384;
    const char *name = flags & 1 ? "w" : "x";

    ivshm_window *w0 = NULL, *w1 = NULL;
    if (flags & 2)
        ivshm_win_open(h0, "w", nseg ? nseg : 2, seg_size, &w0);

    /* overlay the next input bytes at a chosen offset of the directory */
    size_t at = (size_t)take(&in, 2) % spray_len;
    size_t chunk = (size_t)take(&in, 2);
    if (chunk > in.n)
        chunk = in.n;
    if (chunk > spray_len - at)
        chunk = spray_len - at;
    memcpy(spray + at, in.p, chunk);
    in.p += chunk;
    in.n -= chunk;
    if (flags & 4) {
        /* any holder but slot 0, which is alive and would be waited for */
        uint64_t holder = take(&in, 1);
        atomic_store(&ivshm_hdr(h0)->alloc_lock, holder == 1 ? 77 : holder);
    }

    ivshm_win_open(h1, name, nseg, seg_size, &w1);
    /* a hold naming live slot 1 that h1 did not break (it failed before
       locking) would make h0 wait for the full bound */
    uint64_t expect = 2;
    atomic_compare_exchange_strong(&ivshm_hdr(h0)->alloc_lock, &expect, 0);
    if (w0)
        exercise(w0, &in);
    if (w1)
        exercise(w1, &in);
    if (w0)
        locks_and_barrier(h0, h1, w0, &in);
    if (w1)
        locks_and_barrier(h1, h0, w1, &in);
    if (flags & 8)
        ivshm_windows_on_leave(h0, (int)(take(&in, 1) % 5) - 1);
    ivshm_win_close(w1);
    ivshm_win_close(w0);
    /* the directory must still be usable for a fresh window */
    ivshm_window *w2 = NULL;
    if (ivshm_win_open(h0, "fresh", 1, 64, &w2) == 0)
        ivshm_win_close(w2);
    return 0;
}
