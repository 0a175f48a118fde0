"""Run shell commands inside a guest of `ivcloud vm`.

The guest's init serves its second serial port (ttyS1), which QEMU
exposes as a UNIX socket (agent.sock in the VM's directory). Protocol, one
command at a time: the host sends "ID BASE64(command)\\n"; the guest
acknowledges with "@@ivc-ack ID\\n" at once, then answers "@@ivc-begin
ID\\n", the command's output (stdout and stderr) in base64, "@@ivc-end ID
STATUS\\n". A command that is not acknowledged within RESEND_S is sent
again; the guest runs a given ID once and answers every copy of it, so a
line lost on the serial connection costs a resend, never a second run.

Each connection is a new descriptor in QEMU (its chardev accepts it),
so every command holds a shared lock on agent.lock beside the socket
for as long as it is connected, and quiet() holds it exclusively while
QEMU must open nothing (qemu.unplug_ivshmem's eventfd guard).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import re
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .. import filelock
from ..errors import AgentError

_ids = itertools.count(1)
RESEND_S = 1.5
LOCK = "agent.lock"   # beside agent.sock (quiet)
# The guest acknowledges a line once it has read all of it, and its
# serial port reads about 10 KB/s under TCG (less on a loaded host): a
# long line (cluster put's chunks) is resent only once it could have
# arrived at this rate, or every such line would cross the serial line
# twice and the copy delay the commands after it.
SERIAL_BYTES_PER_S = 4000


@dataclass
class Result:
    status: int
    output: str

    @property
    def ok(self) -> bool:
        return self.status == 0


def _new_id() -> str:
    # unique across processes talking to the same guest over time
    return f"{os.getpid()}-{next(_ids)}-{time.monotonic_ns() % 1000000}"


@contextlib.contextmanager
def quiet(sock_path: Path, timeout: float) -> Iterator[None]:
    """No new connection to the agent at `sock_path` for the block: it
    waits, at most `timeout` s, for the commands connected now to end
    (then AgentError), and later ones wait until it ends.

    Why: QEMU 7.2 leaves an unplugged ivshmem-doorbell's fd handlers
    behind, and an agent connection that QEMU accepts under one of their
    descriptor numbers before qemu.guard_eventfds covers it runs the
    freed device's handler (docs/cluster.md, "Two QEMU 7.2 bugs")."""
    with _lock(sock_path, timeout, shared=False):
        yield


def run(sock_path: Path, command: str, timeout: float = 60.0) -> Result:
    """Run `command` with the guest's sh; its status and output."""
    deadline = time.monotonic() + timeout
    with _lock(sock_path, timeout, shared=True):
        return _run(sock_path, command, max(0.05, deadline - time.monotonic()))


@contextlib.contextmanager
def _lock(sock_path: Path, timeout: float, shared: bool) -> Iterator[None]:
    """agent.lock beside `sock_path`: shared by every command while it is
    connected, exclusive for quiet(); AgentError when it cannot be had
    (a guest whose directory is gone cannot be reached either)."""
    holder = ("a device unplug" if shared else "a command running through it")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(filelock.held(
                sock_path.with_name(LOCK), timeout, lambda: AgentError(
                    f"the guest agent at {sock_path} was held for "
                    f"{timeout:.0f} s by {holder}"), shared=shared))
        except OSError as e:
            raise AgentError(f"cannot reach the guest agent at {sock_path}: "
                             f"{e.strerror or e}")
        yield


def _run(sock_path: Path, command: str, timeout: float) -> Result:
    cid = _new_id()
    line = f"{cid} {base64.b64encode(command.encode()).decode()}\n".encode()
    end = re.compile(rb"@@ivc-begin " + re.escape(cid.encode()) +
                     rb"\n(.*?)@@ivc-end " + re.escape(cid.encode()) +
                     rb" (\d+)\n", re.S)
    deadline = time.monotonic() + timeout
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(min(timeout, 5.0))
        s.connect(str(sock_path))
    except OSError as e:
        raise AgentError(f"cannot reach the guest agent at {sock_path}: "
                         f"{e.strerror or e}")
    buf = b""

    def send() -> None:
        # a long line takes the guest a while to read off its serial
        # port: the whole deadline, not the connect timeout
        s.settimeout(max(0.05, deadline - time.monotonic()))
        s.sendall(line)

    # the wait for an acknowledgement before a resend
    resend_s = RESEND_S + len(line) / SERIAL_BYTES_PER_S
    try:
        send()
        next_send = time.monotonic() + resend_s
        while True:
            m = end.search(buf)
            if m:
                body = b"".join(m.group(1).split())
                return Result(int(m.group(2)),
                              base64.b64decode(body).decode(errors="replace"))
            now = time.monotonic()
            if now >= deadline:
                raise AgentError(f"guest did not answer within {timeout:.0f} s")
            if now >= next_send and f"@@ivc-ack {cid}".encode() not in buf:
                send()
                next_send = now + resend_s
            s.settimeout(max(0.05, min(deadline, next_send) - now))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise AgentError("guest agent connection closed (VM gone?)")
            buf += chunk
    except OSError as e:
        raise AgentError(f"guest agent: {e.strerror or e}")
    finally:
        s.close()


def wait_ready(sock_path: Path, timeout: float) -> None:
    """Block until the agent answers a no-op."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            if run(sock_path, "true", timeout=max(1.0, min(
                    10.0, deadline - time.monotonic()))).ok:
                return
        except AgentError as e:
            last = str(e)
        time.sleep(0.2)
    raise AgentError(f"guest agent not ready after {timeout:.0f} s ({last})")


class Job:
    """A command started in the background in the guest; its output and
    status land in files there."""

    def __init__(self, sock_path: Path, command: str):
        self.sock = sock_path
        self.name = f"/tmp/job-{_new_id()}"
        wrapped = (f"( {command}\n echo $? > {self.name}.rc.tmp; "
                   f"mv {self.name}.rc.tmp {self.name}.rc ) "
                   f"> {self.name}.out 2>&1 < /dev/null &\n"
                   f"echo $! > {self.name}.pid")
        r = run(sock_path, wrapped)
        if not r.ok:
            raise AgentError(f"cannot start job in the guest: {r.output}")

    def done(self) -> Optional[int]:
        r = run(self.sock, f"cat {self.name}.rc 2>/dev/null")
        return int(r.output) if r.ok and r.output.strip().isdigit() else None

    def output(self) -> str:
        return run(self.sock, f"cat {self.name}.out").output

    def wait(self, timeout: float, poll: float = 0.3) -> Result:
        deadline = time.monotonic() + timeout
        while True:
            rc = self.done()
            if rc is not None:
                return Result(rc, self.output())
            if time.monotonic() > deadline:
                raise AgentError(f"guest job did not finish within "
                                 f"{timeout:.0f} s; output so far: "
                                 f"{self.output().strip()[-300:]}")
            time.sleep(poll)

    def kill(self) -> None:
        run(self.sock, f"kill $(cat {self.name}.pid) 2>/dev/null; true")


def quote(args) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)
