"""One way to run a job on a cluster: a Job, and run_job, under every
caller, the same for every MPI and instance kind. Each step asks the
one that knows: the MPI's Flavor refuses what it cannot do and turns
the Launch into its command; the instances' kind says where the
launcher runs, refuses what is out of reach, makes the job's regions
and runs the launcher to its end. Slurm steps (run_slurm) let Slurm
place and start the ranks. docs/ARCHITECTURE.md follows a job through.
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .. import mpis, process
from ..errors import ClusterError, JobTimeout
from ..mpis import Command, Launch
from . import kinds
from .launch import PLACEMENTS, host_slots
from .slurm import client as slurm_client
from .topology import SUBNET, topology_from_dict


@dataclass(frozen=True)
class Job:
    """What to run on a cluster: `program` (argv) on `np` ranks with MPI
    `mpi` (a name of ivcloud.mpis)."""
    program: Sequence[str]
    np: int
    mpi: str = mpis.DEFAULT
    transport: str = "tcp"
    placement: str = "block"        # block or round-robin, or else:
    hosts: Sequence[str] = ()       # the instance of each rank, or
    rankfile: Optional[str] = None  # a rankfile's text (Open MPI's)
    shared_region: bool = False     # the servers' standing regions
    env: Mapping[str, str] = field(default_factory=dict)
    options: Sequence[Tuple[str, str]] = ()   # the MPI's own (MCA)
    report: bool = False            # each rank prints its transport line
    oversubscribe: bool = False     # more ranks than vCPUs
    timeout: Optional[float] = None     # seconds, then torn down


@dataclass
class Plan:
    """A job made concrete for one cluster: the launcher's command, the
    instances' kind that runs it, and what the job is told."""
    job: Job
    kind: kinds.InstanceKind
    command: Command
    note: Optional[str]


def check_job(job: Job) -> None:
    """The refusals that need no cluster: the MPI's (a transport, its
    own parameters, a rankfile) and the placement's."""
    flavor = mpis.flavor(job.mpi)
    flavor.check(job.transport, job.report)
    flavor.check_options(job.options, job.rankfile is not None)
    if job.placement not in PLACEMENTS:
        raise ClusterError(f"unknown placement '{job.placement}' (choose "
                           f"from {', '.join(PLACEMENTS)})",
                           setting="placement")
    if job.rankfile is not None and (job.hosts or job.placement != "block"):
        raise ClusterError("give either a rankfile or a placement",
                           setting="rankfile")


def plan_job(state: Dict, job: Job) -> Plan:
    """Everything run_job checks and builds before anything starts."""
    check_job(job)
    flavor = mpis.flavor(job.mpi)
    topo = topology_from_dict(state["topology"])
    slots = topo.servers * topo.instances_per_server * topo.vcpus
    if job.np > slots and not job.oversubscribe:
        raise ClusterError(f"{job.np} ranks exceed the cluster's {slots} "
                           f"vCPUs", setting="oversubscribe")
    unknown = [h for h in job.hosts if h not in state.get("instances", {})]
    if unknown:
        raise ClusterError(f"no instance '{unknown[0]}' in cluster "
                           f"'{state['name']}'")
    kind = kinds.of_state(state)
    site = kind.job_site(state)
    program = kind.job_program(state, flavor, job.program, job.transport)
    files: Dict[str, str] = {}
    rankfile = None
    if job.rankfile is not None:
        rankfile = f"{site.scratch}/rankfile.{uuid.uuid4().hex[:8]}"
        files[rankfile] = job.rankfile
    launch = Launch(program, job.np, transport=job.transport,
                    hosts=host_slots(topo, job.placement),
                    spread=job.placement == "round-robin",
                    rank_hosts=tuple(job.hosts), rankfile=rankfile,
                    agent=site.agent, interface=SUBNET,
                    oversubscribe=job.oversubscribe,
                    unprivileged=site.unprivileged,
                    installed=site.installed, report=job.report,
                    wdir=site.wdir, env={**site.env, **job.env},
                    options=tuple(job.options), scratch=site.scratch)
    command = flavor.command(launch)
    command.files.update(files)
    return Plan(job, kind, command,
                kind.region_note(job.transport, job.shared_region, False))


def run_job(state: Dict, job: Job, stdout=None, stderr=None,
            plan: Optional[Plan] = None) -> int:
    """Run `job` on the cluster of `state` to its end; its launcher's
    exit status. JobTimeout past job.timeout, process.Interrupted on
    SIGTERM/SIGHUP/Ctrl-C (the job torn down first)."""
    plan = plan or plan_job(state, job)
    with process.interrupts():
        with plan.kind.job_regions(state, job.transport,
                                   job.shared_region) as env:
            try:
                return plan.kind.run_launcher(state, plan.command, env,
                                              job.timeout, stdout, stderr)
            except subprocess.TimeoutExpired:
                raise JobTimeout(f"job exceeded {job.timeout:g} s, torn "
                                 f"down") from None


def describe_job(state: Dict, job: Job) -> List[str]:
    """What run_job would run (the launcher's command line), and a line
    on the regions it would run in; nothing is started."""
    plan = plan_job(state, job)
    where = plan.kind.region_note(job.transport, job.shared_region, True)
    return [plan.kind.describe_launcher(state, plan.command)] + \
        ([f"# {where}"] if where else [])


def run_slurm(state: Dict, command: str, args: Sequence[str],
              hosts: Optional[Sequence[str]] = None,
              timeout: Optional[float] = None, stdout=None,
              stderr=None, report: bool = False,
              mpi: Optional[str] = None) -> int:
    """Slurm's `srun ARGS` or `sbatch ARGS` in the head node (Slurm
    places and starts the ranks; its hooks make the job's regions);
    their exit status. hosts: task i on hosts[i]; report: every rank
    prints its transport line (slurm_client.REPORT_ENV); mpi: the
    tasks are ranks of that MPI (slurm_client.client_command).
    SIGTERM/SIGHUP are passed on (srun then ends its job)."""
    full, env, cpus, hostfile = slurm_client.client_command(
        state, command, args, hosts, report=report, mpi=mpi)
    try:
        with process.interrupts():
            return process.run_launcher(
                full, env, timeout, stdout, stderr, cwd="/", cpus=cpus,
                grace_s=slurm_client.STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        raise JobTimeout(f"job exceeded {timeout:g} s, torn down") from None
    finally:
        if hostfile is not None and command == "srun":
            hostfile.unlink(missing_ok=True)

