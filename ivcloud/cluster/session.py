"""A cluster for the length of one `with` block: brought up on entry,
taken down on exit whatever happened (an error, Ctrl-C, SIGTERM or
SIGHUP), and MPI jobs run on it as `ivcloud cluster mpirun` runs them.
The cloud benchmarks (ivcloud.bench.hierarchy, ivcloud.bench.halo) use
it; anything else that needs a throw-away cluster can."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpi
from . import jobs, lifecycle
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


class ClusterSession:
    """An emulated cluster under a unique name made from `prefix`: up on
    entry, down on exit unless `keep`. `log` gets a line when it is up
    and when it is down (or kept)."""

    def __init__(self, prefix: str, servers: int, instances: int,
                 vcpus: int, uplink_rate: Optional[str] = None,
                 keep: bool = False, log=None):
        # unique, and short enough for the socket paths (24 characters)
        self.name = f"{prefix}{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.topo = plan(self.name, servers, instances, vcpus, uplink_rate,
                         oversubscribe=True)
        self.uplink_rate = uplink_rate
        self.keep = keep
        self.log = log or sys.stderr
        self.state: Optional[Dict] = None
        self._old_handlers: Dict = {}

    def describe(self) -> Dict:
        t = self.topo
        return {"name": self.name, "servers": t.servers,
                "instances_per_server": t.instances_per_server,
                "vcpus": t.vcpus, "host_cpus": len(t.host_cpus),
                "uplink_rate": self.uplink_rate}

    def __enter__(self) -> "ClusterSession":
        self.sd = state_dir(self.name)
        self._old_handlers = {s: signal.signal(s, _raise_interrupted)
                              for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            # up() rolls back by itself when it fails or is interrupted
            lifecycle.up(self.topo, self.sd, log=lambda line: None)
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
        own unless `shared_region` (ivcloud.cluster.jobs)."""
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


def floating_rankfile(hosts: Sequence[str], vcpus: int) -> List[str]:
    """Rankfile lines putting rank r on hosts[r], free to run on any of
    its instance's vCPUs. Open MPI binds a rankfile's rank to its slot
    even under --bind-to none, so slot=0 on every instance would pin the
    ranks of all instances to one host CPU; the whole range keeps them
    floating like `--bind-to none` placements do."""
    slots = "0" if vcpus == 1 else f"0-{vcpus - 1}"
    return [f"rank {r}={host} slot={slots}" for r, host in enumerate(hosts)]
