"""What /proc says about processes: one reader for the library's
teardown code (servers, clusters, VMs, MPI jobs).

A pid alone can be reused; code that must not signal a stranger pairs it
with `start_time`, which a reused pid does not share.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def _stat(pid: int) -> Optional[List[str]]:
    """Fields of /proc/PID/stat from the state (field 3 of proc(5)) on;
    None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may contain anything
    return stat[stat.rindex(")") + 2:].split()


def state(pid: int) -> Optional[str]:
    """Kernel state letter ('R', 'S', 'Z', ...), None if gone."""
    f = _stat(pid)
    return f[0] if f else None


def alive(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie."""
    return state(pid) not in (None, "Z", "X")


def start_time(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live, non-zombie pid."""
    f = _stat(pid)
    if not f or f[0] in ("Z", "X"):
        return None
    return int(f[19])  # field 22 of proc(5), counted from the state


def cmdline(pid: int) -> List[str]:
    """The argument vector, [] if gone (or a kernel thread)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def pids() -> List[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def with_environ(name: str, value: str) -> Dict[int, int]:
    """The live processes of our user, this one left out, whose initial
    environment holds name=value (/proc/PID/environ: what they were
    started with, which a process cannot take back by unsetting), as
    {pid: start_time}: a pid kept only if its start time is the same
    before and after its environment was read, so that a pid reused
    meanwhile never pins a stranger."""
    entry = f"{name}={value}".encode()
    uid, me, out = os.geteuid(), os.getpid(), {}
    for p in pids():
        if p == me:
            continue
        try:
            if os.stat(f"/proc/{p}").st_uid != uid:
                continue
            before = start_time(p)
            env = Path(f"/proc/{p}/environ").read_bytes()
        except OSError:
            continue
        if (before is not None and entry in env.split(b"\0") and
                start_time(p) == before):
            out[p] = before
    return out


def descendants(pid: int) -> Dict[int, int]:
    """Every live process below `pid` (children, grandchildren, ...) as
    {pid: start_time}, from one pass over /proc."""
    # parent and start time from the same read: a pid reused between two
    # reads would pin a stranger
    children: Dict[int, List[int]] = {}
    started: Dict[int, int] = {}
    for p in pids():
        f = _stat(p)
        if f and f[0] not in ("Z", "X"):
            children.setdefault(int(f[1]), []).append(p)
            started[p] = int(f[19])
    out: Dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = started[p]
            todo.extend(children.get(p, []))
    return out


def exiting(pid: int, start: int) -> bool:
    """Whether process `pid` of start time `start` is still there: alive,
    or a zombie whose other threads are still exiting (a multi-threaded
    daemon's leader turns zombie first; its threads may take a while).
    A zombie that is only waiting to be reaped is gone."""
    f = _stat(pid)
    if not f or int(f[19]) != start:
        return False
    if f[0] not in ("Z", "X"):
        return True
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def kill_pinned(pinned: Dict[int, int], grace_s: float = 3.0) -> List[int]:
    """SIGTERM the processes {pid: start_time}, then SIGKILL whatever is
    left after grace_s; a pid whose start time changed (recycled) is left
    alone. Returns once every one has exited (threads included), the
    pids still there at the end (should be none), including any we may
    not signal (one that became another user's)."""
    refused: List[int] = []

    def left():
        return [p for p, st in pinned.items()
                if p not in refused and exiting(p, st)]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in left():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                refused.append(pid)
        deadline = time.monotonic() + wait_s
        while left() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not left():
            break
    return left() + refused


def kill_pids(pids: Sequence[int], grace_s: float = 3.0) -> List[int]:
    """kill_pinned of `pids` as they are now."""
    pinned = {}
    for pid in pids:
        f = _stat(pid)
        if f and exiting(pid, int(f[19])):
            pinned[pid] = int(f[19])
    return kill_pinned(pinned, grace_s)
