/*
 * MPI_Comm_spawn over the ivshmem BTL (tests/test_btl_trust.py): the
 * spawned job is another jobid, so its ranks become trusted senders only
 * through ob1's add_procs at connect time (modex check), never through
 * the job tag in the registry. 2 parents spawn 2 children; each pair
 * exchanges a checked eager and a checked rendezvous message, then all 4
 * allreduce over the merged communicator. Prints "PASS trust_spawn".
 */
#include "trust_check.h"

#include <mpi.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parent r sends seed 1 to child r, which answers with seed 2. */
static void exchange(MPI_Comm inter, int parent_side, size_t n)
{
    unsigned char *b = malloc(n ? n : 1);
    if (!b)
        fail("malloc", (long)n, 0);
    MPI_Status st;
    int got;
    if (parent_side) {
        for (size_t i = 0; i < n; i++)
            b[i] = pattern(1, i);
        MPI_Send(b, (int)n, MPI_BYTE, rank, 1, inter);
        MPI_Recv(b, (int)n, MPI_BYTE, rank, 2, inter, &st);
    } else {
        MPI_Recv(b, (int)n, MPI_BYTE, rank, 1, inter, &st);
    }
    MPI_Get_count(&st, MPI_BYTE, &got);
    if ((size_t)got != n)
        fail("length", got, (long)n);
    uint32_t seed = parent_side ? 2 : 1;
    for (size_t i = 0; i < n; i++)
        if (b[i] != pattern(seed, i))
            fail("payload mismatch at byte", (long)i, (long)n);
    if (!parent_side) {
        for (size_t i = 0; i < n; i++)
            b[i] = pattern(2, i);
        MPI_Send(b, (int)n, MPI_BYTE, rank, 2, inter);
    }
    free(b);
}

int main(int argc, char **argv)
{
    MPI_Comm parent, inter, all;
    int nranks;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    MPI_Comm_get_parent(&parent);
    int parent_side = parent == MPI_COMM_NULL;
    if (nranks != 2)
        fail("needs 2 ranks (and spawns 2)", nranks, 2);
    if (parent_side) {
        int errs[2];
        MPI_Comm_spawn(argv[0], MPI_ARGV_NULL, 2, MPI_INFO_NULL, 0,
                       MPI_COMM_WORLD, &inter, errs);
        if (errs[0] != MPI_SUCCESS || errs[1] != MPI_SUCCESS)
            fail("spawn", errs[0], errs[1]);
    } else {
        inter = parent;
    }
    exchange(inter, parent_side, 100);
    exchange(inter, parent_side, 300000);
    MPI_Intercomm_merge(inter, parent_side ? 0 : 1, &all);
    long mine = 1, sum = 0;
    MPI_Allreduce(&mine, &sum, 1, MPI_LONG, MPI_SUM, all);
    if (sum != 4)
        fail("allreduce over parents and children", sum, 4);
    MPI_Comm_free(&all);
    MPI_Comm_disconnect(&inter);
    if (parent_side && rank == 0)
        printf("PASS trust_spawn\n");
    MPI_Finalize();
    return 0;
}
