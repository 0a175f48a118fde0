"""`ivcloud place`: the command line of :mod:`ivcloud.place`
(its rankfile module does the work)."""

from __future__ import annotations

import json
import sys
from fractions import Fraction

from ..place.planner import FILLS, PlacementTopology
from ..place.rankfile import (PARTITIONERS, choose_partitioner,
                              cluster_shape, plan, read_graph,
                              write_rankfile)
from . import CliError, add_run_dir, number, positive_int

_seed = number(int, "'{}' is not an integer", lambda value: None
               if 0 <= value < 1 << 31 else "seed must be 0..2^31-1")
_percent = number(Fraction, "'{}' is not a number", lambda value: None
                  if 0 <= value <= 100 else "imbalance must be 0..100 (%)")


def register(sub) -> None:
    p = sub.add_parser(
        "place", help="place MPI ranks on the cluster (Open MPI rankfile)",
        description="Partition a communication graph over servers, then "
                    "instances, then cores (METIS), and write an Open MPI "
                    "rankfile. Exactly one of --graph / --pattern, and "
                    "either --servers/--instances-per-server/--vcpus or "
                    "--cluster.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--graph", metavar="FILE",
                     help="JSON {\"ranks\": N, \"edges\": [[i, j, w], ...]} "
                          "or {\"matrix\": [[...]]}, or a dense N x N "
                          "traffic matrix in text ('-' = stdin)")
    src.add_argument("--pattern", metavar="P",
                     help="ring | alltoall | halo2d[:PXxPY] | "
                          "halo3d[:PXxPYxPZ]")
    p.add_argument("--ranks", type=positive_int, metavar="N",
                   help="number of ranks (patterns; checked against --graph)")
    p.add_argument("--servers", type=positive_int, metavar="S")
    p.add_argument("--instances-per-server", type=positive_int, metavar="I")
    p.add_argument("--vcpus", type=positive_int, metavar="V",
                   help="vCPUs (rankfile slots) per instance")
    p.add_argument("--cluster", metavar="NAME",
                   help="take S, I, V from a cluster made by "
                        "`ivcloud cluster up`")
    add_run_dir(p, "where clusters keep their state")
    p.add_argument("--cpus-per-rank", type=positive_int, default=1,
                   metavar="T", help="cores each rank gets (default 1)")
    p.add_argument("--fill", choices=FILLS, default="spread",
                   help="spread: ranks balanced over all servers and "
                        "instances (default); pack: as few as will hold "
                        "them, balanced among those")
    p.add_argument("--imbalance", type=_percent, default=Fraction(0),
                   metavar="PCT",
                   help="allowed deviation of a part from the average size, "
                        "in %% (default 0: sizes differ by at most one)")
    p.add_argument("--partitioner", choices=PARTITIONERS, default="auto",
                   help="auto: METIS if installed, else spectral "
                        "bisection with a warning")
    p.add_argument("--seed", type=_seed, default=1,
                   help="METIS random seed (default 1): same input, "
                        "same output")
    p.add_argument("--out", metavar="FILE",
                   help="write the rankfile here (default: stdout, with the "
                        "summary as # comments)")
    p.add_argument("--json", action="store_true",
                   help="print the placement and cuts as JSON")
    p.add_argument("--compare", action="store_true",
                   help="also show round-robin and block placements")
    p.set_defaults(func=_cmd_place)


def _topology(args) -> PlacementTopology:
    explicit = [args.servers, args.instances_per_server, args.vcpus]
    if args.cluster is not None:
        if any(v is not None for v in explicit):
            raise CliError("give either --cluster or --servers/"
                           "--instances-per-server/--vcpus, not both")
        return cluster_shape(args.cluster, args.run_dir)
    if any(v is None for v in explicit):
        raise CliError("need --servers, --instances-per-server and --vcpus "
                       "(or --cluster NAME)")
    return PlacementTopology(*explicit)


def _cmd_place(args) -> int:
    graph = read_graph(args.pattern, args.graph, args.ranks)
    topo = _topology(args)
    part = choose_partitioner(args.partitioner, args.seed)
    if part.metis is None and args.partitioner == "auto":
        sys.stderr.write("ivcloud place: warning: METIS (libmetis5) not "
                         "found, falling back to spectral bisection\n")
    result = plan(graph, topo, part, args.fill, args.imbalance,
                  args.cpus_per_rank, compare=args.compare)
    if args.out:
        write_rankfile(args.out, result.rankfile())
    if args.json:
        print(json.dumps(result.to_json(args.out), indent=2))
    elif args.out:
        print("\n".join(result.summary()))
        print(f"rankfile: {args.out}")
    else:
        sys.stdout.write(result.rankfile())
    return 0
