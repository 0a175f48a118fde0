/*
 * What one 8-byte message costs an MPI, counted (docs/fast-path.md,
 * "Open MPI 5 over the provider, counted"): two ranks in osu bw's shape,
 * rank 0 sending windows of 64 MPI_Isend + MPI_Waitall, rank 1 posting
 * 64 MPI_Irecv, then a 0-byte "go" to rank 0 (so every message finds its
 * receive posted), then completing the window. Under callgrind
 * (--collect-atstart=no) only the loop is counted.
 *
 *   mpi-msg-count WINDOWS [PACE_US]
 *       PACE_US 0 (default): rank 1 waits in MPI_Waitall, rank 0 in
 *       MPI_Wait, spinning as osu does. PACE_US > 0: each rank sleeps
 *       PACE_US between MPI_Test{,all} calls and counts the calls that
 *       found its requests not done ("misses"), so that their cost can
 *       be taken out of the count.
 *   mpi-msg-count idle TESTS
 *       rank 1 calls MPI_Test TESTS times on a receive nothing matches
 *       (counted alone): the cost of one miss.
 *   mpi-msg-count pingpong ROUNDS PACE_US RANK
 *       osu latency's shape: blocking MPI_Send and MPI_Recv of 8 bytes,
 *       ROUNDS round trips. Rank RANK sleeps PACE_US before each
 *       MPI_Recv, so that its message is there when it starts waiting
 *       (the other rank spins meanwhile); the polls that still find
 *       nothing are counted from opal_progress's calls by the caller.
 *
 * Each rank prints one line: pid, rank, windows, misses (or the mode).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_TOGGLE_COLLECT
#define CALLGRIND_ZERO_STATS
#define CALLGRIND_DUMP_STATS
#endif

/* The latency shape counts polls by calls: from a dump of the loop
   alone, zeroed before it (part 1 of the output), so that no call made
   outside it (MPI_Finalize's waits) can be among them. */
#define COUNT_BEGIN                                                           \
    do {                                                                      \
        CALLGRIND_TOGGLE_COLLECT;                                             \
        CALLGRIND_ZERO_STATS;                                                 \
    } while (0)
#define COUNT_END                                                             \
    do {                                                                      \
        CALLGRIND_DUMP_STATS;                                                 \
        CALLGRIND_TOGGLE_COLLECT;                                             \
    } while (0)

#define W 64

static long arg(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    return *s && !*end && v >= 0 ? v : -1;
}

static void idle(int rank, long tests)
{
    char buf[2][8] = {{0}};
    MPI_Request rq;
    int flag;
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) {
        MPI_Irecv(buf[0], 8, MPI_CHAR, 0, 999, MPI_COMM_WORLD, &rq);
        CALLGRIND_TOGGLE_COLLECT;
        for (long i = 0; i < tests; i++)
            MPI_Test(&rq, &flag, MPI_STATUS_IGNORE);
        CALLGRIND_TOGGLE_COLLECT;
        MPI_Send(buf[1], 0, MPI_CHAR, 0, 998, MPI_COMM_WORLD);
        MPI_Wait(&rq, MPI_STATUS_IGNORE);
    } else if (rank == 0) {
        MPI_Recv(buf[1], 0, MPI_CHAR, 1, 998, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
        MPI_Send(buf[0], 8, MPI_CHAR, 1, 999, MPI_COMM_WORLD);
    }
    printf("mpi-msg-count: pid %d rank %d idle %ld\n", (int)getpid(), rank,
           tests);
}

static void pingpong(int rank, long n, long pace, long sleeper)
{
    char buf[8] = {0};
    int peer = 1 - rank;
    /* a few first (not counted): the lazy binding of what the loop calls */
    for (long i = -16; i < n; i++) {
        if (i == 0) {
            MPI_Barrier(MPI_COMM_WORLD);
            COUNT_BEGIN;
        }
        if (rank == 0)
            MPI_Send(buf, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
        if (pace && rank == sleeper)
            usleep((useconds_t)pace);
        MPI_Recv(buf, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (rank == 1)
            MPI_Send(buf, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
    }
    COUNT_END;
    printf("mpi-msg-count: pid %d rank %d pingpong %ld\n", (int)getpid(),
           rank, n);
}

static long windows(int rank, long n, long pace)
{
    static char buf[W][8];
    MPI_Request rq[W];
    int flag;
    long misses = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    CALLGRIND_TOGGLE_COLLECT;
    for (long i = 0; i < n; i++) {
        if (rank == 0) {
            MPI_Request go;
            MPI_Irecv(NULL, 0, MPI_CHAR, 1, 101, MPI_COMM_WORLD, &go);
            if (pace) {
                for (;;) {
                    MPI_Test(&go, &flag, MPI_STATUS_IGNORE);
                    if (flag)
                        break;
                    misses++;
                    usleep((useconds_t)pace);
                }
            } else {
                MPI_Wait(&go, MPI_STATUS_IGNORE);
            }
            for (int w = 0; w < W; w++)
                MPI_Isend(buf[w], 8, MPI_CHAR, 1, 100, MPI_COMM_WORLD, &rq[w]);
            MPI_Waitall(W, rq, MPI_STATUSES_IGNORE);
        } else if (rank == 1) {
            for (int w = 0; w < W; w++)
                MPI_Irecv(buf[w], 8, MPI_CHAR, 0, 100, MPI_COMM_WORLD, &rq[w]);
            MPI_Send(NULL, 0, MPI_CHAR, 0, 101, MPI_COMM_WORLD);
            if (pace) {
                for (;;) {
                    usleep((useconds_t)pace);
                    MPI_Testall(W, rq, &flag, MPI_STATUSES_IGNORE);
                    if (flag)
                        break;
                    misses++;
                }
            } else {
                MPI_Waitall(W, rq, MPI_STATUSES_IGNORE);
            }
        }
    }
    CALLGRIND_TOGGLE_COLLECT;
    return misses;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int is_idle = argc == 3 && !strcmp(argv[1], "idle");
    int is_pp = argc == 5 && !strcmp(argv[1], "pingpong");
    int named = is_idle || is_pp;
    long a = argc >= 2 ? arg(argv[named ? 2 : 1]) : -1;
    long pace = is_pp ? arg(argv[3]) : !named && argc == 3 ? arg(argv[2]) : 0;
    long sleeper = is_pp ? arg(argv[4]) : 0;
    if (size != 2 || argc < 2 || argc > 5 || (argc > 3 && !is_pp) || a < 1 ||
        pace < 0 || sleeper < 0 || sleeper > 1) {
        if (rank == 0)
            fprintf(stderr, "usage: mpi-msg-count WINDOWS [PACE_US] | "
                            "mpi-msg-count idle TESTS | mpi-msg-count "
                            "pingpong ROUNDS PACE_US RANK, on 2 ranks\n");
        MPI_Finalize();
        return 2;
    }
    if (is_idle) {
        idle(rank, a);
    } else if (is_pp) {
        pingpong(rank, a, pace, sleeper);
    } else {
        long misses = windows(rank, a, pace);
        printf("mpi-msg-count: pid %d rank %d windows %ld misses %ld\n",
               (int)getpid(), rank, a, misses);
    }
    MPI_Finalize();
    return 0;
}
