"""The two kinds of instance a cluster is made of, behind one interface.

A cluster's instances are of one kind: `choose()` at `up` (refusing,
before anything exists, what the kind cannot do here), `of_state()`
once up. Nothing else asks which kind it has; it asks the kind. A third
kind is one subclass of InstanceKind defining `name`, `title` and its
abstract methods (start, instance_info, put, stage, stage_dir,
run_everywhere, read_file, job_site, job_program, job_regions,
region_note, run_launcher, describe_launcher) and, where the defaults
differ, record, describe, stop, exec, guest_packages, migrate,
standing_leave_notices and, if it runs slurmd, a slurm.nodes.Nodes of
its own (slurm_nodes); then a case in choose() and of_state(), and its
name among the command line's --instance-kind choices.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, ContextManager, Dict, List, Optional, Sequence

from .. import process
from ..errors import ClusterError, ClusterFailure, LaunchError
from ..mpis import Command, Flavor
from ..vm import agent
from . import holder, migrate, network, regions, vm_instance
from .launch import (check_program, check_visible, enter_command,
                     working_dir)
from .slurm.guests import GuestNodes
from .slurm.nodes import Nodes
from .state import StateDir
from .topology import HEAD_HOSTNAME, ClusterTopology
from .vm_instance import VmConfig, VmOptions

# where `stage` puts host programs in the guests
GUEST_PROGRAM_DIR = "/opt/ivcloud/bin"
# where `stage_dir` puts its archive in the guests on the way
GUEST_STAGING_DIR = "/var/tmp/ivcloud-staging"
# preparing inputs in the guests (meshing, decomposing) under TCG
PREPARE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class JobSite:
    """Where a kind's job launchers run and how they reach the instances:
    the Launch fields of the same names (agent None: ssh), `env` what
    every rank gets, whatever its MPI."""
    agent: Optional[str]
    installed: bool
    unprivileged: bool
    scratch: str
    wdir: str
    env: Dict[str, str] = field(default_factory=dict)


class InstanceKind(ABC):
    name: ClassVar[str]
    title: ClassVar[str]     # what `status` calls the instances
    # whether the servers' standing ivshmem-servers tell their clients
    # that a peer left (docs/server-protocol.md, "Quiet leaves")
    standing_leave_notices: ClassVar[bool] = True

    def record(self) -> Dict:
        return {"kind": self.name}

    def describe(self, state: Optional[Dict]) -> Dict:
        """What a session's description says of its instances (state:
        None before they are up)."""
        return {}

    @abstractmethod
    def start(self, build) -> None:
        """Bring every instance of build.topo up, recording each step."""

    def stop(self, sd: StateDir, state: Optional[Dict]) -> List[str]:
        """Before `down` sweeps the namespaces; the problems left."""
        return []

    @abstractmethod
    def instance_info(self, state: Dict, host: str) -> Dict:
        """{"pid", "alive"} and, while alive, "cpus"."""

    def exec(self, state: Dict, host: str, argv: Sequence[str]) -> int:
        """`argv` in instance (or head node) `host`, our stdio; its status."""
        try:
            full, env, cpus = enter_command(state, host, argv)
        except LaunchError as e:
            raise ClusterError(str(e))
        return process.exit_status(subprocess.run(
            full, env=env, cwd="/",
            preexec_fn=lambda: os.sched_setaffinity(0, cpus)).returncode)

    def guest_packages(self) -> List[str]:
        """Packages (file names) installed beside the guest package."""
        return []

    @abstractmethod
    def put(self, state: Dict, hosts: Sequence[str], files: Sequence[str],
            dest: str) -> List[str]:
        """`files` into `dest` of each of `hosts` (all when empty);
        HOST:PATH of every copy."""

    @abstractmethod
    def stage(self, state: Dict, path: os.PathLike) -> str:
        """The path by which the instances run host file `path`."""

    @abstractmethod
    def stage_dir(self, state: Dict, path: os.PathLike) -> None:
        """Host directory `path` at the same path in every instance,
        writable by the user jobs run as."""

    @abstractmethod
    def run_everywhere(self, state: Dict, argv: Sequence[str],
                       env: Dict[str, str], timeout: float) -> None:
        """A preparation command (meshing a case) wherever the instances'
        files are, as the jobs' user, `env` on a plain environment."""

    @abstractmethod
    def read_file(self, state: Dict, path: os.PathLike,
                  remove: bool = False) -> str:
        """File `path` of the first instance (rank 0's), then removed if
        `remove`."""

    # ---------------------------------------------------------- jobs

    @abstractmethod
    def job_site(self, state: Dict) -> JobSite:
        """Where jobs' launchers run and how they reach the instances."""

    @abstractmethod
    def job_program(self, state: Dict, flavor: Flavor,
                    program: Sequence[str], transport: str) -> List[str]:
        """`program` as the instances run it; refuses a program, an MPI
        or a transport out of their reach."""

    @abstractmethod
    def job_regions(self, state: Dict, transport: str, shared: bool
                    ) -> ContextManager[Dict[str, str]]:
        """The job's regions for the block (shared: the servers' standing
        ones); yields the launcher's extra variables."""

    @abstractmethod
    def region_note(self, transport: str, shared: bool, dry_run: bool
                    ) -> Optional[str]:
        """What a job is told of its regions (a dry run: always)."""

    @abstractmethod
    def run_launcher(self, state: Dict, command: Command,
                     env: Dict[str, str], timeout: Optional[float],
                     stdout=None, stderr=None) -> int:
        """A job's launcher run to its end, its files there meanwhile; its
        status. subprocess.TimeoutExpired after `timeout`, torn down."""

    @abstractmethod
    def describe_launcher(self, state: Dict, command: Command) -> str:
        """What run_launcher would run, for a dry run."""

    def slurm_nodes(self) -> Nodes:
        """What Slurm needs of these instances (slurm/nodes.py); a kind
        that runs no slurmd refuses `--scheduler slurm` here."""
        raise ClusterError(f"{self.name} instances cannot run slurmd",
                           setting="scheduler")

    def migrate(self, sd: StateDir, state: Dict, host: str, server: str,
                wait_jobs_s: Optional[float] = None, log=None) -> Dict:
        """Move instance `host`, live, to emulated server `server` (its
        index, sN or its name); what migrate.migrate reports."""
        raise ClusterError(f"cluster '{state['name']}' has {self.name} "
                           f"instances, which cannot migrate (QEMU guests "
                           f"can)")


