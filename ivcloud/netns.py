"""Two network namespaces joined by a Linux bridge, for benchmarks.

Layout (everything lives in namespaces this module creates; the host's
own network namespace is never touched):

    ns ivb-<pid>-a            ns ivb-<pid>-br             ns ivb-<pid>-b
    eth0 10.250.<k>.1/24 ==== pa  [br0]  pb ==== eth0 10.250.<k>.2/24
         (veth pair)                                (veth pair)

Deleting a namespace deletes the interfaces inside it, so cleanup is
"delete our three namespaces". It runs from try/finally (context manager),
atexit, and a sweep of leftovers whose creating pid is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
from typing import List, Optional, Sequence

from .errors import NetnsError

PREFIX = "ivb-"
_NAME_RE = re.compile(r"^ivb-(\d+)-(a|b|br)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetnsError(f"ip {' '.join(args)}: "
                         f"{msg[-1] if msg else proc.returncode}")
    return proc


def available() -> Optional[str]:
    """None if we can build namespaces here, else the reason we cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a bridge)"
    try:
        proc = _ip("netns", "list", check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"iproute2 unusable: {e}"
    if proc.returncode != 0:
        return f"ip netns unusable: {proc.stderr.strip()}"
    return None


def list_ours() -> List[str]:
    proc = _ip("netns", "list", check=False)
    names = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _NAME_RE.match(name):
            names.append(name)
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> List[str]:
    """Delete ivb-<pid>-* namespaces whose creator is no longer running."""
    removed = []
    for name in list_ours():
        pid = int(_NAME_RE.match(name).group(1))
        if pid != os.getpid() and not _pid_alive(pid):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class BridgedPair:
    """Namespaces a and b, one veth each into a bridge in namespace br.

    `with BridgedPair() as net:` builds it; `net.exec_args('a', [...])`
    prefixes a command to run inside namespace a; addr_a / addr_b are the
    two ends' addresses. Leaving the block (or the process) removes it.
    """

    def __init__(self, subnet: Optional[int] = None):
        pid = os.getpid()
        self.ns = {side: f"{PREFIX}{pid}-{side}" for side in ("a", "b", "br")}
        # 10.250.<k>.0/24 only ever exists inside these namespaces; k just
        # keeps concurrent runs' captures tellable apart.
        k = subnet if subnet is not None else pid % 250 + 1
        self.addr_a = f"10.250.{k}.1"
        self.addr_b = f"10.250.{k}.2"
        self._up = False

    # -- lifecycle

    def __enter__(self) -> "BridgedPair":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        reason = available()
        if reason:
            raise NetnsError(reason)
        cleanup_leftovers()
        atexit.register(self.destroy)
        self._up = True
        try:
            a, b, br = self.ns["a"], self.ns["b"], self.ns["br"]
            for name in (a, b, br):
                _ip("netns", "add", name)
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            for side, ns, addr in (("a", a, self.addr_a),
                                   ("b", b, self.addr_b)):
                port = f"p{side}"
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer",
                    "name", port, "netns", br)
                _ip("-n", br, "link", "set", port, "master", "br0")
                _ip("-n", br, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", br, "link", "set", "br0", "up")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        if not self._up:
            return
        self._up = False
        for name in self.ns.values():
            _ip("netns", "del", name, check=False)
        try:
            atexit.unregister(self.destroy)
        except Exception:
            pass

    # -- use

    def exec_args(self, side: str, argv: Sequence[str]) -> List[str]:
        """argv run inside namespace `side` ('a' or 'b')."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def exists(self) -> bool:
        names = set(list_ours())
        return any(n in names for n in self.ns.values())
