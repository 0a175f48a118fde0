"""ivcloud.filelock: a lock another process holds is waited for up to the
deadline and then refused with the caller's own error; one whose holder
was killed with -9 is free at once; the lock is released on the way out
of the block, also by an exception."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ivcloud import filelock
from ivcloud.errors import ClusterFailure

HOLDER = """
import sys, time
from ivcloud import filelock
from ivcloud.errors import ClusterFailure
with filelock.held(sys.argv[1], 5, lambda: ClusterFailure("stuck")):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(path):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)],
                         stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_held_lock_is_refused_at_the_deadline_with_the_callers_error(tmp_path):
    path = tmp_path / "ports.lock"
    p = _holder(path)
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterFailure, match="still held"):
            with filelock.held(path, 0.5,
                               lambda: ClusterFailure("still held")):
                pytest.fail("entered a lock another process holds")
        assert 0.5 <= time.monotonic() - t0 < 3
    finally:
        p.kill()
        p.wait()


def test_a_holder_killed_with_minus_9_lets_go_at_once(tmp_path):
    path = tmp_path / "x.lock"
    p = _holder(path)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    with filelock.held(path, 5, lambda: ClusterFailure("stuck")):
        assert time.monotonic() - t0 < 1


def test_released_after_the_block_also_on_an_error(tmp_path):
    path = tmp_path / "x.lock"
    with pytest.raises(ValueError):
        with filelock.held(path, 1, lambda: ClusterFailure("stuck")):
            raise ValueError("inside")
    # another process takes it at once
    p = _holder(path)
    p.kill()
    p.wait()
