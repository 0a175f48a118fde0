/*
 * What an MPI needs of the provider, checked: point-to-point with
 * MPI_ANY_SOURCE (small and 1 MiB), a collective, and one-sided put, get
 * and accumulate under fence and passive-target epochs. Prints one line
 * "mpi_check: OK <size>" on rank 0 when every check held; exits 1
 * otherwise. Run under each MPI with the provider forced
 * (tests/test_fi_provider.py, docs/provider.md).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) {                                                           \
            fprintf(stderr, "mpi_check: rank %d: %s:%d: %s\n", rank,          \
                    __FILE__, __LINE__, #c);                                  \
            failures++;                                                       \
        }                                                                     \
    } while (0)

int main(int argc, char **argv)
{
    int rank, size;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    /* every rank sends to 0; 0 takes them in any order */
    int v = 1000 + rank;
    if (rank == 0) {
        int seen = 0;
        for (int i = 1; i < size; i++) {
            int got;
            MPI_Status st;
            MPI_Recv(&got, 1, MPI_INT, MPI_ANY_SOURCE, 5, MPI_COMM_WORLD, &st);
            CHECK(got == 1000 + st.MPI_SOURCE);
            seen |= 1 << st.MPI_SOURCE;
        }
        CHECK(seen == ((1 << size) - 2));
    } else {
        MPI_Send(&v, 1, MPI_INT, 0, 5, MPI_COMM_WORLD);
    }

    /* 1 MiB around the ring */
    const int n = 1 << 18;
    int *out = malloc(n * sizeof *out), *in = malloc(n * sizeof *in);
    for (int i = 0; i < n; i++)
        out[i] = rank * 7 + i;
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    MPI_Sendrecv(out, n, MPI_INT, next, 6, in, n, MPI_INT, MPI_ANY_SOURCE, 6,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    int bad = 0;
    for (int i = 0; i < n; i++)
        bad += in[i] != prev * 7 + i;
    CHECK(bad == 0);

    /* a collective */
    long sum = 0, mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    CHECK(sum == (long)size * (size + 1) / 2);
    double big[1024], bigsum[1024];
    for (int i = 0; i < 1024; i++)
        big[i] = rank + i;
    MPI_Allreduce(big, bigsum, 1024, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    CHECK(bigsum[3] == (double)size * 3 + (double)size * (size - 1) / 2);

    /* one-sided */
    long *base;
    MPI_Win win;
    MPI_Win_allocate(64 * sizeof(long), sizeof(long), MPI_INFO_NULL,
                     MPI_COMM_WORLD, &base, &win);
    for (int i = 0; i < 64; i++)
        base[i] = 0;
    MPI_Win_fence(0, win);
    long val = 100 + rank;
    MPI_Put(&val, 1, MPI_LONG, next, rank, 1, MPI_LONG, win);
    long one = 1;
    MPI_Accumulate(&one, 1, MPI_LONG, 0, 63, 1, MPI_LONG, MPI_SUM, win);
    MPI_Win_fence(0, win);
    CHECK(base[prev] == 100 + prev);
    if (rank == 0)
        CHECK(base[63] == size);
    long got = -1;
    MPI_Get(&got, 1, MPI_LONG, next, rank, 1, MPI_LONG, win);
    MPI_Win_fence(0, win);
    CHECK(got == 100 + rank);
    /* passive target: everyone adds to rank 0's word 62, then reads it */
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    long old = 0;
    MPI_Fetch_and_op(&one, &old, MPI_LONG, 0, 62, MPI_SUM, win);
    MPI_Win_unlock(0, win);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    long total = -1;
    MPI_Get(&total, 1, MPI_LONG, 0, 62, 1, MPI_LONG, win);
    MPI_Win_unlock(0, win);
    CHECK(total == size);
    MPI_Win_free(&win);

    int all = 0;
    MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0 && all == 0)
        printf("mpi_check: OK %d\n", size);
    free(out);
    free(in);
    MPI_Finalize();
    return all ? 1 : 0;
}
