"""Namespace holders: the long-lived processes that keep an instance (or
the head node, or the fabric) existing.

A holder is `taskset -c CPUS unshare ... -- bash -c _SCRIPT`: it sets up
its private mounts and hostname, says "ready" and sleeps; its CPU
affinity is what the instance's "vCPUs" are. It carries the marker
argument "ivcloud-holder:<cluster>:<role>" and is known by pid *and*
start time (docs/cluster.md, "Commands": how `down` finds it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .. import process
from ..errors import HolderError
from ..procfs import cmdline, pids, start_time

MARKER = "ivcloud-holder"
CLUSTER_ENV = "IVCLOUD_CLUSTER"
NS_KINDS = ("net", "uts", "ipc", "mnt")
UNSHARE_FLAG = {"net": "--net", "uts": "--uts", "ipc": "--ipc",
                "mnt": "--mount"}
READY_TIMEOUT_S = 15.0
# what the holder of an instance (and of the head node) unshares
INSTANCE_NS = ["--net", "--uts", "--ipc", "--mount", "--propagation",
               "private"]

# $0 = marker, $1 = hostname ('' keeps the host's: fabric), $2 = hosts
# file ('' = no private mounts), $3 = the run dir to cover ('' = none),
# $4... = paths under it (relative) that stay visible. `set -e`: any
# failed step ends the holder, and `up` reports the step's stderr.
_SCRIPT = r"""
set -e
# cover DIR OPTIONS STAGE PATH...: an empty tmpfs (OPTIONS) over DIR but
# for the PATHs below it, which stay visible at the same place: each is
# bound aside into STAGE, then moved back in.
cover() {
  local dir=$1 opts=$2 stage=$3 n=0 p; shift 3
  for p in "$@"; do
    n=$((n + 1))
    if [ -d "$p" ]; then mkdir "$stage/$n"; else : > "$stage/$n"; fi
    mount --bind "$p" "$stage/$n"
  done
  mount -t tmpfs -o "$opts" ivcloud-cover "$dir"
  n=0
  for p in "$@"; do
    n=$((n + 1)); mkdir -p "$(dirname "$p")"
    if [ -d "$stage/$n" ]; then mkdir -p "$p"; else : > "$p"; fi
    mount --move "$stage/$n" "$p"
  done
}
if [ -n "$2" ]; then
  # Host paths under /tmp that instances must still see (a checkout or
  # build living there), staged on a scratch tmpfs over /mnt.
  keep=()
  if [ -n "${IVCLOUD_KEEP_TMP:-}" ]; then
    IFS=: read -r -a keep <<< "$IVCLOUD_KEEP_TMP"
    mount -t tmpfs -o mode=0700,size=64k ivcloud-stage /mnt
  fi
  cover /tmp mode=1777,nosuid,nodev /mnt "${keep[@]}"
  if [ -n "${IVCLOUD_KEEP_TMP:-}" ]; then umount /mnt; fi
  mount -t tmpfs -o mode=1777,nosuid,nodev ivcloud-shm /dev/shm
  mount --bind "$2" /etc/hosts
fi
if [ -n "$1" ]; then hostname "$1"; fi
ip link set lo up
if [ -n "$3" ]; then
  # Of the run dir (every cluster's state, every server's socket) only
  # the kept paths stay visible.
  run=$3; shift 3
  mkdir /tmp/.ivcloud-keep
  cover "$run" mode=0755,size=64k /tmp/.ivcloud-keep "${@/#/$run/}"
  rm -rf /tmp/.ivcloud-keep
fi
echo ready
exec -a "$0" sleep infinity </dev/null >/dev/null 2>&1
"""


# ---------------------------------------------------------------- /proc

def ns_inode(pid: int, kind: str) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class Holder:
    role: str
    pid: int
    start: int

    def alive(self) -> bool:
        return start_time(self.pid) == self.start

    @classmethod
    def from_dict(cls, d: Dict) -> "Holder":
        return cls(d["role"], int(d["pid"]), int(d["start"]))


def find_by_marker(cluster: str) -> List[Holder]:
    """Live holders of `cluster` found by their marker argument (covers
    one started but not yet written into the state file)."""
    prefix = f"{MARKER}:{cluster}:"
    found = []
    for pid in pids():
        for arg in cmdline(pid):
            if arg.startswith(prefix) and arg.count(":") == 2:
                st = start_time(pid)
                if st is not None:
                    found.append(Holder(arg[len(prefix):], pid, st))
                break
    return found


def carries(pid: int, variable: str) -> bool:
    """Does `pid`'s environment have `variable` (KEY=VALUE)?"""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return variable.encode() in env.split(b"\0")


