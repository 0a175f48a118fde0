"""`ivcloud cluster mpirun --mpi mpich|impi|openmpi5`: each MPI's own
launcher starts the ranks in real namespace instances through the
cluster's agent (ranks on s0i0 and s0i1, one server)."""

from __future__ import annotations

import os

import pytest

from mpis_support import (OFI, mpirun, ofi_cluster,  # noqa: F401 (fixtures)
                          ofi_programs, ranks)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="cluster tests need root")


@pytest.mark.parametrize("mpi", OFI)
def test_mpi4py_over_libfabric_tcp(mpi, ofi_cluster, ofi_programs):
    name, _ = ofi_cluster
    proc = mpirun(name, mpi, "tcp", 2, ofi_programs(mpi, "mpi4py") + ["4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi4py ok: allreduce 3, 4 x 1 MiB ping-pong" in proc.stdout
    assert {r: w["host"] for r, w in ranks(proc.stdout).items()} == \
        {0: "s0i0", 1: "s0i1"}
    # the provider of ours never loaded
    assert "fi_ivshm:" not in proc.stdout + proc.stderr
