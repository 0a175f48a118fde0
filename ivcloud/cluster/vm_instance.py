"""Instances that are QEMU guests (`cluster up --instance-kind vm`): what
each guest is made of, and how the host reaches it, is docs/cluster.md,
"Instances as QEMU guests". Everything of a guest's QEMU lives in its
directory (STATE_DIR/vm/<hostname>/, after a migration state.json's
"dir"), which its command line names, so `down` finds a QEMU even when
`up` was killed before it recorded the pid.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from ..errors import (AgentError, ClusterError, ClusterFailure, IvcloudError,
                      VmFailure)
from ..mpis import mpi_root
from ..vm import agent, debian, qemu, share as vm_share
from ..vm import lifecycle as vm_lifecycle
from ..vm.image import GuestImage
from .. import procfs
from . import holder
from . import network
from .state import StateDir, load, save
from .topology import PREFIX_LEN, ClusterTopology, Instance

DEFAULT_MEMORY_MB = 512
MIN_MEMORY_MB = 256
BOOT_TIMEOUT_S = 300.0
MPI_USER = debian.MPI_USER
# after a guest of a running job died: how often the host looks
JOB_POLL_S = 1.0
# a job launcher's stderr in its guest, then `ivcloud`'s pid (guest_users)
LAUNCHER_ERR = "/tmp/launcher-"
# what a `cluster mpirun` ivshmem job on a VM cluster gets instead of
# regions of its own
SHARED_NOTE = ("the guests' ivshmem devices were attached at boot: this "
               "job shares each server's standing region with the "
               "cluster's other `cluster mpirun` jobs (a VM cluster is one "
               "trust domain)")
# at most this many root ports for hot-plugged devices per guest
MAX_JOB_PORTS = 8

T = TypeVar("T")


def tap_name(hostname: str) -> str:
    return f"t-{hostname}"  # IFNAMSIZ: 15 characters with s249i249


def vm_root(sd: StateDir) -> Path:
    return sd.dir / "vm"


def vm_dir(sd: StateDir, hostname: str) -> Path:
    return vm_root(sd) / hostname


def overlay_path(state: Dict, hostname: str) -> Path:
    """The qcow2 file of guest `hostname`'s root file system."""
    return Path(state["dir"]) / "vm" / f"{hostname}.qcow2"


def _mac(inst: Instance) -> str:
    return f"52:54:00:fb:{inst.server:02x}:{inst.index + 1:02x}"


# ---------------------------------------------------------------- options

@dataclass(frozen=True)
class VmOptions:
    """What a caller asks of QEMU-guest instances (`cluster up
    --instance-kind vm`, ClusterSession)."""
    guest_deb: Optional[str] = None     # None: the newest in build/deb
    memory_mb: int = DEFAULT_MEMORY_MB
    accel: str = "auto"                 # auto (a KVM probe), kvm or tcg


@dataclass(frozen=True)
class VmConfig:
    """VmOptions checked against this machine by preflight: what `up`
    boots. state.json keeps it as "vm"; what the boot found out (the
    accelerator auto chose, the image) is kept apart, as "vm_boot"."""
    qemu: str
    deb: str
    extra_debs: Tuple[str, ...]         # the solver's package, if built
    memory_mb: int
    accel: str                          # as asked: auto, kvm or tcg

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["extra_debs"] = list(self.extra_debs)
        return d

    @classmethod
    def from_dict(cls, d: Dict) -> "VmConfig":
        return cls(d["qemu"], d["deb"], tuple(d.get("extra_debs", ())),
                   int(d["memory_mb"]), d.get("accel", "auto"))


def guest_accel(state: Dict) -> Optional[str]:
    """The accelerator the guests of a cluster run under (kvm or tcg),
    once booted."""
    return (state.get("vm_boot") or {}).get("accel")


# ---------------------------------------------------------------- checks

