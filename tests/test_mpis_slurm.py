"""MPICH from PyPI under the cluster's Slurm (`cluster up --scheduler
slurm`, `cluster srun -- --mpi=pmi2 ...`): its tasks find the provider
`ivshm` and the job's region through the TaskProlog's variables alone
(ivcloud/cluster/slurm/conf.py, TASK_MPIS), and the two ranks on
co-resident instances talk over the region; a task that crashes fails
the step. Open MPI 5 and Intel MPI need values for keys the table sets
otherwise: `cluster srun --mpi NAME` gives them (conf.job_mpi_env)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from ivcloud.mpis import provider
from mpis_support import ofi_programs, ranks  # noqa: F401 (fixture)
from test_cluster import RUN_DIR, assert_gone, ivcloud, new_name

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="cluster tests need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None
                       or shutil.which("munged") is None,
                       reason="Slurm (slurmctld, slurmd, munge) not installed"),
]


def test_mpich_srun_uses_the_region_without_options(ofi_programs):
    name = new_name()
    up = ivcloud("cluster", "up", "--name", name, "--servers", 1,
                 "--instances-per-server", 2, "--vcpus", 1,
                 "--oversubscribe", "--scheduler", "slurm")
    snapshot = {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        snapshot = json.loads((RUN_DIR / f"cluster-{name}" /
                               "state.json").read_text())
        # only the report switch is ours (--report-transport: srun's
        # environment, which Slurm hands to the tasks): everything else
        # comes from the TaskProlog
        proc = ivcloud("cluster", "srun", "--name", name,
                       "--report-transport", "--",
                       "--mpi=pmi2", "--nodes=2", "--ntasks-per-node=1",
                       *ofi_programs("mpich", "pairs"), timeout=120)
        out = assert_pair_over_region(proc)
        # a task that crashes (with Debian's psm library loaded, whose
        # handlers would make the crash an ordinary exit: the TaskProlog's
        # variables stop them) fails the step, and srun names it
        proc = ivcloud("cluster", "srun", "--name", name, "--",
                       "--mpi=pmi2", "--nodes=2", "--ntasks-per-node=1",
                       *ofi_programs("mpich", "crash"), "1", timeout=120)
        out = proc.stdout + proc.stderr
        assert "crash: rank 1 dies of SIGSEGV" in out, out
        assert proc.returncode != 0, out
        assert re.search(r"task 1: Segmentation fault", out), out
    finally:
        if (RUN_DIR / f"cluster-{name}").exists():
            down = ivcloud("cluster", "down", "--name", name)
            assert down.returncode == 0, down.stderr
        assert_gone(name, snapshot)


def assert_pair_over_region(proc):
    """The `pairs` program's two ranks, one on each instance, passed and
    sent and received over the region, nothing delegated (their
    --report-transport lines); srun's whole output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "pairs ok: sum 3" in proc.stdout, out
    assert {w["host"] for w in ranks(proc.stdout).values()} == \
        {"s0i0", "s0i1"}, out
    lines = provider.parse_reports(out)
    assert len(lines) == 2, out
    for counts in lines.values():
        assert counts["sent"] > 0 and counts["received"] > 0, out
        assert counts["delegated"] == 0, out
    return out

@pytest.mark.parametrize("mpi", ["openmpi5", "impi"])
def test_srun_mpi_gives_the_flavours_settings(ofi_programs, mpi):
    """`cluster srun --mpi NAME`: srun's environment carries the MPI's
    variables and its PMI plugin (no --mpi= of the job's), and the two
    ranks on co-resident instances talk over the region. Intel MPI
    loads Slurm's PMI-2 library where the host has it, else speaks
    PMI-1 to Slurm's pmi2 plugin (its startup report says which)."""
    from ivcloud.mpis import impi
    name = new_name()
    up = ivcloud("cluster", "up", "--name", name, "--servers", 1,
                 "--instances-per-server", 2, "--vcpus", 1,
                 "--oversubscribe", "--scheduler", "slurm")
    snapshot = {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        snapshot = json.loads((RUN_DIR / f"cluster-{name}" /
                               "state.json").read_text())
        debug = ["--export=ALL,I_MPI_DEBUG=5"] if mpi == "impi" else []
        proc = ivcloud("cluster", "srun", "--name", name, "--mpi", mpi,
                       "--report-transport", "--", *debug, "--nodes=2",
                       "--ntasks-per-node=1",
                       *ofi_programs(mpi, "pairs"), timeout=120)
        out = assert_pair_over_region(proc)
        if debug:
            api = "pmi2" if impi.PMI2_LIBRARY.is_file() else "pmi"
            assert re.search(rf"PMI API: {api}$", out, re.M), out
    finally:
        if (RUN_DIR / f"cluster-{name}").exists():
            down = ivcloud("cluster", "down", "--name", name)
            assert down.returncode == 0, down.stderr
        assert_gone(name, snapshot)
