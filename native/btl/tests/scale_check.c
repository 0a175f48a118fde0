/*
 * Correctness with many ranks in one region (tests/test_mpi_scale.py):
 * bounded work per rank, so 128 oversubscribed ranks on two cores end in
 * well under a minute, but every path the region layout has for many
 * peers is crossed:
 *   - a ring of sendrecvs at eager and rendezvous sizes (every rank
 *     sends to a new peer: its messages go through the receiver's queue,
 *     shared by all senders);
 *   - fan-in with MPI_ANY_SOURCE: every rank sends FAN messages to one
 *     root, which checks each sender's order and payload (many senders
 *     per receiver at once; the busiest take fast channels);
 *   - collectives: barrier, bcast / reduce from three roots, allreduce,
 *     allgather, alltoall (every pair), gather / scatter.
 * Every value is checked. Prints "PASS scale_check N ranks".
 *   scale_check [ROUNDS]
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAN 6          /* messages each rank sends to a fan-in root */
#define FAN_BYTES 200  /* payload of one (eager) */
#define TAG_RING 21
#define TAG_FAN 22

static int rank, nranks;

static void fail(const char *what, long a, long b)
{
    fprintf(stderr, "FAIL rank %d: %s (%ld, %ld)\n", rank, what, a, b);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

#define OK(call)                                                            \
    do {                                                                    \
        int rc_ = (call);                                                   \
        if (rc_ != MPI_SUCCESS)                                             \
            fail(#call, rc_, __LINE__);                                     \
    } while (0)

static unsigned char byte_of(uint32_t from, uint32_t seq, size_t i)
{
    uint32_t x = (from + 1) * 2654435761u ^ (seq * 40503u + (uint32_t)i);
    return (unsigned char)(x ^ (x >> 11));
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        fail("malloc", (long)n, 0);
    return p;
}

static void ring(int round)
{
    static const size_t sizes[] = {8, 4000, 70000};
    int to = (rank + 1 + round) % nranks, from = (rank - 1 - round) % nranks;
    if (from < 0)
        from += nranks;
    unsigned char *out = xmalloc(70000), *in = xmalloc(70000);
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        size_t n = sizes[k];
        for (size_t i = 0; i < n; i++)
            out[i] = byte_of((uint32_t)rank, (uint32_t)k, i);
        MPI_Status st;
        OK(MPI_Sendrecv(out, (int)n, MPI_BYTE, to, TAG_RING, in, (int)n,
                        MPI_BYTE, from, TAG_RING, MPI_COMM_WORLD, &st));
        for (size_t i = 0; i < n; i++)
            if (in[i] != byte_of((uint32_t)from, (uint32_t)k, i))
                fail("ring payload", (long)k, (long)i);
    }
    free(out);
    free(in);
}

/* Everybody but `root` sends FAN messages to it; it takes them with
   MPI_ANY_SOURCE and checks that each sender's arrive in order. */
static void fan_in(int root)
{
    unsigned char buf[FAN_BYTES];
    if (rank != root) {
        for (uint32_t seq = 0; seq < FAN; seq++) {
            for (size_t i = 0; i < FAN_BYTES; i++)
                buf[i] = byte_of((uint32_t)rank, seq, i);
            OK(MPI_Send(buf, FAN_BYTES, MPI_BYTE, root, TAG_FAN,
                        MPI_COMM_WORLD));
        }
        return;
    }
    int *next = calloc((size_t)nranks, sizeof *next);
    if (!next)
        fail("calloc", nranks, 0);
    for (long got = 0; got < (long)(nranks - 1) * FAN; got++) {
        MPI_Status st;
        int count = -1;
        OK(MPI_Recv(buf, FAN_BYTES, MPI_BYTE, MPI_ANY_SOURCE, TAG_FAN,
                    MPI_COMM_WORLD, &st));
        OK(MPI_Get_count(&st, MPI_BYTE, &count));
        int src = st.MPI_SOURCE;
        if (src < 0 || src >= nranks || src == root || count != FAN_BYTES)
            fail("fan-in source/count", src, count);
        uint32_t seq = (uint32_t)next[src]++;
        if (seq >= FAN)
            fail("fan-in: too many from", src, (long)seq);
        for (size_t i = 0; i < FAN_BYTES; i++)
            if (buf[i] != byte_of((uint32_t)src, seq, i))
                fail("fan-in payload/order from", src, (long)seq);
    }
    free(next);
}

static long val(int r, int i)
{
    return (long)(r + 1) * 1000 + i % 977;
}

static void collectives(void)
{
    OK(MPI_Barrier(MPI_COMM_WORLD));
    const int roots[3] = {0, nranks / 2, nranks - 1};
    const int counts[2] = {1, 20000};
    long *buf = xmalloc(20000 * sizeof *buf), *res = xmalloc(20000 * sizeof *res);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 2; c++) {
            int root = roots[r], n = counts[c];
            for (int i = 0; i < n; i++)
                buf[i] = rank == root ? val(root, i) : -1;
            OK(MPI_Bcast(buf, n, MPI_LONG, root, MPI_COMM_WORLD));
            for (int i = 0; i < n; i++)
                if (buf[i] != val(root, i))
                    fail("bcast", root, i);
            for (int i = 0; i < n; i++)
                buf[i] = val(rank, i);
            OK(MPI_Reduce(buf, res, n, MPI_LONG, MPI_SUM, root, MPI_COMM_WORLD));
            if (rank == root)
                for (int i = 0; i < n; i++) {
                    long want = 0;
                    for (int q = 0; q < nranks; q++)
                        want += val(q, i);
                    if (res[i] != want)
                        fail("reduce", root, i);
                }
        }
    for (int c = 0; c < 2; c++) {
        int n = counts[c];
        for (int i = 0; i < n; i++)
            buf[i] = val(rank, i);
        OK(MPI_Allreduce(buf, res, n, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
        for (int i = 0; i < n; i++) {
            long want = 0;
            for (int q = 0; q < nranks; q++)
                want += val(q, i);
            if (res[i] != want)
                fail("allreduce", n, i);
        }
    }
    free(buf);
    free(res);

    /* every pair: allgather, alltoall; gather/scatter through rank 0 */
    const int per = 4;
    long *mine = xmalloc((size_t)nranks * per * sizeof *mine);
    long *all = xmalloc((size_t)nranks * per * sizeof *all);
    for (int i = 0; i < per; i++)
        mine[i] = val(rank, i);
    OK(MPI_Allgather(mine, per, MPI_LONG, all, per, MPI_LONG, MPI_COMM_WORLD));
    for (int q = 0; q < nranks; q++)
        for (int i = 0; i < per; i++)
            if (all[q * per + i] != val(q, i))
                fail("allgather", q, i);
    for (int q = 0; q < nranks; q++)
        for (int i = 0; i < per; i++)
            mine[q * per + i] = val(rank, q * per + i);
    OK(MPI_Alltoall(mine, per, MPI_LONG, all, per, MPI_LONG, MPI_COMM_WORLD));
    for (int q = 0; q < nranks; q++)
        for (int i = 0; i < per; i++)
            if (all[q * per + i] != val(q, rank * per + i))
                fail("alltoall", q, i);
    OK(MPI_Gather(mine, per, MPI_LONG, all, per, MPI_LONG, 0, MPI_COMM_WORLD));
    if (rank == 0)
        for (int q = 0; q < nranks; q++)
            for (int i = 0; i < per; i++)
                if (all[q * per + i] != val(q, i))
                    fail("gather", q, i);
    if (rank == 0)
        for (int q = 0; q < nranks; q++)
            for (int i = 0; i < per; i++)
                all[q * per + i] = val(q, 100 + i);
    OK(MPI_Scatter(all, per, MPI_LONG, mine, per, MPI_LONG, 0, MPI_COMM_WORLD));
    for (int i = 0; i < per; i++)
        if (mine[i] != val(rank, 100 + i))
            fail("scatter", rank, i);
    free(mine);
    free(all);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    int rounds = argc > 1 ? atoi(argv[1]) : 1;
    if (nranks < 2 || rounds < 1)
        fail("needs 2+ ranks and ROUNDS >= 1", nranks, rounds);
    for (int r = 0; r < rounds; r++) {
        ring(r);
        fan_in(0);
        fan_in(nranks - 1);
        fan_in(nranks / 2);
        collectives();
    }
    OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) {
        printf("PASS scale_check %d ranks\n", nranks);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