def preflight(topo: ClusterTopology, options: VmOptions) -> VmConfig:
    """What VM instances need, before anything exists: QEMU, the guest
    package (its image is built or reused later) and memory."""
    binary = qemu.qemu_binary()
    if binary is None:
        raise ClusterError(f"QEMU not found ({qemu.DEFAULT_QEMU}, or "
                           f"${qemu.QEMU_ENV})")
    memory_mb = options.memory_mb
    if memory_mb < MIN_MEMORY_MB:
        raise ClusterError(f"a guest needs at least {MIN_MEMORY_MB} MiB "
                           f"of memory, not {memory_mb}")
    try:
        deb = (Path(options.guest_deb) if options.guest_deb
               else debian.default_guest_deb())
    except IvcloudError as e:
        raise ClusterError(str(e))
    if not deb.is_file():
        raise ClusterError(f"guest package {deb} does not exist")
    n = topo.servers * topo.instances_per_server
    avail = _mem_available()
    if avail is not None and n * memory_mb << 20 > avail:
        raise ClusterError(f"{n} guests of {memory_mb} MiB need more "
                           f"memory than the host has free "
                           f"({avail >> 20} MiB)")
    # the solver's package, when `make deb` built it with this one
    solver = debian.solver_deb_beside(deb)
    return VmConfig(qemu=binary, deb=str(deb.absolute()),
                    extra_debs=(str(solver.absolute()),) if solver else (),
                    memory_mb=memory_mb, accel=options.accel)


