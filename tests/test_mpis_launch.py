"""`ivcloud cluster mpirun --mpi mpich|impi|openmpi5`: each MPI's own
launcher starts the ranks in real namespace instances through the
cluster's agent (ranks on s0i0 and s0i1, one server), over libfabric's
tcp provider and over ours, `ivshm`, whose per-process lines
(--report-transport) show that the region carried the traffic."""

from __future__ import annotations

import os

import pytest

from ivcloud.mpis import provider
from mpis_support import (CORRECTNESS, CORRECTNESS_ARGS, OFI,  # noqa: F401
                          mpirun, ofi_cluster, ofi_programs, ranks,
                          reports_by_rank)

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


def _over_the_region(reports, rank):
    r = reports[rank]
    return r["sent"] > 0 and r["received"] > 0


def _correctness_cases():
    for program in CORRECTNESS:
        for mpi in OFI:
            yield pytest.param(mpi, program, id=f"{program}-{mpi}")


@pytest.mark.parametrize("mpi,program", list(_correctness_cases()))
def test_correctness_over_ivshm(mpi, program, ofi_cluster, ofi_programs):
    """p2p (incl. ANY_SOURCE), collectives and one-sided between two
    instances of one server: every rank's provider line shows its
    traffic over the region and nothing delegated."""
    name, _ = ofi_cluster
    proc = mpirun(name, mpi, "ivshmem", 2,
                  ofi_programs(mpi, program) + CORRECTNESS_ARGS[program],
                  "--report-transport")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"PASS {program} (2 ranks" in proc.stdout, out
    lines = provider.parse_reports(out)
    assert len(lines) == 2, out
    for counts in lines.values():
        assert counts["sent"] > 0 and counts["received"] > 0, out
        assert counts["delegated"] == 0, out


@pytest.mark.parametrize("mpi", OFI)
def test_mpi4py_over_ivshm(mpi, ofi_cluster, ofi_programs):
    """mpi4py's allreduce and a 1 MiB ping-pong (8 rounds) between two
    instances, carried by the region."""
    name, _ = ofi_cluster
    proc = mpirun(name, mpi, "ivshmem", 2,
                  ofi_programs(mpi, "mpi4py") + ["8"], "--report-transport")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi4py ok: allreduce 3, 8 x 1 MiB ping-pong" in proc.stdout
    reports = reports_by_rank(proc)
    assert {r: w["host"] for r, w in ranks(proc.stdout).items()} == \
        {0: "s0i0", 1: "s0i1"}
    for rank in (0, 1):
        # at least one message per ping and per pong
        assert reports[rank]["sent"] >= 8 and \
            reports[rank]["received"] >= 8, reports
        assert reports[rank]["delegated"] == 0, reports
