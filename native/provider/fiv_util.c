/*
 * What every layer of the provider uses: its parameters' values
 * (fiv_init.c fills them in), the clock and deadlines, and error texts.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fiv.h"

struct fiv_config fiv_cfg = {.position = -1,
                             .peer_answer_bytes = FIV_PEER_ANSWER_BYTES,
                             .peer_queue = FIV_PEER_QUEUE,
                             .drain_ms = 5000,
                             .peer_unexp_bytes = FIV_PEER_UNEXP_BYTES};

uint64_t fiv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t fiv_deadline(int timeout_ms)
{
    return timeout_ms < 0 ? UINT64_MAX
                          : fiv_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

const char *fiv_strerror(int prov_errno, char *buf, size_t len)
{
    const char *s = fi_strerror(prov_errno < 0 ? -prov_errno : prov_errno);
    if (!buf || !len)
        return s;
    snprintf(buf, len, "%s", s);
    return buf;
}
