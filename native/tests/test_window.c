/* One-sided windows between real processes: put/get, atomics, locks,
   barriers, dead holders and members, table/heap limits, and garbage in
   the window directory and lock lines. */
#define _GNU_SOURCE
#include "internal.h"
#include "testutil.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define JOB 0x77
#define CHILD_TIMEOUT_MS 60000

static const ivshm_geometry geo = {.max_peers = 8, .ring_slots = 4,
                                   .slot_size = 256, .max_windows = 4};

/* Test bookkeeping shared by parent and children (not in the region). */
struct board {
    _Atomic int ready;          /* children that reached their start line */
    _Atomic int go;
    _Atomic int holders;        /* shared-lock holders right now          */
    _Atomic int max_holders;
    _Atomic int released;
    _Atomic int killed;
    _Atomic uint64_t kill_ns;
    _Atomic int arrivals[64];   /* barrier rounds                         */
};

static struct board *board;
static const char *region_path;

struct child {
    uint32_t rank, nproc;
};

static uint64_t region_bytes(void)
{
    return ivshm_min_region_size(&geo) + (4u << 20);
}

static void board_reset(void)
{
    memset(board, 0, sizeof *board);
}

/* Bounded wait (in a child) until *v >= want. */
static void await_at_least(_Atomic int *v, int want)
{
    uint64_t end = ivshm_now_ns() + 10000000000ull;
    while (atomic_load(v) < want) {
        REQUIRE(ivshm_now_ns() < end);
        tu_sleep_ms(1);
    }
}

static pid_t spawn(int (*fn)(void *), uint32_t rank, uint32_t nproc)
{
    static struct child args[64];
    args[rank] = (struct child){rank, nproc};
    return tu_fork(fn, &args[rank]);
}

static void wait_all(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++)
        CHECK_RC(tu_wait(pids[i], CHILD_TIMEOUT_MS), 0);
}

static struct ivshm_win_desc *desc_of(ivshm *h, uint32_t i)
{
    return (struct ivshm_win_desc *)(h->base + h->windir_off) + i;
}

static struct ivshm_win_lock *lock_of(ivshm *h, uint32_t win, uint32_t seg)
{
    return (struct ivshm_win_lock *)(h->base + h->wctl_off) +
           (uint64_t)win * h->max_peers + seg;
}

/* Index of the descriptor holding `name`, or -1. */
static int find_desc(ivshm *h, const char *name)
{
    for (uint32_t i = 0; i < h->max_windows; i++)
        if (atomic_load(&desc_of(h, i)->state) != WIN_FREE &&
            strncmp(desc_of(h, i)->name, name, IVSHM_NAME_LEN) == 0)
            return (int)i;
    return -1;
}

/* ---- put/get between processes, argument errors ---- */

#define PG_SEG 5000u /* not a page multiple */

static uint8_t pattern(uint32_t rank, uint64_t i)
{
    return (uint8_t)(rank * 31 + i * 7 + 1);
}

