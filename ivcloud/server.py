"""Control of ivshmem-server daemons: start, stop, status.

A server NAME keeps its files under RUN_DIR/NAME (socket, pid file, JSON
state). Its region is a memfd sealed against shrinking and growing, which
the daemon hands to its clients over the socket (docs/security.md); only
in the single-user host-file mode is it the file /dev/shm/ivcloud-NAME,
which processes may also attach by path. The native daemon does the
work (native/server); this module only starts it with the right paths,
finds it again through its pid file, stops it and checks it cleaned up.
"""

from __future__ import annotations

import grp
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from . import procfs
from .errors import OperationFailed, ServerError

DEFAULT_RUN_DIR = "/run/ivcloud"
DEFAULT_NAME = "default"
SERVER_BINARY = "ivshmem-server"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1


def run_root(run_dir: Optional[str] = None) -> Path:
    """Where ivcloud keeps what runs (servers, clusters, VMs): `run_dir`,
    else $IVCLOUD_RUN_DIR, else DEFAULT_RUN_DIR; absolute."""
    return Path(run_dir or os.environ.get("IVCLOUD_RUN_DIR")
                or DEFAULT_RUN_DIR).absolute()
# Region geometry bounds (ivshm.h): peers per region, cells of a peer's
# receive queue, fast channels per receiver
MAX_PEERS = 1024
MAX_QUEUE_SLOTS = 65536
MAX_FAST_CHANNELS = 64
MAX_CLIENTS = 4096  # connections at once (native/server/server.h)


def parse_size(text: str) -> int:
    """'64M', '1G', '4096', '512KiB' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"bad size '{text}' (expected e.g. 64M, 1G, 4096)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    return int(m.group(1)) << shift


def format_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def server_binary() -> Path:
    """The daemon of this build; OperationFailed if it was not built."""
    from .native import native_file
    return native_file(SERVER_BINARY, OperationFailed, program=True)


def below(base: str, name: str) -> property:
    """A path named `name` inside the path attribute `base`."""
    return property(lambda self: getattr(self, base) / name)


@dataclass(frozen=True)
class ServerPaths:
    name: str
    run_dir: Path

    @property
    def dir(self) -> Path:
        return self.run_dir / self.name

    socket = below("dir", "ivshmem.sock")
    pidfile = below("dir", "server.pid")
    state = below("dir", "state.json")

    @property
    def region(self) -> Path:
        return Path("/dev/shm") / f"ivcloud-{self.name}"

    def files(self) -> List[Path]:
        return [self.socket, self.pidfile, self.state, self.region]


def paths_for(name: str, run_dir: Optional[str] = None) -> ServerPaths:
    if not _NAME_RE.match(name):
        raise ServerError(f"bad server name '{name}' (letters, digits, '_.-', "
                          f"at most 64, not starting with '.' or '-')")
    paths = ServerPaths(name, run_root(run_dir))
    if len(str(paths.socket)) > _SUN_PATH_MAX:
        raise ServerError(f"socket path {paths.socket} is longer than "
                          f"{_SUN_PATH_MAX} bytes (choose a shorter run directory)")
    return paths


# ---------------------------------------------------------------- processes

def _is_server_pid(pid: int) -> bool:
    """Does `pid` live and run our server binary (not a recycled pid)?"""
    if not procfs.alive(pid):
        return False
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm == SERVER_BINARY[:15]


def read_pid(paths: ServerPaths) -> Optional[int]:
    try:
        text = paths.pidfile.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ServerError(f"cannot read {paths.pidfile}: {e.strerror}")
    if not text.isdigit() or int(text) <= 0:
        return None
    return int(text)


def read_state(paths: ServerPaths) -> Optional[Dict]:
    """The daemon's JSON state file, or None (absent or unreadable)."""
    try:
        return json.loads(paths.state.read_text())
    except (OSError, ValueError):
        return None


def running_pid(paths: ServerPaths) -> Optional[int]:
    pid = read_pid(paths)
    return pid if pid is not None and _is_server_pid(pid) else None


def leftovers(paths: ServerPaths) -> List[Path]:
    return [p for p in paths.files() if os.path.lexists(p)]


