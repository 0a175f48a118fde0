/*
 * MPI ping-pong reference for `ivcloud bench p2p`: run with two ranks, e.g.
 *   mpirun -np 2 --mca pml ob1 --mca btl self,vader mpi-pingpong --sizes 8,64
 * Rank 0 prints one JSON line per size, in the same shape as
 * ivshm-pingpong (one-way latency = half a round trip).
 *
 * --pattern exchange: both ranks MPI_Sendrecv at once, as the first of
 * HPCC's two ring-latency loops does with two ranks; the figure is the
 * time per exchange. Both ranks publish and poll at the same moment
 * there, which a ping-pong never makes them do (docs/btl.md, "Message
 * path").
 *
 * --pattern ring: HPCC's other ring loop with two ranks, whose left and
 * right neighbour are the same peer: two MPI_Irecv, two MPI_Isend (tags
 * 0 and 1), one MPI_Waitall; the figure is half an iteration, as HPCC
 * divides. Two messages leave back to back each way, which neither
 * other pattern sends (docs/fast-path.md, "Two messages at once").
 */
#include <mpi.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    size_t sizes[BENCH_MAX_SIZES];
    int nsizes = 0;
    long iters = 10000;
    uint64_t budget = 256u << 20;
    const char *transport = "mpi-vader", *mode = "vader";
    enum { PINGPONG, EXCHANGE, RING } pattern = PINGPONG;
    bench_parse_sizes(BENCH_DEFAULT_SIZES, sizes, &nsizes);
    int bad = nranks != 2;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            bad = 1;
        else if (!strcmp(a, "--sizes"))
            bad |= bench_parse_sizes(v, sizes, &nsizes) < 0;
        else if (!strcmp(a, "--iters"))
            iters = atol(v);
        else if (!strcmp(a, "--budget"))
            budget = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--transport"))
            transport = v;
        else if (!strcmp(a, "--mode"))
            mode = v;
        else if (!strcmp(a, "--pattern") && !strcmp(v, "pingpong"))
            pattern = PINGPONG;
        else if (!strcmp(a, "--pattern") && !strcmp(v, "exchange"))
            pattern = EXCHANGE;
        else if (!strcmp(a, "--pattern") && !strcmp(v, "ring"))
            pattern = RING;
        else
            bad = 1;
    }
    if (bad || iters < 1 || budget < 1) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np 2 mpi-pingpong [--sizes LIST] "
                            "[--iters N] [--budget BYTES] [--transport NAME] "
                            "[--mode NAME] [--pattern pingpong|exchange|ring]\n");
        MPI_Finalize();
        return 2;
    }

    size_t cap = bench_max_size(sizes, nsizes);
    char *buf = malloc(cap), *buf2 = malloc(cap), *buf3 = malloc(cap);
    if (!buf || !buf2 || !buf3)
        MPI_Abort(MPI_COMM_WORLD, 1);
    memset(buf, 0x77, cap);
    int peer = rank ^ 1;

    for (int s = 0; s < nsizes; s++) {
        int size = (int)sizes[s];
        struct bench_plan p = bench_plan_for(sizes[s], iters, budget);
        double batch[BENCH_NBATCH];
        MPI_Barrier(MPI_COMM_WORLD);
        for (int b = -1; b < p.nb; b++) {
            long count = b < 0 ? p.warm : p.per;
            double t0 = MPI_Wtime();
            if (pattern == EXCHANGE)
                for (long i = 0; i < count; i++)
                    MPI_Sendrecv(buf, size, MPI_BYTE, peer, 0, buf2, size,
                                 MPI_BYTE, peer, 0, MPI_COMM_WORLD,
                                 MPI_STATUS_IGNORE);
            else if (pattern == RING)
                for (long i = 0; i < count; i++) {
                    MPI_Request req[4];
                    MPI_Irecv(buf2, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD,
                              &req[0]);
                    MPI_Irecv(buf3, size, MPI_BYTE, peer, 1, MPI_COMM_WORLD,
                              &req[1]);
                    MPI_Isend(buf, size, MPI_BYTE, peer, 0, MPI_COMM_WORLD,
                              &req[2]);
                    MPI_Isend(buf, size, MPI_BYTE, peer, 1, MPI_COMM_WORLD,
                              &req[3]);
                    MPI_Waitall(4, req, MPI_STATUSES_IGNORE);
                }
            else
                bench_mpi_pingpong(buf, size, rank, 0, count);
            if (b >= 0)
                batch[b] = MPI_Wtime() - t0;
        }
        if (rank == 0) {
            /* MPI_Wtime gives seconds: same figures, other unit */
            qsort(batch, (size_t)p.nb, sizeof batch[0], bench_cmp_double);
            /* per one-way message of a round trip, per exchange, per half
               a ring iteration (as HPCC divides) */
            double div = (double)p.per * (pattern == EXCHANGE ? 1 : 2) / 1e6;
            bench_print_batched(transport, mode, sizes[s], batch[p.nb / 2] / div,
                                batch[0] / div, p.per * p.nb, p.nb);
        }
    }
    free(buf);
    free(buf2);
    free(buf3);
    MPI_Finalize();
    return 0;
}
