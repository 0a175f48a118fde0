"""A rankfile from a request: what `ivcloud place` does, as a library.

:func:`read_graph` takes the communication graph from a pattern or a
file (or stdin), :func:`cluster_shape` the shape of a cluster made by
`ivcloud cluster up`, :func:`choose_partitioner` METIS or its fallback;
:func:`plan` places the ranks and measures the cut of each placement
compared; a :class:`RankfilePlan` gives the summary, the rankfile text
and the JSON document; :func:`write_rankfile` replaces a rankfile whole.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, TextIO

from ..errors import PlacementError
from . import graph as graphs
from .metis import Metis
from .planner import (Partitioner, Placement, PlacementTopology, block,
                      cut_by_level, place, rankfile_lines, round_robin)

PARTITIONERS = ("auto", "metis", "spectral")
LEVELS = ("across_servers", "across_instances", "inside_instances")
# patterns whose size is not in their name
SIZED_BY_RANKS = ("ring", "alltoall")


def read_graph(pattern: Optional[str] = None, path: Optional[str] = None,
               ranks: Optional[int] = None,
               stdin: Optional[TextIO] = None) -> graphs.Graph:
    """The graph of a pattern ('ring', 'halo2d:4x2', ...) or of a file
    ('-': `stdin`); `ranks`, if given, must match it."""
    if pattern is not None:
        name = pattern.partition(":")[0]
        if ranks is None and name in SIZED_BY_RANKS:
            raise PlacementError(f"pattern '{name}' needs a number of ranks",
                                 setting="ranks")
        return graphs.pattern(pattern, ranks)
    if path is None:
        raise PlacementError("no graph: give a pattern or a graph file")
    where = path
    try:
        if path == "-":
            where = "stdin"
            text = (stdin or sys.stdin).read()
        else:
            text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlacementError(f"cannot read graph {path}: "
                             f"{getattr(e, 'strerror', None) or e}")
    g = graphs.parse(text, where)
    if ranks is not None and ranks != g.n:
        raise PlacementError(f"{ranks} ranks asked for, but {where} has "
                             f"{g.n}", setting="ranks")
    return g


def cluster_shape(name: str, run_dir: Optional[str] = None
                  ) -> PlacementTopology:
    """The shape of a cluster made by `ivcloud cluster up`, from its
    state file (RUN_DIR/cluster-NAME/state.json); the cluster names its
    instances s<k>i<i>, as a PlacementTopology does."""
    from ..cluster import state as cluster_state
    sd = cluster_state.state_dir(name, run_dir)
    doc = cluster_state.load(sd)
    if doc is None:
        raise PlacementError(f"no cluster '{name}' ({sd.state} does not "
                             f"exist)", setting="cluster")
    topo = doc.get("topology", doc)
    try:
        shape = [int(topo[k]) for k in ("servers", "instances_per_server",
                                        "vcpus")]
    except (KeyError, TypeError, ValueError):
        raise PlacementError(f"{sd.state} does not record the cluster's "
                             f"servers, instances_per_server and vcpus")
    try:
        return PlacementTopology(*shape)
    except PlacementError as e:
        raise PlacementError(f"{sd.state}: {e}") from None


def choose_partitioner(choice: str, seed: int) -> Partitioner:
    """METIS ('metis', or 'auto' where the library is installed) or
    spectral bisection ('spectral', or 'auto' without METIS: the
    partitioner's `metis` is then None)."""
    if choice not in PARTITIONERS:
        raise PlacementError(f"unknown partitioner '{choice}' (choose from "
                             f"{', '.join(PARTITIONERS)})",
                             setting="partitioner")
    if choice == "spectral":
        return Partitioner(None, seed)
    metis = Metis.load()
    if metis is None and choice == "metis":
        raise PlacementError("METIS library not found (apt-get install "
                             "libmetis5)", setting="partitioner")
    return Partitioner(metis, seed)


def _fmt(w: float) -> str:
    return str(int(w)) if float(w).is_integer() else f"{w:.6g}"


@dataclass
class RankfilePlan:
    """A placement of a graph on a shape, with the cuts of the
    placements compared (the partitioner's first)."""
    graph: graphs.Graph
    topo: PlacementTopology
    partitioner: Partitioner
    placement: Placement
    cuts: Dict[str, Dict[str, float]]
    fill: str
    imbalance: Fraction
    cpus_per_rank: int

    def summary(self) -> List[str]:
        """What the rankfile's comments say: the graph, the engine, the
        load per server and instance, each placement's cut by level."""
        g, topo, part = self.graph, self.topo, self.partitioner
        total = g.total_weight
        engine = (f"METIS ({part.metis.path}), seed {part.seed}"
                  if part.metis else "spectral bisection (no METIS)")
        load = self.placement.load(topo)
        lines = [f"{g.n} ranks, {g.edge_count} edges, total weight "
                 f"{_fmt(total)} on {topo.describe()}",
                 f"partitioner: {engine}; fill {self.fill}, imbalance "
                 f"{_fmt(float(self.imbalance))}%",
                 "ranks per server: "
                 + " ".join(str(sum(row)) for row in load)
                 + "; per instance: "
                 + " ".join("/".join(map(str, row)) for row in load)]
        width = max(len(k) for k in self.cuts)
        lines.append(f"{'placement':<{width}}  {'across servers':>18}  "
                     f"{'across instances':>18}  {'inside instances':>18}")
        for name, cut in self.cuts.items():
            cells = []
            for level in LEVELS:
                pct = f"({100 * cut[level] / total:.1f}%)" if total else ""
                cells.append(f"{_fmt(cut[level]) + ' ' + pct:>18}")
            lines.append(f"{name:<{width}}  " + "  ".join(cells))
        return lines

    def rankfile(self) -> str:
        """The rankfile, the summary as # comments above its lines."""
        return ("".join(f"# {s}\n" for s in self.summary())
                + "\n".join(rankfile_lines(self.topo, self.placement))
                + "\n")

    def to_json(self, rankfile_path: Optional[str] = None) -> Dict:
        topo, part, p = self.topo, self.partitioner, self.placement
        doc = {
            "ranks": self.graph.n, "edges": self.graph.edge_count,
            "total_weight": self.graph.total_weight,
            "topology": {"servers": topo.servers,
                         "instances_per_server": topo.instances,
                         "vcpus": topo.vcpus, "slots": topo.slots},
            "cpus_per_rank": self.cpus_per_rank, "fill": self.fill,
            "imbalance_pct": float(self.imbalance),
            "partitioner": part.name,
            "library": part.metis.path if part.metis else None,
            "seed": part.seed,
            "metis_methods": part.methods_used,
            "placement": [{"rank": r, "host": p.host(topo, r),
                           "server": p.server[r],
                           "instance": p.instance[r],
                           "slots": p.slots_of(r)}
                          for r in range(self.graph.n)],
            "load": p.load(topo),
            "cut": self.cuts[part.name],
            "rankfile": rankfile_path,
        }
        others = {k: v for k, v in self.cuts.items() if k != part.name}
        if others:
            doc["compare"] = others
        return doc


def plan(graph: graphs.Graph, topo: PlacementTopology,
         partitioner: Partitioner, fill: str = "spread",
         imbalance: Fraction = Fraction(0), cpus_per_rank: int = 1,
         compare: bool = False) -> RankfilePlan:
    """Place `graph` on `topo`; with `compare`, also measure the cuts of
    round-robin and block placements."""
    placement = place(graph, topo, partitioner, fill, imbalance,
                      cpus_per_rank)
    cuts = {partitioner.name: cut_by_level(graph, placement)}
    if compare:
        cuts["round-robin"] = cut_by_level(
            graph, round_robin(graph.n, topo, cpus_per_rank))
        cuts["block"] = cut_by_level(
            graph, block(graph.n, topo, cpus_per_rank))
    return RankfilePlan(graph, topo, partitioner, placement, cuts, fill,
                        imbalance, cpus_per_rank)


def write_rankfile(path: str, text: str) -> None:
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
        raise PlacementError(f"cannot write {path}: {e.strerror or e}",
                             setting="out")