static int put_get_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "pg", c->nproc, PG_SEG, &w) == 0);
    REQUIRE(ivshm_win_seg_size(w) == PG_SEG);

    /* fresh window memory is zero */
    uint8_t buf[PG_SEG], want[PG_SEG];
    REQUIRE(ivshm_win_get(w, c->rank, 0, buf, PG_SEG) == 0);
    for (uint32_t i = 0; i < PG_SEG; i++)
        REQUIRE(buf[i] == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);

    /* each writes its own segment, then reads everybody's */
    for (uint32_t i = 0; i < PG_SEG; i++)
        want[i] = pattern(c->rank, i);
    REQUIRE(ivshm_win_put(w, c->rank, 0, want, PG_SEG) == 0);
    REQUIRE(ivshm_win_flush(w, c->rank) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    for (uint32_t r = 0; r < c->nproc; r++) {
        memset(buf, 0xee, sizeof buf);
        REQUIRE(ivshm_win_get(w, r, 0, buf, PG_SEG) == 0);
        for (uint32_t i = 0; i < PG_SEG; i++)
            REQUIRE(buf[i] == pattern(r, i));
        const uint8_t *p = ivshm_win_ptr(w, r);
        REQUIRE(p && p[PG_SEG - 1] == pattern(r, PG_SEG - 1));
    }
    /* a put into a neighbour's segment at an offset, once all have read */
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    uint32_t next = (c->rank + 1) % c->nproc;
    uint64_t stamp = 0xabc000 + c->rank;
    REQUIRE(ivshm_win_put(w, next, 8, &stamp, sizeof stamp) == 0);
    REQUIRE(ivshm_win_flush(w, UINT32_MAX) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    uint32_t prev = (c->rank + c->nproc - 1) % c->nproc;
    REQUIRE(ivshm_win_get(w, c->rank, 8, &stamp, sizeof stamp) == 0);
    REQUIRE(stamp == 0xabc000 + prev);

    /* bounds and argument errors */
    REQUIRE(ivshm_win_put(w, c->rank, PG_SEG - 1, buf, 2) == -EINVAL);
    REQUIRE(ivshm_win_put(w, c->rank, PG_SEG - 1, buf, 1) == 0);
    REQUIRE(ivshm_win_put(w, c->rank, PG_SEG, buf, 0) == 0);
    REQUIRE(ivshm_win_put(w, c->rank, PG_SEG + 1, buf, 0) == -EINVAL);
    REQUIRE(ivshm_win_put(w, c->rank, UINT64_MAX, buf, 2) == -EINVAL);
    REQUIRE(ivshm_win_get(w, c->rank, 16, buf, SIZE_MAX) == -EINVAL);
    REQUIRE(ivshm_win_get(w, c->nproc, 0, buf, 1) == -EINVAL);
    REQUIRE(ivshm_win_put(w, c->rank, 0, NULL, 1) == -EINVAL);
    REQUIRE(ivshm_win_ptr(w, c->nproc) == NULL);
    int64_t old;
    uint64_t uold;
    REQUIRE(ivshm_win_fetch_add(w, c->rank, 4, 1, &old) == -EINVAL);
    REQUIRE(ivshm_win_fetch_add(w, c->rank, PG_SEG - 4, 1, &old) == -EINVAL);
    REQUIRE(ivshm_win_cas(w, c->rank, 3, 0, 1, &uold) == -EINVAL);
    REQUIRE(ivshm_win_flush(w, c->nproc) == -EINVAL);
    REQUIRE(ivshm_win_lock(w, c->nproc, IVSHM_LOCK_SHARED) == -EINVAL);
    REQUIRE(ivshm_win_lock(w, 0, 7) == -EINVAL);
    REQUIRE(ivshm_win_unlock(w, 0) == -EINVAL); /* not held */

    /* mismatching arguments for an existing window; a second open by the
       same attachment */
    ivshm_window *w2 = NULL;
    REQUIRE(ivshm_win_open(h, "pg", c->nproc + 1, PG_SEG, &w2) == -EINVAL);
    REQUIRE(ivshm_win_open(h, "pg", c->nproc, PG_SEG + 8, &w2) == -EINVAL);
    REQUIRE(ivshm_win_open(h, "pg", c->nproc, PG_SEG, &w2) == -EBUSY);
    REQUIRE(w2 == NULL);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static void test_put_get(void)
{
    region_path = tu_region(region_bytes(), &geo);
    enum { N = 3 };
    pid_t pids[N];
    for (uint32_t r = 0; r < N; r++)
        pids[r] = spawn(put_get_child, r, N);
    wait_all(pids, N);

    /* every member closed: the descriptor is free again */
    ivshm *h = tu_attach(region_path, JOB, 9, 0);
    CHECK(find_desc(h, "pg") < 0);
    ivshm_detach(h);
}

/* ---- table and heap limits, freeing and reuse (one process) ---- */

static void test_limits(void)
{
    region_path = tu_region(region_bytes(), &geo);
    ivshm *a = tu_attach(region_path, JOB, 0, 0);
    ivshm *b = tu_attach(region_path, JOB, 1, 0);
    ivshm_window *w[4] = {0}, *extra = NULL;
    const char *names[] = {"w0", "w1", "w2", "w3"};
    for (int i = 0; i < 4; i++)
        CHECK_RC(ivshm_win_open(a, names[i], 2, 100, &w[i]), 0);
    CHECK_RC(ivshm_win_open(a, "w4", 2, 100, &extra), IVSHM_EFULL);
    /* joining an existing one still works with a full table */
    ivshm_window *bw = NULL;
    CHECK_RC(ivshm_win_open(b, "w1", 2, 100, &bw), 0);
    /* a third member for two segments */
    ivshm *c = tu_attach(region_path, JOB, 2, 0);
    CHECK_RC(ivshm_win_open(c, "w1", 2, 100, &extra), IVSHM_EFULL);

    /* w1 stays while b holds it; it is freed when b closes too */
    int idx = find_desc(a, "w1");
    CHECK(idx >= 0);
    ivshm_win_close(w[1]);
    CHECK(find_desc(a, "w1") == idx);
    _Atomic uint64_t *members = ivshm_win_bitmap(a, (uint32_t)idx, -1);
    CHECK(members && atomic_load(members) == 1ull << ivshm_self(b));
    ivshm_win_close(bw);
    CHECK(find_desc(a, "w1") < 0);
    CHECK(atomic_load(&desc_of(a, (uint32_t)idx)->state) == WIN_FREE);
    CHECK_RC(ivshm_win_open(a, "w4", 2, 100, &w[1]), 0);
    for (int i = 0; i < 4; i++)
        ivshm_win_close(w[i]);

    /* heap: bigger than the heap fails, the whole heap twice fails, and
       memory is reused once freed */
    uint64_t heap = a->heap_size;
    CHECK_RC(ivshm_win_open(a, "huge", 1, heap + 1, &extra), IVSHM_EFULL);
    CHECK_RC(ivshm_win_open(a, "huge", 1, UINT64_MAX / 2, &extra), IVSHM_EFULL);
    ivshm_window *big = NULL, *big2 = NULL;
    CHECK_RC(ivshm_win_open(a, "big", 2, heap / 2 - 4096, &big), 0);
    CHECK_RC(ivshm_win_open(a, "big2", 1, heap / 2, &big2), IVSHM_EFULL);
    if (big) {
        memset(ivshm_win_ptr(big, 1), 0x5a, 4096);
        ivshm_win_close(big);
    }
    CHECK_RC(ivshm_win_open(a, "big2", 1, heap - 4096, &big2), 0);
    if (big2) {
        /* same memory, zeroed for the new window */
        const uint8_t *p = ivshm_win_ptr(big2, 0);
        int nonzero = 0;
        for (uint64_t i = 0; i < heap - 4096; i += 512)
            nonzero |= p[i];
        CHECK(nonzero == 0);
        ivshm_win_close(big2);
    }

    /* zero-size segments are allowed; bad names are not */
    ivshm_window *z = NULL;
    CHECK_RC(ivshm_win_open(a, "zero", 2, 0, &z), 0);
    CHECK(z && ivshm_win_seg_size(z) == 0);
    CHECK_RC(ivshm_win_put(z, 0, 0, "", 0), 0);
    CHECK_RC(ivshm_win_put(z, 0, 0, "x", 1), -EINVAL);
    ivshm_win_close(z);
    CHECK_RC(ivshm_win_open(a, "", 1, 8, &z), -EINVAL);
    CHECK_RC(ivshm_win_open(a, "this-name-is-much-too-long-for-it", 1, 8, &z),
             -EINVAL);
    CHECK_RC(ivshm_win_open(a, "n", 0, 8, &z), -EINVAL);
    CHECK_RC(ivshm_win_open(a, "n", 9, 8, &z), -EINVAL);

    /* another job's window of the same name is a different window */
    ivshm *other = tu_attach(region_path, JOB + 1, 0, 0);
    ivshm_window *mine = NULL, *theirs = NULL;
    CHECK_RC(ivshm_win_open(a, "same", 1, 64, &mine), 0);
    CHECK_RC(ivshm_win_open(other, "same", 2, 32, &theirs), 0);
    if (mine && theirs)
        CHECK(ivshm_win_ptr(mine, 0) != ivshm_win_ptr(theirs, 0));
    ivshm_win_close(mine);
    ivshm_win_close(theirs);
    ivshm_detach(other);

    /* detach with a window open: its membership is dropped and the
       descriptor reclaimed by the next allocation */
    ivshm_window *left = NULL;
    CHECK_RC(ivshm_win_open(c, "left", 1, 64, &left), 0);
    ivshm_detach(c);
    idx = find_desc(a, "left");
    members = idx >= 0 ? ivshm_win_bitmap(a, (uint32_t)idx, -1) : NULL;
    CHECK(members && atomic_load(members) == 0);
    free(left); /* handle of a detached attachment: only local memory */
    ivshm_window *ws[4] = {0};
    for (int i = 0; i < 4; i++)
        CHECK_RC(ivshm_win_open(a, names[i], 1, 64, &ws[i]), 0);
    for (int i = 0; i < 4; i++)
        ivshm_win_close(ws[i]);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- atomics from every process ---- */

#define ADDS 100000
#define CAS_INCS 20000

static int atomics_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "atom", c->nproc, 64, &w) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    for (int i = 0; i < ADDS; i++)
        REQUIRE(ivshm_win_fetch_add(w, 0, 0, 1, NULL) == 0);
    /* a counter built from CAS alone, in the last segment */
    uint32_t seg = c->nproc - 1;
    for (int i = 0; i < CAS_INCS; i++) {
        uint64_t cur = 0, seen;
        for (;;) {
            REQUIRE(ivshm_win_cas(w, seg, 8, cur, cur + 1, &seen) == 0);
            if (seen == cur)
                break;
            cur = seen;
        }
    }
    REQUIRE(ivshm_win_barrier(w, 20000) == 0);
    int64_t total;
    uint64_t cas_total;
    REQUIRE(ivshm_win_fetch_add(w, 0, 0, 0, &total) == 0);
    REQUIRE(ivshm_win_get(w, seg, 8, &cas_total, 8) == 0);
    REQUIRE(total == (int64_t)c->nproc * ADDS);
    REQUIRE(cas_total == (uint64_t)c->nproc * CAS_INCS);
    /* negative adds wrap like two's complement */
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    if (c->rank == 0) {
        REQUIRE(ivshm_win_fetch_add(w, 1 % c->nproc, 16, -5, NULL) == 0);
        REQUIRE(ivshm_win_fetch_add(w, 1 % c->nproc, 16, 0, &total) == 0);
        REQUIRE(total == -5);
    }
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static void test_atomics(void)
{
    region_path = tu_region(region_bytes(), &geo);
    enum { N = 4 };
    pid_t pids[N];
    for (uint32_t r = 0; r < N; r++)
        pids[r] = spawn(atomics_child, r, N);
    wait_all(pids, N);
}

/* ---- exclusive locks exclude ---- */

#define LOCK_ITERS 1500

static int exclusive_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "excl", c->nproc, 64, &w) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    volatile uint64_t *value = ivshm_win_ptr(w, 0);
    for (int i = 0; i < LOCK_ITERS; i++) {
        REQUIRE(ivshm_win_lock(w, 0, IVSHM_LOCK_EXCLUSIVE) == 0);
        REQUIRE(ivshm_win_lock(w, 0, IVSHM_LOCK_EXCLUSIVE) == -EDEADLK);
        uint64_t v = *value;
        /* widen the window for a lost update: spin, sometimes yield */
        for (int k = 0; k < 200; k++)
            ivshm_cpu_relax();
        if (i % 16 == 0)
            sched_yield();
        *value = v + 1;
        REQUIRE(ivshm_win_unlock(w, 0) == 0);
    }
    REQUIRE(ivshm_win_barrier(w, 30000) == 0);
    REQUIRE(*value == (uint64_t)c->nproc * LOCK_ITERS);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static void test_exclusive(void)
{
    region_path = tu_region(region_bytes(), &geo);
    enum { N = 4 };
    pid_t pids[N];
    uint64_t t0 = ivshm_now_ns();
    for (uint32_t r = 0; r < N; r++)
        pids[r] = spawn(exclusive_child, r, N);
    wait_all(pids, N);
    printf("  exclusive: %d x %d locked updates in %.2f s\n", N, LOCK_ITERS,
           (double)(ivshm_now_ns() - t0) / 1e9);
}

/* ---- shared locks are shared, exclusive waits for them ---- */

static int shared_reader_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "shr", 3, 64, &w) == 0);
    REQUIRE(ivshm_win_lock(w, 1, IVSHM_LOCK_SHARED) == 0);
    int now = atomic_fetch_add(&board->holders, 1) + 1;
    int max = atomic_load(&board->max_holders);
    while (now > max && !atomic_compare_exchange_weak(&board->max_holders, &max, now))
        ;
    await_at_least(&board->max_holders, 2); /* both readers inside at once */
    tu_sleep_ms(150);                          /* the writer is waiting now   */
    atomic_fetch_add(&board->holders, -1);
    atomic_fetch_add(&board->released, 1);
    REQUIRE(ivshm_win_unlock(w, 1) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static int shared_writer_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "shr", 3, 64, &w) == 0);
    await_at_least(&board->max_holders, 2);
    REQUIRE(ivshm_win_lock(w, 1, IVSHM_LOCK_EXCLUSIVE) == 0);
    REQUIRE(atomic_load(&board->released) == 2);
    REQUIRE(atomic_load(&board->holders) == 0);
    REQUIRE(ivshm_win_unlock(w, 1) == 0);
    /* and back to shared: nothing left behind by the readers */
    REQUIRE(ivshm_win_lock(w, 1, IVSHM_LOCK_SHARED) == 0);
    REQUIRE(ivshm_win_unlock(w, 1) == 0);
    REQUIRE(ivshm_win_barrier(w, 10000) == 0);
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static void test_shared(void)
{
    region_path = tu_region(region_bytes(), &geo);
    board_reset();
    pid_t pids[3];
    pids[0] = spawn(shared_reader_child, 0, 3);
    pids[1] = spawn(shared_reader_child, 1, 3);
    pids[2] = spawn(shared_writer_child, 2, 3);
    wait_all(pids, 3);
    CHECK(atomic_load(&board->max_holders) == 2);
}

