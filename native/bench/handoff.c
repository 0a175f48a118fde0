/*
 * How fast two CPUs hand data to each other through shared memory, the
 * way the BTL's large fragments go: a producer copies 16 KiB blocks from
 * private memory into the slots of a shared ring (slot stride and data
 * offset as in an `ivcloud mpirun` region), a consumer on the other CPU
 * copies each one out into private memory and frees the slot. No MPI,
 * no libivshm: a reference for what the machine gives at that moment.
 *
 * Every second for --seconds, two measurements one after the other:
 *   memcpy  the producer copies with memcpy (what ob1's pack does), so
 *           the consumer reads lines that are dirty in the producer's
 *           cache;
 *   stream  the producer writes with non-temporal stores, so the lines
 *           go to memory and the consumer reads them from there.
 * One JSON line per second on stdout:
 *   {"t_s":..,"memcpy_GBs":..,"stream_GBs":..}
 * On the project's VMs the memcpy handoff drops from up to 27 GB/s to
 * 2-4 for seconds at a time while the stream one stays at 9-20, median
 * 16 (BENCHMARKS.md, `handoff`): that state, not the BTL, is what
 * makes HPCC's ring bandwidth over ivshmem bimodal.
 *
 *   handoff [--seconds N] [--cpus A,B] [--blocks N]
 *
 * Bad arguments: one line on stderr, exit 2. Every wait is bounded (an
 * alarm ends a stuck run) and the consumer dies with the producer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define BLOCK 16384u
#define SLOTS 64u
#define STRIDE 16448u     /* a 16 KiB + 64 B slot, as in MPI regions */
#define DATA_OFF 160u     /* ring control (128 B) + slot header (32 B) */
#define SOURCE_BLOCKS 128 /* private buffers of 2 MiB, as HPCC's */

struct shared {
    _Atomic uint64_t head __attribute__((aligned(64)));
    _Atomic uint64_t tail __attribute__((aligned(64)));
    _Atomic int ready __attribute__((aligned(64)));
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        perror("handoff: sched_setaffinity");
        _exit(1);
    }
}

/* Non-temporal copy; dst is 16-byte aligned (DATA_OFF). The fence makes
   the stores visible before the slot is published. */
static void copy_stream(unsigned char *dst, const unsigned char *src, size_t n)
{
#if defined(__SSE2__)
    for (size_t i = 0; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();
#else
    memcpy(dst, src, n); /* no streaming stores here: same as memcpy */
#endif
}

static void consume(struct shared *sh, unsigned char *ring, long blocks)
{
    unsigned char *buf = malloc((size_t)SOURCE_BLOCKS * BLOCK);
    if (!buf)
        _exit(1);
    memset(buf, 1, (size_t)SOURCE_BLOCKS * BLOCK); /* faulted in first */
    atomic_store(&sh->ready, 1);
    for (long i = 0; i < blocks; i++) {
        while (atomic_load_explicit(&sh->head, memory_order_acquire) <=
               (uint64_t)i)
            ;
        memcpy(buf + (size_t)(i % SOURCE_BLOCKS) * BLOCK,
               ring + (size_t)(i % SLOTS) * STRIDE + DATA_OFF, BLOCK);
        atomic_store_explicit(&sh->tail, (uint64_t)i + 1, memory_order_release);
    }
    _exit(0);
}

/* One measurement: GB/s through the ring for `blocks` blocks. */
static double measure(struct shared *sh, unsigned char *ring,
                      const unsigned char *src, long blocks, int stream,
                      int cpu_a, int cpu_b)
{
    atomic_store(&sh->head, 0);
    atomic_store(&sh->tail, 0);
    atomic_store(&sh->ready, 0);
    pid_t child = fork();
    if (child < 0) {
        perror("handoff: fork");
        exit(1);
    }
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        pin(cpu_b);
        consume(sh, ring, blocks);
    }
    while (!atomic_load(&sh->ready))
        ;
    double t0 = now_s();
    for (long i = 0; i < blocks; i++) {
        while ((uint64_t)i - atomic_load_explicit(&sh->tail,
                                                  memory_order_acquire) >= SLOTS)
            ;
        unsigned char *slot = ring + (size_t)(i % SLOTS) * STRIDE + DATA_OFF;
        const unsigned char *from = src + (size_t)(i % SOURCE_BLOCKS) * BLOCK;
        if (stream)
            copy_stream(slot, from, BLOCK);
        else
            memcpy(slot, from, BLOCK);
        atomic_store_explicit(&sh->head, (uint64_t)i + 1, memory_order_release);
    }
    int status;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
        fprintf(stderr, "handoff: the consumer failed\n");
        exit(1);
    }
    return (double)blocks * BLOCK / (now_s() - t0) / 1e9;
}

static int usage(const char *why)
{
    fprintf(stderr, "handoff: %s (usage: handoff [--seconds N] [--cpus A,B] "
                    "[--blocks N])\n", why);
    return 2;
}

int main(int argc, char **argv)
{
    long seconds = 60, blocks = 8192;
    int cpu_a = 0, cpu_b = 1;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc)
            return usage("an option lacks its value");
        char *end;
        if (!strcmp(argv[i], "--seconds")) {
            seconds = strtol(argv[i + 1], &end, 10);
            if (*end || seconds < 1 || seconds > 86400)
                return usage("--seconds takes 1..86400");
        } else if (!strcmp(argv[i], "--blocks")) {
            blocks = strtol(argv[i + 1], &end, 10);
            if (*end || blocks < 1 || blocks > 10000000)
                return usage("--blocks takes 1..10000000");
        } else if (!strcmp(argv[i], "--cpus")) {
            if (sscanf(argv[i + 1], "%d,%d", &cpu_a, &cpu_b) != 2 ||
                cpu_a < 0 || cpu_b < 0 || cpu_a == cpu_b ||
                cpu_a >= CPU_SETSIZE || cpu_b >= CPU_SETSIZE)
                return usage("--cpus takes two different CPU numbers A,B");
        } else {
            return usage("unknown option");
        }
    }
    /* a stuck consumer (a CPU taken away) must not hang the run */
    alarm((unsigned)(seconds * 3 + 60));
    size_t ring_bytes = (size_t)SLOTS * STRIDE + DATA_OFF;
    void *shm = mmap(NULL, sizeof(struct shared) + ring_bytes,
                     PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    unsigned char *src = malloc((size_t)SOURCE_BLOCKS * BLOCK);
    if (shm == MAP_FAILED || !src) {
        perror("handoff: memory");
        return 1;
    }
    struct shared *sh = shm;
    unsigned char *ring = (unsigned char *)shm + sizeof(struct shared);
    memset(ring, 0, ring_bytes);
    memset(src, 7, (size_t)SOURCE_BLOCKS * BLOCK);
    pin(cpu_a);
    double start = now_s();
    for (long s = 0; s < seconds; s++) {
        double t = now_s() - start;
        double plain = measure(sh, ring, src, blocks, 0, cpu_a, cpu_b);
        double stream = measure(sh, ring, src, blocks, 1, cpu_a, cpu_b);
        printf("{\"t_s\":%.1f,\"memcpy_GBs\":%.2f,\"stream_GBs\":%.2f}\n", t,
               plain, stream);
        fflush(stdout);
        double next = start + (double)(s + 1);
        while (now_s() < next)
            usleep(10000);
    }
    return 0;
}
