"""`handoff` (native/bench/handoff.c): the machine's cross-CPU handoff
rate without MPI, the reference for the BTL's timed non-temporal copy."""

from __future__ import annotations

import json
import os
import subprocess

import pytest


def run(native_dir, *args, timeout=60):
    return subprocess.run([str(native_dir / "handoff"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_one_second_gives_one_record_of_both_copies(native_dir):
    if os.cpu_count() < 2:
        pytest.skip("handoff pins its two processes to two CPUs")
    proc = run(native_dir, "--seconds", "2", "--blocks", "512")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 2
    assert records[0]["t_s"] < records[1]["t_s"]
    for r in records:
        # 512 blocks of 16 KiB: far below 0.1 GB/s would mean the two
        # processes never overlapped (a wait that only the alarm ended)
        assert 0.1 < r["memcpy_GBs"] < 1000
        assert 0.1 < r["stream_GBs"] < 1000


@pytest.mark.parametrize("args", [
    ["--seconds", "0"],
    ["--blocks", "x"],
    ["--cpus", "1,1"],
    ["--cpus", "1"],
    ["--seconds"],
    ["--colour", "red"],
])
def test_bad_input_is_one_line_and_exit_2(native_dir, args):
    proc = run(native_dir, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("handoff: "), proc.stderr
