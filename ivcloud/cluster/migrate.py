"""Live migration of a VM cluster's instance to another emulated server
(`cluster migrate INSTANCE --to SERVER`): the guest leaves its server's
region, QEMU moves it to a new QEMU process "on" the destination server,
and it joins the destination server's region.

QEMU migrates no ivshmem-doorbell device, so the guest's device of boot,
in its root port of its own (qemu.BOOT_PORT), comes out first and a
device on the destination server's standing ivshmem-server goes into
the same port of the new QEMU after: the guest finds it at the PCI
address it had. A running Slurm job's device (guest_regions) goes the
same way, from the job's region on the source server to one of the
job's own on the destination (shared with the job's guests there), and
the job's region on the source is stopped once no guest of the job is
left there. The steps, each a phase on the progress lines (check,
drain, unplug, tap, start, migrate, plug, switch, bind, attach,
record), and how a failure is undone (in reverse up to the switch, by
moving the guest back after it; the error names the step):
docs/cluster.md, "Migration".
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .. import filelock, native, process
from ..errors import ClusterError, ClusterFailure, IvcloudError
from ..vm import agent, qemu
from ..vm import lifecycle as vm_lifecycle
from . import holder, network, regions, vm_instance
from .slurm import guest_regions, moves
from .state import StateDir, load, save
from .topology import topology_from_dict

# bounds, in seconds, for a TCG guest on a loaded host (as guest_regions;
# its UNPLUG_TIMEOUT_S bounds the guest giving a device back)
QMP_TIMEOUT_S = 30.0
BIND_TIMEOUT_S = 150.0
MIGRATE_TIMEOUT_S = 300.0
# an agent command of a few processes
GUEST_TIMEOUT_S = 120.0
# how often drain looks again while it waits for BTL jobs to end
DRAIN_POLL_S = 2.0
# only one migration of a cluster at a time: STATE_DIR/migrate.lock
LOCK_TIMEOUT_S = 1.0
# the BTL's component, as a rank maps it
BTL_LIBRARY = "mca_btl_ivshmem.so"
# the provider's ranks' acknowledgement of a drain (their own deadline,
# FI_IVSHM_DRAIN_MS, and a TCG guest's slowness)
DRAIN_ACK_S = 60.0
# how often the drain's wait looks whether the processes of the device
# still live: a rank that died never acknowledges, and its death ends the
# wait (an agent command, costly in a TCG guest)
DRAIN_LIVENESS_S = 2.0
# how long drained ranks may still be seen using the device: each
# acknowledges, then unmaps it
DRAIN_GRACE_S = 10.0
# what a guest's provider ranks attach again after a drain (fiv_util.c),
# hidden while the device is away
GUEST_ENV = "/run/ivshm/ivshm.env"
AWAY_ENV = GUEST_ENV + ".away"
# in the guest's VM directory while its ivshm.env, or a Slurm job's env
# file, is hidden (heal): the hidden files' paths, one a line (empty:
# ivshm.env)
HIDDEN = "env.hidden"


class StepFailed(ClusterFailure):
    """A migration step failed (and what was done was undone)."""


# ---------------------------------------------------------------- check

def server_index(state: Dict, server: str) -> int:
    """Emulated server `server` (its index, sN or its ivshmem-server's
    name) of the cluster."""
    text = str(server).strip()
    for rec in state["servers"].values():
        if text in (str(rec["index"]), f"s{rec['index']}", rec["name"]):
            return int(rec["index"])
    raise ClusterError(f"no server '{server}' in cluster '{state['name']}' "
                       f"(servers: "
                       f"{', '.join(f's{k}' for k in sorted(map(int, state['servers'])))})")


def check(state: Dict, host: str, server: str) -> Tuple[int, int]:
    """(the instance's server now, the destination) of a request, or
    ClusterError."""
    if host not in state.get("vms", {}):
        raise ClusterError(f"no instance '{host}' in cluster "
                           f"'{state['name']}'")
    dest = server_index(state, server)
    src = int(state["instances"][host]["server"])
    if dest == src:
        raise ClusterError(f"instance '{host}' is on server s{src} already")
    return src, dest


# ---------------------------------------------------------------- hooks

def guest_users(sock: Path, addr: str) -> List[Tuple[str, str]]:
    """What in the guest of agent socket `sock` keeps it from moving, as
    (kind, "job J rank R (pid P: COMMAND)"): kind "launcher" for a job's
    launcher (vm_instance.run_launcher's, followed through the guest's
    QEMU), first; "btl" for a rank of an Open MPI job over the ivshmem
    BTL (its component mapped); "device" for another process that maps
    the region of the device at `addr` or holds its vfio group (a rank
    of the libfabric provider, a tool)."""
    q = agent.quote
    # few processes: each fork costs a TCG guest on a loaded host dearly
    script = "\n".join([
        "for f in $(find /proc/[0-9]*/fd -maxdepth 1 -name 2 -lname " +
        q([vm_instance.LAUNCHER_ERR + "*"]) + " -printf '%h%l\\n' "
        "2>/dev/null); do",
        "  p=${f#/proc/}; p=${p%%/*}; read n < /proc/$p/comm || continue",
        "  [ \"$n\" = runuser ] || continue; j=${f#*" +
        vm_instance.LAUNCHER_ERR + "}",
        "  c=$(tr '\\0\\n' '  ' < /proc/$p/cmdline)",
        "  echo \"@@user launcher|$p|of \\`ivcloud\\` pid ${j%%-*}||"
        "${c#* -- }\"",
        "done 2>/dev/null",
        "btl=$(echo $(grep -l -F " + BTL_LIBRARY +
        " /proc/[0-9]*/maps 2>/dev/null))",
        *_device_users(addr),
        "for f in $btl $dev; do",
        "  p=${f#/proc/}; p=${p%%/*}",
        "  case \" $seen \" in *\" $p \"*) continue;; esac",
        "  seen=\"$seen $p\"",
        "  case \" $btl \" in *\" /proc/$p/maps \"*) k=btl;; *) k=device;; esac",
        "  e=$(tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null)",
        "  j=$(printf '%s\\n' \"$e\" | sed -n 's/^OMPI_MCA_ess_base_jobid=//p')",
        "  r=$(printf '%s\\n' \"$e\" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p;"
        "s/^PMI_RANK=//p' | head -n 1)",
        "  c=$(tr '\\0\\n' '  ' < /proc/$p/cmdline 2>/dev/null | cut -c1-80)",
        "  echo \"@@user $k|$p|$j|$r|$c\"",
        "done; true"])
    r = agent.run(sock, script, GUEST_TIMEOUT_S)
    out = []
    for line in r.output.splitlines():
        if not line.startswith("@@user "):
            continue
        kind, pid, job, rank, cmd = (line[7:].split("|", 4) + [""] * 4)[:5]
        if job.isdigit():
            # as Open MPI prints a job id: [family,local job]
            job = f"[{int(job) >> 16},{int(job) & 0xffff}]"
        who = " ".join(f"{k} {v}" for k, v in (("job", job), ("rank", rank))
                       if v)
        cmd = cmd.strip()   # a launcher's whole: its head and its program
        cmd = cmd if len(cmd) < 80 else f"{cmd[:30]}...{cmd[-47:]}"
        out.append((kind, f"{who} (pid {pid}: {cmd})".lstrip()))
    return out


def _region_of(state: Dict, server: int) -> str:
    """The region of emulated server `server`: its ivshmem-server's memfd,
    as /proc/PID/fd/N."""
    return _memfd_of(state["servers"][str(server)]["pid"],
                     f"the ivshmem-server of s{server}")


def _job_region_of(state: Dict, server: int, job: int) -> str:
    """Slurm job `job`'s region on emulated server `server` (its own
    ivshmem-server's memfd)."""
    what = f"the ivshmem-server of Slurm job {job} on s{server}"
    pid = regions.job_server_pid(state, server, regions.slurm_job_key(job))
    if pid is None:
        raise ClusterFailure(f"{what} is not running")
    return _memfd_of(pid, what)


def _memfd_of(pid: int, what: str) -> str:
    try:
        for n in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:"):
                return f"/proc/{pid}/fd/{n}"
    except OSError as e:   # the server is gone, or closed it meanwhile
        raise ClusterFailure(f"{what} (pid {pid}): {e.strerror}") from None
    raise ClusterFailure(f"{what} (pid {pid}) holds no region")


def _device_users(addr: str) -> List[str]:
    """A guest's shell lines that set $dev to the /proc files by which
    processes map the region of the device at `addr` (/proc/P/maps) or
    hold its vfio group (/proc/P/fd): the provider's ranks, a tool."""
    q = agent.quote
    return [f"g=$(readlink /sys/bus/pci/devices/{q([addr])}/iommu_group)",
            "dev=$({ grep -l -F " + q([f"/{addr}/resource2"]) +
            " /proc/[0-9]*/maps; [ -z \"$g\" ] || find /proc/[0-9]*/fd "
            "-maxdepth 1 -lname \"/dev/vfio/${g##*/}\"; } 2>/dev/null)"]


def _gone(sock: Path, host: str, pids: List[int]) -> List[int]:
    """Which of the guest's processes `pids` are gone (or dead, not yet
    reaped)."""
    out = vm_instance.guest_run(
        sock, host, f"for p in {' '.join(map(str, pids))}; do "
        f"s=$(cut -d')' -f2 /proc/$p/stat 2>/dev/null); "
        f"case \"$s\" in ''|' Z'*|' X'*) echo \"@@gone $p\";; esac; "
        f"done; true", GUEST_TIMEOUT_S)
    return sorted({int(w[7:]) for w in out.splitlines()
                   if w.startswith("@@gone ") and w[7:].isdigit()})


def _hidden(d: Path) -> List[str]:
    """The env files a migration hid in the guest of the QEMU in `d`."""
    try:
        text = (d / HIDDEN).read_text()
    except FileNotFoundError:
        return []
    return text.split() or [GUEST_ENV]


def _mark_hidden(d: Path, env: str, hidden: bool) -> None:
    now = [e for e in _hidden(d) if e != env] + ([env] if hidden else [])
    if now:
        (d / HIDDEN).write_text("".join(f"{e}\n" for e in now))
    else:
        (d / HIDDEN).unlink(missing_ok=True)


def drain_ranks(state: Dict, host: str, sock: Path, addr: str, say,
                region: Optional[str] = None, env: str = GUEST_ENV) -> None:
    """The libfabric provider's ranks in the guest let go of the region
    of the device at `addr` (docs/migration.md): the env file they attach
    again from (`env`: the guest's ivshm.env, or a Slurm job's own)
    hidden (so that no rank attaches the device again before it is bound
    on the destination), each registry entry of the guest's IVPosition
    asked to drain on `region` (default: the guest's server's standing
    region), their acknowledgements waited for: bounded, and ended as
    soon as a process of the device died while an entry has not answered
    (a rank killed during the drain never answers)."""
    _mark_hidden(sock.parent, env, True)   # until unhide or unplug (heal)
    q = agent.quote
    # the position is the guest's own word: a false one only asks ranks of
    # the same trust domain to move to the core (docs/migration.md)
    out = vm_instance.guest_run(sock, host, "\n".join([
        *_device_users(addr),
        "for f in $dev; do p=${f#/proc/}; echo \"@@pid ${p%%/*}\"; done",
        f"mv -f {q([env, env + '.away'])} 2>/dev/null; sed -n "
        f"'s/^IVSHM_POSITION=//p' {guest_regions.BIND_DIR}/{addr}.env"]),
        GUEST_TIMEOUT_S)
    pids = sorted({int(w[6:]) for w in out.splitlines()
                   if w.startswith("@@pid ") and w[6:].isdigit()})
    position = next((w.strip() for w in out.splitlines()
                     if w.strip() and not w.startswith("@@")), "")
    if not position.isdigit():
        say(f"drain: the guest names no IVPosition for {addr}: no rank asked")
        return
    if region is None:
        region = _region_of(state, int(state["instances"][host]["server"]))
    req = int.from_bytes(os.urandom(4), "little") | 1   # a new one
    asked = native.drain_guest(region, int(position), req)
    deadline = time.monotonic() + DRAIN_ACK_S
    look = time.monotonic() + DRAIN_LIVENESS_S
    pending = list(asked)
    bad = []

    def answers() -> None:
        for slot, gen in list(pending):
            try:
                st = native.drain_state(region, slot, gen, req)
            except native.NotFound:
                st = 0   # it left
            if st is not None:
                bad.extend([f"slot {slot}: {os.strerror(-st)}"] if st else [])
                pending.remove((slot, gen))
    while True:
        answers()
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            raise StepFailed(f"drain: the rank in slot {pending[0][0]} did "
                             f"not let go of the region within "
                             f"{DRAIN_ACK_S:.0f} s")
        if pids and now > look:
            dead = _gone(sock, host, pids)
            # a rank that ends leaves the registry before its process is
            # gone: what has not answered after its death never will
            answers()
            if dead and pending:
                raise StepFailed(
                    f"drain: the rank in slot {pending[0][0]} did not let "
                    f"go of the region: process "
                    f"{', '.join(map(str, dead))} of the device died in "
                    f"the guest")
            look = time.monotonic() + DRAIN_LIVENESS_S
        time.sleep(0.1)
    say(f"drain: {len(asked)} ranks moved to the core"
        + (f" ({'; '.join(bad)})" if bad else ""))


def drain(state: Dict, host: str, sock: Path, addr: str,
          wait_jobs_s: Optional[float], say, region: Optional[str] = None,
          env: str = GUEST_ENV) -> None:
    """Before the guest's device (at `addr`) goes: what uses the region
    lets go of it (the MPI level's hook; docs/cluster.md, "Migration").
    The provider's ranks are asked to move their co-resident peers to the
    core path (drain_ranks). The BTL cannot move a peer to another path
    under ob1, and any other process holding the device's vfio group
    would keep the guest from giving it back: while such a process runs
    the migration is refused, naming it, or, with `wait_jobs_s`, waits
    that long for it to end. `region` and `env`: drain_ranks'."""
    deadline = None if wait_jobs_s is None else \
        time.monotonic() + wait_jobs_s
    said = asked = False
    grace = 0.0
    try:
        while True:
            users = guest_users(sock, addr)
            if users and not asked and all(k == "device" for k, _ in users):
                asked = True
                drain_ranks(state, host, sock, addr, say, region, env)
                # a rank acknowledges before it unmaps the device
                grace = time.monotonic() + DRAIN_GRACE_S
                continue
            if not users:
                return
            if time.monotonic() < grace:
                time.sleep(DRAIN_POLL_S)
                continue
            kind, who = users[0]
            more = f" and {len(users) - 1} more" if len(users) > 1 else ""
            why = {"launcher": "runs a job's launcher, which cannot follow "
                               "its guest to another QEMU",
                   "btl": "runs ranks of an Open MPI job over the ivshmem "
                          "BTL, which cannot move a peer to another path"
                   }.get(kind, "has processes that use its ivshmem device "
                               "and cannot let go of it")
            if deadline is None:
                raise ClusterError(f"instance '{host}' {why}: {who}{more}")
            if time.monotonic() > deadline:
                raise StepFailed(f"drain: {who}{more} did not end within "
                                 f"{wait_jobs_s:.0f} s")
            if not said:
                say(f"drain: waiting for {who}{more} to end")
                said = True
            time.sleep(DRAIN_POLL_S)
    except BaseException:   # the first error is the one to raise
        if asked:   # the ranks come back to the region they left
            for problem in process.undo([(f"the guest's {env}", lambda:
                                          unhide(sock.parent, host, env))],
                                        say):
                say(f"drain: {problem}: its ranks stay on the core")
        raise


def unhide(d: Path, host: str, env: str = GUEST_ENV) -> None:
    """The env file (ivshm.env, or a Slurm job's) that drain_ranks hid in
    the guest of the QEMU in `d`, back; never over one a bind wrote since
    (that one names the device the guest has now: the hidden one is
    stale)."""
    e, away = agent.quote([env]), agent.quote([env + ".away"])
    vm_instance.guest_run(d / "agent.sock", host,
                          f"if [ -e {e} ]; then rm -f {away}; "
                          f"elif [ -e {away} ]; then "
                          f"mv -f {away} {e}; fi",
                          GUEST_TIMEOUT_S)
    _mark_hidden(d, env, False)


def _device_of_env(env: str) -> str:
    """QEMU's id of the device whose env file is `env`: the device of
    boot's (ivshm.env), or a Slurm job's (its job env file)."""
    if env == GUEST_ENV:
        return qemu.BOOT_DEVICE
    name = Path(env).name
    job = name[:-len(".env")] if name.endswith(".env") else ""
    return guest_regions.device_id(int(job)) if job.isdigit() else ""


def heal(state: Dict, locked: bool = False) -> None:
    """Each env file (ivshm.env, a Slurm job's) that a migration hid and
    never put back (one killed between its drain and its unplug), back
    while its device is plugged, unless a migration holds the cluster's
    lock (`locked`: the caller's own)."""
    def hidden():
        return [(h, Path(rec["dir"])) for h, rec in
                state.get("vms", {}).items()
                if (Path(rec["dir"]) / HIDDEN).exists()]
    if not hidden():
        return
    # _Busy: that migration puts it back or takes the device
    with contextlib.suppress(_Busy):
        with contextlib.nullcontext() if locked else \
                filelock.held(Path(state["dir"]) / "migrate.lock", 0.0,
                              _Busy):
            for host, d in hidden():   # again, under the lock
                for env in _hidden(d):
                    try:
                        dev = _device_of_env(env)
                        with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
                            plugged = bool(dev) and qemu.find_device(
                                q, dev) is not None
                        if plugged:
                            unhide(d, host, env)
                        else:   # killed after its unplug: it is stale
                            vm_instance.guest_run(
                                d / "agent.sock", host,
                                f"rm -f {agent.quote([env + '.away'])}",
                                GUEST_TIMEOUT_S)
                            _mark_hidden(d, env, False)
                    except (OSError, IvcloudError):   # the next caller
                        continue


class _Busy(Exception):
    pass


# ---------------------------------------------------------------- device

def unplug(d: Path, host: str) -> str:
    """The device of boot out of the QEMU in `d`, its chardev closed,
    the guest's unit of it stopped; its PCI address."""
    addr = _unplug_device(d, host, qemu.BOOT_DEVICE, "its device",
                          "device of boot")
    vm_instance.guest_run(d / "agent.sock", host,
                          guest_regions.clear_script(addr, AWAY_ENV),
                          GUEST_TIMEOUT_S)
    _mark_hidden(d, GUEST_ENV, False)
    return addr


def _unplug_device(d: Path, host: str, dev: str, what: str,
                   missing: str) -> str:
    """QEMU's device `dev` (`what`, in messages) out of the QEMU in `d`
    once the guest gave it back, its chardev closed; its PCI address."""
    addr = guest_regions.take_device(d, host, dev, what)
    if addr is None:
        raise ClusterFailure(f"guest {host} has no {missing}")
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        qemu.remove_chardev(q, dev)
    return addr


def plug_qemu(d: Path, server_socket: str) -> str:
    """The QEMU side of a plug: a device on `server_socket` into
    BOOT_PORT of the QEMU in `d` (which may be paused); its PCI
    address."""
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        return qemu.plug_ivshmem(q, qemu.BOOT_DEVICE, qemu.BOOT_PORT,
                                 server_socket, guest_regions.VECTORS)


def restore(d: Path, host: str, server_socket: str) -> None:
    """The device of boot back into the running guest of the QEMU in `d`
    (on `server_socket`) and bound, unless it never came out (a guest
    that did not give it back keeps it, and its unplug request)."""
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        if qemu.find_device(q, qemu.BOOT_DEVICE) is not None:
            return unhide(d, host)
        qemu.remove_chardev(q, qemu.BOOT_DEVICE)   # if still there
    addr = plug_qemu(d, server_socket)
    # a hidden env from before the unplug is stale: the bind writes anew
    vm_instance.guest_run(d / "agent.sock", host, "\n".join(
        [guest_regions.clear_script(addr, AWAY_ENV),
         *guest_regions.bind_lines(addr)]), BIND_TIMEOUT_S)
    _mark_hidden(d, GUEST_ENV, False)


@dataclass
class JobDevice:
    """A running Slurm job's device in the moving guest: the job, its
    name for messages, its node list (Slurm's expression), the device's
    PCI address and root port."""
    job: int
    name: str
    nodelist: str
    addr: str
    port: str

    @property
    def dev(self) -> str:
        return guest_regions.device_id(self.job)

    @property
    def env(self) -> str:
        return guest_regions.job_env_path(self.job)

    @property
    def key(self) -> str:
        return regions.slurm_job_key(self.job)


def unplug_job(d: Path, host: str, j: JobDevice) -> None:
    """Job `j`'s device out of the QEMU in `d`, its chardev closed, the
    guest's unit and env files of it removed (the job's region stays)."""
    addr = _unplug_device(d, host, j.dev, f"{j.name}'s device",
                          f"device of {j.name}")
    vm_instance.guest_run(d / "agent.sock", host, guest_regions.clear_script(
        addr, j.env, j.env + ".away"), GUEST_TIMEOUT_S)
    _mark_hidden(d, j.env, False)


def restore_job(d: Path, host: str, j: JobDevice, server_socket: str
                ) -> None:
    """Job `j`'s device back into the running guest of the QEMU in `d`,
    on the job's server at `server_socket`, bound and named in the job's
    env file again, unless it never came out (then its env file is put
    back)."""
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        if qemu.find_device(q, j.dev) is not None:
            return unhide(d, host, j.env)
        qemu.remove_chardev(q, j.dev)   # if still there
        addr = qemu.plug_ivshmem(q, j.dev, j.port, server_socket,
                                 guest_regions.VECTORS)
    vm_instance.guest_run(d / "agent.sock", host, "\n".join(
        [guest_regions.clear_script(addr, j.env + ".away"),
         *guest_regions.bind_lines(addr),
         *guest_regions.job_env_lines(addr, j.job)]), BIND_TIMEOUT_S)
    _mark_hidden(d, j.env, False)


# ---------------------------------------------------------------- the move

class _Move:
    """One instance moving from server `src` to `dest`: its steps, what
    undoes each, the progress lines."""

    def __init__(self, sd: StateDir, state: Dict, host: str, src: int,
                 dest: int, say, t0: float, jobs: List[JobDevice],
                 held: contextlib.ExitStack):
        self.sd, self.state, self.host = sd, state, host
        self.src, self.dest, self.say, self.t0 = src, dest, say, t0
        self.jobs, self.held = jobs, held
        # {job: the socket of its region on the destination}
        self.job_sockets: Dict[int, str] = {}
        self.step = "check"
        self.undo: List[Tuple[str, Callable[[], None]]] = []
        rec = state["vms"][host]
        self.src_dir = Path(rec["dir"])
        self.src_tap = rec["tap"]
        self.topo = topology_from_dict(state["topology"])
        self.inst = next(i for i in self.topo.instance_list()
                         if i.hostname == host)
        self.dest_dir = vm_instance.vm_root(sd) / (
            host if dest == self.inst.server else f"{host}.s{dest}")
        base = vm_instance.tap_name(host)
        self.dest_tap = base + "m" if self.src_tap == base else base
        self.fabric = int(state["holders"]["fabric"]["pid"])
        self.result: Dict = {"instance": host, "from": f"s{src}",
                             "to": f"s{dest}"}

    def phase(self, name: str) -> None:
        self.step = name
        self.say(f"{name} ({time.monotonic() - self.t0:.1f} s)")

    def socket_of(self, server: int) -> str:
        return self.state["servers"][str(server)]["socket"]

    def job_socket(self, server: int, j: JobDevice) -> str:
        return regions.job_socket(self.state, server, j.key)

    # -- the steps up to the switch, each with its undo

    def unplug_source(self) -> None:
        self.phase("unplug")
        for j in self.jobs:   # its region on the source stays till the end
            self.undo.append((f"{j.name}'s device plugged again", lambda j=j:
                              restore_job(self.src_dir, self.host, j,
                                          self.job_socket(self.src, j))))
            unplug_job(self.src_dir, self.host, j)
        # registered first: the device may be out when a later part of
        # the unplug fails
        self.undo.append(("the source's device plugged again", lambda:
                          restore(self.src_dir, self.host,
                                  self.socket_of(self.src))))
        self.addr = unplug(self.src_dir, self.host)

    def make_tap(self) -> None:
        self.phase("tap")
        srv = self.state["servers"][str(self.dest)]
        self.state["links"].append(self.dest_tap)
        save(self.sd, self.state)
        self.undo.append(("the destination's tap deleted", self._drop_tap))
        network.add_tap(self.fabric, self.dest_tap, srv["bridge"])

    def _drop_tap(self, tap: Optional[str] = None) -> None:
        tap = tap or self.dest_tap
        network.delete_links(self.fabric, [tap])
        if tap in self.state["links"]:
            self.state["links"].remove(tap)
        save(self.sd, self.state)

    def start_destination(self) -> None:
        self.phase("start")
        binary = qemu.qemu_binary()
        if binary is None:
            raise ClusterFailure(f"QEMU not found ({qemu.DEFAULT_QEMU}, or "
                                 f"${qemu.QEMU_ENV})")
        if self.dest_dir.exists():
            vm_lifecycle.stop_vm(self.dest_dir)   # a leftover
        self.dest_dir.mkdir(mode=0o700)
        # no job's epilog unplugs a device there before the move is done
        # (it follows the guest to this QEMU once state.json names it)
        self.held.enter_context(guest_regions.port_lock(self.dest_dir))
        self.job_regions()
        # undone after the destination is gone (they share the disk): a
        # failed or cancelled migration lets the source run on, one that
        # completed leaves it paused
        self.undo.append(("the source resumed", self._resume_source))
        self.undo.append(("the destination QEMU stopped",
                          lambda: vm_lifecycle.stop_vm(self.dest_dir)))
        cmd = vm_instance.guest_qemu_command(
            self.topo, self.state, binary, vm_instance.boot_image(self.state),
            vm_instance.guest_accel(self.state), self.inst, self.dest_dir,
            self.dest_tap, None, incoming=True)
        qemu.launch(holder.enter_argv(self.fabric, ("net",)) + cmd,
                    self.dest_dir, f"{self.host} on s{self.dest}")
        if vm_lifecycle.qemu_pid(self.dest_dir) is None:
            log = (self.dest_dir / "qemu.log").read_text(errors="replace")
            raise ClusterFailure(f"the destination QEMU of {self.host} "
                                 f"exited at once: {qemu.last_line(log)}")

    def job_regions(self) -> None:
        """Each moving job a region of its own on the destination, made
        as the job's prolog makes one (the same size and geometry: the
        server's), unless one of the job's guests there has it already
        (the job is one trust domain); undone after the destination QEMU
        is stopped, which may have a device on it."""
        for j in self.jobs:
            if regions.job_server_pid(self.state, self.dest, j.key):
                self.job_sockets[j.job] = self.job_socket(self.dest, j)
                continue
            self.undo.append((f"{j.name}'s region on s{self.dest} stopped",
                              lambda j=j: self._stop_job_region(self.dest,
                                                                j)))
            self.job_sockets[j.job] = regions.start_regions(
                self.state, j.key, [self.dest],
                leave_notices=guest_regions.LEAVE_NOTICES)[self.dest]

    def _stop_job_region(self, server: int, j: JobDevice) -> None:
        problems = regions.stop_regions(self.state, j.key, [server])
        if problems:
            raise ClusterFailure("; ".join(problems))

    def migrate(self) -> None:
        self.phase("migrate")
        uri = f"unix:{self.dest_dir / 'migrate.sock'}"
        with qemu.Qmp(self.dest_dir / "qmp.sock", QMP_TIMEOUT_S) as q:
            qemu.start_incoming(q, uri)
        # under TCG, QEMU 7.2 loses guest writes made during a live copy
        # (docs/cluster.md, "Migration", step 6): the guest is paused for
        # the whole copy there
        paused = vm_instance.guest_accel(self.state) == "tcg"
        with qemu.Qmp(self.src_dir / "qmp.sock", QMP_TIMEOUT_S) as q:
            info = qemu.migrate(q, uri, MIGRATE_TIMEOUT_S, paused=paused)
        self.result.update(info)
        self.say(f"migrated ({time.monotonic() - self.t0:.1f} s), downtime "
                 f"{info.get('downtime_ms')} ms"
                 f"{' (paused for the copy: TCG)' if paused else ''}, "
                 f"{(info.get('transferred') or 0) >> 20} MiB sent")

    def _resume_source(self) -> None:
        with qemu.Qmp(self.src_dir / "qmp.sock", QMP_TIMEOUT_S) as q:
            qemu.resume(q)

    def plug_destination(self) -> None:
        # undone with the destination QEMU, whose guest never saw it
        self.phase("plug")
        got = plug_qemu(self.dest_dir, self.socket_of(self.dest))
        if got != self.addr:
            raise ClusterFailure(f"the device is at {got} on the "
                                 f"destination, not at {self.addr}")
        # a job's device into the port it had: the guest finds it at the
        # address its job's ranks knew
        for j in self.jobs:
            with qemu.Qmp(self.dest_dir / "qmp.sock", QMP_TIMEOUT_S) as q:
                got = qemu.plug_ivshmem(q, j.dev, j.port,
                                        self.job_sockets[j.job],
                                        guest_regions.VECTORS)
            if got != j.addr:
                raise ClusterFailure(f"{j.name}'s device is at {got} on "
                                     f"the destination, not at {j.addr}")

    # -- the switch, after which there is no undo

    def switch(self) -> None:
        self.phase("switch")
        with qemu.Qmp(self.dest_dir / "qmp.sock", QMP_TIMEOUT_S) as q:
            q.execute("cont")
        self.undo.clear()
        rec = self.state["vms"][self.host]
        old_pid = vm_lifecycle.qemu_pid(self.src_dir)
        rec.update(dir=str(self.dest_dir), tap=self.dest_tap,
                   pid=vm_lifecycle.qemu_pid(self.dest_dir))
        self.state["instances"][self.host]["server"] = self.dest
        save(self.sd, self.state)
        try:
            vm_lifecycle.stop_vm(self.src_dir)
        except IvcloudError as e:
            self.say(f"the source QEMU {old_pid}: {e}")
        self._drop_tap(self.src_tap)

    def finish(self) -> None:
        self.phase("bind")   # ivshm-bind run, bounded: its env file
        lines = guest_regions.bind_lines(self.addr)
        for j in self.jobs:   # the file the job's ranks attach again from
            lines += [*guest_regions.bind_lines(j.addr),
                      *guest_regions.job_env_lines(j.addr, j.job),
                      f"rm -f {agent.quote([j.env + '.away'])}"]
        vm_instance.guest_run(self.dest_dir / "agent.sock", self.host,
                              "\n".join(lines),
                              BIND_TIMEOUT_S * (1 + len(self.jobs)))
        # the provider's drained ranks attach on their own once ivshm-bind
        # wrote ivshm.env (a Slurm job's: its env file) again
        # (docs/migration.md), a BTL job never runs across a migration
        # (drain), new jobs find ivshm-bind's files
        self.phase("attach")
        for j in self.jobs:
            self.release(j)

    def release(self, j: JobDevice) -> None:
        """Job `j`'s region on the source stopped unless a guest of the
        job is still there (its epilog stops it then, as it stops the
        job's regions wherever they are)."""
        try:
            nodes = moves.job_nodes(self.state, j.nodelist)
            there = [n for n in nodes if n != self.host and
                     self.state["instances"].get(n, {}).get("server")
                     == self.src]
            if there:
                self.say(f"attach: {j.name}'s region on s{self.src} stays "
                         f"for {', '.join(there)}")
                return
            self._stop_job_region(self.src, j)
            self.say(f"attach: {j.name}'s region on s{self.src} stopped "
                     f"(no guest of the job is left there)")
        except IvcloudError as e:
            self.say(f"attach: {j.name}'s region on s{self.src} not "
                     f"stopped ({e}); its epilog stops it")

    def record(self) -> None:
        self.phase("record")
        rec = self.state["vms"][self.host]
        rec["vcpu_threads"] = vm_instance.pin(
            self.dest_dir, self.state["instances"][self.host]["cpus"])
        rec["device"] = self.addr
        save(self.sd, self.state)


def _move(sd: StateDir, state: Dict, host: str, src: int, dest: int,
          say, t0: float, jobs: Optional[List[JobDevice]] = None) -> Dict:
    """Steps 3-11 (the module's docstring), counted from `t0`, with the
    devices of the running Slurm jobs `jobs`; the report."""
    with contextlib.ExitStack() as held:
        return _move_held(sd, state, host, src, dest, say, t0, jobs or [],
                          held)


def _move_held(sd: StateDir, state: Dict, host: str, src: int, dest: int,
               say, t0: float, jobs: List[JobDevice],
               held: contextlib.ExitStack) -> Dict:
    m = _Move(sd, state, host, src, dest, say, t0, jobs, held)
    try:
        for step in (m.unplug_source, m.make_tap, m.start_destination,
                     m.migrate, m.plug_destination, m.switch):
            step()
    except BaseException as e:
        problems = process.undo(m.undo, say)
        if not isinstance(e, Exception):
            raise
        but = f" (but: {'; '.join(problems)})" if problems else ""
        raise StepFailed(f"migration of {host} to s{dest} failed at step "
                         f"'{m.step}': {e}; rolled back, the guest runs on "
                         f"s{src}{but}") from None
    try:
        m.finish()
    except Exception as e:
        failed = f"migration of {host} to s{dest} failed at step " \
                 f"'{m.step}': {e}"
        say(f"{m.step} failed ({e}); moving it back to s{src}")
        try:
            _move(sd, state, host, dest, src, say, time.monotonic(), jobs)
        except IvcloudError as back:
            raise StepFailed(f"{failed}; moving it back failed too: "
                             f"{back}") from None
        raise StepFailed(f"{failed}; moved back, the guest runs on "
                         f"s{src}") from None
    try:
        m.record()
    except (OSError, IvcloudError) as e:
        raise StepFailed(f"migration of {host} to s{dest}: step 'record' "
                         f"failed: {e}; the guest runs on s{dest} with its "
                         f"device") from None
    m.result["seconds"] = round(time.monotonic() - m.t0, 1)
    return m.result


def migrate(sd: StateDir, state: Dict, host: str, server: str,
            wait_jobs_s: Optional[float] = None,
            log: Optional[Callable[[str], None]] = None) -> Dict:
    """Move instance `host` of a VM cluster that is up to emulated server
    `server`, live (the module's docstring); {"instance", "from", "to",
    "downtime_ms", "total_ms", "transferred", "seconds"}. ClusterError
    for a request that cannot be (nothing was touched); StepFailed,
    naming the step, when a step failed (undone: the guest runs on its
    source with its device)."""
    log = log or (lambda line: sys.stderr.write(line + "\n"))

    def say(line: str) -> None:
        log(f"migrate {host}: {line}")
    t0 = time.monotonic()
    src, dest = check(state, host, server)
    lock = sd.dir / "migrate.lock"
    with filelock.held(lock, LOCK_TIMEOUT_S, lambda: ClusterError(
            f"another migration of cluster '{state['name']}' is under way")):
        with process.interrupts():
            # what an earlier migration changed since the caller read it
            state = load(sd) or state
            src, dest = check(state, host, server)
            d = vm_instance.vm_dir_of(state, host)
            sock = vm_instance.guest(state, host)   # it lives
            heal(state, locked=True)
            with (moves.held(state, host, say)
                  if state.get("scheduler") == "slurm"
                  else contextlib.nullcontext()):
                return _settle_and_move(sd, state, host, dest, d, sock,
                                        wait_jobs_s, say, t0)


def _slurm_jobs(state: Dict, host: str, sock: Path,
                plugged: Dict[int, Tuple[Optional[str], Optional[str]]]
                ) -> Tuple[List[Tuple[str, str]], List[JobDevice]]:
    """The Slurm jobs of guest `host` (`plugged`: {job: (its device's
    PCI address, its root port)} in the guest's QEMU): (those that keep
    the guest where it is, each as (its name, why); those whose device
    moves with the guest). A running job moves with it when its device
    is plugged and none of its ranks uses the Open MPI BTL (ob1 cannot
    move a peer to another path); a job being set up (its prolog has not
    plugged its device yet), suspended (its ranks do not answer a drain)
    or ending (its epilog has not unplugged it yet) keeps it."""
    if state.get("scheduler") != "slurm":
        return [], []
    stay: List[Tuple[str, str]] = []
    movable: List[JobDevice] = []
    listed = moves.job_list(state, host)
    for job, st, name, nodelist in listed:
        addr, port = plugged.get(job, (None, None))
        if st != "R" or addr is None or port is None:
            stay.append((name, {"CF": "which is being set up",
                                "S": "which is suspended",
                                "CG": "which is ending"}.get(
                                    st, "whose device is not plugged")))
        elif any(k == "btl" for k, _ in guest_users(sock, addr)):
            stay.append((name, "whose ranks use the Open MPI BTL, which "
                               "cannot move a peer to another path (ob1)"))
        else:
            movable.append(JobDevice(job, name, nodelist, addr, port))
    for job in sorted(set(plugged) - {j for j, _, _, _ in listed}):
        stay.append((f"Slurm job {job} (its device {plugged[job][0]})",
                     "which has ended, its device not unplugged yet"))
    return stay, movable


def _settle_and_move(sd: StateDir, state: Dict, host: str, dest: int,
                     d: Path, sock: Path, wait_jobs_s: Optional[float],
                     say, t0: float) -> Dict:
    """Once no Slurm job keeps guest `host` where it is (refused, or
    waited for with `wait_jobs_s`: _slurm_jobs), the drain of its running
    jobs' ranks (each on the job's region) and of its device of boot,
    and its move, under the lock of its ports (no job's prolog or epilog
    plugs or unplugs a device meanwhile)."""
    deadline = None if wait_jobs_s is None else \
        time.monotonic() + wait_jobs_s
    said = False
    while True:
        with guest_regions.port_lock(d):
            with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
                addr = qemu.find_device(q, qemu.BOOT_DEVICE)
                plugged = {guest_regions.job_of(dev):
                           (qemu.find_device(q, dev), qemu.port_of(q, dev))
                           for dev in qemu.ivshmem_ids(q)
                           if guest_regions.job_of(dev) is not None}
            if addr is None:
                raise ClusterFailure(f"guest {host} has no device of "
                                     f"boot (a migration that failed "
                                     f"half-way?)")
            stay, jobs = _slurm_jobs(state, host, sock, plugged)
            if not stay:
                def left():   # the drains share the caller's deadline
                    return None if deadline is None else \
                        max(0.0, deadline - time.monotonic())
                src = int(state["instances"][host]["server"])
                drained: List[JobDevice] = []
                try:
                    for j in jobs:
                        say(f"drain: {j.name}'s ranks, on its region on "
                            f"s{src}")
                        drain(state, host, sock, j.addr, left(), say,
                              region=_job_region_of(state, src, j.job),
                              env=j.env)
                        drained.append(j)
                    drain(state, host, sock, addr, left(), say)
                except BaseException as e:
                    # the jobs' ranks come back to the regions they left
                    for problem in process.undo(
                            [(f"{j.name}'s env file", lambda j=j:
                              unhide(d, host, j.env)) for j in drained],
                            say):
                        say(f"drain: {problem}: its ranks stay on the core")
                    if isinstance(e, ClusterError) or \
                            not isinstance(e, IvcloudError):
                        raise
                    raise StepFailed(f"migration of {host} to s{dest} "
                                     f"failed at step 'drain': {e}; "
                                     f"nothing was changed") from None
                say(f"drained ({time.monotonic() - t0:.1f} s)")
                # a drain may have waited long
                state = load(sd) or state
                src, dest = check(state, host, str(dest))
                return _move(sd, state, host, src, dest, say, t0, jobs)
        name, why = stay[0]
        more = f" and {len(stay) - 1} more" if len(stay) > 1 else ""
        if deadline is None:
            raise ClusterError(f"instance '{host}' runs {name}{more}, {why}")
        if time.monotonic() > deadline:
            raise StepFailed(f"migration of {host} to s{dest} failed at "
                             f"step 'drain': {name}{more} did not end "
                             f"within {wait_jobs_s:.0f} s; nothing was "
                             f"changed")
        if not said:
            say(f"drain: waiting for {name}{more} to end")
            said = True
        time.sleep(DRAIN_POLL_S)


def describe(report: Dict) -> str:
    """One line of a migration's report."""
    return (f"{report['instance']} moved from {report['from']} to "
            f"{report['to']} in {report.get('seconds')} s (QEMU: downtime "
            f"{report.get('downtime_ms')} ms, total "
            f"{report.get('total_ms')} ms)")

