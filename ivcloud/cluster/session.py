"""A cluster for the length of one `with` block: brought up on entry,
taken down on exit whatever happened (an error, Ctrl-C, SIGTERM or
SIGHUP), and MPI jobs run on it as `ivcloud cluster mpirun` runs them.
The cloud benchmarks (ivcloud.bench.hierarchy, ivcloud.bench.halo) use
it; anything else that needs a throw-away cluster can. Its instances are
namespaces, or QEMU guests (VmOptions): then host programs are copied
into the guests (`stage`) and jobs run from the first guest
(vm_instance), in the servers' standing regions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpi
from . import jobs, lifecycle, vm_instance
from .launch import enter_command, mpirun_command
from .state import state_dir
from .topology import plan


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP inside a session: unwinds like Ctrl-C (the running
    job is torn down, the cluster taken down, the CLI exits 130)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@dataclass(frozen=True)
class VmOptions:
    """Instances as QEMU guests (`cluster up --instance-kind vm`)."""
    guest_deb: Optional[str] = None     # None: the newest in build/deb
    memory_mb: int = vm_instance.DEFAULT_MEMORY_MB
    accel: str = "auto"


# where `stage` puts host programs in the guests
GUEST_PROGRAM_DIR = "/opt/ivcloud/bin"


class ClusterSession:
    """An emulated cluster under a unique name made from `prefix`: up on
    entry, down on exit unless `keep`. `log` gets a line when it is up
    and when it is down (or kept). `vm`: its instances are QEMU guests."""

    def __init__(self, prefix: str, servers: int, instances: int,
                 vcpus: int, uplink_rate: Optional[str] = None,
                 keep: bool = False, log=None,
                 vm: Optional[VmOptions] = None):
        # unique, and short enough for the socket paths (24 characters)
        self.name = f"{prefix}{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.topo = plan(self.name, servers, instances, vcpus, uplink_rate,
                         oversubscribe=True)
        self.uplink_rate = uplink_rate
        self.keep = keep
        self.log = log or sys.stderr
        self.state: Optional[Dict] = None
        self._old_handlers: Dict = {}
        self.vm = vm
        self._vm_conf = None
        if vm is not None:
            # refuses (no QEMU, no package, memory) before anything exists
            self._vm_conf = vm_instance.preflight(self.topo, vm.guest_deb,
                                                  vm.memory_mb)
            self._vm_conf["accel"] = vm.accel
        self._staged: Dict[str, str] = {}

    @property
    def kind(self) -> str:
        return vm_instance.KIND if self.vm else "namespace"

    @property
    def accel(self) -> Optional[str]:
        """VM instances: the accelerator they run under (kvm or tcg)."""
        if self.vm is None or self.state is None:
            return None
        return self.state["vm"].get("accel")

    def describe(self) -> Dict:
        t = self.topo
        d = {"name": self.name, "servers": t.servers,
             "instances_per_server": t.instances_per_server,
             "vcpus": t.vcpus, "host_cpus": len(t.host_cpus),
             "uplink_rate": self.uplink_rate, "instance_kind": self.kind}
        if self.vm is not None:
            d.update(accel=self.accel, vm_memory_mb=self.vm.memory_mb)
        return d

    def __enter__(self) -> "ClusterSession":
        self.sd = state_dir(self.name)
        self._old_handlers = {s: signal.signal(s, _raise_interrupted)
                              for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            # up() rolls back by itself when it fails or is interrupted
            lifecycle.up(self.topo, self.sd, log=lambda line: None,
                         vm=self._vm_conf)
            self.state = lifecycle.load_up(self.sd)
        except BaseException:
            self._restore()
            raise
        self.log.write(f"cluster '{self.name}' up: {self.topo.describe()}"
                       f"\n")
        return self

    def _restore(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}

    def __exit__(self, *exc) -> None:
        try:
            if self.keep:
                self.log.write(f"cluster '{self.name}' kept (remove it with "
                               f"`ivcloud cluster down --name {self.name}`)\n")
                return
            # a second Ctrl-C must not leave half a cluster: finish down
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                lifecycle.down(self.sd)
            finally:
                signal.signal(signal.SIGINT, old_int)
            self.log.write(f"cluster '{self.name}' down\n")
        finally:
            self._restore()

    def stage(self, program: os.PathLike) -> str:
        """The path by which the instances run host program `program`:
        itself for namespaces (they see the host's files); for guests a
        copy put into every guest's GUEST_PROGRAM_DIR once."""
        path = str(program)
        if self.vm is None:
            return path
        if path not in self._staged:
            for host in sorted(self.state["vms"]):
                dest = vm_instance.put_files(self.state, host, [Path(path)],
                                             GUEST_PROGRAM_DIR)[0]
            self._staged[path] = dest
        return self._staged[path]

    def mpirun(self, program: Sequence[str], np: int, transport: str,
               timeout: Optional[float] = None, stdout=None, stderr=None,
               placement: str = "block",
               rankfile: Optional[Sequence[str]] = None,
               extra_mca: Sequence[Tuple[str, str]] = (),
               shared_region: bool = False) -> int:
        """Run one job from the head node; its exit status, as
        ivcloud.mpi.run_command (the job is torn down and
        subprocess.TimeoutExpired raised at `timeout`; LaunchError if it
        cannot be launched). rankfile: its lines ("rank R=HOST slot=K"),
        else `placement`'s mapping. An ivshmem job gets regions of its
        own unless `shared_region` (ivcloud.cluster.jobs); a VM job
        always runs in the servers' standing regions."""
        if self.vm is not None:
            return self._mpirun_vm(program, np, transport, timeout, stdout,
                                   stderr, placement, rankfile, extra_mca)
        path = None
        if rankfile is not None:
            # in the state directory: the head node sees it (not /tmp)
            path = self.sd.dir / f"rankfile.{uuid.uuid4().hex[:8]}"
            path.write_text("\n".join(rankfile) + "\n")
        try:
            cmd = mpirun_command(self.state, self.sd, list(program), np,
                                 transport=transport, placement=placement,
                                 extra_mca=list(extra_mca), rankfile=path)
            full, env, _ = enter_command(self.state, "head", cmd)
            with jobs.regions_for(self.state, env, transport,
                                  shared_region):
                return mpi.run_command(full, timeout, env=env,
                                       stdout=stdout, stderr=stderr)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    def _mpirun_vm(self, program, np, transport, timeout, stdout, stderr,
                   placement, rankfile, extra_mca) -> int:
        tag = uuid.uuid4().hex[:8]
        text = path = None
        if rankfile is not None:
            text = "\n".join(rankfile) + "\n"
            path = f"/tmp/rankfile.{tag}"
        # stderr apart from stdout, as for a namespace job: in a file of
        # the first guest, read when the job ended
        err = f"/tmp/mpirun-{tag}.err"
        cmd = vm_instance.mpirun_command(
            self.state, list(program), np, transport=transport,
            placement=placement, rankfile=path, stderr_path=err,
            extra_mca=list(extra_mca) + [("rmaps_base_oversubscribe", "1")])
        try:
            r = vm_instance.run_job(self.state, cmd, timeout,
                                    rankfile_text=text, rankfile=path)
        except TimeoutError:
            raise subprocess.TimeoutExpired(cmd, timeout)
        errors = vm_instance.take_file(self.state, err)
        for f, data in ((stdout or sys.stdout, r.output),
                        (stderr or sys.stderr, errors)):
            f.write(data)
            f.flush()
        return r.status


def floating_rankfile(hosts: Sequence[str], vcpus: int) -> List[str]:
    """Rankfile lines putting rank r on hosts[r], free to run on any of
    its instance's vCPUs. Open MPI binds a rankfile's rank to its slot
    even under --bind-to none, so slot=0 on every instance would pin the
    ranks of all instances to one host CPU; the whole range keeps them
    floating like `--bind-to none` placements do."""
    slots = "0" if vcpus == 1 else f"0-{vcpus - 1}"
    return [f"rank {r}={host} slot={slots}" for r, host in enumerate(hosts)]
