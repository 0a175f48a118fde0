/*
 * MPI smoke test for the ivshmem BTL: ping-pong (with latency), eager and
 * rendezvous sizes, a 64 MiB message, MPI_ANY_SOURCE, a non-contiguous
 * datatype, collectives and one-sided puts. Every check aborts the job on
 * failure; rank 0 prints "btl_smoke: OK" at the end.
 *   usage: btl_smoke [pingpong_iters] [big_mib] [--no-rma]
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "btl_smoke: rank %d: ", rank);                    \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, "\n");                                            \
            MPI_Abort(MPI_COMM_WORLD, 1);                                     \
        }                                                                     \
    } while (0)

static unsigned char pattern(size_t i, int seed)
{
    return (unsigned char)((i * 131u + (size_t)seed * 7u) >> 3);
}

static void pingpong(int iters)
{
    char buf[8] = {0};
    if (size < 2)
        return;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = 0;
    for (int i = -100; i < iters; i++) { /* 100 warm-up rounds */
        if (i == 0)
            t0 = MPI_Wtime();
        if (rank == 0) {
            memcpy(buf, &i, sizeof i);
            MPI_Send(buf, 8, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
            MPI_Recv(buf, 8, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            int back;
            memcpy(&back, buf, sizeof back);
            CHECK(back == i + 1, "pingpong: got %d, want %d", back, i + 1);
        } else if (rank == 1) {
            MPI_Recv(buf, 8, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            int v;
            memcpy(&v, buf, sizeof v);
            v++;
            memcpy(buf, &v, sizeof v);
            MPI_Send(buf, 8, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
        }
    }
    double t = MPI_Wtime() - t0;
    if (rank == 0 && iters > 0)
        printf("btl_smoke: 8-byte one-way latency %.3f us (%d round trips)\n",
               t / iters / 2 * 1e6, iters);
}

/* rank 0 -> rank 1 with a known pattern, several sizes across protocols */
static void sizes(size_t big)
{
    size_t lens[] = {0, 1, 100, 4000, 4100, 32000, 40000, 300000, 1 << 20, big};
    if (size < 2)
        return;
    unsigned char *buf = malloc(big ? big : 1);
    CHECK(buf, "malloc %zu", big);
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        size_t n = lens[k];
        if (n > big)
            continue;
        if (rank == 0) {
            for (size_t i = 0; i < n; i++)
                buf[i] = pattern(i, (int)k);
            MPI_Send(buf, (int)n, MPI_BYTE, 1, 10 + (int)k, MPI_COMM_WORLD);
        } else if (rank == 1) {
            memset(buf, 0, n);
            MPI_Status st;
            MPI_Recv(buf, (int)n, MPI_BYTE, 0, 10 + (int)k, MPI_COMM_WORLD, &st);
            int got;
            MPI_Get_count(&st, MPI_BYTE, &got);
            CHECK((size_t)got == n, "size %zu: received %d bytes", n, got);
            for (size_t i = 0; i < n; i++)
                CHECK(buf[i] == pattern(i, (int)k), "size %zu: byte %zu wrong", n, i);
        }
    }
    free(buf);
    if (rank == 0)
        printf("btl_smoke: sizes up to %zu bytes OK\n", big);
}

static void any_source(void)
{
    if (rank == 0) {
        int seen = 0;
        for (int i = 1; i < size; i++) {
            int v;
            MPI_Status st;
            MPI_Recv(&v, 1, MPI_INT, MPI_ANY_SOURCE, 7, MPI_COMM_WORLD, &st);
            CHECK(v == st.MPI_SOURCE * 1000, "any_source: %d from %d", v, st.MPI_SOURCE);
            seen++;
        }
        CHECK(seen == size - 1, "any_source: %d messages", seen);
    } else {
        int v = rank * 1000;
        MPI_Send(&v, 1, MPI_INT, 0, 7, MPI_COMM_WORLD);
    }
}

static void noncontig(void)
{
    enum { N = 5000 };
    if (size < 2)
        return;
    MPI_Datatype vec;
    MPI_Type_vector(N, 1, 3, MPI_DOUBLE, &vec); /* every third double */
    MPI_Type_commit(&vec);
    double *a = calloc(3 * N, sizeof *a);
    CHECK(a, "calloc");
    if (rank == 0) {
        for (int i = 0; i < 3 * N; i++)
            a[i] = i;
        MPI_Send(a, 1, vec, 1, 3, MPI_COMM_WORLD);
    } else if (rank == 1) {
        MPI_Recv(a, 1, vec, 0, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        for (int i = 0; i < 3 * N; i++)
            CHECK(a[i] == (i % 3 ? 0.0 : (double)i), "noncontig: a[%d] = %g", i, a[i]);
    }
    free(a);
    MPI_Type_free(&vec);
}

static void collectives(void)
{
    long sum = 0, mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    CHECK(sum == (long)size * (size + 1) / 2, "allreduce: %ld", sum);

    size_t n = 1 << 20;
    unsigned char *b = malloc(n);
    CHECK(b, "malloc");
    for (size_t i = 0; i < n; i++)
        b[i] = rank == 0 ? pattern(i, 99) : 0;
    MPI_Bcast(b, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD);
    for (size_t i = 0; i < n; i++)
        CHECK(b[i] == pattern(i, 99), "bcast: byte %zu", i);
    free(b);

    int *all = malloc(sizeof(int) * (size_t)size);
    CHECK(all, "malloc");
    MPI_Allgather(&rank, 1, MPI_INT, all, 1, MPI_INT, MPI_COMM_WORLD);
    for (int i = 0; i < size; i++)
        CHECK(all[i] == i, "allgather: [%d] = %d", i, all[i]);
    free(all);
    MPI_Barrier(MPI_COMM_WORLD);
}

static void rma(void)
{
    long *mem;
    MPI_Win win;
    MPI_Win_allocate(sizeof(long) * (MPI_Aint)size, sizeof(long), MPI_INFO_NULL,
                     MPI_COMM_WORLD, &mem, &win);
    for (int i = 0; i < size; i++)
        mem[i] = -1;
    MPI_Win_fence(0, win);
    long v = 100 + rank;
    for (int t = 0; t < size; t++)
        MPI_Put(&v, 1, MPI_LONG, t, rank, 1, MPI_LONG, win);
    MPI_Win_fence(0, win);
    for (int i = 0; i < size; i++)
        CHECK(mem[i] == 100 + i, "rma: mem[%d] = %ld", i, mem[i]);
    MPI_Win_fence(0, win);
    MPI_Win_free(&win);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int iters = argc > 1 ? atoi(argv[1]) : 1000;
    size_t big = (argc > 2 ? (size_t)atoi(argv[2]) : 64) << 20;
    int do_rma = !(argc > 3 && strcmp(argv[3], "--no-rma") == 0);

    pingpong(iters);
    sizes(big);
    any_source();
    noncontig();
    collectives();
    if (do_rma)
        rma();
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0)
        printf("btl_smoke: OK (%d ranks)\n", size);
    MPI_Finalize();
    return 0;
}
