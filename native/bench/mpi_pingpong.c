/*
 * MPI ping-pong reference for `ivcloud bench p2p`: run with two ranks, e.g.
 *   mpirun -np 2 --mca pml ob1 --mca btl self,vader mpi-pingpong --sizes 8,64
 * Rank 0 prints one JSON line per size, in the same shape as
 * ivshm-pingpong (one-way latency = half a round trip).
 */
#include <mpi.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SIZES 64
#define NBATCH 5

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_sizes(const char *s, size_t *sizes, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (end == s || errno)
            return -1;
        if (*end == 'k' || *end == 'K')
            v <<= 10, end++;
        else if (*end == 'm' || *end == 'M')
            v <<= 20, end++;
        if (v == 0 || v > (64ull << 20) || *n == MAX_SIZES)
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

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    size_t sizes[MAX_SIZES];
    int nsizes = 0;
    long iters = 10000;
    uint64_t budget = 256u << 20;
    const char *transport = "mpi-vader", *mode = "vader";
    parse_sizes("8,64,512,4096,32768,262144,1048576,4194304", sizes, &nsizes);
    int bad = nranks != 2;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            bad = 1;
        else if (!strcmp(a, "--sizes"))
            bad |= parse_sizes(v, sizes, &nsizes) < 0;
        else if (!strcmp(a, "--iters"))
            iters = atol(v);
        else if (!strcmp(a, "--budget"))
            budget = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--transport"))
            transport = v;
        else if (!strcmp(a, "--mode"))
            mode = v;
        else
            bad = 1;
    }
    if (bad || iters < 1 || budget < 1) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np 2 mpi-pingpong [--sizes LIST] "
                            "[--iters N] [--budget BYTES] [--transport NAME] "
                            "[--mode NAME]\n");
        MPI_Finalize();
        return 2;
    }

    size_t cap = 8;
    for (int s = 0; s < nsizes; s++)
        if (sizes[s] > cap)
            cap = sizes[s];
    char *buf = malloc(cap);
    if (!buf)
        MPI_Abort(MPI_COMM_WORLD, 1);
    memset(buf, 0x77, cap);
    int peer = rank ^ 1;

    for (int s = 0; s < nsizes; s++) {
        int size = (int)sizes[s];
        long n = (long)(budget / sizes[s]);
        if (n > iters)
            n = iters;
        if (n < 10)
            n = 10;
        /* median of NBATCH timed batches, as in ivshm-pingpong */
        int nb = n >= 10 * NBATCH ? NBATCH : 1;
        long per = n / nb, warm = per / 5 + 2;
        double batch[NBATCH];
        MPI_Barrier(MPI_COMM_WORLD);
        for (int b = -1; b < nb; b++) {
            long count = b < 0 ? warm : per;
            double t0 = MPI_Wtime();
            for (long i = 0; i < count; i++) {
                if (rank == 0) {
                    MPI_Send(buf, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
                    MPI_Recv(buf, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
                } else {
                    MPI_Recv(buf, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
                    MPI_Send(buf, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
                }
            }
            if (b >= 0)
                batch[b] = MPI_Wtime() - t0;
        }
        if (rank == 0) {
            qsort(batch, (size_t)nb, sizeof batch[0], cmp_double);
            double div = (double)per * 2 / 1e6;
            double lat_us = batch[nb / 2] / div;
            printf("{\"transport\":\"%s\",\"mode\":\"%s\",\"size\":%d,"
                   "\"latency_us\":%.4f,\"bandwidth_MBps\":%.2f,\"iters\":%ld,"
                   "\"latency_min_us\":%.4f,\"batches\":%d}\n",
                   transport, mode, size, lat_us, (double)size / lat_us,
                   per * nb, batch[0] / div, nb);
            fflush(stdout);
        }
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
