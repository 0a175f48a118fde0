/*
 * Time for deadlines and spinning: the monotonic clock and what the
 * waits compute from it.
 */
#ifndef IVSHM_CLOCK_H
#define IVSHM_CLOCK_H

#include "attachment.h"

#include <errno.h>
#include <limits.h>
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

#endif
