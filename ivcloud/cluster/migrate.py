"""Live migration of a VM cluster's instance to another emulated server
(`cluster migrate INSTANCE --to SERVER`): the guest leaves its server's
region, QEMU moves it to a new QEMU process "on" the destination server,
and it joins the destination server's region.

QEMU migrates no ivshmem-doorbell device, so the guest's device of boot,
in its root port of its own (qemu.BOOT_PORT), comes out first and a
device on the destination server's standing ivshmem-server goes into
the same port of the new QEMU after: the guest finds it at the PCI
address it had. The steps, each a phase on the progress lines (check,
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
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .. import filelock, native, process
from ..errors import ClusterError, ClusterFailure, IvcloudError
from ..vm import agent, qemu
from ..vm import lifecycle as vm_lifecycle
from . import holder, network, vm_instance
from .slurm import guest_regions, moves
from .state import StateDir, load, save
from .topology import topology_from_dict

# bounds, in seconds, for a TCG guest on a loaded host (as guest_regions)
QMP_TIMEOUT_S = 30.0
UNPLUG_TIMEOUT_S = 30.0
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
# in the guest's VM directory while its ivshm.env is hidden (heal)
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
    pid = state["servers"][str(server)]["pid"]
    try:
        for n in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:"):
                return f"/proc/{pid}/fd/{n}"
    except OSError as e:   # the server is gone, or closed it meanwhile
        raise ClusterFailure(f"the ivshmem-server of s{server} (pid {pid}): "
                             f"{e.strerror}") from None
    raise ClusterFailure(f"the ivshmem-server of s{server} (pid {pid}) "
                         f"holds no region")


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


def drain_ranks(state: Dict, host: str, sock: Path, addr: str, say) -> None:
    """The libfabric provider's ranks in the guest let go of the region
    (docs/migration.md): the guest's ivshm.env hidden (so that no rank
    attaches the device again before it is bound on the destination),
    each registry entry of the guest's IVPosition asked to drain on its
    server's region, their acknowledgements waited for: bounded, and
    ended as soon as a process of the device died while an entry has not
    answered (a rank killed during the drain never answers)."""
    (sock.parent / HIDDEN).touch()   # until unhide or unplug (heal)
    # the position is the guest's own word: a false one only asks ranks of
    # the same trust domain to move to the core (docs/migration.md)
    out = vm_instance.guest_run(sock, host, "\n".join([
        *_device_users(addr),
        "for f in $dev; do p=${f#/proc/}; echo \"@@pid ${p%%/*}\"; done",
        f"mv -f {GUEST_ENV} {AWAY_ENV} 2>/dev/null; sed -n "
        f"'s/^IVSHM_POSITION=//p' {guest_regions.BIND_DIR}/{addr}.env"]),
        GUEST_TIMEOUT_S)
    pids = sorted({int(w[6:]) for w in out.splitlines()
                   if w.startswith("@@pid ") and w[6:].isdigit()})
    position = next((w.strip() for w in out.splitlines()
                     if w.strip() and not w.startswith("@@")), "")
    if not position.isdigit():
        say(f"drain: the guest names no IVPosition for {addr}: no rank asked")
        return
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
          wait_jobs_s: Optional[float], say) -> None:
    """Before the guest's device (at `addr`) goes: what uses the region
    lets go of it (the MPI level's hook; docs/cluster.md, "Migration").
    The provider's ranks are asked to move their co-resident peers to the
    core path (drain_ranks). The BTL cannot move a peer to another path
    under ob1, and any other process holding the device's vfio group
    would keep the guest from giving it back: while such a process runs
    the migration is refused, naming it, or, with `wait_jobs_s`, waits
    that long for it to end."""
    deadline = None if wait_jobs_s is None else \
        time.monotonic() + wait_jobs_s
    said = asked = False
    grace = 0.0
    try:
        while True:
            users = guest_users(sock, addr)
            if users and not asked and all(k == "device" for k, _ in users):
                asked = True
                drain_ranks(state, host, sock, addr, say)
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
            for problem in process.undo([(f"the guest's {GUEST_ENV}", lambda:
                                          unhide(sock.parent, host))], say):
                say(f"drain: {problem}: its ranks stay on the core")
        raise


def unhide(d: Path, host: str) -> None:
    """The ivshm.env that drain_ranks hid in the guest of the QEMU in
    `d`, back; never over one a bind wrote since (that one names the
    device the guest has now: the hidden one is stale)."""
    vm_instance.guest_run(d / "agent.sock", host,
                          f"if [ -e {GUEST_ENV} ]; then rm -f {AWAY_ENV}; "
                          f"elif [ -e {AWAY_ENV} ]; then "
                          f"mv -f {AWAY_ENV} {GUEST_ENV}; fi",
                          GUEST_TIMEOUT_S)
    (d / HIDDEN).unlink(missing_ok=True)


def heal(state: Dict, locked: bool = False) -> None:
    """Each ivshm.env that a migration hid and never put back (one killed
    between its drain and its unplug), back, unless a migration holds
    the cluster's lock (`locked`: the caller's own)."""
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
                try:
                    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
                        plugged = qemu.find_device(
                            q, qemu.BOOT_DEVICE) is not None
                    if plugged:
                        unhide(d, host)
                    else:   # killed after its unplug: the env is stale
                        vm_instance.guest_run(
                            d / "agent.sock", host, f"rm -f {AWAY_ENV}",
                            GUEST_TIMEOUT_S)
                        (d / HIDDEN).unlink(missing_ok=True)
                except (OSError, IvcloudError):   # the next caller tries again
                    continue


class _Busy(Exception):
    pass


# ---------------------------------------------------------------- device

def unplug(d: Path, host: str) -> str:
    """The device of boot out of the QEMU in `d`, its chardev closed,
    the guest's unit of it stopped; its PCI address."""
    pid = vm_lifecycle.qemu_pid(d)
    if pid is None:
        raise ClusterFailure(f"the QEMU of {host} is gone")
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        addr = qemu.find_device(q, qemu.BOOT_DEVICE)
        if addr is None:
            raise ClusterFailure(f"guest {host} has no device of boot")
        with agent.quiet(d / "agent.sock", UNPLUG_TIMEOUT_S):
            back = qemu.unplug_ivshmem(q, pid, qemu.BOOT_DEVICE,
                                       UNPLUG_TIMEOUT_S)
        if not back:
            raise ClusterFailure(
                f"guest {host} did not give its device ({addr}) back "
                f"within {UNPLUG_TIMEOUT_S:.0f} s (a process holds it)")
        qemu.remove_chardev(q, qemu.BOOT_DEVICE)
    vm_instance.guest_run(d / "agent.sock", host,
                          guest_regions.clear_script(addr, AWAY_ENV),
                          GUEST_TIMEOUT_S)
    (d / HIDDEN).unlink(missing_ok=True)
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
    (d / HIDDEN).unlink(missing_ok=True)


