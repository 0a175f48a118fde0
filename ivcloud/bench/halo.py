"""Rank placement on the emulated cloud: halo exchange, planned vs round-robin.

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

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Sequence

from ..cli import CliError, positive_int
from ..place import graph as graphs
from ..place.metis import Metis
from ..errors import PlacementError
from ..place.planner import (Partitioner, Placement,
                             PlacementTopology as PlaceTopology, cut_by_level, place,
                             rankfile_lines, round_robin)
from .hierarchy import (ClusterSession, Results, attempt, check_root,
                        common_arguments, finish, floating_rankfile,
                        program)
from .common import machine_info
from .mpi import BenchError
from .p2p import Target, print_targets

SERVERS, INSTANCES, VCPUS = 2, 2, 2
RANKS = 8
PLACEMENTS = ["round-robin", "planned"]
DEFAULT_UPLINK = "200mbit"
FACE_BYTES = 64 * 1024


@dataclass
class Settings:
    iters: int
    warmup: int
    reps: int
    face: int
    uplink_rate: str
    transport: str
    timeout_s: int
    quick: bool

    @classmethod
    def from_args(cls, args) -> "Settings":
        quick = args.quick
        return cls(iters=args.iters or (30 if quick else 150),
                   warmup=5 if quick else 10,
                   reps=args.reps or (1 if quick else 3),
                   face=args.face, uplink_rate=args.uplink_rate,
                   transport=args.transport,
                   timeout_s=90 if quick else 240, quick=quick)


@dataclass
class Plan:
    """The two placements of the halo job on the cluster's shape."""
    dims: List[int]
    graph: graphs.Graph
    topo: PlaceTopology
    placements: Dict[str, Placement]
    partitioner: str

    def hosts(self, name: str) -> List[str]:
        p = self.placements[name]
        return [p.host(self.topo, r) for r in range(self.graph.n)]

    def cut(self, name: str) -> Dict[str, float]:
        return cut_by_level(self.graph, self.placements[name])


def make_plan(log=sys.stderr) -> Plan:
    """What `ivcloud place --pattern halo2d:PXxPY --servers 2
    --instances-per-server 2 --vcpus 2` computes, through its API."""
    dims = graphs.dims_create(RANKS, 2)
    graph = graphs.pattern(f"halo2d:{dims[0]}x{dims[1]}", None)
    topo = PlaceTopology(SERVERS, INSTANCES, VCPUS)
    metis = Metis.load()
    if metis is None:
        log.write("bench halo: METIS (libmetis5) not found, planning with "
                  "spectral bisection\n")
    part = Partitioner(metis, seed=1)
    planned = place(graph, topo, part)
    return Plan(dims, graph, topo,
                {"planned": planned, "round-robin": round_robin(RANKS, topo)},
                part.name)


def _parse(stdout: str, origin: str) -> Dict:
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                raise BenchError(f"{origin}: unparsable line: {line[:120]}")
            for key in ("wall_s", "per_iter_us", "dims", "hosts",
                        "bad_faces"):
                if key not in rec:
                    raise BenchError(f"{origin}: record without '{key}'")
            return rec
    raise BenchError(f"{origin}: produced no record")


def run_once(cluster: ClusterSession, plan: Plan, name: str, rep: int,
             s: Settings) -> Dict:
    origin = f"halo {name} #{rep + 1}"
    argv = [program("mpi-halo"), "--face", str(s.face), "--iters",
            str(s.iters), "--warmup", str(s.warmup), "--transport",
            s.transport, "--placement", name]
    if name == "planned":
        kw = dict(rankfile=floating_rankfile(plan.hosts(name), VCPUS))
    else:
        kw = dict(placement=name)
    stdout, _ = cluster.mpirun(
        argv, RANKS, s.transport, s.timeout_s, origin,
        # 8 ranks on 2 cores: waiting ranks give the CPU away instead of
        # polling through their time slice (the same for both placements)
        extra_mca=[("mpi_yield_when_idle", "1")], **kw)
    rec = _parse(stdout, origin)
    if rec["dims"] != plan.dims:
        raise BenchError(f"{origin}: the job's grid is {rec['dims']}, the "
                         f"plan's {plan.dims}")
    want = plan.hosts(name)
    if rec["hosts"] != want:
        raise BenchError(f"{origin}: ranks ran on {rec['hosts']}, the "
                         f"placement says {want}")
    rec.update(placement=name, rep=rep, cut=plan.cut(name),
               uplink_rate=s.uplink_rate)
    return rec


