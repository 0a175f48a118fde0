/*
 * Nearest-neighbour halo exchange for `ivcloud bench halo`: the
 * communication skeleton of a 2-D domain-decomposed solver, to compare
 * rank placements on an emulated cluster.
 *
 * The ranks form a non-periodic 2-D grid (MPI_Dims_create, then
 * MPI_Cart_create without reordering, so rank r sits where `ivcloud
 * place --pattern halo2d:PXxPY` expects it: row-major, last dimension
 * fastest). Each iteration every rank sends one face of --face bytes to
 * each of its up to 4 neighbours, receives theirs, and folds the received
 * faces into a small local array (--compute doubles) as the stencil
 * update would. Faces carry the sender's rank and the iteration number;
 * every receiver checks them, so a misrouted or stale face fails the run.
 *
 * Rank 0 prints one JSON line:
 *   {"test":"halo2d","ranks","dims":[px,py],"face_bytes","iters",
 *    "wall_s","per_iter_us","hosts":[host of each rank],...}
 * wall_s is the slowest rank's time for the timed iterations (after
 * --warmup untimed ones that open every connection).
 */
#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NDIRS 4
#define HOST_LEN 64

struct opts {
    size_t face;       /* bytes per face and neighbour */
    long iters;        /* timed iterations */
    long warmup;       /* untimed iterations before them */
    long compute;      /* doubles of local state updated per iteration */
    const char *transport;
    const char *placement;
};

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    long face = 64 * 1024;
    o->iters = 100;
    o->warmup = 10;
    o->compute = 4096;
    o->transport = "mpi";
    o->placement = "unknown";
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            return -1;
        if (!strcmp(a, "--face")) {
            /* whole doubles: the check words are doubles */
            if (parse_long(v, 16, 64L << 20, &face) < 0 || face % 8)
                return -1;
        } else if (!strcmp(a, "--iters")) {
            if (parse_long(v, 1, 100000000, &o->iters) < 0)
                return -1;
        } else if (!strcmp(a, "--warmup")) {
            if (parse_long(v, 0, 100000000, &o->warmup) < 0)
                return -1;
        } else if (!strcmp(a, "--compute")) {
            if (parse_long(v, 1, 1L << 24, &o->compute) < 0)
                return -1;
        } else if (!strcmp(a, "--transport")) {
            o->transport = v;
        } else if (!strcmp(a, "--placement")) {
            o->placement = v;
        } else {
            return -1;
        }
    }
    o->face = (size_t)face;
    return 0;
}

/* Check word of a face: who sent it in which iteration. Exact in a
   double for any rank and iteration count this program accepts. */
static double stamp(int sender, long iter)
{
    return (double)sender * 1e9 + (double)iter;
}

struct halo {
    MPI_Comm cart;
    int dims[2];
    int nbr[NDIRS];          /* up, down, left, right; MPI_PROC_NULL at edges */
    size_t words;            /* doubles per face */
    double *send[NDIRS], *recv[NDIRS];
    double *local;
    long nlocal;
    long bad;                /* faces that failed their check */
};

/* One exchange with every neighbour, then the local update. */
static void step(struct halo *h, int rank, long iter)
{
    MPI_Request rq[2 * NDIRS];
    int n = 0;
    for (int d = 0; d < NDIRS; d++) {
        if (h->nbr[d] == MPI_PROC_NULL)
            continue;
        MPI_Irecv(h->recv[d], (int)h->words, MPI_DOUBLE, h->nbr[d], 5,
                  h->cart, &rq[n++]);
    }
    for (int d = 0; d < NDIRS; d++) {
        if (h->nbr[d] == MPI_PROC_NULL)
            continue;
        /* the stamp at both ends of the face: a torn or short face
           shows at one of them */
        h->send[d][0] = h->send[d][h->words - 1] = stamp(rank, iter);
        MPI_Isend(h->send[d], (int)h->words, MPI_DOUBLE, h->nbr[d], 5,
                  h->cart, &rq[n++]);
    }
    MPI_Waitall(n, rq, MPI_STATUSES_IGNORE);

    double boundary = 0.0;
    for (int d = 0; d < NDIRS; d++) {
        if (h->nbr[d] == MPI_PROC_NULL)
            continue;
        double want = stamp(h->nbr[d], iter);
        if (h->recv[d][0] != want || h->recv[d][h->words - 1] != want)
            h->bad++;
        boundary += h->recv[d][1];
    }
    /* a relaxation sweep standing in for the solver's work; reading the
       received faces keeps the exchange from being optimized away */
    double prev = boundary * 1e-12;
    for (long i = 0; i < h->nlocal; i++) {
        double cur = h->local[i];
        h->local[i] = 0.5 * cur + 0.25 * (prev + h->local[(i + 1) % h->nlocal]);
        prev = cur;
    }
}

