"""The two kinds of instance a cluster is made of, behind one interface.

All instances of a cluster are of one kind, chosen once: `choose()`
when the cluster is brought up (it refuses, before anything exists,
what the kind cannot do on this machine), `of_state()` for a cluster
that is up (its state file records the kind). Nothing else asks which
kind it has; it asks the kind:

    record()                  what state.json keeps of the kind
    start(build)              every instance up, once the servers and
                              bridges exist (lifecycle.Build: the
                              topology, the state and how to record)
    stop(sd, state)           what `down` does for the kind before it
                              sweeps the namespaces; the problems left
    instance_info(state, host)  pid, alive, CPUs (for `status`)
    exec(state, host, argv)   run a command in an instance (or the head
                              node, a namespace holder in either kind)
    put(state, hosts, files, dest)   copy host files into instances
    guest_packages()          what the instances have installed beside
                              the guest package

NamespaceInstances: a holder process per instance (holder.py) with a
veth into its server's bridge. VmInstances: a QEMU guest per instance
(vm_instance.py), configured by a VmConfig.
"""

from __future__ import annotations

import os
import subprocess
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Dict, List, Optional, Sequence

from ..errors import ClusterError, LaunchError
from . import holder, network, vm_instance
from .launch import enter_command
from .state import StateDir
from .topology import HEAD_HOSTNAME, ClusterTopology
from .vm_instance import VmConfig, VmOptions

if TYPE_CHECKING:
    from .lifecycle import Build

class InstanceKind(ABC):
    name: ClassVar[str]
    # whether `--scheduler slurm` can run a slurmd in each instance
    runs_slurmd: ClassVar[bool] = False

    def record(self) -> Dict:
        return {"kind": self.name}

    @abstractmethod
    def start(self, build: "Build") -> None:
        """Bring every instance of build.topo up, recording each step."""

    def stop(self, sd: StateDir, state: Optional[Dict]) -> List[str]:
        """Before `down` kills what runs in the cluster's namespaces;
        returns the problems left."""
        return []

    @abstractmethod
    def instance_info(self, state: Dict, host: str) -> Dict:
        """{"pid", "alive"} and, while alive, "cpus"."""

    def exec(self, state: Dict, host: str, argv: Sequence[str]) -> int:
        """Run `argv` in instance (or head node) `host` with this
        process's stdin, stdout and stderr; its exit status."""
        return _exec_in_holder(state, host, argv)

    def guest_packages(self) -> List[str]:
        """The packages (file names) the instances have installed beside
        the guest package: none but the host's for namespaces."""
        return []

    def put(self, state: Dict, hosts: Sequence[str], files: Sequence[str],
            dest: str) -> List[str]:
        """Copy `files` into directory `dest` of each of `hosts` (all
        when empty); returns HOST:PATH of every copy."""
        raise ClusterError(f"cluster '{state['name']}' has {self.name} "
                           f"instances: they see the host's files (outside "
                           f"/tmp and /dev/shm), there is nothing to copy")


class NamespaceInstances(InstanceKind):
    """An instance is a holder process's namespaces (holder.py)."""
    name = "namespace"
    runs_slurmd = True

    def start(self, build: "Build") -> None:
        servers = build.topo.server_list()
        for inst in build.topo.instance_list():
            build.step(f"instance {inst.hostname}")
            srv = servers[inst.server]
            pid = build.start_holder(
                inst.hostname, unshare_flags=holder.INSTANCE_NS, cpus=inst.cpus,
                hostname=inst.hostname, hosts_file=build.sd.hosts,
                cover_dir=build.sd.run_dir,
                keep_visible=[str(p.relative_to(build.sd.run_dir))
                              for p in build.visible_in(srv)])
            build.state["links"].append(
                network.attach_instance(build.fabric, pid, inst, srv))
            build.save()
            build.log(f"  {inst.hostname}: {inst.address}, cpus "
                      f"{','.join(map(str, inst.cpus))}, server {srv.name}")

    def instance_info(self, state: Dict, host: str) -> Dict:
        return holder.holder_info(state, host)


class VmInstances(InstanceKind):
    """An instance is a QEMU guest (vm_instance.py)."""
    name = "vm"
    runs_slurmd = True   # the image's slurmd (slurm/guests.py)

    def __init__(self, config: VmConfig):
        self.config = config

    def record(self) -> Dict:
        return {**super().record(), "vm": self.config.to_dict(), "vms": {}}

    def start(self, build: "Build") -> None:
        vm_instance.start_guests(build.topo, build.sd, build.state,
                                 self.config, build.fabric, build.step,
                                 build.log)

    def stop(self, sd: StateDir, state: Optional[Dict]) -> List[str]:
        # found by their directories as well as by the record
        if vm_instance.guest_dirs(sd, state) or (state or {}).get("vms"):
            return vm_instance.stop_guests(sd, state)
        return []

    def instance_info(self, state: Dict, host: str) -> Dict:
        return vm_instance.guest_info(state, host)

    def guest_packages(self) -> List[str]:
        return [Path(x).name for x in self.config.extra_debs]

    def exec(self, state: Dict, host: str, argv: Sequence[str]) -> int:
        if host == HEAD_HOSTNAME:
            return super().exec(state, host, argv)
        r = vm_instance.exec_in(state, host, argv)
        sys.stdout.write(r.output)
        sys.stdout.flush()
        return r.status

    def put(self, state: Dict, hosts: Sequence[str], files: Sequence[str],
            dest: str) -> List[str]:
        return [f"{host}:{path}"
                for host in (hosts or sorted(state["vms"]))
                for path in vm_instance.put_files(state, host,
                                                  [Path(f) for f in files],
                                                  dest)]


def choose(topo: ClusterTopology, vm: Optional[VmOptions] = None,
           slurmd: bool = False) -> InstanceKind:
    """The kind of a cluster about to be brought up: QEMU guests when
    `vm` is given (checked now: QEMU, the guest package, memory), else
    namespaces. slurmd: the instances are to run Slurm's slurmd."""
    cls = NamespaceInstances if vm is None else VmInstances
    if slurmd and not cls.runs_slurmd:
        raise ClusterError(f"{cls.name} instances cannot run slurmd",
                           setting="scheduler")
    if vm is None:
        return NamespaceInstances()
    return VmInstances(vm_instance.preflight(topo, vm))


def of_state(state: Optional[Dict]) -> InstanceKind:
    """The kind a cluster's state file records. A cluster without a
    state file (an `up` killed before its first save) has nothing of
    either kind yet but holders, which `down` finds by their marker."""
    if (state or {}).get("kind") == VmInstances.name:
        return VmInstances(VmConfig.from_dict(state["vm"]))
    return NamespaceInstances()


def _exec_in_holder(state: Dict, host: str, argv: Sequence[str]) -> int:
    try:
        full, env, cpus = enter_command(state, host, argv)
    except LaunchError as e:
        raise ClusterError(str(e))
    proc = subprocess.run(full, env=env, cwd="/",
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
