"""ivcloud.filelock: a lock another process holds is waited for up to the
deadline and then refused with the caller's own error; one whose holder
was killed with -9 is free at once; the lock is released on the way out
of the block, also by an exception; shared holders keep out only an
exclusive one, which the guest agent uses to let no connection reach a
QEMU while it unplugs a device (agent.quiet)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ivcloud import filelock
from ivcloud.errors import AgentError, ClusterFailure
from ivcloud.vm import agent

HOLDER = """
import sys, time
from ivcloud import filelock
from ivcloud.errors import ClusterFailure
with filelock.held(sys.argv[1], 5, lambda: ClusterFailure("stuck"),
                   shared=sys.argv[2:] == ["shared"]):
    print("held", flush=True)
    time.sleep(60)
"""

QUIET = """
import sys, time
from pathlib import Path
from ivcloud.vm import agent
with agent.quiet(Path(sys.argv[1]), 5):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(path, *args, program=HOLDER):
    p = subprocess.Popen([sys.executable, "-c", program, str(path), *args],
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


def test_shared_holders_keep_out_only_an_exclusive_one(tmp_path):
    path = tmp_path / "agent.lock"
    p = _holder(path, "shared")
    try:
        t0 = time.monotonic()
        with filelock.held(path, 5, lambda: ClusterFailure("stuck"),
                           shared=True):
            assert time.monotonic() - t0 < 1
        with pytest.raises(ClusterFailure, match="exclusive"):
            with filelock.held(path, 0.3,
                               lambda: ClusterFailure("exclusive")):
                pytest.fail("an exclusive lock beside a shared holder")
    finally:
        p.kill()
        p.wait()


def test_no_agent_connection_while_another_process_keeps_it_quiet(tmp_path):
    sock = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(4)
    listener.setblocking(False)
    p = _holder(sock, program=QUIET)
    try:
        t0 = time.monotonic()
        with pytest.raises(AgentError, match="held for 0 s by a device unplug"):
            agent.run(sock, "true", timeout=0.5)
        assert 0.5 <= time.monotonic() - t0 < 3
        with pytest.raises(BlockingIOError):
            listener.accept()   # nothing connected meanwhile
    finally:
        p.kill()
        p.wait()
        listener.close()


def test_an_agent_whose_directory_is_gone_is_unreachable(tmp_path):
    with pytest.raises(AgentError, match="cannot reach the guest agent"):
        agent.run(tmp_path / "gone" / "agent.sock", "true", timeout=1)
