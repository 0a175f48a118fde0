"""Many ranks in one region: 128 real Open MPI ranks on this
2-core machine, oversubscribed (blocking waits: Open MPI yields when
idle, the BTL spins then blocks), every inter-rank byte through the
ivshmem BTL (`--mca btl self,ivshmem`, no tcp in the list) in one
private region that `ivcloud mpirun` sizes from the linear formula.

- native/btl/tests/scale_check.c: a ring of sendrecvs (eager and
  rendezvous), fan-in with MPI_ANY_SOURCE from every rank to three roots
  (per-sender order and payload checked), and collectives (barrier,
  bcast/reduce from three roots, allreduce, allgather, alltoall,
  gather/scatter), all content-checked, bounded work per rank.
- native/tests/mpi/p2p.c, the p2p suite of tests/test_mpi_btl.py
  (ANY_SOURCE/ANY_TAG, probes, ordering, many outstanding requests), at
  128 ranks with sizes up to 1 MiB.
- scale_check with SERVER_RANKS ranks attached through `ivcloud server`
  (ivshmem-server with --max-peers 160 and small queues, so senders
  contend): every rank holds an eventfd per peer, and the server's
  connection cap and descriptor budget follow max_peers. (128 ranks
  through a server on a loaded 2-core machine sometimes miss the
  attach deadline or stall, hence SERVER_RANKS below 128.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from ivcloud.mpis import openmpi
from ivcloud.errors import IvcloudError

REPO = Path(__file__).resolve().parent.parent
SCALE = REPO / "native" / "btl" / "tests" / "scale_check.c"
P2P = REPO / "native" / "tests" / "mpi" / "p2p.c"
RANKS = 128
SERVER_RANKS = 64
JOB_TIMEOUT = 240  # s: a hang fails the test, it does not hold the suite


@pytest.fixture(scope="module")
def programs(mpicc) -> Dict[str, Path]:
    return {"scale": mpicc(SCALE), "p2p": mpicc(P2P)}


@pytest.fixture(scope="module")
def component() -> Path:
    try:
        return openmpi.component_dir()
    except IvcloudError as e:
        pytest.fail(str(e))


def _private_regions() -> List[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("ivcloud-mpi-*"))


def _ivcloud(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _ivcloud_mpirun(np: int, program: List[str],
                    attach: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`ivcloud mpirun` as a user runs it: private region (unless
    `attach` names one), counters on, self,ivshmem only. In its own
    session, killed whole on a timeout."""
    cmd = [sys.executable, "-m", "ivcloud", "mpirun", "-np", str(np),
           "--verbose-btl", "--no-tcp-fallback", *attach, "--"] + program
    env = {k: v for k, v in os.environ.items()
           if k not in ("IVSHM_REGION", "IVSHM_SOCKET")}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{np} ranks: no end within {JOB_TIMEOUT} s\n"
                    f"{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _described(job) -> str:
    """A failed job for an assertion message: its exit status, the end of
    its stdout, and what its stderr says besides the per-rank counter
    lines (128 of those would push an error message out of view)."""
    counters = openmpi.parse_btl_counters(job.stderr)
    other = [ln for ln in job.stderr.splitlines()
             if not ln.startswith("btl_ivshmem: rank ")]
    said = "\n".join(other)
    return (f"exit {job.returncode}\n{job.stdout[-2000:]}\n"
            f"counter lines of {len(counters)} ranks; the rest of stderr:\n"
            f"{said[-4000:]}")


def _assert_all_ranks_used_the_region(job, np: int) -> None:
    described = _described(job)
    counters = openmpi.parse_btl_counters(job.stderr)
    assert sorted(counters) == list(range(np)), described
    for rank, c in counters.items():
        assert c["sent_msgs"] > 0 and c["recv_msgs"] > 0, (rank, c)
        assert c["sent_bytes"] > 0 and c["recv_bytes"] > 0, (rank, c)


def test_128_ranks_in_one_region(programs, component):
    before = _private_regions()
    t0 = time.monotonic()
    job = _ivcloud_mpirun(RANKS, [str(programs["scale"]), "2"])
    seconds = time.monotonic() - t0
    assert job.returncode == 0, _described(job)
    assert f"PASS scale_check {RANKS} ranks" in job.stdout, job.stdout
    _assert_all_ranks_used_the_region(job, RANKS)
    # the fan-in roots heard from every other rank through the region
    counters = openmpi.parse_btl_counters(job.stderr)
    for root in (0, RANKS // 2, RANKS - 1):
        assert counters[root]["recv_msgs"] >= 2 * 6 * (RANKS - 1), \
            (root, counters[root])
    assert _private_regions() == before, "the private region was left behind"
    print(f"scale_check: {RANKS} ranks in {seconds:.1f} s")


def test_128_ranks_p2p_suite(programs, component):
    job = _ivcloud_mpirun(RANKS, [str(programs["p2p"]), "1"])
    assert job.returncode == 0, _described(job)
    assert "PASS p2p" in job.stdout, job.stdout
    _assert_all_ranks_used_the_region(job, RANKS)


def test_many_ranks_through_ivshmem_server(programs, component, tmp_path,
                                           unique):
    run_dir = tmp_path / "run"
    common = ["--name", unique, "--run-dir", run_dir]
    proc = _ivcloud("server", "start", *common, "--size", "512M",
                    "--max-peers", "160", "--queue-slots", "16",
                    "--fast-channels", "4")
    assert proc.returncode == 0, proc.stderr
    try:
        status = json.loads(_ivcloud("server", "status", *common,
                                     "--json").stdout)
        pid = status["pid"]
        limits = Path(f"/proc/{pid}/limits").read_text()
        soft = int(next(ln for ln in limits.splitlines()
                        if ln.startswith("Max open files")).split()[3])
        # the default cap (2 x max-peers clients of 1 + 1 fds) fits
        assert soft >= 2 * 160 * 2, limits
        job = _ivcloud_mpirun(SERVER_RANKS, [str(programs["scale"]), "1"],
                              ["--socket", run_dir / unique / "ivshmem.sock"])
        assert job.returncode == 0, _described(job)
        assert f"PASS scale_check {SERVER_RANKS} ranks" in job.stdout, \
            job.stdout
        _assert_all_ranks_used_the_region(job, SERVER_RANKS)
    finally:
        _ivcloud("server", "stop", *common)