def _mem_available() -> Optional[int]:
    """/proc/meminfo's MemAvailable, in bytes."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return None


# ---------------------------------------------------------------- up

def start_guests(topo: ClusterTopology, sd: StateDir, state: Dict,
                 config: VmConfig, fabric_pid: int, step, log) -> None:
    """Build (or reuse) the image, start every guest, wait until all are
    booted with their device bound, pin vCPUs."""
    step("image")
    img = debian.build(deb=Path(config.deb),
                       extra=[Path(x) for x in config.extra_debs],
                       log=lambda m: log(f"  {m}"))
    # the PyPI MPIs, at their host paths (docs/cluster.md)
    share, shared = vm_share.prefixes(mpi_root(), lambda m: log(f"  {m}"))
    accel = config.accel
    if accel == "auto":
        ok, why = qemu.kvm_usable(config.qemu, img, debian.cache_root())
        accel = "kvm" if ok else "tcg"
        if not ok:
            log(f"  KVM unusable ({why}); guests run under TCG")
    boot = state["vm_boot"] = {"accel": accel, "kernel": str(img.kernel),
                               "initrd": str(img.initrd),
                               "kernel_version": img.kernel_version,
                               "disk": str(img.disk), "shared": shared,
                               "share": share and share.to_dict()}
    vm_root(sd).mkdir(mode=0o755, exist_ok=True)
    insts = topo.instance_list()
    state.setdefault("vms", {})
    for inst in insts:
        step(f"guest {inst.hostname}")
        _launch_guest(topo, sd, state, config, img, accel, fabric_pid, inst)

    step("boot")
    t0 = time.monotonic()
    try:
        banners = vm_lifecycle.wait_booted(
            {i.hostname: vm_dir(sd, i.hostname) for i in insts},
            BOOT_TIMEOUT_S, accel, what="guest")
    except VmFailure as e:
        raise ClusterFailure(str(e)) from None
    for name, banner in sorted(banners.items()):
        state["vms"][name]["device"] = banner.get("device")
        if banner.get("device") in (None, "none"):
            raise ClusterFailure(f"guest {name} has no ivshmem device")
    for inst in insts:
        _finish_guest(sd, state, inst)
    boot["boot_s"] = round(time.monotonic() - t0, 1)
    save(sd, state)
    log(f"  {len(insts)} guests booted in {boot['boot_s']} s ({accel})")


def job_ports(state: Dict, vcpus: int) -> int:
    """How many root ports a guest of `vcpus` vCPUs gets for Slurm jobs'
    devices (slurm/guest_regions.py): one per job it may run at once.
    Slurm gives each job at least one of its CPUs (CR_CPU, no
    oversubscription), two jobs per CPU with gang scheduling; none
    without Slurm."""
    slurm = state.get("slurm")
    if not slurm:
        return 0
    return min(MAX_JOB_PORTS, vcpus * (2 if slurm.get("time_slice_s") else 1))


def port_window(region_size: int) -> int:
    """The address space a root port reserves at boot for a device with a
    region of `region_size` bytes (a power of two): twice the BAR (256
    MiB is what was seen to place a 128 MiB region; none left it
    unplaced, docs/cluster.md)."""
    return 2 * region_size


def _launch_guest(topo: ClusterTopology, sd: StateDir, state: Dict,
                  config: VmConfig, img, accel: str, fabric_pid: int,
                  inst: Instance) -> None:
    """The guest's tap in its server's bridge, its directory, its QEMU
    (in the fabric's network namespace, where the tap is); each recorded
    before it exists, so that `down` removes what may exist."""
    srv = topo.server_list()[inst.server]
    tap = tap_name(inst.hostname)
    state["links"].append(tap)
    save(sd, state)
    network.add_tap(fabric_pid, tap, srv.bridge)
    d = vm_dir(sd, inst.hostname)
    d.mkdir(mode=0o700)
    state["vms"][inst.hostname] = {"dir": str(d), "tap": tap, "pid": None}
    save(sd, state)
    try:
        qemu.make_overlay(img, overlay_path(state, inst.hostname))
        cmd = guest_qemu_command(topo, state, config.qemu, img, accel,
                                 inst, d, tap,
                                 state["servers"][str(srv.index)]["socket"])
        qemu.launch(holder.enter_argv(fabric_pid, ("net",)) + cmd, d,
                    inst.hostname)
    except VmFailure as e:
        raise ClusterFailure(str(e)) from None
    state["vms"][inst.hostname]["pid"] = vm_lifecycle.qemu_pid(d)
    save(sd, state)


def guest_qemu_command(topo: ClusterTopology, state: Dict, binary: str,
                       img, accel: str, inst: Instance, d: Path, tap: str,
                       server_socket: Optional[str],
                       incoming: bool = False) -> List[str]:
    """The QEMU command line of guest `inst` in directory `d` with tap
    `tap`: at `up`, and for a migration's destination (no device yet,
    waiting for the migration), which must have the same machine: the
    same vCPUs, memory, disk, MAC, kernel command line and PCI slots."""
    hosts = ",".join(f"{i.hostname}:{i.address}" for i in topo.instance_list())
    net = {"ip": f"{inst.address}/{PREFIX_LEN}", "hosts": hosts,
           "tap": tap, "mac": _mac(inst)}
    size = next(iter(state["servers"].values()))["size"]
    return qemu.guest_command(binary, img, d, inst.hostname, accel,
                              topo.vcpus, VmConfig.from_dict(
                                  state["vm"]).memory_mb,
                              server_socket, net=net,
                              hotplug_ports=job_ports(state, topo.vcpus),
                              port_window=port_window(size), boot_port=True,
                              overlay=overlay_path(state, inst.hostname),
                              incoming=incoming, share=vm_share.Share.
                              from_dict(state["vm_boot"].get("share")))


def shared_dirs(state: Dict) -> List[str]:
    """Host directories the guests see, read only, at their host paths."""
    return (state.get("vm_boot") or {}).get("shared", [])


def boot_image(state: Dict):
    """The image the guests of a cluster that is up booted."""
    boot = state["vm_boot"]
    return GuestImage(Path(boot["kernel"]), Path(boot["initrd"]),
                           boot.get("kernel_version", ""), Path(boot["disk"]))


def _finish_guest(sd: StateDir, state: Dict, inst: Instance) -> None:
    """Once booted: its agent answers, the share is mounted, its vCPU
    threads are pinned."""
    agent.wait_ready(vm_dir(sd, inst.hostname) / "agent.sock", timeout=60)
    share = vm_share.Share.from_dict(state["vm_boot"].get("share"))
    why = share and share.unmounted(vm_dir(sd, inst.hostname))
    if why:   # jobs would find no MPI there
        raise ClusterFailure(f"guest {inst.hostname}: {why}")
    state["vms"][inst.hostname]["vcpu_threads"] = pin(
        vm_dir(sd, inst.hostname), inst.cpus)


def guest_run(sock: Path, host: str, script: str, timeout: float,
              lines: int = 1) -> str:
    """`script` run by the shell of guest `host` (its agent at `sock`);
    its output, or ClusterFailure with its last `lines` lines."""
    r = agent.run(sock, script, timeout)
    if not r.ok:
        said = [ln.strip() for ln in r.output.splitlines() if ln.strip()]
        why = " ".join(said[-lines:]) or f"exit {r.status}"
        raise ClusterFailure(f"guest {host}: {why}")
    return r.output


def shell_in(state: Dict, host: str, script: str, timeout: float,
             lines: int = 1) -> str:
    """guest_run in live guest `host` of the cluster of `state`."""
    return guest_run(guest(state, host), host, script, timeout, lines)


def pin(d: Path, cpus: Sequence[int]) -> List[Dict]:
    """vCPU i's thread to cpus[i] (the cluster's vCPU map)."""
    out = []
    for t in qemu.vcpu_threads(d / "qmp.sock"):
        core = cpus[t["cpu"] % len(cpus)]
        os.sched_setaffinity(t["thread"], {core})
        out.append({"cpu": t["cpu"], "thread": t["thread"], "core": core})
    return out


# ---------------------------------------------------------------- down

def guest_dirs(sd: StateDir, state: Optional[Dict]) -> List[Path]:
    dirs = {Path(v["dir"]) for v in (state or {}).get("vms", {}).values()}
    root = vm_root(sd)
    if root.is_dir():
        dirs |= {p for p in root.iterdir() if p.is_dir()}
    return sorted(dirs)


def stop_guests(sd: StateDir, state: Optional[Dict]) -> List[str]:
    """Stop every guest of the cluster (recorded, or found by its
    directory in a QEMU command line); returns the problems."""
    problems = []
    for d in guest_dirs(sd, state):
        try:
            vm_lifecycle.stop_vm(d)
        except IvcloudError as e:
            problems.append(str(e))
    # a QEMU started by an `up` killed before it made the directory's
    # entry: its command line still names the state directory
    left = vm_lifecycle.pids_naming(vm_root(sd))
    if left:
        left = procfs.kill_pids(left, 1.0)
        if left:
            problems.append(f"QEMU {left} survived SIGKILL")
    for disk in sorted(vm_root(sd).glob("*.qcow2")):
        disk.unlink(missing_ok=True)   # their QEMUs are gone
    try:
        vm_root(sd).rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        problems.append(f"{vm_root(sd)}: {e.strerror}")
    return problems


# ---------------------------------------------------------------- use

def vm_dir_of(state: Dict, host: str) -> Path:
    return Path(state["vms"][host]["dir"])


def guest(state: Dict, host: str) -> Path:
    """The agent socket of live guest `host`, or ClusterFailure."""
    rec = state.get("vms", {}).get(host)
    if rec is None:
        raise ClusterError(f"no instance '{host}' in cluster "
                           f"'{state['name']}'")
    d = Path(rec["dir"])
    if vm_lifecycle.qemu_pid(d) is None:
        raise ClusterFailure(f"instance '{host}' is down (its QEMU is gone)")
    return d / "agent.sock"


def guest_info(state: Dict, host: str) -> Dict:
    rec = state.get("vms", {}).get(host) or {}
    d = Path(rec.get("dir", "/nonexistent"))
    pid = vm_lifecycle.qemu_pid(d)
    info: Dict = {"pid": pid, "alive": pid is not None, "qemu": True}
    if pid is not None:
        cpus = set()
        for t in rec.get("vcpu_threads", []):
            allowed = vm_lifecycle.cpus_allowed(pid, t["thread"])
            if allowed:
                cpus |= set(vm_lifecycle.parse_cores(allowed))
        if cpus:
            info["cpus"] = sorted(cpus)
    return info


def exec_in(state: Dict, host: str, command: Sequence[str],
            timeout: float = 3600.0) -> agent.Result:
    return agent.run(guest(state, host), agent.quote(command) if command
                     else "true", timeout)


# bytes per agent command (gzipped): 32 KiB of base64 on the serial line,
# a few seconds of it under TCG
PUT_CHUNK = 24 << 10


def put_files(state: Dict, host: str, files: Sequence[Path],
              dest_dir: str) -> List[str]:
    """Copy host files into guest `host`'s DEST_DIR (made if missing)
    through its agent, keeping names and mode bits, readable to all (the
    MPI user runs them); their paths in the guest. They travel as one
    gzipped tar (each agent command costs a round trip over the slow
    serial line: per file, they cost more than the bytes), unpacked
    beside the destinations, each file's SHA-256 checked, then renamed:
    a copy cut short leaves no half file under a name."""
    if not dest_dir.startswith("/"):
        raise ClusterError(f"the directory in the guest must be an "
                           f"absolute path, not '{dest_dir}'")
    blobs = {}
    for src in files:
        try:
            # a later file of the same name replaces an earlier one
            blobs[Path(src).name] = (Path(src).read_bytes(),
                                     Path(src).stat().st_mode & 0o755 | 0o444)
        except OSError as e:
            raise ClusterError(f"{src}: {e.strerror}")
    sock = guest(state, host)
    d = dest_dir.rstrip("/") or "/"
    if not blobs:
        guest_run(sock, host, f"mkdir -p {agent.quote([d])}", 30)
        return []
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        for name, (data, mode) in blobs.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    # the serial line carries about 10 KB/s: gzip first
    packed = gzip.compress(tar_bytes.getvalue(), 6)
    stage = f"{d.rstrip('/')}/.ivcloud-put-{_put_id()}.part"
    q_stage, q_gz = agent.quote([stage]), agent.quote([stage + ".tgz"])
    for off in range(0, len(packed), PUT_CHUNK):
        b64 = base64.b64encode(packed[off:off + PUT_CHUNK]).decode()
        first = off == 0
        guest_run(sock, host,
                  (f"mkdir -p {agent.quote([d])} && " if first else "") +
                  f"echo {b64} | base64 -d {'>' if first else '>>'} {q_gz}",
                  60)
    sums = "\n".join(f"{hashlib.sha256(data).hexdigest()}  {name}"
                      for name, (data, _) in blobs.items())
    out, moves = [], []
    for name, (_, mode) in blobs.items():
        dest = f"{d.rstrip('/')}/{name}"
        src = agent.quote([f"{stage}/{name}"])
        moves.append(f"chmod {mode:o} {src} && mv -f {src} "
                     f"{agent.quote([dest])}")
        out.append(dest)
    # tar -o: owned by root, not the host's uid; -m: dated now
    r = agent.run(sock, f"rm -rf {q_stage} && mkdir {q_stage} && "
                        f"tar -C {q_stage} -xmozf {q_gz} && rm {q_gz} && "
                        f"printf '%s\\n' {agent.quote([sums])} | "
                        f"(cd {q_stage} && sha256sum -c >/dev/null) && "
                        + " && ".join(moves) + f" && rmdir {q_stage}", 60)
    if not r.ok:
        agent.run(sock, f"rm -rf {q_stage} {q_gz}", 30)
        raise ClusterFailure(f"copy of {', '.join(blobs)} into {host} failed "
                             f"{r.output.strip()[-200:] or '(checksum)'}")
    return out


def _put_id() -> str:
    return f"{os.getpid()}-{time.monotonic_ns() % 10**9}"


def first_guest(state: Dict) -> str:
    return min(state["vms"])


def each(hosts: Sequence[str], fn: Callable[[str], T]
         ) -> List[Tuple[str, Optional[T], Optional[BaseException]]]:
    """fn(host) for every guest of `hosts` at once (each has its own
    agent, and TCG guests are slow: one at a time would add up);
    (host, result, error) for each."""
    def call(host):
        try:
            return host, fn(host), None
        except BaseException as e:   # reported by the caller
            return host, None, e
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        return list(pool.map(call, hosts))


def host_of_dir(state: Dict, d: Path) -> str:
    """The instance whose QEMU lives in directory `d`."""
    for host, rec in state.get("vms", {}).items():
        if Path(rec["dir"]) == d:
            return host
    return d.name


def _dead(state: Dict, dirs: Sequence[Path]) -> List[str]:
    """The instances of `dirs` whose QEMU is gone."""
    return [host_of_dir(state, d) for d in dirs
            if vm_lifecycle.qemu_pid(d) is None]


def rank_env(state: Dict) -> Dict[str, str]:
    """What every rank in the guests gets, whatever its MPI and however
    it is started (a job's launcher; Slurm's task prolog,
    slurm/guests.py): what any program there needs (qemu.guest_env)."""
    return qemu.guest_env(guest_accel(state))


def _read_and_remove(sock: Path, path: str) -> str:
    """The text of file `path` in a guest, which is removed; "" when
    that guest is gone."""
    with contextlib.suppress(IvcloudError):
        return agent.run(sock, f"cat {agent.quote([path])} 2>/dev/null; "
                               f"rm -f {agent.quote([path])}", 60).output
    return ""


def run_launcher(state: Dict, argv: Sequence[str], files: Dict[str, str],
                 timeout: Optional[float] = None, stdout=None,
                 stderr=None) -> int:
    """Run a job's launcher in the first guest as the MPI user in /tmp,
    `files` (path: text) there meanwhile; its output to `stdout` and
    `stderr`. Its exit status; 137 (as a kill) as soon as any guest
    dies; subprocess.TimeoutExpired after `timeout` s. Either way
    nothing of it keeps running."""
    host = first_guest(state)
    sock = guest(state, host)
    dirs = [Path(v["dir"]) for v in state["vms"].values()]
    dead = _dead(state, dirs)
    if dead:
        raise ClusterFailure(f"instance(s) {', '.join(dead)} down (the "
                             f"cluster is degraded: take it down)")
    err = f"{LAUNCHER_ERR}{os.getpid()}-{time.monotonic_ns()}.err"
    for path, text in files.items():
        guest_run(sock, host, f"printf %s {agent.quote([text])} > "
                              f"{agent.quote([path])} && chmod 644 "
                              f"{agent.quote([path])}", 30)
    command = (f"cd /tmp && runuser -u {MPI_USER} -- {agent.quote(argv)} "
               f"2> {agent.quote([err])}")
    try:
        status, out = _follow(state, agent.Job(sock, command), dirs, host,
                              timeout)
    finally:
        errors = _read_and_remove(sock, err)
        if files:
            with contextlib.suppress(IvcloudError):
                agent.run(sock, f"rm -f {agent.quote(list(files))}", 30)
    for f, data in ((stdout or sys.stdout, out), (stderr or sys.stderr,
                                                  errors)):
        f.write(data)
        f.flush()
    return status


def _follow(state: Dict, job: agent.Job, dirs: List[Path], host: str,
            timeout: Optional[float]) -> Tuple[int, str]:
    """(status, output) of a job in guest `host` (see run_launcher)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first = vm_dir_of(state, host)
    try:
        while True:
            try:
                rc = job.done()
            except AgentError:
                # a guest busy on a loaded host may answer late; only a
                # guest whose QEMU is gone (its exit closed the agent's
                # socket, give it a moment) has gone
                time.sleep(JOB_POLL_S)
                if vm_lifecycle.qemu_pid(first) is None:
                    raise
                rc = None
            if rc is not None:
                return rc, job.output()
            dead = _dead(state, dirs)
            if dead:
                # a guest that moved (cluster migrate) runs on elsewhere
                state, dirs = _moved(state, dirs)
                dead = _dead(state, dirs)
            if dead:
                out = _end(state, job, dirs)
                return 137, out + (f"instance(s) {', '.join(dead)} died "
                                   f"during the job\n")
            if deadline is not None and time.monotonic() > deadline:
                _end(state, job, dirs)
                raise subprocess.TimeoutExpired(job.name, timeout)
            time.sleep(JOB_POLL_S)
    except BaseException:
        _end(state, job, dirs)
        raise


def _moved(state: Dict, dirs: List[Path]) -> Tuple[Dict, List[Path]]:
    """The state as saved now, and `dirs` with each guest's directory as
    recorded there."""
    try:
        d = Path(state["dir"])
        now = load(StateDir(state["name"], d.parent)) or state
    except (IvcloudError, KeyError):
        return state, dirs
    return now, [vm_dir_of(now, host_of_dir(state, d))
                 if host_of_dir(state, d) in now.get("vms", {}) else d
                 for d in dirs]


def _end(state: Dict, job: agent.Job, dirs: List[Path]) -> str:
    """Kill the job's processes in every guest still alive; returns what
    the job printed so far (when its guest is alive)."""
    for d in dirs:
        if vm_lifecycle.qemu_pid(d) is not None:
            with contextlib.suppress(IvcloudError):
                agent.run(d / "agent.sock",
                          f"pkill -KILL -u {MPI_USER}; true", 10)
    with contextlib.suppress(IvcloudError):
        return job.output()
    return ""
