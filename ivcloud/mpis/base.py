"""What every MPI installed beside Debian's Open MPI shares: where its
prefix lives, the job a launcher line is made for, the paths its traffic
can take, and how programs are built for it.

A flavor (one module per MPI: mpich, impi, openmpi5) knows its own
launcher line and the environment that makes its ranks take a transport;
everything else is here. Nothing runs: a flavor builds argv lists and
environments, the caller (ivcloud.cluster.launch, the benchmarks) runs
them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import MpiFlavorError
from . import provider

# Paths a job's traffic between ranks can take:
#   ivshmem  libfabric's `ivshm` provider for every peer outside the own
#            instance (the region for co-resident ones, tcp for the rest,
#            delegated by the provider); the MPI's own shared memory inside
#   tcp      libfabric's tcp provider instead of ivshm
#   shm      libfabric's shm provider for every peer, the MPI's own shared
#            memory off (ranks of one instance only)
#   own-shm  the MPI's own shared memory (ranks of one instance only)
TRANSPORTS = ("ivshmem", "tcp", "shm", "own-shm")
# what may run across instances
ACROSS_INSTANCES = ("ivshmem", "tcp")


def mpi_root() -> Path:
    """Where `make build` installs the MPIs: $IVCLOUD_MPI_DIR, else
    <repo>/build/mpi (one prefix per MPI below it)."""
    env = os.environ.get("IVCLOUD_MPI_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "build" / "mpi"


@dataclass(frozen=True)
class Job:
    """One launch: `program` (argv) on `np` ranks.

    hosts: (hostname, slots) in the order ranks fill them, empty for
    this machine only; spread: consecutive ranks on different hosts
    (one per host and round); agent: the program that reaches a host as
    ssh would (`AGENT HOST COMMAND...`), None without hosts; report:
    every rank prints its per-rank transport line at exit; env: more
    variables for every rank."""
    program: Sequence[str]
    np: int
    hosts: Sequence[Tuple[str, int]] = ()
    spread: bool = False
    agent: Optional[str] = None
    transport: str = "ivshmem"
    report: bool = False
    wdir: Optional[str] = None
    env: Mapping[str, str] = field(default_factory=dict)


class Flavor:
    """An MPI installed in a prefix of its own (a PyPI wheel in a venv
    under mpi_root()), reaching other ranks through libfabric."""

    name = ""           # as jobs and the command line name it
    title = ""          # for people: the MPI and its version
    wheel = ""          # the pip requirement `make build` installs
    launcher = "mpiexec"
    # transports this MPI cannot take, and why
    lacks: Mapping[str, str] = {}

    # ---------------------------------------------------------- install

    def prefix(self) -> Path:
        """The installed prefix; MpiFlavorError if it is missing."""
        p = mpi_root() / self.name
        if not os.access(p / "bin" / self.launcher, os.X_OK):
            raise MpiFlavorError(f"{self.title} is not installed: no "
                                 f"{p / 'bin' / self.launcher} (`make "
                                 f"build` installs {self.wheel} there)")
        return p

    def launcher_path(self) -> Path:
        return self.prefix() / "bin" / self.launcher

    def python(self) -> Path:
        """The prefix's Python, with mpi4py for this MPI."""
        return self.prefix() / "bin" / "python"

    def compile_command(self, source: os.PathLike, output: os.PathLike,
                        flags: Sequence[str] = ()) -> List[str]:
        """argv that builds a C MPI program for this MPI (its mpicc)."""
        return [str(self.prefix() / "bin" / "mpicc"), *flags, "-o",
                str(output), str(source)]

    # ---------------------------------------------------------- launch

    def check(self, transport: str, report: bool = False) -> None:
        """Refuse what this machine cannot run: an unknown transport, a
        missing prefix, ivshmem without the provider built, a per-rank
        report where no provider of ours runs."""
        if transport not in TRANSPORTS:
            raise MpiFlavorError(f"unknown transport '{transport}' for "
                                 f"{self.title} (choose from "
                                 f"{', '.join(TRANSPORTS)})")
        if transport in self.lacks:
            raise MpiFlavorError(f"{self.title} cannot use the {transport} "
                                 f"transport: {self.lacks[transport]}")
        if report and transport != "ivshmem":
            raise MpiFlavorError(f"only the ivshmem transport reports its "
                                 f"traffic per rank, not '{transport}'")
        self.prefix()
        if transport == "ivshmem":
            provider.library()

    def command(self, job: Job) -> List[str]:
        """The launcher's argv for `job` (run it where the hosts resolve:
        a cluster's head node)."""
        self.check(job.transport, job.report)
        program = [str(a) for a in job.program]
        if not program or not program[0]:
            raise MpiFlavorError("no program given")
        if not isinstance(job.np, int) or job.np < 1:
            raise MpiFlavorError(f"the number of ranks must be a positive "
                                 f"integer, not {job.np!r}")
        if job.hosts and not job.agent:
            raise MpiFlavorError("hosts need an agent to reach them")
        return self.launch_line(job, program, self.rank_env(job))

    def rank_env(self, job: Job) -> Dict[str, str]:
        """What every rank gets on top of what the agent gives it: where
        libfabric finds the provider, the report switch, the flavor's
        choice of path and provider, and the job's own variables.

        Each flavor picks the provider through its MPI's own setting
        where it has one: FI_PROVIDER (MPICH has nothing else) hides
        every provider it does not name from libfabric."""
        env: Dict[str, str] = {}
        if job.transport == "ivshmem":
            env["FI_PROVIDER_PATH"] = self.provider_path(provider.library())
            if job.report:
                env[provider.REPORT_ENV] = "1"
        env.update(self.transport_env(job.transport))
        env.update({str(k): str(v) for k, v in job.env.items()})
        return env

    def provider_path(self, library: Path) -> str:
        """FI_PROVIDER_PATH that makes this MPI's libfabric load the
        provider: its directory (the wheels' libfabric builds its core
        providers in)."""
        return str(library.parent)

    # what a flavor defines
    def transport_env(self, transport: str) -> Dict[str, str]:
        raise NotImplementedError

    def launch_line(self, job: Job, program: List[str],
                    env: Dict[str, str]) -> List[str]:
        raise NotImplementedError


def hosts_arg(hosts: Sequence[Tuple[str, int]]) -> str:
    """'s0i0:2,s0i1:2': hosts with their slots, as hydra's -hosts and
    PRRTE's --host take them."""
    return ",".join(f"{h}:{n}" for h, n in hosts)
