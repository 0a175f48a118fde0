/*
 * OSU-style MPI micro-benchmarks for `ivcloud bench mpi`, run under
 * mpirun with whichever BTL is being measured; --test takes a list:
 *
 *   latency    ping-pong between ranks 0 and 1; one-way = half a round trip
 *   bw         rank 0 streams a window of non-blocking sends, rank 1
 *              answers each window with a short ack
 *   put, get   MPI_Put / MPI_Get of one buffer + MPI_Win_flush, inside a
 *              lock_all epoch (passive target)
 *   put-fence, get-fence   the same, completed by a fence per operation
 *   allreduce  MPI_Allreduce of `size` bytes of floats on all ranks
 *
 * Rank 0 prints one JSON line per test and size:
 *   {"transport","test","ranks","size","latency_us","bandwidth_MBps",...}
 * Each figure is the median of NBATCH timed batches after a warm-up;
 * bandwidth = size / latency per operation. With --phases 1, bw's line
 * also says how each rank of the pair spent a window, per message:
 * "phases_us":{"sender":[post,wait,ack],"receiver":[post,wait,ack]}
 * (posting the window, MPI_Waitall, the acknowledgement).
 */
#include <mpi.h>

#include "bench_util.h" /* after mpi.h: with its MPI helpers */

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NBATCH 5
#define MAX_WINDOW 256
#define WINDOW_BYTES (16u << 20)

enum test { T_LATENCY, T_BW, T_PUT, T_GET, T_PUT_FENCE, T_GET_FENCE,
            T_ALLREDUCE, NTESTS };
static const char *const test_names[NTESTS] = {
    "latency", "bw", "put", "get", "put-fence", "get-fence", "allreduce"};

struct opts {
    int tests[NTESTS];  /* in the order given */
    int ntests;
    size_t sizes[BENCH_MAX_SIZES];
    int nsizes;
    long iters;        /* operations per size for small sizes */
    uint64_t budget;   /* bytes per size: caps the operations of big ones */
    int window;        /* bw: sends in flight */
    const char *transport;
    int phases;        /* bw: time each phase of a window (--phases 1) */
};

static int rank, nranks;

static int parse_tests(const char *list, struct opts *o)
{
    char copy[256];
    if (strlen(list) >= sizeof copy)
        return -1;
    strcpy(copy, list);
    o->ntests = 0;
    for (char *save, *t = strtok_r(copy, ",", &save); t;
         t = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int i = 0; i < NTESTS; i++)
            if (!strcmp(t, test_names[i]))
                found = i;
        if (found < 0 || o->ntests == NTESTS)
            return -1;
        o->tests[o->ntests++] = found;
    }
    return o->ntests ? 0 : -1;
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    memset(o, 0, sizeof *o);
    o->iters = 10000;
    o->budget = 256u << 20;
    o->window = 64;
    o->transport = "mpi";
    o->ntests = 0;
    bench_parse_sizes("8,64,512,4096,32768,262144,1048576", o->sizes, &o->nsizes);
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            return -1;
        if (!strcmp(a, "--test")) {
            if (parse_tests(v, o) < 0)
                return -1;
        } else if (!strcmp(a, "--sizes")) {
            if (bench_parse_sizes(v, o->sizes, &o->nsizes) < 0)
                return -1;
        } else if (!strcmp(a, "--iters")) {
            o->iters = atol(v);
        } else if (!strcmp(a, "--budget")) {
            o->budget = strtoull(v, NULL, 10);
        } else if (!strcmp(a, "--window")) {
            o->window = atoi(v);
        } else if (!strcmp(a, "--transport")) {
            o->transport = v;
        } else if (!strcmp(a, "--phases")) {
            o->phases = atoi(v);
        } else {
            return -1;
        }
    }
    /* ranks 0 and 1 do the point-to-point and one-sided tests; any
       further ranks only join the barriers (and fences) */
    if (!o->ntests || o->iters < 1 || o->budget < 1 || o->window < 1 ||
        o->window > MAX_WINDOW || nranks < 2)
        return -1;
    return 0;
}

/* How many operations for one size: `iters`, fewer for big sizes so one
   size moves about `budget` bytes, at least enough for NBATCH batches. */
static long ops_for(const struct opts *o, size_t per_op)
{
    long n = (long)(o->budget / (per_op ? per_op : 1));
    if (n > o->iters)
        n = o->iters;
    return n < 2 * NBATCH ? 2 * NBATCH : n;
}

/* The phases of a bw window, as each rank of the pair lives them:
   posting its window (MPI_Isend or MPI_Irecv), MPI_Waitall, and the
   acknowledgement (waiting for it, or sending it). Seconds summed over
   the timed windows, when asked for (--phases). */