/* ---- barrier: nobody passes early ---- */

#define ROUNDS 60

static int barrier_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "bar", c->nproc, 8, &w) == 0);
    for (int r = 0; r < ROUNDS; r++) {
        if ((r + (int)c->rank) % 7 == 0)
            tu_sleep_ms(2); /* vary who arrives last */
        atomic_fetch_add(&board->arrivals[r], 1);
        REQUIRE(ivshm_win_barrier(w, 20000) == 0);
        REQUIRE(atomic_load(&board->arrivals[r]) == (int)c->nproc);
    }
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

/* Opens the window, then exits without closing or detaching. */
static int quitter_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "reaped", c->nproc, 8, &w) == 0);
    return 0;
}

static void test_barrier(void)
{
    region_path = tu_region(region_bytes(), &geo);
    board_reset();
    enum { N = 4 };
    pid_t pids[N];
    for (uint32_t r = 0; r < N; r++)
        pids[r] = spawn(barrier_child, r, N);
    wait_all(pids, N);
    CHECK(atomic_load(&board->arrivals[ROUNDS - 1]) == N);

    /* a timed-out barrier keeps our arrival: calling again resumes it */
    ivshm *a = tu_attach(region_path, JOB, 0, 0);
    ivshm *b = tu_attach(region_path, JOB, 1, 0);
    ivshm_window *wa = NULL, *wb = NULL;
    CHECK_RC(ivshm_win_open(a, "tb", 2, 8, &wa), 0);
    CHECK_RC(ivshm_win_open(b, "tb", 2, 8, &wb), 0);
    CHECK_RC(ivshm_win_barrier(wa, 0), -ETIMEDOUT);
    CHECK_RC(ivshm_win_barrier(wa, 5), -ETIMEDOUT);
    CHECK_RC(ivshm_win_barrier(wb, 0), 0); /* last arriver completes it */
    CHECK_RC(ivshm_win_barrier(wa, 0), 0);
    int idx = find_desc(a, "tb");
    CHECK(idx >= 0 && atomic_load(&desc_of(a, (uint32_t)idx)->bar_count) == 0);
    ivshm_win_close(wa);
    ivshm_win_close(wb);

    /* a member dies without closing and is reaped by someone else before
       the waiters ever saw its bit: the barrier is broken, no hang */
    CHECK_RC(ivshm_win_open(a, "reaped", 3, 8, &wa), 0);
    CHECK_RC(ivshm_win_open(b, "reaped", 3, 8, &wb), 0);
    pid_t quitter = spawn(quitter_child, 2, 3);
    CHECK_RC(tu_wait(quitter, CHILD_TIMEOUT_MS), 0);
    CHECK(ivshm_reap(b) == 1);
    uint64_t t0 = ivshm_now_ns();
    CHECK_RC(ivshm_win_barrier(wa, 5000), IVSHM_EPEERDEAD);
    CHECK(ivshm_now_ns() - t0 < 1000000000ull);
    CHECK_RC(ivshm_win_barrier(wb, 5000), IVSHM_EPEERDEAD);
    CHECK_RC(ivshm_win_barrier(wb, 5000), IVSHM_EPEERDEAD); /* stays so */
    ivshm_win_close(wa);
    ivshm_win_close(wb);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- dead lock holder, dead barrier member ---- */

static int doomed_holder_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "dead", c->nproc, 64, &w) == 0);
    REQUIRE(ivshm_win_lock(w, 0, IVSHM_LOCK_EXCLUSIVE) == 0);
    REQUIRE(ivshm_win_lock(w, 1, IVSHM_LOCK_SHARED) == 0);
    atomic_fetch_add(&board->ready, 1);
    for (;;)
        pause(); /* until SIGKILL */
}