class NamespaceInstances(InstanceKind):
    """A holder process's namespaces per instance (holder.py), a veth in
    its server's bridge; launchers run on the head node and reach the
    instances through the launch agent (launch.py)."""
    name = "namespace"
    title = "instances"

    def start(self, build) -> None:
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
            network.attach(build.fabric, pid, srv.bridge, inst.bridge_port,
                           inst.address)
            build.state["links"].append(inst.bridge_port)
            build.save()
            build.log(f"  {inst.hostname}: {inst.address}, cpus "
                      f"{','.join(map(str, inst.cpus))}, server {srv.name}")

    def instance_info(self, state: Dict, host: str) -> Dict:
        return holder.holder_info(state, host)

    def put(self, state: Dict, hosts: Sequence[str], files: Sequence[str],
            dest: str) -> List[str]:
        raise ClusterError(f"cluster '{state['name']}' has {self.name} "
                           f"instances: they see the host's files (outside "
                           f"/tmp and /dev/shm), there is nothing to copy")

    def stage(self, state: Dict, path: os.PathLike) -> str:
        return str(path)    # they see the host's files

    def stage_dir(self, state: Dict, path: os.PathLike) -> None:
        pass

    def run_everywhere(self, state: Dict, argv: Sequence[str],
                       env: Dict[str, str], timeout: float) -> None:
        # the instances share the host's files: once, here
        full_env = {"PATH": "/usr/bin:/bin", **env}
        try:
            p = subprocess.run(list(argv), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True,
                               env=full_env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ClusterFailure(f"{argv[0]}: {e}")
        if p.returncode != 0:
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            raise ClusterFailure(f"{argv[0]} failed: {' '.join(tail)}")

    def read_file(self, state: Dict, path: os.PathLike,
                  remove: bool = False) -> str:
        try:
            text = Path(path).read_text(errors="replace")
            if remove:
                Path(path).unlink()
        except OSError as e:
            raise ClusterFailure(f"cannot read {path}: {e.strerror}")
        return text

    def job_site(self, state: Dict) -> JobSite:
        sd_dir = Path(state["dir"])
        return JobSite(agent=str(sd_dir / "agent"), installed=False,
                       unprivileged=False,
                       # the head node sees the state directory (not /tmp)
                       scratch=str(sd_dir), wdir=working_dir())

    def job_program(self, state: Dict, flavor: Flavor,
                    program: Sequence[str], transport: str) -> List[str]:
        program = check_program(program)
        check_visible(flavor.launcher_path(), f"{flavor.title}'s launcher")
        for what, path in flavor.build_files(transport):
            check_visible(path, what)
        return program

    @contextlib.contextmanager
    def job_regions(self, state: Dict, transport: str, shared: bool):
        if transport != "ivshmem" or shared:
            yield {}
            return
        # the agent picks the job's sockets by this variable, which the
        # launcher passes on to it from the head node
        job = regions.new_job_id()
        with regions.job_regions(state, job):
            yield {regions.JOB_ENV: job}

    def run_launcher(self, state: Dict, command: Command,
                     env: Dict[str, str], timeout: Optional[float],
                     stdout=None, stderr=None) -> int:
        full, head_env, _ = enter_command(state, HEAD_HOSTNAME,
                                          command.argv)
        try:
            for path, text in command.files.items():
                Path(path).write_text(text)
            return process.run_launcher(full, {**head_env, **env}, timeout,
                                        stdout, stderr)
        except FileNotFoundError as e:
            raise ClusterFailure(f"cannot run the launcher: {e}")
        finally:
            for path in command.files:
                Path(path).unlink(missing_ok=True)

    def describe_launcher(self, state: Dict, command: Command) -> str:
        full, _, _ = enter_command(state, HEAD_HOSTNAME, command.argv)
        return shlex.join(full)

    def region_note(self, transport: str, shared: bool, dry_run: bool
                    ) -> Optional[str]:
        if transport != "ivshmem" or not dry_run:
            return None
        if shared:
            return "the job runs in each server's standing region"
        return "each server gets a region of the job's own for the job's " \
               "duration"

    def slurm_nodes(self) -> Nodes:
        return Nodes()


class VmInstances(InstanceKind):
    """An instance is a QEMU guest (vm_instance.py). Jobs' launchers run
    in the first guest as its MPI user and reach the others over ssh;
    the guests' devices were attached at boot, so jobs share each
    server's standing region (a VM cluster is one trust domain)."""
    name = "vm"
    title = "QEMU guests"
    # the clients are QEMU devices, which must be able to leave (a
    # migration) after another peer left: QEMU 7.2 cannot unplug a
    # device that was told of a leave (qemu.remove_chardev)
    standing_leave_notices = False

    def __init__(self, config: VmConfig):
        self.config = config

    def record(self) -> Dict:
        return {**super().record(), "vm": self.config.to_dict(), "vms": {}}

    def describe(self, state: Optional[Dict]) -> Dict:
        return {"accel": vm_instance.guest_accel(state) if state else None,
                "vm_memory_mb": self.config.memory_mb}

    def start(self, build) -> None:
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
        # every guest at once: each has its own agent and serial line
        paths = [Path(f) for f in files]
        out = []
        for host, copies, err in vm_instance.each(
                list(hosts or sorted(state["vms"])),
                lambda host: vm_instance.put_files(state, host, paths, dest)):
            if err is not None:
                raise err
            out += [f"{host}:{path}" for path in copies]
        return out

    def stage(self, state: Dict, path: os.PathLike) -> str:
        # put rewrites a file only through a checked copy
        return self.put(state, [], [str(path)],
                        GUEST_PROGRAM_DIR)[0].split(":", 1)[1]

    def stage_dir(self, state: Dict, path: os.PathLike) -> None:
        path = Path(path)
        if not path.is_absolute() or not path.is_dir():
            raise ClusterFailure(f"{path} is not an absolute path of a "
                                 f"directory")
        with tempfile.TemporaryDirectory(prefix="ivcloud-stage-") as tmp:
            archive = Path(tmp) / f"{path.name}.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(path, arcname=path.name)
            parent = agent.quote([str(path.parent)])
            target = agent.quote([str(path)])

            def one(host: str) -> None:
                [copy] = vm_instance.put_files(state, host, [archive],
                                               GUEST_STAGING_DIR)
                q = agent.quote([copy])
                vm_instance.shell_in(
                    state, host, f"rm -rf {target} && mkdir -p {parent} && "
                    f"tar -C {parent} --no-same-owner -xf {q} && rm -f {q} "
                    f"&& chown -R {vm_instance.MPI_USER}: {target}", 120,
                    lines=3)
            _each_guest(state, one)

    def run_everywhere(self, state: Dict, argv: Sequence[str],
                       env: Dict[str, str], timeout: float) -> None:
        cmd = ["runuser", "-u", vm_instance.MPI_USER, "--", "env"] + \
            [f"{k}={v}" for k, v in env.items()] + list(argv)
        # its output stays in the guest (the serial line is slow) unless
        # it fails: then its last 3 lines (a meshing tool's error)
        log = f"/tmp/prepare-{uuid.uuid4().hex[:8]}.log"
        _each_guest(state, lambda host: vm_instance.shell_in(
            state, host, f"{agent.quote(cmd)} > {log} 2>&1; rc=$?; "
                         f"[ $rc = 0 ] || tail -n 3 {log}; rm -f {log}; "
                         f"exit $rc", timeout, lines=3))

    def read_file(self, state: Dict, path: os.PathLike,
                  remove: bool = False) -> str:
        host = vm_instance.first_guest(state)
        q = agent.quote([str(path)])
        r = agent.run(vm_instance.guest(state, host),
                      f"cat {q}" + (f" && rm -f {q}" if remove else ""), 120)
        if not r.ok:
            raise ClusterFailure(f"cannot read {path} in {host}: "
                                 f"{r.output.strip()[-200:]}")
        return r.output

    def job_site(self, state: Dict) -> JobSite:
        return JobSite(agent=None, installed=True, unprivileged=True,
                       scratch="/tmp", wdir="/tmp",
                       env=vm_instance.rank_env(state))

    def job_program(self, state: Dict, flavor: Flavor,
                    program: Sequence[str], transport: str) -> List[str]:
        lacking = flavor.guest_needs(vm_instance.shared_dirs(state))
        if lacking:
            raise ClusterError(f"{flavor.title}: jobs of a VM cluster run "
                               f"with the MPIs the guests have: {lacking}",
                               setting="mpi")
        return list(program)     # a path in the guests

    @contextlib.contextmanager
    def job_regions(self, state: Dict, transport: str, shared: bool):
        yield {}

    def region_note(self, transport: str, shared: bool, dry_run: bool
                    ) -> Optional[str]:
        if dry_run:
            return "VM instances: the job uses each server's standing region"
        if transport == "ivshmem" and not shared:
            return vm_instance.SHARED_NOTE
        return None

    def run_launcher(self, state: Dict, command: Command,
                     env: Dict[str, str], timeout: Optional[float],
                     stdout=None, stderr=None) -> int:
        migrate.heal(state)
        return vm_instance.run_launcher(state, command.argv, command.files,
                                        timeout, stdout, stderr)

    def describe_launcher(self, state: Dict, command: Command) -> str:
        return (f"# in guest {vm_instance.first_guest(state)}: runuser -u "
                f"{vm_instance.MPI_USER} -- {shlex.join(command.argv)}")

    def slurm_nodes(self) -> Nodes:
        return GuestNodes()

    def migrate(self, sd: StateDir, state: Dict, host: str, server: str,
                wait_jobs_s: Optional[float] = None, log=None) -> Dict:
        return migrate.migrate(sd, state, host, server, wait_jobs_s, log)


def choose(topo: ClusterTopology,
           vm: Optional[VmOptions] = None) -> InstanceKind:
    """QEMU guests when `vm` is given (checked now), else namespaces."""
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


def _each_guest(state: Dict, fn) -> None:
    """fn(host) in every guest at once; the first guest's error raised."""
    for _, _, error in vm_instance.each(sorted(state["vms"]), fn):
        if error is not None:
            raise error
