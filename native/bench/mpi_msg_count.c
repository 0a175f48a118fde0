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
 *   mpi-msg-count pingpong ROUNDS WORDS
 *       osu latency's shape ("The ping-pong, counted"): rank 0 MPI_Send
 *       of 8 B then MPI_Recv, rank 1 MPI_Recv then MPI_Send, ROUNDS round
 *       trips after WARM uncounted ones. Each rank posts its receive only
 *       once the peer has said, in the file WORDS (two zeroed longs, shared),
 *       that the message is sent, waiting for that uncounted: a receive
 *       is its post and the poll that finds the message (the caller counts
 *       the polls, and takes out any that found nothing).
 *   mpi-msg-count wait MS
 *       after the same warm-up, rank 1 waits in one MPI_Recv while rank 0
 *       sleeps MS ms before sending (counted alone): the cost of one empty
 *       poll of a blocking receive, the wait's count over its polls.
 *   Both under callgrind --collect-atstart=yes: what they count is a dump
 *   of its own (FILE.PID.2), between two CALLGRIND_DUMP_STATS.
 *
 * Each rank prints one line: pid, rank, then windows and misses, rounds,
 * idle or wait.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_TOGGLE_COLLECT
#define CALLGRIND_DUMP_STATS
#endif

#define W 64
/* Round trips before anything is counted: btl sm sets up its fast box
 * to a peer after its 16th message, and an empty poll then looks at it. */
#define WARM 100

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

static void round_trips(int rank, long n)
{
    char out[8] = {0}, in[8];
    int peer = 1 - rank;
    for (long i = 0; i < n; i++) {
        if (rank == 0) {
            MPI_Send(out, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
            MPI_Recv(in, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        } else if (rank == 1) {
            MPI_Recv(in, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(out, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
        }
    }
}

/* Waits, uncounted, until the peer says its message i is sent: an 8 B
 * MPI_Send has returned once the message lies in this rank's ring (or
 * fast box), so the receive then posted finds it at its first poll,
 * the path of a receive posted before its message comes. */
static void await_sent(volatile long *word, long i)
{
    CALLGRIND_TOGGLE_COLLECT;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < i)
        usleep(20);
    CALLGRIND_TOGGLE_COLLECT;
}

static void pingpong(int rank, long n, const char *path)
{
    char out[8] = {0}, in[8];
    int peer = 1 - rank;
    int fd = open(path, O_RDWR);
    long *words = fd < 0 ? MAP_FAILED
                         : mmap(NULL, 2 * sizeof(long), PROT_READ | PROT_WRITE,
                                MAP_SHARED, fd, 0);
    if (words == MAP_FAILED) {
        perror(path);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    round_trips(rank, WARM);
    MPI_Barrier(MPI_COMM_WORLD);
    /* Run with collection on from the start (callgrind counts calls
     * while it collects nothing, and only a dump of what it collected
     * zeroes them): the loop is a dump of its own, FILE.PID.2 */
    CALLGRIND_DUMP_STATS;
    for (long i = 1; i <= n; i++) {
        if (rank == 0) {
            MPI_Send(out, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
            __atomic_store_n(&words[0], i, __ATOMIC_RELEASE);
            await_sent(&words[1], i);
            MPI_Recv(in, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        } else if (rank == 1) {
            await_sent(&words[0], i);
            MPI_Recv(in, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(out, 8, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
            __atomic_store_n(&words[1], i, __ATOMIC_RELEASE);
        }
    }
    CALLGRIND_DUMP_STATS;
    munmap(words, 2 * sizeof(long));
    close(fd);
    printf("mpi-msg-count: pid %d rank %d rounds %ld\n", (int)getpid(), rank,
           n);
}

static void wait_one(int rank, long ms)
{
    char buf[8] = {0};
    round_trips(rank, WARM);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) {
        CALLGRIND_DUMP_STATS;
        MPI_Recv(buf, 8, MPI_CHAR, 0, 997, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        CALLGRIND_DUMP_STATS;
    } else if (rank == 0) {
        usleep((useconds_t)(ms * 1000));
        MPI_Send(buf, 8, MPI_CHAR, 1, 997, MPI_COMM_WORLD);
    }
    printf("mpi-msg-count: pid %d rank %d wait %ld\n", (int)getpid(), rank,
           ms);
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
    const char *mode = argc >= 2 && (!strcmp(argv[1], "idle") ||
                                      !strcmp(argv[1], "wait") ||
                                      !strcmp(argv[1], "pingpong"))
                           ? argv[1] : "windows";
    int named = strcmp(mode, "windows") != 0;
    int paced = !strcmp(mode, "windows");
    int pp = !strcmp(mode, "pingpong");
    long a = argc >= 2 + named ? arg(argv[1 + named]) : -1;
    long pace = paced && argc == 3 + named ? arg(argv[2 + named]) : 0;
    if (size != 2 || argc < 2 + named + pp ||
        argc > 2 + named + paced + pp || a < 1 || pace < 0) {
        if (rank == 0)
            fprintf(stderr, "usage: mpi-msg-count WINDOWS [PACE_US] | "
                            "mpi-msg-count idle TESTS | "
                            "mpi-msg-count pingpong ROUNDS WORDS | "
                            "mpi-msg-count wait MS, on 2 ranks\n");
        MPI_Finalize();
        return 2;
    }
    if (!strcmp(mode, "idle")) {
        idle(rank, a);
    } else if (!strcmp(mode, "wait")) {
        wait_one(rank, a);
    } else if (!strcmp(mode, "pingpong")) {
        pingpong(rank, a, argv[3]);
    } else {
        long misses = windows(rank, a, pace);
        printf("mpi-msg-count: pid %d rank %d windows %ld misses %ld\n",
               (int)getpid(), rank, a, misses);
    }
    MPI_Finalize();
    return 0;
}