static int survivor_child(void *arg)
{
    struct child *c = arg;
    ivshm *h = tu_attach(region_path, JOB, c->rank, 0);
    ivshm_window *w = NULL;
    REQUIRE(ivshm_win_open(h, "dead", c->nproc, 64, &w) == 0);
    await_at_least(&board->ready, 1);
    atomic_fetch_add(&board->go, 1);
    if (c->rank == 1) {
        /* exclusive on a segment the dead one held exclusive */
        REQUIRE(ivshm_win_lock(w, 0, IVSHM_LOCK_EXCLUSIVE) == 0);
        uint64_t got = ivshm_now_ns();
        REQUIRE(atomic_load(&board->killed) == 1); /* not before the kill */
        REQUIRE(got - atomic_load(&board->kill_ns) < 3000000000ull);
        REQUIRE(ivshm_win_unlock(w, 0) == 0);
        /* exclusive on one it held shared: its reader bit is cleared */
        REQUIRE(ivshm_win_lock(w, 1, IVSHM_LOCK_EXCLUSIVE) == 0);
        REQUIRE(ivshm_win_unlock(w, 1) == 0);
    } else {
        /* a barrier including the dead member fails instead of hanging */
        uint64_t t0 = ivshm_now_ns();
        int rc = ivshm_win_barrier(w, 15000);
        REQUIRE(rc == IVSHM_EPEERDEAD || rc == -ETIMEDOUT);
        REQUIRE(atomic_load(&board->killed) == 1);
        REQUIRE(ivshm_now_ns() - t0 < 10000000000ull);
        REQUIRE(rc == IVSHM_EPEERDEAD); /* well before the timeout */
    }
    ivshm_win_close(w);
    ivshm_detach(h);
    return 0;
}

