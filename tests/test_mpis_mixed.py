"""A job of 3 ranks on 2 servers with each libfabric MPI: ranks 0 and 1
on the two instances of server 0 share its region, rank 2 on server 1 is
alone in its own. Every pair exchanges 100 messages; the provider's
lines show the co-resident pair over the region and every pair with
rank 2 handed to the delegated core provider (tcp)."""

from __future__ import annotations

import os

import pytest

from mpis_support import (OFI, mpirun, ofi_cluster,  # noqa: F401 (fixtures)
                          ofi_programs, ranks, reports_by_rank)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="cluster tests need root")


@pytest.mark.parametrize("mpi", OFI)
def test_co_resident_pair_over_the_region_rest_delegated(mpi, ofi_cluster,
                                                         ofi_programs):
    name, _ = ofi_cluster
    # round-robin lists the instances instance-major: s0i0, s1i0, s0i1
    proc = mpirun(name, mpi, "ivshmem", 3, ofi_programs(mpi, "pairs"),
                  "--placement", "round-robin", "--report-transport")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "pairs ok: sum 6" in proc.stdout, out
    hosts = {r: w["host"] for r, w in ranks(proc.stdout).items()}
    assert hosts == {0: "s0i0", 1: "s1i0", 2: "s0i1"}, out
    reports = reports_by_rank(proc)
    # s0i0 and s0i1 (ranks 0 and 2): each other over the region, rank 1
    # through the core provider
    for rank in (0, 2):
        assert reports[rank]["sent"] >= 100, reports
        assert reports[rank]["received"] >= 100, reports
        assert reports[rank]["delegated"] >= 100, reports
    # s1i0 is alone in its server's region: everything delegated
    assert reports[1]["sent"] == reports[1]["received"] == 0, reports
    assert reports[1]["delegated"] >= 200, reports
