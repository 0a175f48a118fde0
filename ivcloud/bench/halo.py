"""Rank placement on the emulated cloud: halo exchange, planned vs round-robin.

:func:`run` brings up a cluster (ivcloud.cluster.session) of 2 servers x
2 instances x 2 vCPUs with rate-limited uplinks, and runs mpi-halo
(native/bench/halo.c: RANKS ranks on a 2-D grid exchanging faces with
their neighbours) under the two PLACEMENTS: "planned", what
ivcloud.place computes for the halo2d pattern on this shape, and
"round-robin", Open MPI's by-node mapping. The placements alternate,
the settings' `reps` times each, and the figure is the median wall time;
every run checks that each rank ran where its placement put it. The
target is the ratio round-robin / planned from this run. The cluster is
taken down at the end, also after an error or a signal, unless it is to
be kept.
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..cluster.session import ClusterSession, floating_rankfile
from ..errors import BenchError, InvalidRequest
from ..place import graph as graphs
from ..place.metis import Metis
from ..errors import PlacementError
from ..place.planner import (Partitioner, Placement,
                             PlacementTopology as PlaceTopology, cut_by_level, place,
                             rankfile_lines, round_robin)
from . import report
from .toolkit import (BenchResults, Target, attempt, conclude, count,
                      machine_info, parse_records, print_grid, program,
                      ratio_target, require_root, run_job)

SERVERS, INSTANCES, VCPUS = 2, 2, 2
RANKS = 8
PLACEMENTS = ["round-robin", "planned"]
DEFAULT_UPLINK = "200mbit"
FACE_BYTES = 64 * 1024
TRANSPORTS = ["ivshmem", "tcp"]
KEYS = ("wall_s", "per_iter_us", "dims", "hosts", "bad_faces")


def check_face(face: int) -> int:
    if face % 8 or not 16 <= face <= 64 << 20:
        raise InvalidRequest("face size: a multiple of 8, 16 B .. 64 MiB")
    return face


@dataclass
class HaloSettings:
    iters: int          # timed halo iterations per run
    warmup: int
    reps: int           # runs per placement (the median counts)
    face: int           # bytes per face and neighbour
    uplink_rate: str
    transport: str      # between instances of a server
    timeout_s: int
    quick: bool

    @classmethod
    def make(cls, quick: bool = False, iters: Optional[int] = None,
             reps: Optional[int] = None, face: int = FACE_BYTES,
             uplink_rate: str = DEFAULT_UPLINK,
             transport: str = "ivshmem") -> "HaloSettings":
        """The full comparison, or one short run per placement; the
        others override the defaults of either."""
        if transport not in TRANSPORTS:
            raise InvalidRequest(f"unknown transport '{transport}' (choose "
                                 f"from {', '.join(TRANSPORTS)})")
        return cls(iters=(count("timed iterations", iters)
                          or (30 if quick else 150)),
                   warmup=5 if quick else 10,
                   reps=count("runs", reps) or (1 if quick else 3),
                   face=check_face(face), uplink_rate=uplink_rate,
                   transport=transport,
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


def make_plan(log=None) -> Plan:
    """What `ivcloud place` computes for the halo2d pattern on the
    cluster's shape, through its API."""
    log = log or sys.stderr
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


def run_once(cluster: ClusterSession, plan: Plan, name: str, rep: int,
             s: HaloSettings) -> Dict:
    origin = f"halo {name} #{rep + 1}"
    argv = [str(program("mpi-halo")), "--face", str(s.face), "--iters",
            str(s.iters), "--warmup", str(s.warmup), "--transport",
            s.transport, "--placement", name]
    if name == "planned":
        kw = dict(rankfile=floating_rankfile(plan.hosts(name), VCPUS))
    else:
        kw = dict(placement=name)
    stdout, _ = run_job(functools.partial(
        cluster.mpirun, argv, RANKS, s.transport,
        # 8 ranks on 2 cores: waiting ranks give the CPU away instead of
        # polling through their time slice (the same for both placements)
        extra_mca=[("mpi_yield_when_idle", "1")], **kw), s.timeout_s, origin)
    rec = parse_records(stdout, origin, KEYS)[0]
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


def measure(cluster: ClusterSession, plan: Plan, s: HaloSettings,
            log=None) -> BenchResults:
    log = log or sys.stderr
    res = BenchResults()
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
    return [ratio_target("halo wall time round-robin / planned",
                         summ.get("round-robin"), summ.get("planned"),
                         "wall_s", ">=", 1.3, "placement missing")]


def print_table(summ: Dict[str, Dict], out=None) -> None:
    out = out or sys.stdout
    print_grid(*report.halo_table(summ), out)
    for name, s in summ.items():
        out.write(f"{name}: ranks on {' '.join(s['hosts'])}\n")


def run(s: HaloSettings, out_dir: Path, json_path: Optional[Path] = None,
        keep_cluster: bool = False, out=None, log=None) -> int:
    """Plan, bring a cluster up, run both placements, take it down
    (unless `keep_cluster`); print the table, targets and notes to `out`,
    progress to `log`; write the document to OUT_DIR/halo.json (and
    `json_path`) and the report into `out_dir`. 1 if a run or the report
    failed."""
    require_root("halo")
    program("mpi-halo")  # refuse before building anything
    try:
        plan = make_plan(log)
    except (graphs.GraphError, PlacementError) as e:
        raise BenchError(f"cannot place the halo ranks: {e}") from e
    info = machine_info()
    with ClusterSession("halo", SERVERS, INSTANCES, VCPUS, s.uplink_rate,
                        keep=keep_cluster, log=log) as cluster:
        res = measure(cluster, plan, s, log)
    summ = summary(res.records)
    ts = targets(summ)
    print_table(summ, out)
    doc = conclude(
        "halo", s.quick, info, res, ts, out,
        cluster=cluster.describe(), ranks=RANKS, dims=plan.dims,
        pattern=f"halo2d:{plan.dims[0]}x{plan.dims[1]}",
        partitioner=plan.partitioner, transport=s.transport,
        face_bytes=s.face, iters=s.iters, reps=s.reps,
        rankfile=rankfile_lines(plan.topo, plan.placements["planned"]),
        rankfile_used=floating_rankfile(plan.hosts("planned"), VCPUS),
        summary=summ)
    return report.publish("halo", doc, out_dir, json_path,
                          failed=bool(res.failed), stdout=out)