static int setup(struct halo *h, const struct opts *o, int nranks)
{
    int periods[2] = {0, 0};
    memset(h, 0, sizeof *h);
    MPI_Dims_create(nranks, 2, h->dims);
    /* reorder 0: rank numbers must stay the ones the rankfile placed */
    MPI_Cart_create(MPI_COMM_WORLD, 2, h->dims, periods, 0, &h->cart);
    MPI_Cart_shift(h->cart, 0, 1, &h->nbr[0], &h->nbr[1]);
    MPI_Cart_shift(h->cart, 1, 1, &h->nbr[2], &h->nbr[3]);
    h->words = o->face / sizeof(double);
    h->nlocal = o->compute;
    for (int d = 0; d < NDIRS; d++) {
        h->send[d] = calloc(h->words, sizeof(double));
        h->recv[d] = calloc(h->words, sizeof(double));
        if (!h->send[d] || !h->recv[d])
            return -1;
        for (size_t i = 1; i + 1 < h->words; i++)
            h->send[d][i] = (double)(i % 97);
    }
    h->local = calloc((size_t)h->nlocal, sizeof(double));
    if (!h->local)
        return -1;
    for (long i = 0; i < h->nlocal; i++)
        h->local[i] = (double)(i % 13);
    return 0;
}

static void teardown(struct halo *h)
{
    for (int d = 0; d < NDIRS; d++) {
        free(h->send[d]);
        free(h->recv[d]);
    }
    free(h->local);
    MPI_Comm_free(&h->cart);
}

static void print_result(const struct halo *h, const struct opts *o,
                         int nranks, double wall, long bad,
                         const char *hosts)
{
    printf("{\"test\":\"halo2d\",\"transport\":\"%s\",\"placement\":\"%s\","
           "\"ranks\":%d,\"dims\":[%d,%d],\"face_bytes\":%zu,\"iters\":%ld,"
           "\"warmup\":%ld,\"compute_doubles\":%ld,\"wall_s\":%.6f,"
           "\"per_iter_us\":%.3f,\"bad_faces\":%ld,\"hosts\":[",
           o->transport, o->placement, nranks, h->dims[0], h->dims[1],
           o->face, o->iters, o->warmup, o->compute, wall,
           wall / (double)o->iters * 1e6, bad);
    for (int r = 0; r < nranks; r++) {
        const char *name = hosts + (size_t)r * HOST_LEN;
        /* hostnames are [A-Za-z0-9.-]; anything else is left out rather
           than escaped, to keep the line valid JSON */
        printf("%s\"", r ? "," : "");
        for (const char *p = name; *p; p++)
            if (*p != '"' && *p != '\\' && (unsigned char)*p >= 0x20)
                putchar(*p);
        putchar('"');
    }
    printf("]}\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    int rank, nranks;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    struct opts o;
    if (parse_args(argc, argv, &o) < 0) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np N halo [--face BYTES (multiple "
                    "of 8)] [--iters K] [--warmup W] [--compute DOUBLES] "
                    "[--transport NAME] [--placement NAME]\n");
        MPI_Finalize();
        return 2;
    }
    struct halo h;
    if (setup(&h, &o, nranks) < 0) {
        fprintf(stderr, "halo: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    char host[HOST_LEN] = "";
    gethostname(host, sizeof host - 1);
    char *hosts = rank == 0 ? calloc((size_t)nranks, HOST_LEN) : NULL;
    if (rank == 0 && !hosts)
        MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Gather(host, HOST_LEN, MPI_CHAR, hosts, HOST_LEN, MPI_CHAR, 0,
               MPI_COMM_WORLD);

    long it = 0;
    for (; it < o.warmup; it++)
        step(&h, rank, it);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (long k = 0; k < o.iters; k++, it++)
        step(&h, rank, it);
    double wall = MPI_Wtime() - t0;
    /* the job is as fast as its slowest rank */
    MPI_Allreduce(MPI_IN_PLACE, &wall, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    long bad = h.bad;
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);

    if (rank == 0)
        print_result(&h, &o, nranks, wall, bad, hosts);
    if (bad && rank == 0)
        fprintf(stderr, "halo: %ld faces arrived with a wrong stamp\n", bad);
    free(hosts);
    teardown(&h);
    MPI_Finalize();
    return bad ? 1 : 0;
}
