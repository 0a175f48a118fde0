/*
 * Shared helpers of the MPI correctness programs in this directory.
 * Every check that fails prints one line naming the rank, the place and
 * the values, then aborts the whole job so mpirun exits non-zero; a
 * program that gets to its end prints one "PASS" line from rank 0.
 */
#ifndef IVCLOUD_MPITEST_H
#define IVCLOUD_MPITEST_H

#include <mpi.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int mt_rank = -1;

static void mt_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

static void mt_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL rank %d: %s:%d: %s\n", mt_rank, file, line, msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1); /* MPI_Abort does not return; keeps the compiler informed */
}

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond))                                                      \
            mt_fail(__FILE__, __LINE__, __VA_ARGS__);                     \
    } while (0)

/* MPI calls return codes only under MPI_ERRORS_RETURN (set by mt_init):
   a failed call is then reported with its error string. */
#define MPI_OK(call)                                                      \
    do {                                                                  \
        int mt_rc_ = (call);                                              \
        if (mt_rc_ != MPI_SUCCESS) {                                      \
            char mt_es_[MPI_MAX_ERROR_STRING];                            \
            int mt_el_ = 0;                                               \
            MPI_Error_string(mt_rc_, mt_es_, &mt_el_);                    \
            mt_fail(__FILE__, __LINE__, "%s: %s", #call, mt_es_);         \
        }                                                                 \
    } while (0)

static inline void mt_init(int *argc, char ***argv, int *rank, int *size)
{
    MPI_Init(argc, argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    mt_rank = *rank;
}

/* Deterministic content: byte i of the buffer identified by `seed`.
   Mixing the index keeps misplaced fragments (shifted, swapped, stale
   from a previous message) from comparing equal. */
static inline uint8_t mt_byte(uint64_t seed, size_t i)
{
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(i >> 3) *
                 0xBF58476D1CE4E5B9ull);
    x ^= x >> 29;
    return (uint8_t)(x >> (8 * (i & 7)));
}

static inline void mt_fill(void *buf, size_t n, uint64_t seed)
{
    uint8_t *p = buf;
    size_t i = 0;
    /* word at a time: 256 MiB buffers are filled in a fraction of a second */
    for (; i + 8 <= n; i += 8) {
        uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^
                     ((uint64_t)(i >> 3) * 0xBF58476D1CE4E5B9ull);
        x ^= x >> 29;
        memcpy(p + i, &x, 8);
    }
    for (; i < n; i++)
        p[i] = mt_byte(seed, i);
}

/* Index of the first wrong byte, or -1 if all `n` match. */
static inline long long mt_verify(const void *buf, size_t n, uint64_t seed)
{
    const uint8_t *p = buf;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^
                     ((uint64_t)(i >> 3) * 0xBF58476D1CE4E5B9ull), y;
        x ^= x >> 29;
        memcpy(&y, p + i, 8);
        if (x != y)
            break;
    }
    for (; i < n; i++)
        if (p[i] != mt_byte(seed, i))
            return (long long)i;
    return -1;
}

static inline void *mt_alloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL, "out of memory for %zu bytes", n);
    return p;
}

/* Wall-clock guard for polling loops (MPI_Iprobe/MPI_Test): a message
   that never comes fails the test instead of hanging it. */
static inline int mt_expired(double start, double limit_s)
{
    return MPI_Wtime() - start > limit_s;
}

#endif
