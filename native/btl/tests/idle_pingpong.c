/*
 * Ping-pong driven by MPI_Test polling loops, for the BTL test with a
 * co-tenant scribbling ring heads (tests/test_btl_trust.py): every
 * receive is an MPI_Irecv completed by calling MPI_Test until it is
 * done, so each call goes through the BTL's progress and its
 * ivshm_recv_idle look first. 2 ranks, ITERS round trips of sizes from
 * 0 B to 64 KiB (eager and rendezvous), every byte checked. Prints
 * "PASS idle_pingpong (N round trips, M tests)".
 *   idle_pingpong ITERS
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int rank;

static void fail(const char *what, long a, long b)
{
    fprintf(stderr, "FAIL rank %d: %s (%ld, %ld)\n", rank, what, a, b);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

static unsigned char pattern(uint32_t seed, size_t i)
{
    uint32_t x = seed * 2246822519u + (uint32_t)i * 3266489917u;
    return (unsigned char)(x ^ (x >> 15));
}

static long tests;

/* Receive n bytes from peer with tag by polling MPI_Test, then check. */
static void poll_recv(unsigned char *buf, size_t n, int peer, int tag,
                      uint32_t seed)
{
    MPI_Request req;
    MPI_Status st;
    int done = 0, got;
    MPI_Irecv(buf, 1 << 16, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &req);
    while (!done) {
        MPI_Test(&req, &done, &st);
        tests++;
    }
    MPI_Get_count(&st, MPI_BYTE, &got);
    if ((size_t)got != n)
        fail("length", got, (long)n);
    for (size_t i = 0; i < n; i++)
        if (buf[i] != pattern(seed, i))
            fail("payload mismatch at byte", (long)i, (long)seed);
}

int main(int argc, char **argv)
{
    static const size_t sizes[] = {0, 8, 100, 4000, 4097, 32768, 65536};
    const size_t nsizes = sizeof sizes / sizeof sizes[0];
    int nranks;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (argc != 2 || nranks != 2)
        fail("usage: idle_pingpong ITERS, 2 ranks", argc, nranks);
    long iters = strtol(argv[1], NULL, 10);
    unsigned char *buf = malloc(1 << 16);
    if (!buf)
        fail("malloc", 0, 0);
    int peer = rank ^ 1;
    for (long it = 0; it < iters; it++) {
        size_t n = sizes[it % nsizes];
        uint32_t ping = (uint32_t)(2 * it + 1), pong = (uint32_t)(2 * it + 2);
        if (rank == 0) {
            for (size_t i = 0; i < n; i++)
                buf[i] = pattern(ping, i);
            MPI_Send(buf, (int)n, MPI_BYTE, peer, 7, MPI_COMM_WORLD);
            poll_recv(buf, n, peer, 8, pong);
        } else {
            poll_recv(buf, n, peer, 7, ping);
            for (size_t i = 0; i < n; i++)
                buf[i] = pattern(pong, i);
            MPI_Send(buf, (int)n, MPI_BYTE, peer, 8, MPI_COMM_WORLD);
        }
    }
    long all = 0;
    MPI_Reduce(&tests, &all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    free(buf);
    if (rank == 0)
        printf("PASS idle_pingpong (%ld round trips, %ld tests)\n", iters, all);
    MPI_Finalize();
    return 0;
}
