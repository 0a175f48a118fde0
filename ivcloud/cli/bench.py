"""`ivcloud bench p2p|mpi|small|hierarchy|halo|apps|scaling|migrate|report`: the
command line of the benchmarks in ivcloud.bench (options -> settings ->
``run``) and of their report (ivcloud.bench.report.write)."""

from __future__ import annotations

import argparse
import functools
import inspect
from pathlib import Path
from typing import Optional, Tuple

from .. import mpis
from ..bench import (apps, btl, halo, hierarchy, migrate, ofi, p2p, report,
                     scaling, small)
from ..bench.toolkit import check_transports
from ..cluster.session import VmOptions
from ..server import parse_size
from . import (CliError, add_vm_arguments, checked, comma_list,
               positive_int, sub_actions, vm_options)

DEFAULT_OUT = "build/demo"


# ---------------------------------------------------------------- types

_names = comma_list()
_sizes = comma_list(parse_size, p2p.check_sizes)
_ranks = comma_list(positive_int, what="rank list")
_scaling_ranks = comma_list(positive_int, scaling.check_ranks, "rank list")
_scaling_transports = comma_list(check=functools.partial(
    check_transports, allowed=scaling.TRANSPORTS))


def _face(text: str) -> int:
    return checked(halo.check_face)(positive_int(text))


# ---------------------------------------------------------------- running

def _settings(settings, args, **given):
    """settings.make with the options named as its parameters (those the
    benchmark has: --quick, --iters, --rounds and its own), and `given`."""
    names = inspect.signature(settings.make).parameters
    return settings.make(**{k: getattr(args, k) for k in names
                            if k not in given and hasattr(args, k)}, **given)


def _run_here(settings, run, args) -> int:
    """A benchmark on this host alone: run(its settings, --json)."""
    return run(_settings(settings, args), json_path=args.json)


def _run_mpi(args) -> int:
    if ofi.covers(args.mpi):
        return ofi.run(_settings(ofi.OfiSettings, args, mpi_name=args.mpi,
                                 configs=args.transports), json_path=args.json)
    return _run_here(btl.MpiSettings, btl.run, args)


def _build(text: str) -> Tuple[str, Path]:
    """LABEL=DIR of another native build."""
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"a build is LABEL=DIR, not '{text}'")
    return label.strip(), Path(path.strip())


def _run_hierarchy(args) -> int:
    s = _settings(hierarchy.HierarchySettings, args)
    return hierarchy.run(s, Path(args.out), json_path=args.json,
                         keep_cluster=args.keep_cluster,
                         vm=vm_options(args, VmOptions.memory_mb))


def _run_halo(args) -> int:
    s = _settings(halo.HaloSettings, args)
    run = halo.run_slurm if args.scheduler == "slurm" else halo.run
    return run(s, Path(args.out), json_path=args.json,
               keep_cluster=args.keep_cluster)


def _run_apps(args) -> int:
    vm = vm_options(args, apps.VM_MEMORY_MB)
    s = _settings(apps.AppsSettings, args, vm=vm is not None)
    return apps.run(s, Path(args.out), json_path=args.json,
                    keep_cluster=args.keep_cluster, vm=vm)


def _run_migrate(args) -> int:
    vm = vm_options(args, migrate.VM_MEMORY_MB)
    if vm is None:
        raise CliError("bench migrate moves QEMU guests: --instance-kind vm")
    s = _settings(migrate.MigrateSettings, args, mpi_name=args.mpi, vm=vm)
    return migrate.run(s, json_path=args.json)


def _run_report(args) -> int:
    print(report.write(Path(args.dir)))
    return 0


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
    p.add_argument("--skip-netns", dest="netns", action="store_false",
                   help="skip the two-namespace TCP bridge transport")


def _mpi_arguments(p: argparse.ArgumentParser) -> None:
    names = ",".join(btl.TRANSPORTS)
    p.add_argument("--mpi", default=mpis.DEFAULT, metavar="NAME",
                   help=mpis.choices())
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
    p.add_argument("--build", dest="builds", type=_build, action="append",
                   default=[], metavar="LABEL=DIR",
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


def _cluster_arguments(p: argparse.ArgumentParser, name: str, quick: str,
                       iters: Optional[str] = None,
                       rounds: Optional[str] = None) -> None:
    """The options every cluster benchmark has (hierarchy, halo, apps)."""
    _options(p, quick, iters, rounds,
             json="also write the records and targets as JSON here")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"where {name}.json, the plots and report.md go "
                        f"(default {DEFAULT_OUT})")
    p.add_argument("--keep-cluster", action="store_true",
                   help="leave the cluster up afterwards (for inspection)")


