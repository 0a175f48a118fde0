/*
 * A sender's last messages outlive it: every rank but 0 sends rank 0
 * `count` eager messages (MPI_Send completes locally) and finalizes at
 * once; rank 0 reads nothing for `delay_ms`, then receives them all, in
 * order and intact. Run with the finalize fence skipped
 * (`--mca async_mpi_finalize 1`), as a fence that releases ranks early
 * would: the senders then leave the region before rank 0 has read what
 * they published. MPI requires the messages to arrive all the same.
 *
 *   last_words [count] [delay_ms]
 */
#include "mpitest.h"

#include <time.h>

static unsigned char byte_of(int rank, int i, int k)
{
    return (unsigned char)(rank * 37 + i * 11 + k);
}

int main(int argc, char **argv)
{
    int rank, size;
    mt_init(&argc, &argv, &rank, &size);
    const int count = argc > 1 ? atoi(argv[1]) : 8;
    const int delay_ms = argc > 2 ? atoi(argv[2]) : 1500;
    CHECK(size >= 2 && count >= 1 && count <= 1000, "bad arguments");
    unsigned char buf[512];
    if (rank != 0) {
        for (int i = 0; i < count; i++) {
            int n = 1 + (i * 29 + rank) % (int)sizeof buf;
            for (int k = 0; k < n; k++)
                buf[k] = byte_of(rank, i, k);
            MPI_OK(MPI_Send(buf, n, MPI_BYTE, 0, i, MPI_COMM_WORLD));
        }
        MPI_Finalize();
        return 0;
    }
    struct timespec pause = {delay_ms / 1000, (long)(delay_ms % 1000) * 1000000};
    nanosleep(&pause, NULL); /* no MPI call: nothing is read meanwhile */
    for (int src = 1; src < size; src++)
        for (int i = 0; i < count; i++) {
            MPI_Status st;
            int n = 1 + (i * 29 + src) % (int)sizeof buf, got = -1;
            MPI_OK(MPI_Recv(buf, sizeof buf, MPI_BYTE, src, i, MPI_COMM_WORLD,
                            &st));
            MPI_Get_count(&st, MPI_BYTE, &got);
            CHECK(got == n, "message %d of rank %d: %d bytes, not %d", i, src,
                  got, n);
            for (int k = 0; k < n; k++)
                CHECK(buf[k] == byte_of(src, i, k),
                      "message %d of rank %d: byte %d wrong", i, src, k);
        }
    printf("PASS last_words (%d ranks, %d messages each)\n", size - 1, count);
    fflush(stdout);
    MPI_Finalize();
    return 0;
}