static void test_dead_peers(void)
{
    region_path = tu_region(region_bytes(), &geo);
    board_reset();
    pid_t doomed = spawn(doomed_holder_child, 0, 3);
    pid_t pids[2];
    pids[0] = spawn(survivor_child, 1, 3);
    pids[1] = spawn(survivor_child, 2, 3);
    /* both survivors are waiting (lock / barrier) before the kill */
    uint64_t end = ivshm_now_ns() + 10000000000ull;
    while (atomic_load(&board->go) < 2 && ivshm_now_ns() < end)
        tu_sleep_ms(1);
    tu_sleep_ms(200);
    atomic_store(&board->kill_ns, ivshm_now_ns());
    atomic_store(&board->killed, 1);
    kill(doomed, SIGKILL); /* left a zombie until tu_wait: still "dead" */
    wait_all(pids, 2);
    CHECK(tu_wait(doomed, 5000) == -1);
}

/* ---- garbage in the directory and lock lines ---- */

static void test_garbage(void)
{
    region_path = tu_region(region_bytes(), &geo);
    ivshm *a = tu_attach(region_path, JOB, 0, 0);
    ivshm *b = tu_attach(region_path, JOB, 1, 0);
    ivshm_window *wa = NULL, *wb = NULL;
    CHECK_RC(ivshm_win_open(a, "g", 2, 4096, &wa), 0);
    int idx = find_desc(a, "g");
    CHECK(idx >= 0);
    if (idx < 0)
        return;
    struct ivshm_win_desc *d = desc_of(a, (uint32_t)idx);
    struct ivshm_win_desc saved = *d;

    d->data_off = a->size + 4096;
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    d->data_off = saved.data_off + 1; /* not page aligned */
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    d->data_off = saved.data_off;
    d->data_bytes = UINT64_MAX - 4095; /* wraps data_off + data_bytes */
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    d->data_bytes = saved.data_bytes;
    d->nseg = 0xffffffffu;
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    d->nseg = saved.nseg;
    d->seg_size = UINT64_MAX / 2;
    CHECK_RC(ivshm_win_open(b, "g", 2, UINT64_MAX / 2, &wb), IVSHM_EFULL);
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    d->seg_size = saved.seg_size;
    /* the members bitmap at the start of its extent */
    _Atomic uint64_t *members = ivshm_win_bitmap(a, (uint32_t)idx, -1);
    CHECK(members != NULL);
    if (!members)
        return;
    atomic_store(members, ~0ull);
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), IVSHM_ECORRUPT);
    atomic_store(members, 1ull << ivshm_self(a));
    CHECK(wb == NULL);
    /* the handle kept its validated copy: operations still work */
    uint64_t v = 42;
    CHECK_RC(ivshm_win_put(wa, 1, 0, &v, 8), 0);
    CHECK_RC(ivshm_win_open(b, "g", 2, 4096, &wb), 0);
    v = 0;
    CHECK_RC(ivshm_win_get(wb, 1, 0, &v, 8), 0);
    CHECK(v == 42);

    /* lock lines: garbage holder values fail fast, dead ones are broken */
    struct ivshm_win_lock *l = lock_of(a, (uint32_t)idx, 0);
    _Atomic uint64_t *readers = ivshm_win_bitmap(a, (uint32_t)idx, 0);
    CHECK(readers != NULL);
    if (!readers)
        return;
    uint64_t t0 = ivshm_now_ns();
    atomic_store(&l->writer, 1000);
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_EXCLUSIVE), IVSHM_ECORRUPT);
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_SHARED), IVSHM_ECORRUPT);
    atomic_store(&l->writer, 7 + 1); /* slot 7: nobody there */
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_EXCLUSIVE), 0);
    CHECK_RC(ivshm_win_unlock(wa, 0), 0);
    atomic_store(readers, 1ull << 40);
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_EXCLUSIVE), IVSHM_ECORRUPT);
    CHECK(atomic_load(&l->writer) == 0); /* gave its claim back */
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_SHARED), IVSHM_ECORRUPT);
    atomic_store(readers, (1ull << 6) | (1ull << ivshm_self(a)));
    CHECK_RC(ivshm_win_lock(wa, 0, IVSHM_LOCK_EXCLUSIVE), 0);
    CHECK(atomic_load(readers) == 0);
    /* someone broke our hold and took it: unlock reports it */
    atomic_store(&l->writer, (uint64_t)ivshm_self(b) + 1);
    CHECK_RC(ivshm_win_unlock(wa, 0), IVSHM_ECORRUPT);
    atomic_store(&l->writer, 0);
    CHECK(ivshm_now_ns() - t0 < 2000000000ull);

    /* barrier counter beyond nseg */
    atomic_store(&d->bar_count, 1000);
    CHECK_RC(ivshm_win_barrier(wa, 100), IVSHM_ECORRUPT);
    atomic_store(&d->bar_count, 0);

    /* a garbage descriptor elsewhere does not stop new windows */
    int other = (idx + 1) % (int)a->max_windows;
    struct ivshm_win_desc *g = desc_of(a, (uint32_t)other);
    memset(g, 0xa5, sizeof *g);
    atomic_store(&g->state, WIN_READY);
    ivshm_window *w2 = NULL;
    CHECK_RC(ivshm_win_open(a, "fresh", 1, 4096, &w2), 0);
    if (w2) {
        uint8_t *p = ivshm_win_ptr(w2, 0);
        CHECK(p >= a->base + a->heap_off &&
              p + 4096 <= a->base + a->heap_off + a->heap_size);
        ivshm_win_close(w2);
    }
    /* a state value that means nothing */
    atomic_store(&g->state, 77);
    CHECK_RC(ivshm_win_open(a, "fresh2", 1, 4096, &w2), 0);
    ivshm_win_close(w2);
    /* garbage owner of the alloc lock is broken */
    atomic_store(&ivshm_hdr(a)->alloc_lock, 12345);
    CHECK_RC(ivshm_win_open(a, "fresh3", 1, 4096, &w2), 0);
    ivshm_win_close(w2);

    ivshm_win_close(wa);
    ivshm_win_close(wb);
    ivshm_detach(a);
    ivshm_detach(b);
}