# ---------------------------------------------------------------- the move

class _Move:
    """One instance moving from server `src` to `dest`: its steps, what
    undoes each, the progress lines."""

    def __init__(self, sd: StateDir, state: Dict, host: str, src: int,
                 dest: int, say, t0: float):
        self.sd, self.state, self.host = sd, state, host
        self.src, self.dest, self.say, self.t0 = src, dest, say, t0
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

    # -- the steps up to the switch, each with its undo

    def unplug_source(self) -> None:
        self.phase("unplug")
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
        vm_instance.guest_run(self.dest_dir / "agent.sock", self.host,
                              "\n".join(guest_regions.bind_lines(self.addr)),
                              BIND_TIMEOUT_S)
        # the provider's drained ranks attach on their own once ivshm-bind
        # wrote ivshm.env again (docs/migration.md), a BTL job never runs
        # across a migration (drain), new jobs find ivshm-bind's files
        self.phase("attach")

    def record(self) -> None:
        self.phase("record")
        rec = self.state["vms"][self.host]
        rec["vcpu_threads"] = vm_instance.pin(
            self.dest_dir, self.state["instances"][self.host]["cpus"])
        rec["device"] = self.addr
        save(self.sd, self.state)


def _move(sd: StateDir, state: Dict, host: str, src: int, dest: int,
          say, t0: float) -> Dict:
    """Steps 3-11 (the module's docstring), counted from `t0`; the
    report."""
    m = _Move(sd, state, host, src, dest, say, t0)
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
            _move(sd, state, host, dest, src, say, time.monotonic())
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


