"""`ivcloud bench p2p|mpi|small|hierarchy|halo|apps|scaling|report`: the
command line of the benchmarks in ivcloud.bench (options -> settings ->
``run``) and of their report (ivcloud.bench.report.write)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, List, Optional, Tuple, TypeVar

from .. import mpis
from ..bench import apps, btl, halo, hierarchy, ofi, p2p, scaling, small
from ..bench.report import write as write_report
from ..bench.toolkit import check_transports
from ..cluster.session import VmOptions
from ..server import parse_size
from . import add_vm_arguments, positive_int, wants_vm

DEFAULT_OUT = "build/demo"

T = TypeVar("T")

P2P = """Point-to-point latency and bandwidth: libivshm against references.

Runs, in one go and on this machine: libivshm rings (spin, and
spin-then-block), libivshm window put+flush, a memcpy reference, TCP over
loopback, TCP between two network namespaces over a bridge, Open MPI's
vader BTL, two oversubscribed ping-pong pairs, and the CPU use of a
blocked peer. Prints one table, the targets as ratios measured in this
run (informational), and optionally writes every record as JSON.

One-way latency is half a round trip; bandwidth = size / one-way latency.
"""

MPI = """MPI over ivshmem: OSU-style latency, bandwidth, RMA and allreduce.