/* ---- alloc lock held by a process that died ---- */

static int alloc_holder_child(void *arg)
{
    (void)arg;
    ivshm *h = tu_attach(region_path, JOB, 5, 0);
    REQUIRE(ivshm_alloc_lock(h) == 0);
    atomic_store(&board->ready, 1);
    for (;;)
        pause();
}

static void test_dead_alloc_holder(void)
{
    region_path = tu_region(region_bytes(), &geo);
    board_reset();
    pid_t pid = spawn(alloc_holder_child, 5, 6);
    uint64_t end = ivshm_now_ns() + 10000000000ull;
    while (!atomic_load(&board->ready) && ivshm_now_ns() < end)
        tu_sleep_ms(1);
    CHECK(atomic_load(&board->ready) == 1);
    ivshm *a = tu_attach(region_path, JOB, 0, 0);
    kill(pid, SIGKILL);
    uint64_t t0 = ivshm_now_ns();
    ivshm_window *w = NULL;
    CHECK_RC(ivshm_win_open(a, "after", 1, 64, &w), 0);
    CHECK(ivshm_now_ns() - t0 < 2000000000ull);
    ivshm_win_close(w);
    ivshm_detach(a);
    tu_wait(pid, 5000);
}

int main(void)
{
    board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (board == MAP_FAILED)
        return 1;
    struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {
        {"put_get", test_put_get},     {"limits", test_limits},
        {"atomics", test_atomics},     {"exclusive", test_exclusive},
        {"shared", test_shared},       {"barrier", test_barrier},
        {"dead_peers", test_dead_peers}, {"garbage", test_garbage},
        {"dead_alloc_holder", test_dead_alloc_holder},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        uint64_t t0 = ivshm_now_ns();
        int failed = tu_failed;
        tests[i].fn();
        printf("%-18s %s (%.2f s)\n", tests[i].name,
               tu_failed == failed ? "ok" : "FAILED",
               (double)(ivshm_now_ns() - t0) / 1e9);
        fflush(stdout);
    }
    return tu_summary("test_window");
}