def measure(cluster: ClusterSession, plan: Plan, s: Settings,
            log=sys.stderr) -> Results:
    res = Results()
    # alternating, so that a slow phase of the machine hits both
    for rep in range(s.reps):
        for name in PLACEMENTS:
            rec = attempt(res, "halo", f"{name} #{rep + 1}",
                          lambda: run_once(cluster, plan, name, rep, s), log)
            if rec is not None:
                res.records.append(rec)
                log.write(f"bench halo: {name} #{rep + 1}: wall "
                          f"{rec['wall_s']:.3f} s\n")
    return res


def summary(records: Sequence[Dict]) -> Dict[str, Dict]:
    """Per placement: median and every wall time, cut by level."""
    out = {}
    for name in PLACEMENTS:
        mine = [r for r in records if r["placement"] == name]
        if not mine:
            continue
        walls = [r["wall_s"] for r in mine]
        out[name] = {"wall_s": statistics.median(walls), "runs": walls,
                     "per_iter_us": statistics.median(
                         r["per_iter_us"] for r in mine),
                     "cut": mine[0]["cut"], "hosts": mine[0]["hosts"]}
    return out


def targets(summ: Dict[str, Dict]) -> List[Target]:
    name = "halo wall time round-robin / planned"
    rr, planned = summ.get("round-robin"), summ.get("planned")
    if not rr or not planned:
        return [Target(name, None, ">=", 1.3, "placement missing")]
    return [Target(name, rr["wall_s"] / planned["wall_s"], ">=", 1.3)]


def table(summ: Dict[str, Dict]):
    """(header, rows), shared with the markdown report."""
    header = ["placement", "wall s (median)", "runs", "per iteration us",
              "edges across servers", "across instances",
              "inside instances"]
    rows = []
    for name, s in summ.items():
        c = s["cut"]
        rows.append([name, f"{s['wall_s']:.3f}",
                     " ".join(f"{w:.3f}" for w in s["runs"]),
                     f"{s['per_iter_us']:.0f}",
                     f"{c['across_servers']:g}",
                     f"{c['across_instances']:g}",
                     f"{c['inside_instances']:g}"])
    return header, rows


def print_table(summ: Dict[str, Dict], out=sys.stdout) -> None:
    header, rows = table(summ)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    out.write(line + "\n" + "-" * len(line) + "\n")
    for row in rows:
        out.write("  ".join(c.rjust(w) for c, w in zip(row, widths)) + "\n")
    for name, s in summ.items():
        out.write(f"{name}: ranks on {' '.join(s['hosts'])}\n")


def _face(text: str) -> int:
    v = positive_int(text)
    if v % 8 or not 16 <= v <= 64 << 20:
        raise argparse.ArgumentTypeError("face size: a multiple of 8, "
                                         "16 B .. 64 MiB")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_arguments(p, "halo",
                     "one short run per placement (plumbing check)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed halo iterations per run")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="runs per placement (the median counts)")
    p.add_argument("--face", type=_face, default=FACE_BYTES,
                   help=f"bytes per face and neighbour (default "
                        f"{FACE_BYTES})")
    p.add_argument("--uplink-rate", default=DEFAULT_UPLINK, metavar="RATE",
                   help=f"servers' uplink limit (default {DEFAULT_UPLINK})")
    p.add_argument("--transport", choices=["ivshmem", "tcp"],
                   default="ivshmem", help="between instances of a server "
                                           "(default ivshmem)")


def run(args) -> int:
    check_root("halo")
    s = Settings.from_args(args)
    program("mpi-halo")  # refuse before building anything
    try:
        plan = make_plan()
    except (graphs.GraphError, PlacementError) as e:
        raise CliError(str(e))
    info = machine_info()
    with ClusterSession("halo", SERVERS, INSTANCES, VCPUS, s.uplink_rate,
                        keep=args.keep_cluster) as cluster:
        res = measure(cluster, plan, s)
    summ = summary(res.records)
    ts = targets(summ)
    print_table(summ)
    print_targets(ts)
    for note in res.notes:
        print(f"note: {note}")
    doc = {"benchmark": "halo", "quick": s.quick, **info,
           "cluster": cluster.describe(), "ranks": RANKS, "dims": plan.dims,
           "pattern": f"halo2d:{plan.dims[0]}x{plan.dims[1]}",
           "partitioner": plan.partitioner, "transport": s.transport,
           "face_bytes": s.face, "iters": s.iters, "reps": s.reps,
           "rankfile": rankfile_lines(plan.topo, plan.placements["planned"]),
           "rankfile_used": floating_rankfile(plan.hosts("planned"), VCPUS),
           "records": res.records, "summary": summ,
           "targets": [t.to_json() for t in ts], "notes": res.notes}
    return finish("halo", doc, args, failed=bool(res.failed))
