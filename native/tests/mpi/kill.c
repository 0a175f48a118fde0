/*
 * Failure path: ranks exchange messages, then rank 1 dies by SIGKILL in
 * the middle of the job (no MPI_Finalize, no clean detach). The job as a
 * whole must then end with a non-zero status in bounded time instead of
 * hanging in a receive that can never complete. Arguments: round trips
 * before the kill (default 200).
 */
#include "mpitest.h"

#include <signal.h>

int main(int argc, char **argv)
{
    int rank, nranks;
    mt_init(&argc, &argv, &rank, &nranks);
    CHECK(nranks >= 2, "needs at least 2 ranks, got %d", nranks);
    long before = argc > 1 ? atol(argv[1]) : 200;
    char buf[4096];
    memset(buf, rank, sizeof buf);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    for (long i = 0;; i++) {
        if (rank == 1 && i == before) {
            printf("kill: rank 1 raising SIGKILL after %ld round trips\n", i);
            fflush(stdout);
            raise(SIGKILL);
        }
        if (rank == 0) {
            MPI_OK(MPI_Send(buf, (int)sizeof buf, MPI_BYTE, 1, 0,
                            MPI_COMM_WORLD));
            MPI_OK(MPI_Recv(buf, (int)sizeof buf, MPI_BYTE, 1, 0,
                            MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        } else if (rank == 1) {
            MPI_OK(MPI_Recv(buf, (int)sizeof buf, MPI_BYTE, 0, 0,
                            MPI_COMM_WORLD, MPI_STATUS_IGNORE));
            MPI_OK(MPI_Send(buf, (int)sizeof buf, MPI_BYTE, 0, 0,
                            MPI_COMM_WORLD));
        } else {
            /* bystanders wait in a collective that cannot complete */
            MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
        }
    }
    /* not reached: the loop only ends by the job being torn down */
}
