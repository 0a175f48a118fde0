"""`ivcloud place`: the command line of :mod:`ivcloud.place`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import PlacementError
from ..place import graph as graphs
from ..place.metis import Metis
from ..place.planner import (FILLS, Partitioner, Placement,
                             PlacementTopology, block, cut_by_level, place,
                             rankfile_lines, round_robin)
from . import CliError, positive_int

PARTITIONERS = ("auto", "metis", "spectral")
LEVELS = ("across_servers", "across_instances", "inside_instances")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer")
    if not 0 <= value < 1 << 31:
        raise argparse.ArgumentTypeError("seed must be 0..2^31-1")
    return value


def _percent(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a number")
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError("imbalance must be 0..100 (%)")
    return value


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
    p.add_argument("--run-dir", default=None,
                   help="where clusters keep their state (default "
                        "$IVCLOUD_RUN_DIR or /run/ivcloud)")
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


# ---------------------------------------------------------------- inputs

def _read_graph(args) -> graphs.Graph:
    if args.pattern is not None:
        name = args.pattern.partition(":")[0]
        if args.ranks is None and name in ("ring", "alltoall"):
            raise CliError(f"pattern '{name}' needs --ranks")
        return graphs.pattern(args.pattern, args.ranks)
    where = args.graph
    try:
        if args.graph == "-":
            where = "stdin"
            text = sys.stdin.read()
        else:
            text = Path(args.graph).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read graph {args.graph}: "
                       f"{getattr(e, 'strerror', None) or e}")
    g = graphs.parse(text, where)
    if args.ranks is not None and args.ranks != g.n:
        raise CliError(f"--ranks {args.ranks} but {where} has {g.n} ranks")
    return g


def _topology(args) -> PlacementTopology:
    explicit = [args.servers, args.instances_per_server, args.vcpus]
    if args.cluster is not None:
        if any(v is not None for v in explicit):
            raise CliError("give either --cluster or --servers/"
                           "--instances-per-server/--vcpus, not both")
        return _cluster_topology(args.cluster, args.run_dir)
    if any(v is None for v in explicit):
        raise CliError("need --servers, --instances-per-server and --vcpus "
                       "(or --cluster NAME)")
    return PlacementTopology(args.servers, args.instances_per_server, args.vcpus)


def _cluster_topology(name: str, run_dir: Optional[str]) -> PlacementTopology:
    """The shape of a cluster made by `ivcloud cluster up`, from its state
    file (RUN_DIR/cluster-NAME/state.json)."""
    try:
        from ..cluster import state as cluster_state
    except ImportError as e:
        raise CliError(f"--cluster needs the ivcloud cluster module ({e})")
    sd = cluster_state.state_dir(name, run_dir)
    doc = cluster_state.load(sd)
    if doc is None:
        raise CliError(f"no cluster '{name}' ({sd.state} does not exist)")
    topo = doc.get("topology", doc)
    try:
        shape = [int(topo[k]) for k in ("servers", "instances_per_server",
                                        "vcpus")]
    except (KeyError, TypeError, ValueError):
        raise CliError(f"{sd.state} does not record the cluster's servers, "
                       f"instances_per_server and vcpus")
    try:
        # the cluster names its instances s<k>i<i> too (Instance.hostname)
        return PlacementTopology(*shape)
    except PlacementError as e:
        raise CliError(f"{sd.state}: {e}")


def _partitioner(choice: str, seed: int) -> Partitioner:
    if choice == "spectral":
        return Partitioner(None, seed)
    metis = Metis.load()
    if metis is None:
        if choice == "metis":
            raise CliError("METIS library not found (apt-get install "
                           "libmetis5)")
        sys.stderr.write("ivcloud place: warning: METIS (libmetis5) not "
                         "found, falling back to spectral bisection\n")
    return Partitioner(metis, seed)


# ---------------------------------------------------------------- outputs

def _fmt(w: float) -> str:
    return str(int(w)) if float(w).is_integer() else f"{w:.6g}"


def _summary(g: graphs.Graph, topo: PlacementTopology, part: Partitioner,
             rows: Dict[str, Dict[str, float]], args,
             placement: Placement) -> List[str]:
    total = g.total_weight
    engine = (f"METIS ({part.metis.path}), seed {part.seed}"
              if part.metis else "spectral bisection (no METIS)")
    load = placement.load(topo)
    per_server = [sum(row) for row in load]
    lines = [f"{g.n} ranks, {g.edge_count} edges, total weight "
             f"{_fmt(total)} on {topo.describe()}",
             f"partitioner: {engine}; fill {args.fill}, imbalance "
             f"{_fmt(float(args.imbalance))}%",
             "ranks per server: " + " ".join(map(str, per_server))
             + "; per instance: "
             + " ".join("/".join(map(str, row)) for row in load)]
    width = max(len(k) for k in rows)
    lines.append(f"{'placement':<{width}}  {'across servers':>18}  "
                 f"{'across instances':>18}  {'inside instances':>18}")
    for name, cut in rows.items():
        cells = []
        for level in LEVELS:
            pct = f"({100 * cut[level] / total:.1f}%)" if total else ""
            cells.append(f"{_fmt(cut[level]) + ' ' + pct:>18}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return lines


def _write(path: str, text: str) -> None:
    """Replace `path` whole: a job starting meanwhile reads the old
    rankfile or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CliError(f"cannot write {path}: {e.strerror or e}")


def _cmd_place(args) -> int:
    try:
        g = _read_graph(args)
        topo = _topology(args)
        part = _partitioner(args.partitioner, args.seed)
        placement = place(g, topo, part, args.fill, args.imbalance,
                          args.cpus_per_rank)
    except (graphs.GraphError, PlacementError) as e:
        raise CliError(str(e))
    rows = {part.name: cut_by_level(g, placement)}
    if args.compare:
        rows["round-robin"] = cut_by_level(
            g, round_robin(g.n, topo, args.cpus_per_rank))
        rows["block"] = cut_by_level(
            g, block(g.n, topo, args.cpus_per_rank))
    summary = _summary(g, topo, part, rows, args, placement)
    lines = rankfile_lines(topo, placement)
    rankfile = "".join(f"# {s}\n" for s in summary) + "\n".join(lines) + "\n"
    if args.out:
        _write(args.out, rankfile)

    if args.json:
        doc = {
            "ranks": g.n, "edges": g.edge_count,
            "total_weight": g.total_weight,
            "topology": {"servers": topo.servers,
                         "instances_per_server": topo.instances,
                         "vcpus": topo.vcpus, "slots": topo.slots},
            "cpus_per_rank": args.cpus_per_rank, "fill": args.fill,
            "imbalance_pct": float(args.imbalance),
            "partitioner": part.name,
            "library": part.metis.path if part.metis else None,
            "seed": args.seed,
            "metis_methods": part.methods_used,
            "placement": [{"rank": r, "host": placement.host(topo, r),
                           "server": placement.server[r],
                           "instance": placement.instance[r],
                           "slots": placement.slots_of(r)}
                          for r in range(g.n)],
            "load": placement.load(topo),
            "cut": rows[part.name],
            "rankfile": args.out,
        }
        if args.compare:
            doc["compare"] = {k: v for k, v in rows.items()
                              if k != part.name}
        print(json.dumps(doc, indent=2))
    elif args.out:
        print("\n".join(summary))
        print(f"rankfile: {args.out}")
    else:
        sys.stdout.write(rankfile)
    return 0
