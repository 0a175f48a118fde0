"""The real applications as workloads (ivcloud.apps): input files they
accept, and parsers checked against the output of real, tiny runs of
Debian's hpcc and OpenFOAM under Open MPI over our BTL."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ivcloud.mpis import local, openmpi, regions
from ivcloud.apps import hpcc, openfoam
from ivcloud.errors import InvalidRequest, OperationFailed


def _run_mpi(argv, np, cwd, env_extra, timeout=300):
    env = dict(os.environ, **env_extra)
    with regions.private_region(np) as region:
        cmd = local.mpirun_command(argv, np, transport="ivshmem",
                                 region=str(region), verbose_btl=True)
        # every rank gets the application's environment
        for key in env_extra:
            cmd[1:1] = ["-x", key]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)


# ------------------------------------------------------------------ hpcc

def test_hpcc_grid_is_the_most_square():
    assert hpcc.grid(1) == (1, 1)
    assert hpcc.grid(2) == (1, 2)
    assert hpcc.grid(4) == (2, 2)
    assert hpcc.grid(6) == (2, 3)
    assert hpcc.grid(7) == (1, 7)
    with pytest.raises(InvalidRequest):
        hpcc.grid(0)


def test_hpcc_input_has_the_lines_hpcc_reads():
    lines = hpcc.input_text(4, 1000).splitlines()
    assert lines[5].split()[0] == "1000"          # Ns
    assert lines[10].split()[0] == "2"            # Ps
    assert lines[11].split()[0] == "2"            # Qs
    assert lines[31].startswith("#####")          # the ignored line 32
    with pytest.raises(InvalidRequest):
        hpcc.input_text(2, 10)


def test_hpcc_summary_parser_refuses_broken_output():
    with pytest.raises(OperationFailed, match="no summary"):
        hpcc.parse_summary("HPL started\n")
    with pytest.raises(OperationFailed, match="failed run"):
        hpcc.parse_summary("Begin of Summary section.\nSuccess=0\n"
                           "End of Summary section.\n")


@pytest.mark.skipif(shutil.which("hpcc") is None, reason="needs hpcc")
def test_hpcc_runs_over_ivshmem_and_parses(tmp_path):
    work = hpcc.prepare(tmp_path / "hpcc", 2, 400)
    proc = _run_mpi(hpcc.command(), 2, work, hpcc.ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    values = hpcc.results(work)
    assert set(values) == {k for k, *_ in hpcc.METRICS}
    assert all(v > 0 for v in values.values()), values
    # both ranks talked through the region
    counters = openmpi.parse_btl_counters(proc.stdout + proc.stderr)
    assert set(counters) == {0, 1}
    assert all(c["sent_msgs"] > 0 for c in counters.values())


# -------------------------------------------------------------- openfoam

def test_openfoam_split_prefers_x():
    assert openfoam.split(1) == (1, 1)
    assert openfoam.split(2) == (2, 1)
    assert openfoam.split(4) == (2, 2)
    assert openfoam.split(6) == (3, 2)
    with pytest.raises(InvalidRequest):
        openfoam.split(0)


def test_openfoam_log_parser():
    log = ("Time = 1\n\nExecutionTime = 0.01 s  ClockTime = 0 s\n\n"
           "Time = 2\n\nExecutionTime = 0.25 s  ClockTime = 1 s\n\nEnd\n")
    assert openfoam.execution_time(log) == 0.25
    with pytest.raises(OperationFailed, match="no ExecutionTime"):
        openfoam.execution_time("Time = 1\n")
    with pytest.raises(OperationFailed, match="End"):
        openfoam.execution_time("ExecutionTime = 0.01 s  ClockTime = 0 s\n")


@pytest.mark.skipif(shutil.which("simpleFoam") is None,
                    reason="needs openfoam")
def test_openfoam_pitzdaily_runs_over_ivshmem_and_parses(tmp_path):
    case = openfoam.prepare(tmp_path / "pitz", 2, 5, dict(os.environ))
    assert (case / "processor0").is_dir() and (case / "processor1").is_dir()
    proc = _run_mpi(openfoam.command(case, 2), 2, case, {})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert openfoam.execution_time(proc.stdout) > 0
    assert "Time = 5" in proc.stdout
    counters = openmpi.parse_btl_counters(proc.stdout + proc.stderr)
    assert set(counters) == {0, 1}