enum { PH_POST, PH_WAIT, PH_ACK, NPHASES };
static double phase_s[NPHASES];

/* The pair's phase sums at rank 0: its own (the sender's) and rank 1's
   (the receiver's); every rank's own start again from zero. */
static void gather_phases(double sender_s[NPHASES],
                          double receiver_s[NPHASES])
{
    if (rank == 1)
        MPI_Send(phase_s, NPHASES, MPI_DOUBLE, 0, 4, MPI_COMM_WORLD);
    else if (rank == 0)
        MPI_Recv(receiver_s, NPHASES, MPI_DOUBLE, 1, 4, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    memcpy(sender_s, phase_s, sizeof phase_s);
    memset(phase_s, 0, sizeof phase_s);
}

/* The phases per message in us, as a JSON field of rank 0's record:
   "phases_us":{"sender":[post,wait,ack],"receiver":[post,wait,ack]} */
static void print_phases(const double sender_s[NPHASES],
                         const double receiver_s[NPHASES], double msgs)
{
    printf(",\"phases_us\":{\"sender\":[%.4f,%.4f,%.4f],"
           "\"receiver\":[%.4f,%.4f,%.4f]}",
           sender_s[PH_POST] / msgs * 1e6, sender_s[PH_WAIT] / msgs * 1e6,
           sender_s[PH_ACK] / msgs * 1e6, receiver_s[PH_POST] / msgs * 1e6,
           receiver_s[PH_WAIT] / msgs * 1e6, receiver_s[PH_ACK] / msgs * 1e6);
}

/* `count` windows of o->window messages; buf holds window * size bytes
   so that the messages in flight never share memory. `timed`: add each
   window's phases to phase_s. */
static void stream(char *buf, int size, int window, long count, int timed)
{
    MPI_Request rq[MAX_WINDOW];
    char ack[4] = {0};
    for (long i = 0; i < count; i++) {
        double t0 = timed ? MPI_Wtime() : 0;
        for (int w = 0; w < window; w++) {
            char *p = buf + (size_t)w * (size_t)size;
            if (rank == 0)
                MPI_Isend(p, size, MPI_BYTE, 1, 2, MPI_COMM_WORLD, &rq[w]);
            else
                MPI_Irecv(p, size, MPI_BYTE, 0, 2, MPI_COMM_WORLD, &rq[w]);
        }
        double t1 = timed ? MPI_Wtime() : 0;
        MPI_Waitall(window, rq, MPI_STATUSES_IGNORE);
        double t2 = timed ? MPI_Wtime() : 0;
        if (rank == 0)
            MPI_Recv(ack, 4, MPI_BYTE, 1, 3, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        else
            MPI_Send(ack, 4, MPI_BYTE, 0, 3, MPI_COMM_WORLD);
        if (timed) {
            double t3 = MPI_Wtime();
            phase_s[PH_POST] += t1 - t0;
            phase_s[PH_WAIT] += t2 - t1;
            phase_s[PH_ACK] += t3 - t2;
        }
    }
}

/* rank 0 is the origin, rank 1 the target; the others (and the target)
   only take part in fences */
static void rma_ops(enum test t, MPI_Win win, char *buf, int size,
                    long count)
{
    int fence = t == T_PUT_FENCE || t == T_GET_FENCE;
    int put = t == T_PUT || t == T_PUT_FENCE;
    for (long i = 0; i < count; i++) {
        if (rank == 0) {
            if (put)
                MPI_Put(buf, size, MPI_BYTE, 1, 0, size, MPI_BYTE, win);
            else
                MPI_Get(buf, size, MPI_BYTE, 1, 0, size, MPI_BYTE, win);
            if (!fence)
                MPI_Win_flush(1, win);
        }
        if (fence)
            MPI_Win_fence(0, win);
    }
}

static void allreduce(float *in, float *out, int size, long count)
{
    int n = size / (int)sizeof(float);
    if (n < 1)
        n = 1;
    for (long i = 0; i < count; i++)
        MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

/* One test over every size; rank 0 prints a JSON line per size. */
static void run_test(const struct opts *o, enum test t, char *buf,
                     size_t cap)
{
    int rma = t == T_PUT || t == T_GET || t == T_PUT_FENCE ||
              t == T_GET_FENCE;
    int fence = t == T_PUT_FENCE || t == T_GET_FENCE;
    int p2p = t == T_LATENCY || t == T_BW;
    MPI_Win win = MPI_WIN_NULL;
    if (rma) {
        void *base;
        MPI_Win_allocate((MPI_Aint)cap, 1, MPI_INFO_NULL, MPI_COMM_WORLD,
                         &base, &win);
        memset(base, 0, cap);
        if (fence)
            MPI_Win_fence(0, win);
        else
            MPI_Win_lock_all(0, win);
    }

    for (int s = 0; s < o->nsizes; s++) {
        int size = (int)o->sizes[s];
        /* bw: distinct buffers per message in flight, but no more than
           WINDOW_BYTES of them, so big sizes are not measuring DRAM
           misses the small ones do not see */
        int window = o->window;
        if ((size_t)window * (size_t)size > WINDOW_BYTES) {
            window = (int)(WINDOW_BYTES / (size_t)size);
            if (window < 1)
                window = 1;
        }
        size_t per_op = t == T_BW ? (size_t)size * (size_t)window
                                  : (size_t)size;
        long n = ops_for(o, per_op);
        if (t == T_BW && n > o->iters / window + 2 * NBATCH)
            n = o->iters / window + 2 * NBATCH;
        long per = n / NBATCH, warm = per / 5 + 1;
        double batch[NBATCH];
        for (int b = -1; b < NBATCH; b++) {
            long count = b < 0 ? warm : per;
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (p2p && rank > 1)
                ; /* bystander */
            else if (t == T_LATENCY)
                bench_mpi_pingpong(buf, size, rank, 1, count);
            else if (t == T_BW)
                stream(buf, size, window, count, o->phases && b >= 0);
            else if (rma)
                rma_ops(t, win, buf, size, count);
            else
                allreduce((float *)buf, (float *)(buf + cap), size, count);
            double dt = MPI_Wtime() - t0;
            /* the slowest rank defines a collective's time */
            if (t == T_ALLREDUCE)
                MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX,
                              MPI_COMM_WORLD);
            if (b >= 0)
                batch[b] = dt;
        }
        double sender_s[NPHASES] = {0}, receiver_s[NPHASES] = {0};
        if (t == T_BW && o->phases)
            gather_phases(sender_s, receiver_s);
        if (rank == 0) {
            qsort(batch, NBATCH, sizeof batch[0], bench_cmp_double);
            /* per operation: a round trip is two one-way trips, a bw
               window is `window` messages */
            double ops = (double)per * (t == T_LATENCY ? 2
                                        : t == T_BW ? window : 1);
            double lat_us = batch[NBATCH / 2] / ops * 1e6;
            printf("{\"transport\":\"%s\",\"test\":\"%s\",\"ranks\":%d,"
                   "\"size\":%d,\"latency_us\":%.4f,\"bandwidth_MBps\":%.6g,"
                   "\"ops\":%.0f,\"latency_min_us\":%.4f",
                   o->transport, test_names[t],
                   p2p || rma ? 2 : nranks, size, lat_us,
                   (double)size / lat_us, ops * NBATCH,
                   batch[0] / ops * 1e6);
            if (t == T_BW)
                printf(",\"window\":%d", window);
            if (t == T_BW && o->phases)
                print_phases(sender_s, receiver_s, ops * NBATCH);
            if (rma)
                printf(",\"sync\":\"%s\"", fence ? "fence" : "lock_all");
            printf("}\n");
            fflush(stdout);
        }
    }

    if (rma) {
        if (fence)
            MPI_Win_fence(0, win);
        else
            MPI_Win_unlock_all(win);
        MPI_Win_free(&win);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    struct opts o;
    if (parse_args(argc, argv, &o) < 0) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np N osu --test LIST [--sizes "
                    "LIST] [--iters N] [--budget BYTES] [--window N] [--phases 1] "
                    "[--transport NAME]\n  tests: latency,bw,put,get,"
                    "put-fence,get-fence,allreduce (N >= 2; point-to-point "
                    "and one-sided use ranks 0 and 1)\n");
        MPI_Finalize();
        return 2;
    }

    size_t cap = 8;
    for (int s = 0; s < o.nsizes; s++)
        if (o.sizes[s] > cap)
            cap = o.sizes[s];
    /* room for a bw window of distinct buffers, or 2 x cap for the
       allreduce input and output */
    size_t bufsize = cap * (size_t)o.window < WINDOW_BYTES
                         ? cap * (size_t)o.window : WINDOW_BYTES + cap;
    if (bufsize < 2 * cap)
        bufsize = 2 * cap;
    char *buf = malloc(bufsize);
    if (!buf)
        MPI_Abort(MPI_COMM_WORLD, 1);
    memset(buf, 0x5a, bufsize);
    for (int i = 0; i < o.ntests; i++)
        run_test(&o, (enum test)o.tests[i], buf, cap);
    free(buf);
    MPI_Finalize();
    return 0;
}
