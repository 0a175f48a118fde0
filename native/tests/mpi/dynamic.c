/*
 * Dynamic MPI: a window created dynamic reports what the standard says
 * (size 0, displacement unit 1) before and after memory is attached and
 * takes a put into attached memory; then ranks 0 and 1 meet through a
 * port (MPI_Open_port, MPI_Comm_accept / MPI_Comm_connect on
 * MPI_COMM_SELF) and exchange messages both ways over the new
 * intercommunicator. Any number of ranks >= 2; the others only take part
 * in the window.
 */
#include "mpitest.h"

static int rank, nranks;

static MPI_Aint win_size(MPI_Win win)
{
    MPI_Aint *v = NULL;
    int flag = 0;
    MPI_OK(MPI_Win_get_attr(win, MPI_WIN_SIZE, &v, &flag));
    CHECK(flag && v, "MPI_WIN_SIZE not set");
    return *v;
}

static void dynamic_window(void)
{
    MPI_Win win;
    MPI_OK(MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, &win));
    CHECK(win_size(win) == 0, "dynamic window: MPI_WIN_SIZE %ld want 0",
          (long)win_size(win));
    int *unit = NULL, flag = 0;
    MPI_OK(MPI_Win_get_attr(win, MPI_WIN_DISP_UNIT, &unit, &flag));
    CHECK(flag && unit && *unit == 1, "dynamic window: MPI_WIN_DISP_UNIT %d",
          unit ? *unit : -1);
    int *mem = mt_alloc(4 * sizeof *mem);
    for (int i = 0; i < 4; i++)
        mem[i] = -1;
    MPI_OK(MPI_Win_attach(win, mem, 4 * sizeof *mem));
    CHECK(win_size(win) == 0, "after attach: MPI_WIN_SIZE %ld want 0",
          (long)win_size(win));
    MPI_Aint mine, right_base;
    MPI_OK(MPI_Get_address(mem, &mine));
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    MPI_OK(MPI_Sendrecv(&mine, 1, MPI_AINT, left, 5, &right_base, 1, MPI_AINT,
                        right, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    MPI_OK(MPI_Win_lock(MPI_LOCK_SHARED, right, 0, win));
    MPI_OK(MPI_Put(&rank, 1, MPI_INT, right, right_base, 1, MPI_INT, win));
    MPI_OK(MPI_Win_unlock(right, win));
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    MPI_OK(MPI_Win_lock(MPI_LOCK_SHARED, rank, 0, win));
    CHECK(mem[0] == left, "put into attached memory: %d want %d", mem[0], left);
    MPI_OK(MPI_Win_unlock(rank, win));
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    MPI_OK(MPI_Win_detach(win, mem));
    MPI_OK(MPI_Win_free(&win));
    free(mem);
}

static void accept_connect(void)
{
    char port[MPI_MAX_PORT_NAME] = "";
    MPI_Comm inter = MPI_COMM_NULL;
    if (rank == 0) {
        MPI_OK(MPI_Open_port(MPI_INFO_NULL, port));
        MPI_OK(MPI_Send(port, MPI_MAX_PORT_NAME, MPI_CHAR, 1, 9,
                        MPI_COMM_WORLD));
        MPI_OK(MPI_Comm_accept(port, MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter));
    } else if (rank == 1) {
        MPI_OK(MPI_Recv(port, MPI_MAX_PORT_NAME, MPI_CHAR, 0, 9,
                        MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        MPI_OK(MPI_Comm_connect(port, MPI_INFO_NULL, 0, MPI_COMM_SELF,
                                &inter));
    }
    if (rank < 2) {
        MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
        int remote = 0;
        MPI_OK(MPI_Comm_remote_size(inter, &remote));
        CHECK(remote == 1, "remote group of %d", remote);
        /* a small and a large message each way */
        int v = 100 + rank, got = -1;
        MPI_OK(MPI_Sendrecv(&v, 1, MPI_INT, 0, 1, &got, 1, MPI_INT, 0, 1,
                            inter, MPI_STATUS_IGNORE));
        CHECK(got == 101 - rank, "intercomm: got %d want %d", got, 101 - rank);
        size_t n = 1 << 20;
        unsigned char *out = mt_alloc(n), *in = mt_alloc(n);
        for (size_t i = 0; i < n; i++)
            out[i] = (unsigned char)(i * 7 + (size_t)rank);
        MPI_OK(MPI_Sendrecv(out, (int)n, MPI_BYTE, 0, 2, in, (int)n, MPI_BYTE,
                            0, 2, inter, MPI_STATUS_IGNORE));
        for (size_t i = 0; i < n; i++)
            CHECK(in[i] == (unsigned char)(i * 7 + (size_t)(1 - rank)),
                  "intercomm: byte %zu", i);
        free(out);
        free(in);
        MPI_OK(MPI_Comm_disconnect(&inter));
        if (rank == 0)
            MPI_OK(MPI_Close_port(port));
    }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
}

int main(int argc, char **argv)
{
    mt_init(&argc, &argv, &rank, &nranks);
    CHECK(nranks >= 2, "needs 2 ranks, got %d", nranks);
    const char *only = argc > 1 ? argv[1] : "all";
    if (!strcmp(only, "all") || !strcmp(only, "window"))
        dynamic_window();
    if (!strcmp(only, "all") || !strcmp(only, "accept"))
        accept_connect();
    if (rank == 0)
        printf("PASS dynamic %s (%d ranks)\n", only, nranks);
    MPI_Finalize();
    return 0;
}