def _hierarchy_arguments(p: argparse.ArgumentParser) -> None:
    _cluster_arguments(p, "hierarchy",
                       "three sizes, few iterations (plumbing check)",
                       "round trips per small size (big sizes use fewer)",
                       "rounds of alternating levels and transports; "
                       "figures are medians (default 3, quick 1)")
    p.add_argument("--uplink-rate", default=None, metavar="RATE",
                   help="shape the servers' uplinks (e.g. 1gbit; default "
                        "unshaped)")
    add_vm_arguments(p, "namespace (default) or vm: QEMU guests of the "
                        "Debian image (1 server x 2 guests x 2 vCPUs, "
                        "levels 1 and 2)", VmOptions.memory_mb)


def _halo_arguments(p: argparse.ArgumentParser) -> None:
    _cluster_arguments(p, "halo",
                       "one short run per placement (plumbing check)",
                       "timed halo iterations per run")
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
                       "one round, tiny inputs, 1-2 ranks (plumbing check)",
                       rounds="rounds of alternating configurations "
                              "(default 3)")
    p.add_argument("--apps", type=_names, default=None,
                   help=f"comma-separated subset of {','.join(apps.APPS)}")
    p.add_argument("--configs", type=_names, default=None,
                   help=f"comma-separated subset of "
                        f"{','.join(apps.CONFIGS)} (default all; one is "
                        f"the reference and always needed)")
    p.add_argument("--hpcc-n", type=positive_int, default=None,
                   metavar="N", help="HPL problem size (default 2000)")
    p.add_argument("--foam-iterations", type=positive_int, default=None,
                   metavar="N", help="simpleFoam iterations (default 200)")
    p.add_argument("--ranks", type=_ranks, default=None,
                   dest="scaling_ranks", metavar="RANKS",
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


def _migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mpi", choices=migrate.MPIS, default=migrate.MPIS[0],
                   help="the MPI of the job (default mpich)")
    _options(p, "3 ticks per steady phase (plumbing check)",
             "8 B round trips per pair and tick (default 20)", rounds=None)
    p.add_argument("--ticks", type=positive_int, default=None,
                   help="ticks of the job per steady phase (default 10, "
                        "quick 3)")
    add_vm_arguments(p, "vm (the default; the benchmark moves QEMU "
                        "guests)", migrate.VM_MEMORY_MB)
    p.set_defaults(instance_kind="vm")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR",
                   help=f"where the benchmarks' JSON is (`make demo`: "
                        f"{DEFAULT_OUT})")


def register(sub) -> None:
    p = sub.add_parser("bench", help="run benchmarks",
                       description="Benchmarks of libivshm against "
                                   "reference transports.")
    actions = sub_actions(p, "BENCHMARK")
    # a benchmark's module docstring is its description; raw: it has laid
    # out lists, keep its line breaks
    for name, text, arguments, run, raw in (
            ("p2p", p2p.__doc__, _p2p_arguments,
             functools.partial(_run_here, p2p.P2pSettings, p2p.run), False),
            ("mpi", f"{btl.__doc__}\n{ofi.__doc__}", _mpi_arguments,
             _run_mpi, True),
            ("small", small.__doc__, _small_arguments, functools.partial(
                _run_here, small.SmallSettings, small.run), False),
            ("hierarchy", hierarchy.__doc__, _hierarchy_arguments,
             _run_hierarchy, True),
            ("halo", halo.__doc__, _halo_arguments, _run_halo, True),
            ("apps", apps.__doc__, _apps_arguments, _run_apps, True),
            ("scaling", scaling.__doc__, _scaling_arguments,
             functools.partial(_run_here, scaling.ScalingSettings,
                               scaling.run), False),
            ("migrate", migrate.__doc__, _migrate_arguments, _run_migrate,
             True),
            ("report", report.__doc__, _report_arguments, _run_report,
             True)):
        kw = ({"formatter_class": argparse.RawDescriptionHelpFormatter}
              if raw else {})
        summary = " ".join(text.split("\n\n")[0].split())
        b = actions.add_parser(name, help=summary, description=text, **kw)
        arguments(b)
        b.set_defaults(func=run)
