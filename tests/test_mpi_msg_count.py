"""native/bench/mpi_msg_count.py: instructions per 8-byte message under
Open MPI 5 over the provider, both ranks under callgrind
(docs/fast-path.md, "Open MPI 5 over the provider, counted"), and per
round trip of osu latency's shape under Open MPI 4.1 ("The ping-pong,
counted")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "native" / "bench" / "mpi_msg_count.py"


def run(*args, timeout=600):
    return subprocess.run([sys.executable, str(TOOL), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args", [
    ["--mpi", "impi"],
    ["--transport", "tcp"],
    ["--windows", "0"],
    ["--pace", "-1"],
    ["--windows", "x"],
    ["--colour", "red"],
    ["--shape", "zigzag"],
    ["--shape", "pingpong", "--mpi", "mpich"],
    ["--rounds", "0"],
    ["--wait", "0"],
])
def test_bad_arguments_exit_2_with_one_line(args):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].strip()


@pytest.mark.skipif(not os.environ.get("IVCLOUD_LONG"),
                    reason="30-60 s of valgrind: `make test-msg-count`")
def test_counts_open_mpi_5_over_the_provider(native_dir):
    if not shutil.which("valgrind"):
        pytest.skip("valgrind is not installed")
    if not (REPO / "build" / "mpi" / "openmpi5" / "bin" / "mpicc").exists():
        pytest.fail("build/mpi/openmpi5 missing: `make` installs the MPI "
                    "wheels", pytrace=False)
    proc = run("--mpi", "openmpi5", "--transport", "ivshm", "--windows", "20",
               "--idle", "200", "--pace", "1000",
               "--provider", str(native_dir / "provider"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # per rank: its total and the provider's share, both per message
    ranks = re.findall(r"^rank (\d) \((sender|receiver)\): ([\d.]+) per "
                       r"message \((\d+) misses taken out\)$", out, re.M)
    assert [r[:2] for r in ranks] == [("0", "sender"), ("1", "receiver")], out
    provider = [float(v) for v in
                re.findall(r"^\s+([\d.]+)\s+libivshm-fi\.so$", out, re.M)]
    assert len(provider) == 2, out
    for (_, _, total, _), share in zip(ranks, provider):
        # a send and a receive through the provider each cost it some
        # hundreds of instructions (docs/fast-path.md's table), and the
        # MPI's own layers cost more than nothing besides
        assert 100 < share < 2000, out
        assert share < float(total) < 10000, out
    both = re.search(r"^both ranks: ([\d.]+) per message$", out, re.M)
    assert both and float(both.group(1)) == pytest.approx(
        sum(float(r[2]) for r in ranks), abs=0.2), out


@pytest.mark.skipif(not os.environ.get("IVCLOUD_LONG"),
                    reason="10-20 s of valgrind: `make test-msg-count`")
@pytest.mark.parametrize("transport,btl", [("ivshm", "mca_btl_ivshmem.so"),
                                           ("own", "mca_btl_vader.so")])
def test_counts_open_mpi_4_round_trips(native_dir, transport, btl):
    """osu latency's shape under Debian's Open MPI 4.1, ob1 over our BTL
    or vader: per round trip and rank, each receive its post and the one
    poll that finds its message."""
    if not shutil.which("valgrind") or not shutil.which("mpicc"):
        pytest.skip("valgrind or Debian's Open MPI is not installed")
    if not (native_dir / "btl" / "mca_btl_ivshmem.so").exists():
        pytest.fail("no mca_btl_ivshmem.so: `make build`", pytrace=False)
    proc = run("--mpi", "openmpi4", "--transport", transport, "--shape",
               "pingpong", "--rounds", "100", "--wait", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    poll = re.search(r"a blocking receive's empty poll ([\d.]+) "
                     r"instructions \((\d+) polls in 200 ms\)$", out, re.M)
    # a poll is opal_progress, ob1's wait and the BTL's progress: tens to
    # hundreds of instructions
    assert poll and 20 < float(poll.group(1)) < 1000, out
    ranks = re.findall(r"^rank (\d): ([\d.-]+) per round trip \((\d+) "
                       r"empty polls taken out\); MPI_Send ([\d.]+), "
                       r"MPI_Recv ([\d.]+)", out, re.M)
    assert [r[0] for r in ranks] == ["0", "1"], out
    shares = [float(v) for v in
              re.findall(rf"^\s+([\d.-]+)\s+{re.escape(btl)}$", out, re.M)]
    assert len(shares) == 2, out
    for (_, total, misses, send, recv), share in zip(ranks, shares):
        # the receive waited for nothing: its message was sent before it
        # was posted, so few polls (a busy machine's) found nothing
        assert int(misses) <= 10, out
        # the BTL's send and receive cost it some tens to hundreds, ob1
        # and the rest of Open MPI more than that
        assert 20 < share < 2000, out
        assert 2 * share < float(total) < 10000, out
        assert float(send) + float(recv) < float(total), out
