"""A cluster for the length of one `with` block: brought up on entry,
taken down on exit whatever happened (an error, Ctrl-C, SIGTERM or
SIGHUP); jobs run on it through the one job pipeline (job.py). The
cloud benchmarks use it. Its instances are namespaces, or QEMU guests
(VmOptions), and what differs between them the instances' kind does
(kinds.py). With SlurmOptions it runs Slurm and takes `srun` jobs."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from .. import process
from . import kinds, lifecycle, vm_instance
from .job import Job, run_job, run_slurm
from .kinds import PREPARE_TIMEOUT_S
from .slurm.daemons import Slurm, SlurmOptions
from .state import state_dir
from .topology import plan
from .vm_instance import VmOptions


class ClusterSession:
    """An emulated cluster under a unique name made from `prefix`: up on
    entry, down on exit unless `keep`. `log` gets a line when it is up
    and when it is down (or kept). `vm`: its instances are QEMU guests."""

    def __init__(self, prefix: str, servers: int, instances: int,
                 vcpus: int, uplink_rate: Optional[str] = None,
                 keep: bool = False, log=None,
                 vm: Optional[VmOptions] = None,
                 slurm: Optional[SlurmOptions] = None):
        # unique, and short enough for the socket paths (24 characters)
        self.name = f"{prefix}{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.topo = plan(self.name, servers, instances, vcpus, uplink_rate,
                         oversubscribe=True)
        self.uplink_rate = uplink_rate
        self.keep = keep
        self.log = log or sys.stderr
        self.state: Optional[Dict] = None
        self._signals = contextlib.ExitStack()
        # refuses (no QEMU, no package, memory) before anything exists
        self.instances = kinds.choose(self.topo, vm)
        self.scheduler = Slurm(slurm) if slurm is not None else None
        self._staged: Dict[str, str] = {}

    @property
    def kind(self) -> str:
        return self.instances.name

    @property
    def accel(self) -> Optional[str]:
        """VM instances: the accelerator they run under (kvm or tcg)."""
        return vm_instance.guest_accel(self.state) if self.state else None

    def describe(self) -> Dict:
        t = self.topo
        d = {"name": self.name, "servers": t.servers,
             "instances_per_server": t.instances_per_server,
             "vcpus": t.vcpus, "host_cpus": len(t.host_cpus),
             "uplink_rate": self.uplink_rate, "instance_kind": self.kind,
             **self.instances.describe(self.state)}
        if self.scheduler is not None:
            d["scheduler"] = "slurm"
        return d

    def __enter__(self) -> "ClusterSession":
        self.sd = state_dir(self.name)
        self._signals.enter_context(process.interrupts())
        try:
            # up() rolls back by itself when it fails or is interrupted
            self.state = lifecycle.up(
                self.topo, self.sd, log=lambda line: None,
                kind=self.instances, scheduler=self.scheduler)
        except BaseException:
            self._signals.close()
            raise
        self.log.write(f"cluster '{self.name}' up: {self.topo.describe()}"
                       f"\n")
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.keep:
                self.log.write(f"cluster '{self.name}' kept (remove it with "
                               f"`ivcloud cluster down --name {self.name}`)\n")
                return
            with process.shielded():
                lifecycle.down(self.sd)
            self.log.write(f"cluster '{self.name}' down\n")
        finally:
            self._signals.close()

    def stage(self, program: os.PathLike) -> str:
        """InstanceKind.stage, once per program and session."""
        path = str(program)
        if path not in self._staged:
            self._staged[path] = self.instances.stage(self.state, path)
        return self._staged[path]

    # the instances' kind's, on this session's cluster
    @property
    def guest_packages(self) -> List[str]:
        return self.instances.guest_packages()

    def stage_dir(self, path: os.PathLike) -> None:
        self.instances.stage_dir(self.state, path)

    def run_everywhere(self, argv: Sequence[str],
                       env: Optional[Dict[str, str]] = None,
                       timeout: float = PREPARE_TIMEOUT_S) -> None:
        self.instances.run_everywhere(self.state, argv, dict(env or {}),
                                      timeout)

    def read_file(self, path: os.PathLike, remove: bool = False) -> str:
        return self.instances.read_file(self.state, path, remove)

    def run_job(self, job: Job, stdout=None, stderr=None) -> int:
        """job.run_job; jobs of a session may oversubscribe."""
        return run_job(self.state, replace(job, oversubscribe=True),
                       stdout, stderr)

    def srun(self, args: Sequence[str], timeout: Optional[float] = None,
             stdout=None, stderr=None) -> int:
        """job.run_slurm's `srun ARGS` (a session with `slurm`)."""
        return run_slurm(self.state, "srun", list(args), timeout=timeout,
                         stdout=stdout, stderr=stderr)


