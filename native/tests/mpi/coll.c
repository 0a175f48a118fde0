/*
 * Collectives correctness on any number of ranks: barrier, bcast, reduce,
 * allreduce, allgather, allgatherv, alltoall, alltoallv (plus ibcast and
 * iallreduce), each with several counts (small: eager, large: the
 * algorithms' segmented/rendezvous paths) and every root. Values are
 * integers (and integer-valued doubles) so every result is exact.
 * Optional argument: iterations of the whole set (default 2).
 */
#include "mpitest.h"

static int rank, nranks;

/* what rank r contributes at element i */
static int val(int r, int i, int salt)
{
    return (r + 1) * 1000 + i % 977 + salt * 7;
}

static void bcast_reduce(int count, int salt)
{
    int *buf = mt_alloc((size_t)count * sizeof *buf);
    int *res = mt_alloc((size_t)count * sizeof *res);
    for (int root = 0; root < nranks; root++) {
        for (int i = 0; i < count; i++)
            buf[i] = rank == root ? val(root, i, salt) : -1;
        MPI_OK(MPI_Bcast(buf, count, MPI_INT, root, MPI_COMM_WORLD));
        for (int i = 0; i < count; i++)
            CHECK(buf[i] == val(root, i, salt),
                  "bcast root %d count %d: [%d]=%d", root, count, i, buf[i]);

        for (int i = 0; i < count; i++)
            buf[i] = val(rank, i, salt);
        MPI_OK(MPI_Reduce(buf, res, count, MPI_INT, MPI_SUM, root,
                          MPI_COMM_WORLD));
        if (rank == root)
            for (int i = 0; i < count; i++) {
                long want = 0;
                for (int r = 0; r < nranks; r++)
                    want += val(r, i, salt);
                CHECK(res[i] == want, "reduce root %d count %d: [%d]=%d "
                      "want %ld", root, count, i, res[i], want);
            }
    }
    free(res);
    free(buf);
}

