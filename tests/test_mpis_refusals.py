"""Bad input to `ivcloud cluster mpirun --mpi`: one line on stderr, exit
status 2, before anything starts (no cluster needed to refuse)."""

from __future__ import annotations

import os
import sys
import subprocess

import pytest

from test_cluster import new_name, one_line_error


def mpirun(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
         new_name(), *args, "-np", "2", "--", "/bin/true"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,env,words", [
    (["--mpi", "lam"], None, "unknown MPI 'lam'"),
    (["--mpi", "mpich"], {"IVCLOUD_MPI_DIR": "/nonexistent"},
     "MPICH 5.0.2 is not installed"),
    (["--mpi", "impi", "--transport", "tcp"],
     {"IVCLOUD_MPI_DIR": "/nonexistent"}, "Intel MPI 2021.18.1 is not "
                                          "installed"),
    (["--mpi", "openmpi5", "--transport", "ivshmem"],
     {"IVCLOUD_NATIVE_DIR": "/nonexistent"}, "provider 'ivshm' is not built"),
    (["--mpi", "mpich", "--transport", "tcp", "--report-transport"], None,
     "only the ivshmem transport"),
    (["--mpi", "impi", "--btl", "self,tcp"], None, "--btl applies to --mpi "
                                                   "openmpi only"),
    (["--mpi", "openmpi5", "--mca", "pml", "ob1"], None,
     "--mca applies to --mpi openmpi only"),
    (["--mpi", "mpich", "--transport", "shm"], None, "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(args, env, words):
    assert words in one_line_error(mpirun(*args, env=env))


@pytest.mark.parametrize("args,words", [
    (["--mpi", "lam"], "unknown MPI 'lam'"),
    (["--mpi", "openmpi5", "--transports", "shm"],
     "cannot use the shm transport"),
    (["--mpi", "mpich", "--transports", "vader"], "subset of"),
])
def test_bench_refuses_in_one_line(args, words):
    proc = subprocess.run([sys.executable, "-m", "ivcloud", "bench", "mpi",
                           *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert words in one_line_error(proc)


def test_bench_leaves_out_what_an_mpi_cannot_take():
    from ivcloud.bench import ofi as bench
    assert bench.OfiSettings.make("openmpi5").configs == \
        ["own-shm", "ivshmem", "tcp"]
    assert bench.OfiSettings.make("mpich").configs == bench.CONFIGS
