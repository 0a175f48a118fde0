/*
 * Time for deadlines and spinning: the monotonic clock and what the
 * waits compute from it.
 */
#ifndef IVSHM_CLOCK_H
#define IVSHM_CLOCK_H

#include "attachment.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>

/* CLOCK_MONOTONIC in nanoseconds. */
IVSHM_INTERNAL uint64_t ivshm_now_ns(void);

static inline void ivshm_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* The deadline of a call with `timeout_ms`: UINT64_MAX for -1 (forever),
   0 for 0 (already passed: a poll), else now + timeout. No clock read on
   the forever and poll paths. */
static inline uint64_t ivshm_deadline(int timeout_ms)
{
    return timeout_ms < 0    ? UINT64_MAX
           : timeout_ms == 0 ? 0
                             : ivshm_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

/* Milliseconds left until `deadline` (UINT64_MAX: -1, forever), or
   -ETIMEDOUT once it has passed. */
static inline int ms_left(uint64_t deadline)
{
    if (deadline == UINT64_MAX)
        return -1;
    uint64_t now = ivshm_now_ns();
    if (now >= deadline)
        return -ETIMEDOUT;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

/* ---- the work budget (ivshm.h, "Bounds") ----
   What peers write decides how many trips some loops make: cells to
   drop or move aside, fragments of a message, sources to poll. Each
   such trip is one unit (ivshm_work). Between two looks at the clock a
   call spends at most ivshm_work_budget() of them: once they are spent,
   those loops stop as if nothing were there, and the call looks at its
   deadline: past it (a timeout of 0 always is) it returns what it has
   (a message in progress stays in progress), else it takes a new budget
   (ivshm_work_start). Honest traffic spends a few units a message; a
   receive with timeout 0 takes up to the budget's worth of fragments of
   a long message, and the next one goes on from there. */
#define IVSHM_WORK_SLOTS_MAX 2048u
static inline uint32_t ivshm_work_budget_of(uint32_t queue_slots,
                                            uint32_t ring_slots,
                                            uint32_t max_peers)
{
    uint32_t slots = queue_slots + ring_slots;
    if (slots > IVSHM_WORK_SLOTS_MAX)
        slots = IVSHM_WORK_SLOTS_MAX;
    return 2 * slots + max_peers + 2 * IVSHM_MAX_FAST;
}

/* The budget of `h`'s geometry, computed once when the region is
   mapped (region.c). */
static inline uint32_t ivshm_work_budget(const ivshm *h)
{
    return h->work_budget;
}

#ifdef IVSHM_WORK_COUNT
#define IVSHM_WORK_COUNTING 1
#else
#define IVSHM_WORK_COUNTING 0
#endif

/* A call begins, or looked at the clock and has time left: a new budget. */
static inline void ivshm_work_start(ivshm *h)
{
    if (IVSHM_WORK_COUNTING) {
        uint64_t run = h->work_units - h->work_mark;
        if (run > h->work_peak)
            h->work_peak = run;
        h->work_mark = h->work_units;
    }
    h->work_left = ivshm_work_budget(h);
}

/* One trip of a loop that peers' writes drive: false once the budget is
   spent (the loop stops; its caller looks at the clock). Charged where
   a loop goes round again (a cell dropped, a claim retried), so that
   the plain case of one trip costs nothing. */
static inline bool ivshm_work(ivshm *h)
{
    if (IVSHM_WORK_COUNTING)
        h->work_units++;
    if (__builtin_expect(h->work_left == 0, 0))
        return false;
    h->work_left--;
    return true;
}

/* Trips of a loop bounded by the geometry alone (a pass over the
   registry, the channels, a bitmap): counted, never cut. */
static inline void ivshm_work_count(ivshm *h, uint32_t n)
{
    if (IVSHM_WORK_COUNTING)
        h->work_units += n;
    (void)h;
    (void)n;
}

#endif