static void allreduce(int count, int salt)
{
    int *in = mt_alloc((size_t)count * sizeof *in);
    int *out = mt_alloc((size_t)count * sizeof *out);
    double *din = mt_alloc((size_t)count * sizeof *din);
    double *dout = mt_alloc((size_t)count * sizeof *dout);
    for (int i = 0; i < count; i++) {
        in[i] = val(rank, i, salt);
        din[i] = (double)((rank * 31 + i) % 1009);
    }
    MPI_OK(MPI_Allreduce(in, out, count, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    for (int i = 0; i < count; i++) {
        long want = 0;
        for (int r = 0; r < nranks; r++)
            want += val(r, i, salt);
        CHECK(out[i] == want, "allreduce sum count %d: [%d]=%d want %ld",
              count, i, out[i], want);
    }
    MPI_OK(MPI_Allreduce(din, dout, count, MPI_DOUBLE, MPI_MAX,
                         MPI_COMM_WORLD));
    for (int i = 0; i < count; i++) {
        double want = 0;
        for (int r = 0; r < nranks; r++) {
            double v = (double)((r * 31 + i) % 1009);
            if (v > want)
                want = v;
        }
        CHECK(dout[i] == want, "allreduce max count %d: [%d]=%g want %g",
              count, i, dout[i], want);
    }
    /* in place, and the non-blocking variant */
    memcpy(out, in, (size_t)count * sizeof *in);
    MPI_OK(MPI_Allreduce(MPI_IN_PLACE, out, count, MPI_INT, MPI_MIN,
                         MPI_COMM_WORLD));
    for (int i = 0; i < count; i++)
        CHECK(out[i] == val(0, i, salt), "allreduce min in place: [%d]=%d",
              i, out[i]);
    MPI_Request rq;
    MPI_OK(MPI_Iallreduce(in, out, count, MPI_INT, MPI_BXOR, MPI_COMM_WORLD,
                          &rq));
    MPI_OK(MPI_Wait(&rq, MPI_STATUS_IGNORE));
    for (int i = 0; i < count; i++) {
        int want = 0;
        for (int r = 0; r < nranks; r++)
            want ^= val(r, i, salt);
        CHECK(out[i] == want, "iallreduce bxor: [%d]=%d want %d", i, out[i],
              want);
    }
    free(dout);
    free(din);
    free(out);
    free(in);
}

static void gathers(int count, int salt)
{
    int *in = mt_alloc((size_t)count * sizeof *in);
    int *all = mt_alloc((size_t)count * (size_t)nranks * sizeof *all);
    for (int i = 0; i < count; i++)
        in[i] = val(rank, i, salt);
    MPI_OK(MPI_Allgather(in, count, MPI_INT, all, count, MPI_INT,
                         MPI_COMM_WORLD));
    for (int r = 0; r < nranks; r++)
        for (int i = 0; i < count; i++)
            CHECK(all[(size_t)r * (size_t)count + (size_t)i] == val(r, i, salt),
                  "allgather count %d: block %d [%d]", count, r, i);

    /* allgatherv: rank r gives (r+1)*count/nranks elements, blocks placed
       in reverse rank order with gaps that must stay untouched */
    int *counts = mt_alloc((size_t)nranks * sizeof *counts);
    int *displs = mt_alloc((size_t)nranks * sizeof *displs);
    int pos = 0;
    for (int r = nranks - 1; r >= 0; r--) {
        counts[r] = (r + 1) * count / nranks;
        displs[r] = pos;
        pos += counts[r] + 3;
    }
    int *vall = mt_alloc((size_t)pos * sizeof *vall);
    for (int i = 0; i < pos; i++)
        vall[i] = -7;
    MPI_OK(MPI_Allgatherv(in, counts[rank], MPI_INT, vall, counts, displs,
                          MPI_INT, MPI_COMM_WORLD));
    for (int r = 0; r < nranks; r++) {
        for (int i = 0; i < counts[r]; i++)
            CHECK(vall[displs[r] + i] == val(r, i, salt),
                  "allgatherv count %d: block %d [%d]=%d", count, r, i,
                  vall[displs[r] + i]);
        for (int g = 0; g < 3; g++)
            CHECK(vall[displs[r] + counts[r] + g] == -7,
                  "allgatherv wrote into the gap after block %d", r);
    }
    free(vall);
    free(displs);
    free(counts);
    free(all);
    free(in);
}

/* alltoall: element i of the block for d from s = s*100000 + d*1000 + i */
static int a2a(int s, int d, int i, int salt)
{
    return s * 100000 + d * 1000 + i % 1000 + salt;
}

static void alltoalls(int count, int salt)
{
    size_t total = (size_t)count * (size_t)nranks;
    int *out = mt_alloc(total * sizeof *out), *in = mt_alloc(total * sizeof *in);
    for (int d = 0; d < nranks; d++)
        for (int i = 0; i < count; i++)
            out[(size_t)d * (size_t)count + (size_t)i] = a2a(rank, d, i, salt);
    MPI_OK(MPI_Alltoall(out, count, MPI_INT, in, count, MPI_INT,
                        MPI_COMM_WORLD));
    for (int s = 0; s < nranks; s++)
        for (int i = 0; i < count; i++)
            CHECK(in[(size_t)s * (size_t)count + (size_t)i] == a2a(s, rank, i, salt),
                  "alltoall count %d: from %d [%d]", count, s, i);

    /* alltoallv: s sends (s + d) % 3 * count / 2 elements to d (some 0) */
    int *sc = mt_alloc((size_t)nranks * sizeof *sc), *sd = mt_alloc((size_t)nranks * sizeof *sd);
    int *rc = mt_alloc((size_t)nranks * sizeof *rc), *rd = mt_alloc((size_t)nranks * sizeof *rd);
    int spos = 0, rpos = 0;
    for (int p = 0; p < nranks; p++) {
        sc[p] = (rank + p) % 3 * count / 2;
        rc[p] = (p + rank) % 3 * count / 2;
        sd[p] = spos;
        rd[p] = rpos;
        spos += sc[p];
        rpos += rc[p];
    }
    int *vout = mt_alloc((size_t)spos * sizeof *vout);
    int *vin = mt_alloc((size_t)rpos * sizeof *vin);
    for (int d = 0; d < nranks; d++)
        for (int i = 0; i < sc[d]; i++)
            vout[sd[d] + i] = a2a(rank, d, i, salt + 1);
    MPI_OK(MPI_Alltoallv(vout, sc, sd, MPI_INT, vin, rc, rd, MPI_INT,
                         MPI_COMM_WORLD));
    for (int s = 0; s < nranks; s++)
        for (int i = 0; i < rc[s]; i++)
            CHECK(vin[rd[s] + i] == a2a(s, rank, i, salt + 1),
                  "alltoallv count %d: from %d [%d]", count, s, i);
    free(vin);
    free(vout);
    free(rd);
    free(rc);
    free(sd);
    free(sc);
    free(in);
    free(out);
}

/* Repeated barriers (their messages interleave with nothing else), the
   non-blocking barrier, and a one-int ibcast from a rotating root. */
static void barriers(int salt)
{
    for (int i = 0; i < 20; i++)
        MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    MPI_Request rq;
    MPI_OK(MPI_Ibarrier(MPI_COMM_WORLD, &rq));
    MPI_OK(MPI_Wait(&rq, MPI_STATUS_IGNORE));
    int v = rank + salt, root = salt % nranks;
    MPI_OK(MPI_Ibcast(&v, 1, MPI_INT, root, MPI_COMM_WORLD, &rq));
    MPI_OK(MPI_Wait(&rq, MPI_STATUS_IGNORE));
    CHECK(v == root + salt, "ibcast root %d: %d", root, v);
}

int main(int argc, char **argv)
{
    mt_init(&argc, &argv, &rank, &nranks);
    int iters = argc > 1 ? atoi(argv[1]) : 2;
    CHECK(iters >= 1, "iterations %d", iters);
    /* 1 element, a few KiB, and 1 MiB of ints (segmented algorithms) */
    static const int counts[] = {1, 7, 1000, 1 << 18};
    int ncounts = (int)(sizeof counts / sizeof counts[0]);
    double t0 = MPI_Wtime();
    for (int it = 0; it < iters; it++)
        for (int c = 0; c < ncounts; c++) {
            int salt = it * 10 + c;
            barriers(salt);
            bcast_reduce(counts[c], salt);
            allreduce(counts[c], salt);
            gathers(counts[c], salt);
            alltoalls(counts[c] > 4096 ? counts[c] / nranks : counts[c], salt);
        }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("PASS coll (%d ranks, %d iterations, %.2f s)\n", nranks, iters,
               MPI_Wtime() - t0);
    MPI_Finalize();
    return 0;
}
