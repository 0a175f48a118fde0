/*
 * Many ranks on one host, for `ivcloud bench scaling`: the figures that
 * tell whether a transport keeps up as ranks are added, run under
 * mpirun with whichever BTL is being measured (oversubscribed: the ranks
 * share the host's cores, so waiting ranks must give their CPU away).
 *
 *   latency    8 B ping-pong between rank 0 and rank N-1 (the farthest
 *              pair) while the other ranks wait in a barrier; one-way =
 *              half a round trip
 *   allreduce  MPI_Allreduce of one double on all ranks
 *   msgrate    ranks i and i+N/2 pair up; each sender posts windows of
 *              WINDOW non-blocking 8 B sends, its receiver answers each
 *              window with one ack; the rate is every pair's messages
 *              over the slowest rank's time
 *
 * Rank 0 prints one JSON line per test:
 *   {"transport","test","ranks","size","latency_us","rate_msgs_per_s",
 *    "ops","batches"}
 * Each figure is the median of NBATCH timed batches after a warm-up.
 *   mpi-scaling --transport NAME [--lat-iters N] [--allreduce-iters N]
 *               [--windows N]
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NBATCH 5
#define WINDOW 64
#define TAG_PING 31
#define TAG_RATE 32
#define TAG_ACK 33

static int rank, nranks;

static double now_s(void)
{
    return MPI_Wtime();
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static void record(const char *transport, const char *test, double lat_us,
                   double rate, long ops)
{
    if (rank != 0)
        return;
    printf("{\"transport\":\"%s\",\"test\":\"%s\",\"ranks\":%d,\"size\":8,"
           "\"latency_us\":%.4f,\"rate_msgs_per_s\":%.1f,\"ops\":%ld,"
           "\"batches\":%d}\n",
           transport, test, nranks, lat_us, rate, ops, NBATCH);
    fflush(stdout);
}

/* Round trips between rank 0 and rank N-1; the rest wait in the barrier
   that ends the batch. Returns one batch's seconds (at rank 0). */
static double latency_batch(long iters)
{
    char buf[8] = {0};
    const int far = nranks - 1;
    double t0 = now_s();
    if (rank == 0) {
        for (long i = 0; i < iters; i++) {
            MPI_Send(buf, 8, MPI_BYTE, far, TAG_PING, MPI_COMM_WORLD);
            MPI_Recv(buf, 8, MPI_BYTE, far, TAG_PING, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        }
    } else if (rank == far) {
        for (long i = 0; i < iters; i++) {
            MPI_Recv(buf, 8, MPI_BYTE, 0, TAG_PING, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(buf, 8, MPI_BYTE, 0, TAG_PING, MPI_COMM_WORLD);
        }
    }
    double t = now_s() - t0;
    MPI_Barrier(MPI_COMM_WORLD);
    return t;
}

static double allreduce_batch(long iters)
{
    double in = rank, out = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now_s();
    for (long i = 0; i < iters; i++)
        MPI_Allreduce(&in, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    double t = now_s() - t0;
    if (out != (double)nranks * (nranks - 1) / 2) {
        fprintf(stderr, "mpi-scaling: allreduce gave %g\n", out);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return t;
}

/* Pairs (i, i + N/2) stream windows; an odd last rank only waits. The
   batch time is the slowest rank's. */
static double msgrate_batch(long windows)
{
    static char bufs[WINDOW][8];
    MPI_Request rq[WINDOW];
    const int half = nranks / 2;
    char ack = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now_s();
    if (rank < half) {
        for (long w = 0; w < windows; w++) {
            for (int k = 0; k < WINDOW; k++)
                MPI_Isend(bufs[k], 8, MPI_BYTE, rank + half, TAG_RATE,
                          MPI_COMM_WORLD, &rq[k]);
            MPI_Waitall(WINDOW, rq, MPI_STATUSES_IGNORE);
            MPI_Recv(&ack, 1, MPI_BYTE, rank + half, TAG_ACK, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        }
    } else if (rank < 2 * half) {
        for (long w = 0; w < windows; w++) {
            for (int k = 0; k < WINDOW; k++)
                MPI_Irecv(bufs[k], 8, MPI_BYTE, rank - half, TAG_RATE,
                          MPI_COMM_WORLD, &rq[k]);
            MPI_Waitall(WINDOW, rq, MPI_STATUSES_IGNORE);
            MPI_Send(&ack, 1, MPI_BYTE, rank - half, TAG_ACK, MPI_COMM_WORLD);
        }
    }
    double t = now_s() - t0, slowest = 0;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    const char *transport = "mpi";
    long lat_iters = 1000, ar_iters = 200, windows = 20;
    int bad = nranks < 2 || argc % 2 == 0;
    for (int i = 1; !bad && i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--transport"))
            transport = v;
        else if (!strcmp(a, "--lat-iters"))
            lat_iters = atol(v);
        else if (!strcmp(a, "--allreduce-iters"))
            ar_iters = atol(v);
        else if (!strcmp(a, "--windows"))
            windows = atol(v);
        else
            bad = 1;
    }
    if (bad || lat_iters < 1 || ar_iters < 1 || windows < 1) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np N mpi-scaling --transport NAME "
                            "[--lat-iters N] [--allreduce-iters N] "
                            "[--windows N] (N >= 2 ranks)\n");
        MPI_Finalize();
        return 2;
    }

    double t[NBATCH];
    /* warm-ups make the connections (and fast channels) first */
    (void)latency_batch(lat_iters / 5 + 1);
    for (int b = 0; b < NBATCH; b++)
        t[b] = latency_batch(lat_iters);
    record(transport, "latency", median(t, NBATCH) / lat_iters / 2 * 1e6, 0,
           lat_iters * NBATCH);

    (void)allreduce_batch(ar_iters / 5 + 1);
    for (int b = 0; b < NBATCH; b++)
        t[b] = allreduce_batch(ar_iters);
    record(transport, "allreduce", median(t, NBATCH) / ar_iters * 1e6, 0,
           ar_iters * NBATCH);

    (void)msgrate_batch(1);
    for (int b = 0; b < NBATCH; b++)
        t[b] = msgrate_batch(windows);
    double msgs = (double)(nranks / 2) * windows * WINDOW;
    double sec = median(t, NBATCH);
    record(transport, "msgrate", sec / msgs * 1e6, sec > 0 ? msgs / sec : 0,
           (long)msgs * NBATCH);

    MPI_Finalize();
    return 0;
}
