/*
 * What the ping-pong benchmarks (ivshm-pingpong, tcp-pingpong,
 * mpi-pingpong) share: the --sizes syntax, how many round trips a size
 * gets, and the JSON result line that `ivcloud bench p2p` parses. Kept in
 * one place so the three transports are measured and reported the same
 * way. Header-only because mpi-pingpong is built by mpicc outside the
 * CMake targets.
 */
#ifndef IVSHM_BENCH_UTIL_H
#define IVSHM_BENCH_UTIL_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BENCH_MAX_SIZES 64
#define BENCH_MAX_MSG (64u << 20) /* largest size --sizes accepts */
#define BENCH_NBATCH 5
#define BENCH_DEFAULT_SIZES "8,64,512,4096,32768,262144,1048576,4194304"

static inline uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* "8,64,4K,1M": a comma list of sizes with optional K/M suffix (binary).
   Rejects 0, sizes above BENCH_MAX_MSG, more than BENCH_MAX_SIZES entries,
   an empty list and any stray character. */
static inline int bench_parse_sizes(const char *s, size_t *sizes, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (end == s || errno)
            return -1;
        if (*end == 'k' || *end == 'K') {
            v <<= 10;
            end++;
        } else if (*end == 'm' || *end == 'M') {
            v <<= 20;
            end++;
        }
        if (v == 0 || v > BENCH_MAX_MSG || *n == BENCH_MAX_SIZES)
            return -1;
        sizes[(*n)++] = (size_t)v;
        if (*end == ',')
            end++;
        else if (*end)
            return -1;
        s = end;
    }
    return *n ? 0 : -1;
}

/* Buffer size for a run: the largest size, and never less than 8 bytes. */
static inline size_t bench_max_size(const size_t *sizes, int n)
{
    size_t m = 8;
    for (int i = 0; i < n; i++)
        if (sizes[i] > m)
            m = sizes[i];
    return m;
}

/* How one size is measured: `warm` untimed round trips, then `nb` timed
   batches of `per`. Many round trips for small messages, a byte budget for
   big ones, never so few that one hiccup dominates. The median batch is
   the result, so a neighbour's burst of CPU use spoils one batch, not the
   figure; runs too short to split keep one batch. */
struct bench_plan {
    int nb;
    long per;
    long warm;
};

static inline struct bench_plan bench_plan_for(size_t size, long iters,
                                               uint64_t budget)
{
    uint64_t n = budget / (size ? size : 1);
    if (n > (uint64_t)iters)
        n = (uint64_t)iters;
    if (n < 10)
        n = 10;
    struct bench_plan p;
    p.nb = n >= 10 * BENCH_NBATCH ? BENCH_NBATCH : 1;
    p.per = (long)n / p.nb;
    p.warm = p.per / 5 + 2;
    return p;
}

static inline int bench_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One result line. Bandwidth is bytes per microsecond (= MB/s) of one-way
   latency; a zero latency reports 0 rather than inf, which is not JSON.
   `extra` is appended inside the object (",\"key\":value..." or NULL). */
static inline void bench_print_record(const char *transport, const char *mode,
                                      size_t size, double lat_us, long iters,
                                      const char *extra)
{
    printf("{\"transport\":\"%s\",\"mode\":\"%s\",\"size\":%zu,"
           "\"latency_us\":%.4f,\"bandwidth_MBps\":%.2f,\"iters\":%ld%s}\n",
           transport, mode, size, lat_us, lat_us > 0 ? (double)size / lat_us : 0.0,
           iters, extra ? extra : "");
    fflush(stdout);
}

/* The line for a batched size: median batch as the latency, best batch
   beside it. Latencies in microseconds; iters counts the timed round trips. */
static inline void bench_print_batched(const char *transport, const char *mode,
                                       size_t size, double median_us,
                                       double min_us, long iters, int nb)
{
    char extra[96];
    snprintf(extra, sizeof extra, ",\"latency_min_us\":%.4f,\"batches\":%d",
             min_us, nb);
    bench_print_record(transport, mode, size, median_us, iters, extra);
}

/* Sorts `batch_ns` (nb timed batches of `per` steps, `hops` one-way trips
   per step) and prints its line. */
static inline void bench_report_ns(const char *transport, const char *mode,
                                   size_t size, uint64_t *batch_ns, int nb,
                                   long per, int hops)
{
    qsort(batch_ns, (size_t)nb, sizeof batch_ns[0], bench_cmp_u64);
    double div = (double)per * hops * 1e3;
    bench_print_batched(transport, mode, size, (double)batch_ns[nb / 2] / div,
                        (double)batch_ns[0] / div, per * nb, nb);
}

#ifdef MPI_VERSION
/* For the MPI programs (mpi.h included first): `count` round trips of
   `size` bytes between `rank` and rank ^ 1, rank 0 sending first. */
static inline void bench_mpi_pingpong(void *buf, int size, int rank, int tag,
                                      long count)
{
    int peer = rank ^ 1;
    for (long i = 0; i < count; i++) {
        if (rank == 0) {
            MPI_Send(buf, size, MPI_BYTE, peer, tag, MPI_COMM_WORLD);
            MPI_Recv(buf, size, MPI_BYTE, peer, tag, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(buf, size, MPI_BYTE, peer, tag, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(buf, size, MPI_BYTE, peer, tag, MPI_COMM_WORLD);
        }
    }
}
#endif

#endif