def processes_in(namespaces: Dict[str, Iterable[int]],
                 cluster: Optional[str] = None) -> List[int]:
    """Pids (other than ours) living in any of the given namespaces,
    {'net': {inode, ...}, 'mnt': {...}}. With `cluster`, only those that
    also carry its IVCLOUD_CLUSTER (set for everything the launch agent
    and `exec` start, and inherited by their children): for namespaces
    whose holder is gone, whose inode numbers the kernel may already have
    handed out again."""
    wanted = {kind: set(inos) for kind, inos in namespaces.items() if inos}
    me = os.getpid()
    hits = []
    for pid in pids():
        if pid == me:
            continue
        for kind, inos in wanted.items():
            if ns_inode(pid, kind) in inos:
                if cluster is None or \
                        carries(pid, f"{CLUSTER_ENV}={cluster}"):
                    hits.append(pid)
                break
    return hits


# ---------------------------------------------------------------- spawn

def spawn(cluster: str, role: str, *, unshare_flags: Sequence[str],
          cpus: Optional[Sequence[int]] = None, hostname: str = "",
          hosts_file: Optional[Path] = None,
          cover_dir: Optional[Path] = None,
          keep_visible: Sequence[str] = ()) -> subprocess.Popen:
    """Start a holder; returns at once (the caller records the pid, then
    calls wait_ready). cover_dir/keep_visible: hide cover_dir inside but
    for the files and directories keep_visible (paths relative to it)."""
    argv = []
    if cpus:
        argv += ["taskset", "-c", ",".join(str(c) for c in cpus)]
    argv += ["unshare", *unshare_flags, "--", "bash", "-c", _SCRIPT,
             f"{MARKER}:{cluster}:{role}", hostname,
             str(hosts_file) if hosts_file else "",
             str(cover_dir) if cover_dir else "", *keep_visible]
    # Own session: a Ctrl-C meant for `up` must not reach the holders
    # (rollback removes them in order instead).
    env = dict(os.environ, **{CLUSTER_ENV: cluster})
    if hosts_file:
        env["IVCLOUD_KEEP_TMP"] = ":".join(host_paths_under_tmp())
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True,
                            env=env)


def host_paths_under_tmp() -> List[str]:
    """The project checkout and native build, when they live under /tmp
    (a CI clone may): instances get a private /tmp but must still run
    our programs and load the BTL from there."""
    from ..native import native_dir
    roots = {Path(__file__).resolve().parents[2], native_dir().resolve()}
    tmp = Path("/tmp")
    keep = [str(p) for p in sorted(roots)
            if tmp in p.parents and p.is_dir() and ":" not in str(p)]
    # a path inside another kept one comes along with it
    return [p for p in keep
            if not any(p != q and p.startswith(q + "/") for q in keep)]


def wait_ready(proc: subprocess.Popen, role: str,
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until the holder printed 'ready' (its namespaces are set
    up); HolderError with its stderr if it died or took too long."""
    line = process.first_line(proc.stdout, timeout_s)
    if line is None:
        raise HolderError(f"holder {role} not ready after "
                          f"{timeout_s:.0f} s")
    if line.strip() != "ready":
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        raise HolderError(f"holder {role} failed: "
                          f"{err[-1] if err else line.strip() or 'no output'}")
    proc.stdout.close()
    proc.stderr.close()


def namespaces_of(pid: int) -> Dict[str, int]:
    return {kind: ns_inode(pid, kind) for kind in NS_KINDS}


def enter_argv(pid: int, kinds: Sequence[str] = NS_KINDS) -> List[str]:
    """argv prefix running a command inside holder `pid`'s namespaces."""
    flags = {"net": "-n", "uts": "-u", "ipc": "-i", "mnt": "-m"}
    return ["nsenter", "-t", str(pid), *(flags[k] for k in kinds), "--"]


def holder_info(state: Dict, role: str) -> Dict:
    """{"pid", "alive"} of the holder `state` records for `role` (an
    instance, the head node, the fabric) and, while it lives, its CPUs."""
    rec = state.get("holders", {}).get(role)
    if not rec or rec.get("start") is None:
        return {"pid": None, "alive": False}
    h = Holder.from_dict(rec)
    info = {"pid": h.pid, "alive": h.alive()}
    if info["alive"]:
        with contextlib.suppress(OSError):
            info["cpus"] = sorted(os.sched_getaffinity(h.pid))
    return info
