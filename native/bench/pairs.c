/*
 * Every pair of ranks measured in turn, over and over, while the cluster
 * changes under the job (`ivcloud bench migrate`: an instance moves to
 * another server and back):
 *
 *   mpi-pairs --phase-file PATH [--lat-iters N] [--bw-msgs M]
 *             [--size BYTES] [--pause-ms P] [--seconds S]
 *
 * A tick: rank 0 reads PATH (the phase the host wrote last, a word of
 * [a-z0-9-]; "stop" ends the job) and broadcasts it with its clock;
 * then each pair (a, b), a < b, in a fixed order, alone (a barrier
 * after each): N round trips of 8 B (one-way latency = half a round
 * trip), then M messages of BYTES (default 1 MiB) sent by a at once and
 * acknowledged by b with 8 B (bandwidth = M * BYTES over that time).
 * Rank a prints one JSON line per pair and tick:
 *   {"tick":K,"t":T,"phase":"P","a":A,"b":B,"latency_us":L,
 *    "bandwidth_MBps":W}
 * T: seconds since the first tick on rank 0's clock (the host moves no
 * launcher's instance, so that clock stays). Rank 0 writes the number of
 * ticks done to PATH.ticks, which the host reads to know how far the job
 * got, and every rank then sleeps P ms (default 0): MPI ranks spin while
 * they wait, and a guest of one vCPU whose rank never sleeps answers its
 * host slowly. The job ends at "stop" or after S seconds (default 3600).
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PHASE_LEN 16
#define MAX_MSGS 64

struct tick {
    char phase[PHASE_LEN];
    double t;
};

/* The first word of `path` if it is [a-z0-9-]{1,15}, else "unknown"
   ("none" while it does not exist). */
static void read_phase(const char *path, char *out)
{
    char line[64] = "";
    FILE *f = fopen(path, "r");
    if (!f) {
        strcpy(out, "none");
        return;
    }
    if (!fgets(line, sizeof line, f))
        line[0] = 0;
    fclose(f);
    size_t n = strcspn(line, "\n");
    int ok = n > 0 && n < PHASE_LEN;
    for (size_t i = 0; ok && i < n; i++)
        ok = (line[i] >= 'a' && line[i] <= 'z') ||
             (line[i] >= '0' && line[i] <= '9') || line[i] == '-';
    if (!ok) {
        strcpy(out, "unknown");
        return;
    }
    memcpy(out, line, n);
    out[n] = 0;
}

static void write_ticks(const char *path, long ticks)
{
    char tmp[4200], final[4200];
    snprintf(final, sizeof final, "%s.ticks", path);
    snprintf(tmp, sizeof tmp, "%s.ticks.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fprintf(f, "%ld\n", ticks);
    if (fclose(f) == 0)
        rename(tmp, final);
}

static long arg_long(const char *name, const char *v, long lo, long hi)
{
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == 0 || *end || x < lo || x > hi) {
        fprintf(stderr, "mpi-pairs: bad %s '%s' (%ld..%ld)\n", name, v, lo,
                hi);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return x;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    const char *phase_file = NULL;
    long lat_iters = 20, bw_msgs = 4, size = 1 << 20, seconds = 3600;
    long pause_ms = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--phase-file") && strlen(argv[i + 1]) < 4096)
            phase_file = argv[i + 1];
        else if (!strcmp(argv[i], "--lat-iters"))
            lat_iters = arg_long(argv[i], argv[i + 1], 1, 1000000);
        else if (!strcmp(argv[i], "--bw-msgs"))
            bw_msgs = arg_long(argv[i], argv[i + 1], 1, MAX_MSGS);
        else if (!strcmp(argv[i], "--size"))
            size = arg_long(argv[i], argv[i + 1], 1, 64l << 20);
        else if (!strcmp(argv[i], "--pause-ms"))
            pause_ms = arg_long(argv[i], argv[i + 1], 0, 60000);
        else if (!strcmp(argv[i], "--seconds"))
            seconds = arg_long(argv[i], argv[i + 1], 1, 86400);
        else {
            fprintf(stderr, "mpi-pairs: unknown option '%s'\n", argv[i]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (!phase_file || nranks < 2) {
        if (rank == 0)
            fprintf(stderr, "mpi-pairs: needs --phase-file and 2 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    char *buf = malloc((size_t)size);
    char small[8] = {0};
    if (!buf) {
        fprintf(stderr, "mpi-pairs: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memset(buf, rank, (size_t)size);
    MPI_Request reqs[MAX_MSGS];
    double t0 = 0;
    for (long k = 0;; k++) {
        struct tick tk;
        if (rank == 0) {
            double now = MPI_Wtime();
            if (k == 0)
                t0 = now;
            read_phase(phase_file, tk.phase);
            if (now - t0 > seconds)
                strcpy(tk.phase, "stop");
            tk.t = now - t0;
        }
        MPI_Bcast(&tk, sizeof tk, MPI_BYTE, 0, MPI_COMM_WORLD);
        if (!strcmp(tk.phase, "stop"))
            break;
        for (int a = 0; a < nranks; a++)
            for (int b = a + 1; b < nranks; b++) {
                if (rank == a || rank == b) {
                    int peer = rank == a ? b : a;
                    double s = MPI_Wtime();
                    for (long i = 0; i < lat_iters; i++) {
                        if (rank == a) {
                            MPI_Send(small, 8, MPI_BYTE, peer, 1,
                                     MPI_COMM_WORLD);
                            MPI_Recv(small, 8, MPI_BYTE, peer, 1,
                                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                        } else {
                            MPI_Recv(small, 8, MPI_BYTE, peer, 1,
                                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                            MPI_Send(small, 8, MPI_BYTE, peer, 1,
                                     MPI_COMM_WORLD);
                        }
                    }
                    double lat = MPI_Wtime() - s;
                    s = MPI_Wtime();
                    for (long i = 0; i < bw_msgs; i++) {
                        if (rank == a)
                            MPI_Isend(buf, (int)size, MPI_BYTE, peer, 2,
                                      MPI_COMM_WORLD, &reqs[i]);
                        else
                            MPI_Irecv(buf, (int)size, MPI_BYTE, peer, 2,
                                      MPI_COMM_WORLD, &reqs[i]);
                    }
                    MPI_Waitall((int)bw_msgs, reqs, MPI_STATUSES_IGNORE);
                    if (rank == a)
                        MPI_Recv(small, 8, MPI_BYTE, peer, 3,
                                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                    else
                        MPI_Send(small, 8, MPI_BYTE, peer, 3,
                                 MPI_COMM_WORLD);
                    double bw = MPI_Wtime() - s;
                    if (rank == a)
                        printf("{\"tick\":%ld,\"t\":%.3f,\"phase\":\"%s\","
                               "\"a\":%d,\"b\":%d,\"latency_us\":%.3f,"
                               "\"bandwidth_MBps\":%.2f}\n",
                               k, tk.t, tk.phase, a, b,
                               lat * 1e6 / (2.0 * (double)lat_iters),
                               (double)bw_msgs * (double)size / bw / 1e6);
                }
                MPI_Barrier(MPI_COMM_WORLD);
            }
        if (rank == 0)
            write_ticks(phase_file, k + 1);
        struct timespec nap = {pause_ms / 1000, (pause_ms % 1000) * 1000000};
        nanosleep(&nap, NULL);
    }
    fflush(stdout);
    free(buf);
    MPI_Finalize();
    return 0;
}
