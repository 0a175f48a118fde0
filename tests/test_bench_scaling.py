"""`ivcloud bench scaling`: the plumbing on tiny inputs (2 and 4 ranks,
one round, few operations), real mpirun jobs over ivshmem and vader; and
its one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ivcloud.bench import scaling
from ivcloud.errors import InvalidRequest


def ivcloud(*args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_bench_scaling_quick(tmp_path, native_dir):
    assert (native_dir / "mpi-scaling").exists(), "mpi-scaling not built"
    out = tmp_path / "scaling.json"
    t0 = time.monotonic()
    proc = ivcloud("bench", "scaling", "--quick", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 120
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "scaling" and doc["quick"] is True
    assert doc["ranks"] == [2, 4] and doc["rounds"] == 1
    recs = doc["records"]
    got = {(r["transport"], r["ranks"], r["test"]) for r in recs}
    assert got == {(t, n, test) for t in ("ivshmem", "vader")
                   for n in (2, 4) for test in scaling.TESTS}, got
    for r in recs:
        assert r["latency_us"] > 0 and r["runs"] == 1, r
        assert r["region_bytes"] == r["bytes_per_rank"] * r["ranks"], r
        if r["test"] == "msgrate":
            assert r["rate_msgs_per_s"] > 0, r
        if r["transport"] == "ivshmem":
            assert r["btl"] == "self,ivshmem", r
    assert len(doc["runs"]) == len(recs)
    # every rank count has its ratios, from this run
    assert len(doc["targets"]) == 2 * len(scaling.TESTS)
    assert all(t["status"] in ("PASS", "MISS") for t in doc["targets"])
    assert "shared mem" in proc.stdout and "Targets" in proc.stdout


@pytest.mark.parametrize("args, words", [
    (["--ranks", "1,4"], "rank counts"),
    (["--ranks", "2,2000"], "rank counts"),
    (["--ranks", "2,x"], "bad rank list"),
    (["--transports", "tcp"], "subset"),
    (["--rounds", "0"], "positive"),
])
def test_bench_scaling_bad_input_is_one_line_exit_2(args, words):
    proc = ivcloud("bench", "scaling", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_settings_refuse_without_naming_flags():
    with pytest.raises(InvalidRequest) as e:
        scaling.ScalingSettings.make(ranks=[1])
    assert "--" not in str(e.value)
    s = scaling.ScalingSettings.make(quick=True)
    assert s.ranks == [2, 4] and s.rounds == 1
    assert "--allreduce-iters" in s.argv("ivshmem", 128)
