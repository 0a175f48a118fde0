/*
 * Failure path: one rank dies of SIGSEGV, with the library Debian's
 * libfabric links for its psm provider (libpsm_infinipath) loaded from
 * the rank's start, as a program that uses that libfabric has it. That
 * library installs signal handlers that turn a crash into an ordinary
 * exit unless IPATH_NO_BACKTRACE is set, and the launcher would then
 * take the rank for one that finished. The job must end with a non-zero
 * status and the launcher's line naming the rank (or its instance) and
 * the signal. The others wait in a barrier the dead rank never reaches.
 * Arguments: the rank that crashes (default 1), the library (default
 * Debian's libpsm_infinipath; "-" for none).
 */
#include "mpitest.h"

#include <unistd.h>

#define PRELOADED "IVCLOUD_CRASH_PRELOADED"

int main(int argc, char **argv)
{
    const char *lib = argc > 2 ? argv[2]
        : "/usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1";
    if (strcmp(lib, "-") != 0 && !getenv(PRELOADED)) {
        /* before anything of MPI: the library's constructors run first */
        setenv("LD_PRELOAD", lib, 1);
        setenv(PRELOADED, "1", 1);
        execv("/proc/self/exe", argv);
        perror("crash: re-exec");
        return 1;
    }
    int rank, nranks;
    mt_init(&argc, &argv, &rank, &nranks);
    int victim = argc > 1 ? atoi(argv[1]) : 1;
    CHECK(victim >= 0 && victim < nranks, "no rank %d of %d", victim, nranks);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == victim) {
        printf("crash: rank %d dies of SIGSEGV\n", rank);
        fflush(stdout);
        volatile int *nowhere = NULL;
        *nowhere = 1;
    }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    MPI_Finalize();
    return 0;
}