def _remove(paths: List[Path]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def remove_dir(paths: ServerPaths) -> None:
    try:
        for tmp in paths.dir.glob("*.tmp"):
            tmp.unlink()
        paths.dir.rmdir()
    except OSError:
        pass  # not empty (someone else's files) or already gone


# ---------------------------------------------------------------- actions

def _fast_channels_arg(fast_channels: Optional[int]) -> int:
    """ivshm_geometry.fast_channels for a count (None: the default, 0:
    none)."""
    if fast_channels is None:
        return 0
    from .native import FAST_NONE
    return FAST_NONE if fast_channels == 0 else fast_channels


def _min_size(max_peers: int, queue_slots: int = 0,
              fast_channels: int = 0, ring_slots: int = 0,
              slot_size: int = 0) -> int:
    """Smallest region for this geometry (0: the daemon's default), 0 if
    libivshm is unavailable (the daemon then checks it itself)."""
    try:
        from .native import min_region_size
        return min_region_size(max_peers=max_peers, queue_slots=queue_slots,
                               fast_channels=fast_channels,
                               ring_slots=ring_slots, slot_size=slot_size)
    except (OSError, ImportError):
        return 0


def _check_geometry(size: int, vectors: int, max_peers: Optional[int],
                    queue_slots: Optional[int], fast_channels: Optional[int],
                    ring_slots: Optional[int], slot_size: Optional[int],
                    max_clients: Optional[int]) -> None:
    """Refuse, as the daemon would (exit 2), what it cannot serve."""
    if size <= 0 or size & (size - 1):
        raise ServerError(f"size {size} is not a power of two (QEMU "
                          f"maps the region as a PCI BAR)")
    if not 1 <= vectors <= 64:
        raise ServerError(f"vectors must be 1..64, not {vectors}")
    if max_peers is not None and not 2 <= max_peers <= MAX_PEERS:
        raise ServerError(f"the number of peers must be 2..{MAX_PEERS}, "
                          f"not {max_peers}")
    if max_clients is not None and not 1 <= max_clients <= MAX_CLIENTS:
        raise ServerError(f"the number of clients must be 1..{MAX_CLIENTS}, "
                          f"not {max_clients}")
    if queue_slots is not None and (
            not 2 <= queue_slots <= MAX_QUEUE_SLOTS
            or queue_slots & (queue_slots - 1)):
        raise ServerError(f"queue slots must be a power of two in "
                          f"2..{MAX_QUEUE_SLOTS}, not {queue_slots}")
    if fast_channels is not None and not 0 <= fast_channels <= MAX_FAST_CHANNELS:
        raise ServerError(f"fast channels must be 0..{MAX_FAST_CHANNELS}, "
                          f"not {fast_channels}")
    need = _min_size(max_peers or 0, queue_slots or 0,
                     _fast_channels_arg(fast_channels), ring_slots or 0,
                     slot_size or 0)
    if need and size < need:
        raise ServerError(f"size {format_size(size)} is too small for "
                          f"{max_peers or 8} peers (needs at least "
                          f"{need} bytes)")


def _group_id(group: Optional[str]) -> Optional[int]:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if not group.isdigit():
            raise ServerError(f"unknown group '{group}'")
        return int(group)


def _prepare_dir(paths: ServerPaths, gid: Optional[int]) -> None:
    """The server's directory, cleared of a dead server's files; refuses
    while a server runs, or while a host-file region is left over."""
    pid = running_pid(paths)
    if pid is not None:
        raise ServerError(f"server '{paths.name}' is already running (pid {pid})")
    stale = leftovers(paths)
    if paths.region in stale:
        raise ServerError(f"region {paths.region} exists but no server "
                          f"'{paths.name}' runs; stopping server "
                          f"'{paths.name}' removes the leftovers")
    _remove(stale)  # socket, pid and state of a server that died
    paths.dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        paths.dir.mkdir(mode=0o750 if gid is not None else 0o700)
    except FileExistsError:
        pass
    if gid is not None:
        # setgid: the pid and state files the daemon (re)creates in there
        # belong to the group too, so its members can run `status`
        os.chown(paths.dir, -1, gid)
        os.chmod(paths.dir, 0o2750)


def _run_daemon(cmd: List[str], paths: ServerPaths, gid: Optional[int],
                timeout_s: float) -> int:
    """Run the daemon's parent, which returns once the socket listens and
    the pid file is written; its files get 0600 (0640 with a group) from
    the umask. Returns the daemon's pid."""
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True,
                              umask=0o027 if gid is not None else 0o077,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise OperationFailed(f"{SERVER_BINARY} did not become ready in "
                              f"{timeout_s:.0f} s")
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        remove_dir(paths)
        # the daemon exits 2 for a command line it refuses (bad input)
        cls = ServerError if proc.returncode == 2 else OperationFailed
        raise cls(f"{SERVER_BINARY} failed: {why}")
    pid = running_pid(paths)
    if pid is None or not paths.socket.exists():
        raise OperationFailed(f"{SERVER_BINARY} reported ready but "
                              f"{paths.pidfile} names no live server")
    return pid


def start(paths: ServerPaths, size: int, vectors: int = 1,
          max_peers: Optional[int] = None, group: Optional[str] = None,
          verbose: bool = False, timeout_s: float = 10.0,
          host_file: bool = False, queue_slots: Optional[int] = None,
          fast_channels: Optional[int] = None,
          ring_slots: Optional[int] = None,
          slot_size: Optional[int] = None,
          max_clients: Optional[int] = None,
          leave_notices: bool = True) -> int:
    """Start the daemon; returns its pid. Raises ServerError/OperationFailed.
    queue_slots / fast_channels: the region's receive queues and fast
    channels per peer (None: the library's defaults; fast_channels 0: no
    fast channels, every message through the queues); ring_slots /
    slot_size: the fast channels' rings (None: the defaults);
    max_clients: connections at once (None: 2 x max_peers);
    leave_notices False: the clients are never told that a peer left
    (--no-leave-notices), for a server whose clients are all QEMU
    devices (docs/server-protocol.md, "Quiet leaves")."""
    _check_geometry(size, vectors, max_peers, queue_slots, fast_channels,
                    ring_slots, slot_size, max_clients)
    gid = _group_id(group)
    binary = server_binary()
    _prepare_dir(paths, gid)
    cmd = [str(binary), "-S", str(paths.socket),
           "-l", str(size), "-n", str(vectors), "-p", str(paths.pidfile),
           "-s", str(paths.state)]
    if host_file:
        cmd += ["-M", str(paths.region)]
    for option, value in (("--max-peers", max_peers),
                          ("--max-clients", max_clients),
                          ("--queue-slots", queue_slots),
                          ("--fast-channels", fast_channels),
                          ("--ring-slots", ring_slots),
                          ("--slot-size", slot_size), ("-g", gid)):
        if value is not None:
            cmd += [option, str(value)]
    if not leave_notices:
        cmd.append("--no-leave-notices")
    if verbose:
        cmd.append("-v")
    return _run_daemon(cmd, paths, gid, timeout_s)


def stop(paths: ServerPaths, timeout_s: float = 10.0) -> str:
    """Stop the daemon and check that its files are gone. Returns a
    one-line report."""
    pid = running_pid(paths)
    if pid is None:
        stale = leftovers(paths)
        if not stale:
            raise ServerError(f"server '{paths.name}' is not running")
        old = read_pid(paths)
        _remove(stale)
        remove_dir(paths)
        return (f"server '{paths.name}' was not running"
                f"{f' (pid {old} is gone)' if old else ''}; removed "
                f"{', '.join(str(p) for p in stale)}")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout_s
    while _is_server_pid(pid):
        if time.monotonic() > deadline:
            raise OperationFailed(f"server '{paths.name}' (pid {pid}) did not "
                                  f"exit within {timeout_s:.0f} s of SIGTERM")
        time.sleep(0.02)
    left = leftovers(paths)
    if left:
        # the daemon is gone, so nobody else will ever remove these
        _remove(left)
        remove_dir(paths)
        raise OperationFailed(f"server '{paths.name}' (pid {pid}) exited but "
                              f"left {', '.join(str(p) for p in left)} "
                              f"(removed now)")
    remove_dir(paths)
    return f"server '{paths.name}' stopped (pid {pid})"


def status(paths: ServerPaths) -> Dict:
    pid = running_pid(paths)
    st = read_state(paths) if pid is not None else None
    info: Dict = {
        "name": paths.name,
        "running": pid is not None,
        "pid": pid,
        "socket": str(paths.socket),
        "region": str(paths.region),
        "pidfile": str(paths.pidfile),
        "state_file": str(paths.state),
    }
    if st is not None:
        info["region"] = st.get("shm") or "memfd (sealed)"
        info["sealed"] = bool(st.get("sealed"))
        info["size"] = st.get("size")
        info["vectors"] = st.get("vectors")
        info["peers"] = st.get("peers", [])
    elif pid is not None:
        info["peers"] = []
    if pid is None:
        info["stale_files"] = [str(p) for p in leftovers(paths)]
    return info
