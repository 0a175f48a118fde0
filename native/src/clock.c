/* The monotonic clock every deadline of libivshm is measured on. */
#define _GNU_SOURCE
#include "clock.h"

#include <time.h>

uint64_t ivshm_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
