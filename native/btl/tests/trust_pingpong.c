/*
 * Ping-pong with content checks for the BTL trust test
 * (tests/test_btl_trust.py): 2 ranks; rank 1 first waits (at most 60 s)
 * until the file GATE exists (GATE "-": no gate), which the hostile
 * co-tenant creates once it has filled its rings towards both ranks,
 * while rank 0 idles in a barrier (so its housekeeping looks at the
 * registry meanwhile). Then ITERS round trips of sizes from 0 B to 1 MiB,
 * eager and rendezvous; every byte is checked on both sides. With "test",
 * every receive is an MPI_Irecv completed by calling MPI_Test until it is
 * done: each call is one pass of the BTL's progress, its ivshm_recv_idle
 * look first. Prints "PASS trust_pingpong (N round trips)".
 * With $TRUST_PINGPONG_PROGRESS set, rank 0 writes the round trips done
 * there every PROGRESS_EVERY of them (a whole file, renamed into place):
 * the test tells a slow machine from a stalled job by it.
 *   trust_pingpong GATE ITERS [test]
 */
#include "trust_check.h"

#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void fill(unsigned char *b, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        b[i] = pattern(seed, i);
}

static void check(const unsigned char *b, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != pattern(seed, i))
            fail("payload mismatch at byte", (long)i, (long)seed);
}

/* Receive into buf (1 MiB) from peer with tag: blocking, or by polling
   MPI_Test. The byte count. */
static int recv_from(unsigned char *buf, int peer, int tag, int by_test)
{
    MPI_Status st;
    int got;
    if (by_test) {
        MPI_Request req;
        int done = 0;
        MPI_Irecv(buf, 1 << 20, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &req);
        while (!done)
            MPI_Test(&req, &done, &st);
    } else {
        MPI_Recv(buf, 1 << 20, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &st);
    }
    MPI_Get_count(&st, MPI_BYTE, &got);
    return got;
}

#define PROGRESS_EVERY 100

static void note_progress(const char *path, long done)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        fail("progress path too long", 0, 0);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%ld\n", done) < 0 || fclose(f) != 0 ||
        rename(tmp, path) != 0)
        fail("cannot write progress", done, 0);
}

static void wait_gate(const char *gate)
{
    struct timespec nap = {0, 10 * 1000 * 1000};
    for (int i = 0; i < 6000; i++) {
        if (access(gate, F_OK) == 0)
            return;
        nanosleep(&nap, NULL);
    }
    fail("gate never opened", 0, 0);
}

int main(int argc, char **argv)
{
    static const size_t sizes[] = {0, 1, 8, 100, 4000, 4097, 32768, 65537, 1 << 20};
    const size_t nsizes = sizeof sizes / sizeof sizes[0];
    int nranks;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if ((argc != 3 && (argc != 4 || strcmp(argv[3], "test") != 0)) ||
        nranks != 2)
        fail("usage: trust_pingpong GATE ITERS [test], 2 ranks", argc, nranks);
    long iters = strtol(argv[2], NULL, 10);
    const int by_test = argc == 4;
    if (rank == 1 && strcmp(argv[1], "-") != 0)
        wait_gate(argv[1]);
    MPI_Barrier(MPI_COMM_WORLD);

    unsigned char *buf = malloc(1 << 20);
    if (!buf)
        fail("malloc", 0, 0);
    int peer = rank ^ 1;
    const char *progress = rank == 0 ? getenv("TRUST_PINGPONG_PROGRESS") : NULL;
    for (long it = 0; it < iters; it++) {
        if (progress && it % PROGRESS_EVERY == 0)
            note_progress(progress, it);
        size_t n = sizes[it % nsizes];
        uint32_t ping = (uint32_t)(2 * it + 1), pong = (uint32_t)(2 * it + 2);
        int got;
        if (rank == 0) {
            fill(buf, n, ping);
            MPI_Send(buf, (int)n, MPI_BYTE, peer, 7, MPI_COMM_WORLD);
            got = recv_from(buf, peer, 8, by_test);
            if ((size_t)got != n)
                fail("pong length", got, (long)n);
            check(buf, n, pong);
        } else {
            got = recv_from(buf, peer, 7, by_test);
            if ((size_t)got != n)
                fail("ping length", got, (long)n);
            check(buf, n, ping);
            fill(buf, n, pong);
            MPI_Send(buf, (int)n, MPI_BYTE, peer, 8, MPI_COMM_WORLD);
        }
    }
    long mine = rank + 1, sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (sum != 3)
        fail("allreduce", sum, 3);
    free(buf);
    if (rank == 0)
        printf("PASS trust_pingpong (%ld round trips)\n", iters);
    MPI_Finalize();
    return 0;
}
