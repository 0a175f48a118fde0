/*
 * Communicator management with traffic on every communicator: split by
 * parity with reversed keys, dup (same tags on world and the dup must
 * not cross), split_type(SHARED), create from a group, nested splits,
 * and an intercommunicator between the two parity halves. Any number
 * of ranks >= 2.
 */
#include "mpitest.h"

static int rank, nranks;

/* Sendrecv around the ring of `comm`, checking the neighbour's world
   rank comes back; then an allreduce of world ranks. */
static void ring_and_sum(MPI_Comm comm, const char *what)
{
    int r, n;
    MPI_Comm_rank(comm, &r);
    MPI_Comm_size(comm, &n);
    int right = (r + 1) % n, left = (r + n - 1) % n;
    int from_left = -1, sum = 0, want = 0;
    int *world_of = mt_alloc((size_t)n * sizeof *world_of);
    MPI_OK(MPI_Allgather(&rank, 1, MPI_INT, world_of, 1, MPI_INT, comm));
    MPI_OK(MPI_Sendrecv(&rank, 1, MPI_INT, right, 3, &from_left, 1, MPI_INT,
                        left, 3, comm, MPI_STATUS_IGNORE));
    CHECK(from_left == world_of[left], "%s: from left got %d want %d", what,
          from_left, world_of[left]);
    MPI_OK(MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, comm));
    for (int i = 0; i < n; i++)
        want += world_of[i];
    CHECK(sum == want, "%s: allreduce %d want %d", what, sum, want);
    free(world_of);
}

/* the highest world rank of parity `color` */
static int highest_of(int color)
{
    return (nranks - 1) % 2 == color ? nranks - 1 : nranks - 2;
}

static void split(void)
{
    MPI_Comm half;
    int color = rank % 2;
    MPI_OK(MPI_Comm_split(MPI_COMM_WORLD, color, -rank, &half));
    int r, n;
    MPI_Comm_rank(half, &r);
    MPI_Comm_size(half, &n);
    int want_n = (nranks - color + 1) / 2;
    CHECK(n == want_n, "split size %d want %d", n, want_n);
    /* key -rank: the highest world rank of the colour is sub-rank 0 */
    CHECK(r == (highest_of(color) - rank) / 2, "split rank %d (world %d)", r,
          rank);
    ring_and_sum(half, "split");

    /* nested split of the half, and undefined colour */
    MPI_Comm quarter, none;
    MPI_OK(MPI_Comm_split(half, r % 2, r, &quarter));
    ring_and_sum(quarter, "nested split");
    MPI_OK(MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0,
                          &none));
    CHECK((rank == 0) == (none != MPI_COMM_NULL), "MPI_UNDEFINED colour");
    if (none != MPI_COMM_NULL)
        MPI_Comm_free(&none);

    /* intercommunicator between the halves; each side's leader is its
       sub-rank 0, i.e. the highest world rank of the other colour */
    MPI_Comm inter;
    MPI_OK(MPI_Intercomm_create(half, 0, MPI_COMM_WORLD,
                                highest_of(1 - color), 77, &inter));
    int rsize;
    MPI_Comm_remote_size(inter, &rsize);
    CHECK(rsize == nranks - n, "intercomm remote size %d", rsize);
    if (r == 0) {
        int other = -1;
        MPI_OK(MPI_Sendrecv(&rank, 1, MPI_INT, 0, 5, &other, 1, MPI_INT, 0, 5,
                            inter, MPI_STATUS_IGNORE));
        CHECK(other == highest_of(1 - color), "intercomm peer %d", other);
    }
    MPI_Comm_free(&inter);
    MPI_Comm_free(&quarter);
    MPI_Comm_free(&half);
}

/* Same source, same tag on world and on a dup: each message must land
   on its own communicator, whichever is received first. */
static void dup(void)
{
    MPI_Comm d1, d2;
    MPI_OK(MPI_Comm_dup(MPI_COMM_WORLD, &d1));
    MPI_OK(MPI_Comm_dup(d1, &d2));
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    for (int round = 0; round < 20; round++) {
        MPI_Request rq[6];
        int out[3] = {rank * 10 + 1, rank * 10 + 2, rank * 10 + 3};
        int in[3] = {-1, -1, -1};
        /* post receives in the opposite order to the sends */
        MPI_OK(MPI_Irecv(&in[2], 1, MPI_INT, left, 9, d2, &rq[0]));
        MPI_OK(MPI_Irecv(&in[1], 1, MPI_INT, left, 9, d1, &rq[1]));
        MPI_OK(MPI_Irecv(&in[0], 1, MPI_INT, left, 9, MPI_COMM_WORLD, &rq[2]));
        MPI_OK(MPI_Isend(&out[0], 1, MPI_INT, right, 9, MPI_COMM_WORLD,
                         &rq[3]));
        MPI_OK(MPI_Isend(&out[1], 1, MPI_INT, right, 9, d1, &rq[4]));
        MPI_OK(MPI_Isend(&out[2], 1, MPI_INT, right, 9, d2, &rq[5]));
        MPI_OK(MPI_Waitall(6, rq, MPI_STATUSES_IGNORE));
        for (int c = 0; c < 3; c++)
            CHECK(in[c] == left * 10 + c + 1, "dup round %d: comm %d got %d",
                  round, c, in[c]);
    }
    ring_and_sum(d2, "dup of dup");
    MPI_Comm_free(&d2);
    MPI_Comm_free(&d1);
}

static void shared_and_group(void)
{
    MPI_Comm node;
    MPI_OK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank,
                               MPI_INFO_NULL, &node));
    ring_and_sum(node, "split_type shared");
    MPI_Comm_free(&node);

    /* the even world ranks, created from a group */
    MPI_Group world, evens;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int range[1][3] = {{0, nranks - 1, 2}};
    MPI_Group_range_incl(world, 1, range, &evens);
    MPI_Comm ec;
    MPI_OK(MPI_Comm_create(MPI_COMM_WORLD, evens, &ec));
    CHECK((rank % 2 == 0) == (ec != MPI_COMM_NULL), "comm_create membership");
    if (ec != MPI_COMM_NULL) {
        ring_and_sum(ec, "comm_create");
        MPI_Comm_free(&ec);
    }
    MPI_Group_free(&evens);
    MPI_Group_free(&world);
}

int main(int argc, char **argv)
{
    mt_init(&argc, &argv, &rank, &nranks);
    CHECK(nranks >= 2, "needs at least 2 ranks, got %d", nranks);
    for (int it = 0; it < 3; it++) {
        split();
        dup();
        shared_and_group();
    }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("PASS comm (%d ranks)\n", nranks);
    MPI_Finalize();
    return 0;
}