def _slurm_jobs(state: Dict, devices: List[str], host: str) -> List[str]:
    """The Slurm jobs that keep guest `host` (its QEMU's ivshmem
    `devices`) where it is: those slurmctld has on its node, and any
    whose device is still plugged (an epilog not done yet)."""
    if state.get("scheduler") != "slurm":
        return []
    jobs = moves.jobs_on(state, host)
    for dev in devices:
        job = guest_regions.job_of(dev)
        if job is not None and not any(j.startswith(f"Slurm job {job} ")
                                       for j in jobs):
            jobs.append(f"Slurm job {job} (its device {dev})")
    return jobs


def _settle_and_move(sd: StateDir, state: Dict, host: str, dest: int,
                     d: Path, sock: Path, wait_jobs_s: Optional[float],
                     say, t0: float) -> Dict:
    """Once no Slurm job runs in guest `host` (refused, or waited for
    with `wait_jobs_s`: a job's region is its own on the guest's server,
    plugged for the job's life), its drain and move, under the lock of
    its ports (no job's prolog plugs a device meanwhile)."""
    deadline = None if wait_jobs_s is None else \
        time.monotonic() + wait_jobs_s
    said = False
    while True:
        with guest_regions.port_lock(d):
            with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
                addr = qemu.find_device(q, qemu.BOOT_DEVICE)
                devices = qemu.ivshmem_ids(q)
            jobs = _slurm_jobs(state, devices, host)
            if addr is None:
                raise ClusterFailure(f"guest {host} has no device of "
                                     f"boot (a migration that failed "
                                     f"half-way?)")
            if not jobs:
                left = None if deadline is None else \
                    max(0.0, deadline - time.monotonic())
                try:
                    drain(state, host, sock, addr, left, say)
                except ClusterError:
                    raise
                except IvcloudError as e:
                    raise StepFailed(f"migration of {host} to s{dest} "
                                     f"failed at step 'drain': {e}; "
                                     f"nothing was changed") from None
                say(f"drained ({time.monotonic() - t0:.1f} s)")
                # a drain may have waited long
                state = load(sd) or state
                src, dest = check(state, host, str(dest))
                return _move(sd, state, host, src, dest, say, t0)
        more = f" and {len(jobs) - 1} more" if len(jobs) > 1 else ""
        if deadline is None:
            raise ClusterError(
                f"instance '{host}' runs {jobs[0]}{more}, whose region is "
                f"the job's own on its server and cannot follow it to "
                f"another")
        if time.monotonic() > deadline:
            raise StepFailed(f"migration of {host} to s{dest} failed at "
                             f"step 'drain': {jobs[0]}{more} did not end "
                             f"within {wait_jobs_s:.0f} s; nothing was "
                             f"changed")
        if not said:
            say(f"drain: waiting for {jobs[0]}{more} to end")
            said = True
        time.sleep(DRAIN_POLL_S)


def describe(report: Dict) -> str:
    """One line of a migration's report."""
    return (f"{report['instance']} moved from {report['from']} to "
            f"{report['to']} in {report.get('seconds')} s (QEMU: downtime "
            f"{report.get('downtime_ms')} ms, total "
            f"{report.get('total_ms')} ms)")