Runs the mpi-osu program (native/bench/osu.c) under Open MPI on this
machine for three BTL sets: self,ivshmem (our component; tcp is left out
so every figure provably went through it, which its counters confirm),
self,vader (Open MPI's shared memory) and self,tcp (loopback).
Point-to-point and one-sided tests use 2 ranks, allreduce 4. One-sided
operations go through osc pt2pt for every transport, so the BTLs are
what is compared. Prints one table, the targets as ratios measured in
this run (informational), and optionally writes every record as JSON.

With --mpi openmpi5, mpich or impi (the PyPI MPIs, through libfabric)
it brings up a cluster of 1 server x 2 instances x 2 vCPUs instead and
measures that MPI's 8 B latency, 8 B message rate and 1 MiB bandwidth
with both ranks in one instance (its own shared memory: own-shm;
libfabric's shm provider: shm) and with one rank in each instance (our
ivshm provider: ivshmem; libfabric's tcp provider: tcp), then every
ratio against own-shm and, second, against shm, and the targets against
own-shm (8 B latency <= 1.05 x, 8 B rate >= 0.95 x, 1 MiB bandwidth
>= 0.9 x).
"""

SMALL = """Small messages: 8 B latency, message rate, exchange and ring against vader.

Runs, under Open MPI on this machine with 2 ranks: mpi-osu's 8 B one-way
latency and message rate (window of 64, time per message) and
mpi-pingpong's 8 B exchange and ring, HPCC's two ring-latency loops with
two ranks (both ranks in MPI_Sendrecv at once; both post two MPI_Irecv
and two MPI_Isend, then MPI_Waitall), over self,ivshmem (this build's
BTL, and the BTL of each --build) and over self,vader.

The machine switches between a fast and a slow state within seconds, so
each round runs short jobs back to back: vader, ours, vader again, and
every figure of ours is divided by the mean of the two vader figures
around it. A figure on which a round's two vader jobs differ by more
than 10 % (the machine changed state) is left out of that round, the
whole round when they differ on the latency; the rounds are split into
the machine's states by vader's latency. Where a BTL's code lies in memory
moves its figures too (identical copies of one build have differed by a
third), so each BTL runs from several fresh copies of its file in turn.
Prints, per state and figure, the medians of the ratios with their
spread, the targets (every figure at or below vader's, but the ring, for
HPCC's 0.9 of one instance's speed, at or below 1/0.9 of vader's time),
and optionally writes every round as JSON.
"""

HIERARCHY = """MPI latency and bandwidth at the three levels of the cloud hierarchy.

Brings up an emulated cluster (`ivcloud cluster`: 2 servers x 2
instances x 2 vCPUs, under a unique name) and runs mpi-osu's 2-rank
latency and bandwidth tests, 4 B .. 1 MiB, with the two ranks

  level 1  inside one instance (s0i0, s0i0): Open MPI's vader,
  level 2  on two instances of one server (s0i0, s0i1),
  level 3  on two servers (s0i0, s1i0), through both uplinks,

each level once with --transport tcp and once with --transport ivshmem
(BTL lists self,vader,tcp and self,vader,ivshmem,tcp), placed by a
rankfile. Open MPI's own report of the BTL each pair used is recorded
and checked: with ivshmem, level 1 still uses vader, level 2 ivshmem and
level 3 tcp, because a region is shared only by one server's instances.
Uplinks are unshaped unless --uplink-rate is given. The cluster is taken
down at the end, also after an error or a signal (unless
--keep-cluster).

With --instance-kind vm the instances are QEMU guests of the Debian image
(1 server x 2 guests x 2 vCPUs; mpi-osu is copied into them) and levels 1
and 2 are measured: level 2 tcp is virtio-net through the server's bridge,
level 2 ivshmem the guests' ivshmem-doorbell devices. The table names the
accelerator; under TCG only the ratios mean something.

Prints one table and the targets as ratios measured in this run, writes
the records as JSON, and into --out the plots and report.md
(`ivcloud bench report`).
"""

HALO = """Rank placement on the emulated cloud: halo exchange, planned vs round-robin.

Brings up an `ivcloud cluster` of 2 servers x 2 instances x 2 vCPUs whose
uplinks are rate-limited (--uplink-rate, default 200mbit), so traffic
between servers costs what it does in a cloud, and runs mpi-halo
(native/bench/halo.c: 8 ranks on a 4x2 grid, each exchanging --face
bytes with its up to 4 neighbours per iteration, plus a tiny compute)
with transport ivshmem under two placements:

  planned      the rankfile `ivcloud place --pattern halo2d:4x2` makes
               for this cluster (METIS: neighbours in one instance, the
               fewest grid edges across servers);
  round-robin  Open MPI's --map-by node over the instances (consecutive
               ranks on different servers), what a scheduler does
               without knowing the traffic.

The 8 ranks share the host's 2 cores (oversubscribed), so runs are
short; the placements alternate, --reps times each, and the figure is
the median wall time. Every run checks that each rank ran where its
placement put it. The target is the ratio round-robin / planned from
this run. The cluster is taken down at the end, also after an error or
a signal (unless --keep-cluster).
"""

REPORT = """The plots and report.md of the cloud benchmarks, from their JSON.

Reads DIR/hierarchy.json, halo.json and apps.json (whichever exist; each
cloud benchmark writes its own and redoes the report itself) and writes
into DIR the plots and report.md: nothing is measured, no cluster is
needed. Prints the path of report.md.
"""

SCALING = """Many ranks in one region: ivshmem against vader as ranks are added.

Runs the mpi-scaling program (native/bench/scaling.c) under Open MPI on
this machine at 2, 8, 32 and 128 ranks (oversubscribed: the ranks share
the host's cores), for self,ivshmem (a private region sized for the job,
linear in the ranks; the BTL counters must show traffic on every rank)
and self,vader. Per transport and rank count: the shared memory it
sets up, the 8 B latency between rank 0 and rank N-1, the 8 B allreduce
latency and the 8 B message rate of N/2 streaming pairs. Transports and
rank counts alternate in rounds; figures are medians with their spread.
Prints one table, the ratios ivshmem / vader measured in this run
(informational), and optionally writes every record as JSON.
"""


# ---------------------------------------------------------------- types

def _checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a library check: its message (a ValueError,
    an InvalidRequest) becomes the usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return convert


@_checked
def _sizes(text: str) -> List[int]:
    return p2p.check_sizes(parse_size(x) for x in text.split(",")
                           if x.strip())


@_checked
def _scaling_transports(text: str) -> List[str]:
    return check_transports((t.strip() for t in text.split(",")
                             if t.strip()), scaling.TRANSPORTS)


def _names(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ranks(text: str) -> List[int]:
    try:
        return [positive_int(t) for t in _names(text)]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"bad rank list '{text}': {e}")


def _scaling_ranks(text: str) -> List[int]:
    return _checked(scaling.check_ranks)(_ranks(text))


def _face(text: str) -> int:
    return _checked(halo.check_face)(positive_int(text))


# ---------------------------------------------------------------- running

def _run_p2p(args) -> int:
    s = p2p.P2pSettings.make(quick=args.quick, sizes=args.sizes,
                             iters=args.iters, netns=not args.skip_netns,
                             rounds=args.rounds)
    return p2p.run(s, json_path=args.json)


def _run_mpi(args) -> int:
    if ofi.covers(args.mpi):
        o = ofi.OfiSettings.make(args.mpi, quick=args.quick,
                                  iters=args.iters, configs=args.transports,
                                  rounds=args.rounds)
        return ofi.run(o, json_path=args.json)
    s = btl.MpiSettings.make(quick=args.quick, iters=args.iters,
                             transports=args.transports, rounds=args.rounds)
    return btl.run(s, json_path=args.json)


def _build(text: str) -> Tuple[str, Path]:
    """LABEL=DIR of another native build."""
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"a build is LABEL=DIR, not '{text}'")
    return label.strip(), Path(path.strip())


def _run_small(args) -> int:
    s = small.SmallSettings.make(quick=args.quick, rounds=args.rounds,
                                 iters=args.iters, builds=args.build,
                                 realtime=args.realtime, copies=args.copies)
    return small.run(s, json_path=args.json)


def _run_hierarchy(args) -> int:
    s = hierarchy.HierarchySettings.make(quick=args.quick, iters=args.iters,
                                         uplink_rate=args.uplink_rate,
                                         rounds=args.rounds)
    return hierarchy.run(s, Path(args.out), json_path=args.json,
                         keep_cluster=args.keep_cluster, vm=_vm_options(args))


def _vm_options(args, memory_mb: int = VmOptions.memory_mb
                ) -> Optional[VmOptions]:
    """VmOptions of --instance-kind vm, None for namespaces
    (`memory_mb`: the command's default guest memory)."""
    if not wants_vm(args, memory_mb):
        return None
    return VmOptions(guest_deb=args.guest_deb, memory_mb=args.vm_memory,
                     accel=args.accel)


def _run_halo(args) -> int:
    s = halo.HaloSettings.make(quick=args.quick, iters=args.iters,
                               reps=args.reps, face=args.face,
                               uplink_rate=args.uplink_rate,
                               transport=args.transport)
    run = halo.run_slurm if args.scheduler == "slurm" else halo.run
    return run(s, Path(args.out), json_path=args.json,
               keep_cluster=args.keep_cluster)


def _run_apps(args) -> int:
    vm = _vm_options(args, apps.VM_MEMORY_MB)
    s = apps.AppsSettings.make(quick=args.quick, apps=args.apps,
                               rounds=args.rounds, hpcc_n=args.hpcc_n,
                               foam_iterations=args.foam_iterations,
                               scaling_ranks=args.ranks,
                               vm=vm is not None, configs=args.configs)
    return apps.run(s, Path(args.out), json_path=args.json,
                    keep_cluster=args.keep_cluster, vm=vm)


def _run_report(args) -> int:
    print(write_report(Path(args.dir)))
    return 0


def _run_scaling(args) -> int:
    s = scaling.ScalingSettings.make(quick=args.quick, ranks=args.ranks,
                                     transports=args.transports,
                                     rounds=args.rounds, iters=args.iters)
    return scaling.run(s, json_path=args.json)


# ---------------------------------------------------------------- options

ROUNDS = "rounds of alternating transports; figures are medians " \
         "(default 3, quick 1)"


def _options(p: argparse.ArgumentParser, quick: str,
             iters: Optional[str] = None, rounds: Optional[str] = ROUNDS,
             json: str = "write the records and targets as JSON") -> None:
    """The options most benchmarks share, with their own help texts."""
    p.add_argument("--json", metavar="FILE", default=None, help=json)
    p.add_argument("--quick", action="store_true", help=quick)
    if iters:
        p.add_argument("--iters", type=positive_int, default=None,
                       help=iters)
    if rounds:
        p.add_argument("--rounds", type=positive_int, default=None,
                       help=rounds)


def _p2p_arguments(p: argparse.ArgumentParser) -> None:
    _options(p, "few sizes and iterations (plumbing check)",
             "round trips per small size (big sizes use fewer)")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help="comma-separated message sizes (K/M suffixes)")
    p.add_argument("--skip-netns", action="store_true",
                   help="skip the two-namespace TCP bridge transport")


def _mpi_arguments(p: argparse.ArgumentParser) -> None:
    names = ",".join(btl.TRANSPORTS)
    p.add_argument("--mpi", default=mpis.DEFAULT,
                   metavar="NAME",
                   help="openmpi (default: Debian's Open MPI and our BTL), "
                        "openmpi5, mpich or impi (through libfabric)")
    _options(p, "two sizes, few iterations (plumbing check)",
             "operations per small size (big sizes use fewer)")
    p.add_argument("--transports", type=_names, default=None,
                   help=f"comma-separated subset of {names} (openmpi) or "
                        f"{','.join(ofi.CONFIGS)} (the others)")


def _small_arguments(p: argparse.ArgumentParser) -> None:
    _options(p, "two rounds of short jobs (plumbing check)",
             "mpi-osu operations per job; the exchange and the ring do "
             "half (default 200000, quick 2000)",
             "rounds (default 20, quick 2)",
             "write the records, each round's figures and the targets as "
             "JSON")
    p.add_argument("--build", type=_build, action="append", default=[],
                   metavar="LABEL=DIR",
                   help="also run the BTL of the native build in DIR "
                        "(its btl/ directory) under LABEL; repeatable")
    p.add_argument("--copies", type=positive_int, default=None,
                   help=f"fresh copies of each BTL's file, one a round in "
                        f"turn: where its code lies in memory moves the "
                        f"figures (default {small.COPIES}, quick 1)")
    p.add_argument("--realtime", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="run the ranks in a real-time class (default: "
                        "when root and chrt allow it)")


def _cluster_arguments(p: argparse.ArgumentParser, name: str,
                       quick: str) -> None:
    """The options every cluster benchmark has (hierarchy, halo)."""
    _options(p, quick, rounds=None,
             json="also write the records and targets as JSON here")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"where {name}.json, the plots and report.md go "
                        f"(default {DEFAULT_OUT})")
    p.add_argument("--keep-cluster", action="store_true",
                   help="leave the cluster up afterwards (for inspection)")


def _hierarchy_arguments(p: argparse.ArgumentParser) -> None:
    _cluster_arguments(p, "hierarchy",
                       "three sizes, few iterations (plumbing check)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="round trips per small size (big sizes use fewer)")
    p.add_argument("--uplink-rate", default=None, metavar="RATE",
                   help="shape the servers' uplinks (e.g. 1gbit; default "
                        "unshaped)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="rounds of alternating levels and transports; "
                        "figures are medians (default 3, quick 1)")
    _vm_arguments(p)


def _vm_arguments(p: argparse.ArgumentParser) -> None:
    add_vm_arguments(p, "namespace (default) or vm: QEMU guests of the "
                        "Debian image (1 server x 2 guests x 2 vCPUs, "
                        "levels 1 and 2)", VmOptions.memory_mb)


def _halo_arguments(p: argparse.ArgumentParser) -> None:
    _cluster_arguments(p, "halo",
                       "one short run per placement (plumbing check)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed halo iterations per run")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="runs per placement (the median counts)")
    p.add_argument("--face", type=_face, default=halo.FACE_BYTES,
                   help=f"bytes per face and neighbour (default "
                        f"{halo.FACE_BYTES})")
    p.add_argument("--uplink-rate", default=halo.DEFAULT_UPLINK,
                   metavar="RATE",
                   help=f"servers' uplink limit (default "
                        f"{halo.DEFAULT_UPLINK})")
    p.add_argument("--transport", choices=halo.TRANSPORTS,
                   default="ivshmem", help="between instances of a server "
                                           "(default ivshmem)")
    p.add_argument("--scheduler", choices=halo.SCHEDULERS, default="none",
                   help="slurm: a 4-rank job on 2 instances of a cluster "
                        "running Slurm, placed by Slurm's tree topology "
                        "against a round-robin spread (halo-slurm.json)")


def _apps_arguments(p: argparse.ArgumentParser) -> None:
    _cluster_arguments(p, "apps",
                       "one round, tiny inputs, 1-2 ranks (plumbing check)")
    p.add_argument("--apps", type=_names, default=None,
                   help=f"comma-separated subset of {','.join(apps.APPS)}")
    p.add_argument("--configs", type=_names, default=None,
                   help=f"comma-separated subset of "
                        f"{','.join(apps.CONFIGS)} (default all; one is "
                        f"the reference and always needed)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="rounds of alternating configurations (default 3)")
    p.add_argument("--hpcc-n", type=positive_int, default=None,
                   metavar="N", help="HPL problem size (default 2000)")
    p.add_argument("--foam-iterations", type=positive_int, default=None,
                   metavar="N", help="simpleFoam iterations (default 200)")
    p.add_argument("--ranks", type=_ranks, default=None,
                   help="rank counts of the scaling series (default "
                        "1,2,4 up to the host's CPUs; none on VMs)")
    add_vm_arguments(p, "namespace (default) or vm: QEMU guests of the "
                        "Debian image (the inputs copied in, the solver "
                        "from python3-micromag)", apps.VM_MEMORY_MB)


def _scaling_arguments(p: argparse.ArgumentParser) -> None:
    names = ",".join(scaling.TRANSPORTS)
    _options(p, "2 and 4 ranks, one round, few operations (plumbing check)",
             "latency round trips per batch at 2 ranks (fewer with more "
             "ranks)", "rounds of alternating transports and rank counts; "
             "figures are medians (default 3, quick 1)")
    p.add_argument("--ranks", type=_scaling_ranks, default=None,
                   help="comma-separated rank counts (default 2,8,32,128)")
    p.add_argument("--transports", type=_scaling_transports, default=None,
                   help=f"comma-separated subset of {names}")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR",
                   help=f"where the benchmarks' JSON is (`make demo`: "
                        f"{DEFAULT_OUT})")


def register(sub) -> None:
    p = sub.add_parser("bench", help="run benchmarks",
                       description="Benchmarks of libivshm against "
                                   "reference transports.")
    actions = p.add_subparsers(dest="action", metavar="BENCHMARK",
                               parser_class=type(p))
    actions.required = True
    for name, text, arguments, run, raw in (
            ("p2p", P2P, _p2p_arguments, _run_p2p, False),
            ("mpi", MPI, _mpi_arguments, _run_mpi, False),
            ("small", SMALL, _small_arguments, _run_small, False),
            # their descriptions are laid out lists: keep the line breaks
            ("hierarchy", HIERARCHY, _hierarchy_arguments, _run_hierarchy,
             True),
            ("halo", HALO, _halo_arguments, _run_halo, True),
            ("apps", apps.__doc__, _apps_arguments, _run_apps, True),
            ("scaling", SCALING, _scaling_arguments, _run_scaling, False),
            ("report", REPORT, _report_arguments, _run_report, False)):
        kw = ({"formatter_class": argparse.RawDescriptionHelpFormatter}
              if raw else {})
        b = actions.add_parser(name, help=text.splitlines()[0],
                               description=text, **kw)
        arguments(b)
        b.set_defaults(func=run)
