"""Rank placement on the emulated cloud: halo exchange, planned vs round-robin.

mpi-halo (native/bench/halo.c: 8 ranks on a 4x2 grid) on a cluster of 2
servers x 2 instances x 2 vCPUs with rate-limited uplinks, under two
placements, alternating:

  planned      the rankfile `ivcloud place --pattern halo2d:4x2` makes
  round-robin  Open MPI's --map-by node over the instances

each run checked to have run where its placement put it
(BENCHMARKS.md, "Rank placement"). With --scheduler slurm: Slurm's tree
allocation against a round-robin one, into halo-slurm.json
(BENCHMARKS.md, "Halo under Slurm").
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..cluster.job import Job
from ..cluster.session import ClusterSession
from ..mpis.openmpi import rankfile_text
from ..cluster.slurm.daemons import SlurmOptions
from ..cluster.slurm.client import wait_idle
from ..errors import BenchError, InvalidRequest
from ..place import graph as graphs
from ..place.metis import Metis
from ..errors import PlacementError
from ..place.planner import (Partitioner, Placement,
                             PlacementTopology as PlaceTopology, cut_by_level, place,
                             rankfile_lines, round_robin)
from . import report
from .toolkit import (BenchResults, Target, checked_run, cluster_job, count,
                      measure_rounds, parse_records, print_grid, program,
                      ratio_target, require_root, run_benchmark)

SERVERS, INSTANCES, VCPUS = 2, 2, 2
RANKS = 8
PLACEMENTS = ["round-robin", "planned"]
DEFAULT_UPLINK = "200mbit"
FACE_BYTES = 64 * 1024
TRANSPORTS = ["ivshmem", "tcp"]
KEYS = ("wall_s", "per_iter_us", "dims", "hosts", "bad_faces")
SCHEDULERS = ("none", "slurm")
# --scheduler slurm: a job on two of the four instances, two ranks each
SLURM_RANKS, SLURM_NODES = 4, 2
# the topology-blind choice: one instance on each server
SLURM_SPREAD = ("s0i0", "s1i0")
ALLOCATIONS = ["round-robin", "tree"]


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


def halo_argv(s: HaloSettings, placement: str) -> List[str]:
    """mpi-halo's command line (`placement`: what its records say)."""
    return [str(program("mpi-halo")), "--face", str(s.face), "--iters",
            str(s.iters), "--warmup", str(s.warmup), "--transport",
            s.transport, "--placement", placement]


def run_once(cluster: ClusterSession, plan: Plan, name: str,
             s: HaloSettings) -> List[Dict]:
    origin = f"halo {name}"
    argv = halo_argv(s, name)
    if name == "planned":
        kw = dict(hosts=plan.hosts(name))
    else:
        kw = dict(placement=name)
    stdout, _ = cluster_job(cluster, Job(
        argv, RANKS, transport=s.transport,
        # 8 ranks on 2 cores: waiting ranks give the CPU away instead of
        # polling through their time slice (the same for both placements)
        options=[("mpi_yield_when_idle", "1")], **kw), s.timeout_s, origin)
    rec = parse_records(stdout, origin, KEYS)[0]
    if rec["dims"] != plan.dims:
        raise BenchError(f"{origin}: the job's grid is {rec['dims']}, the "
                         f"plan's {plan.dims}")
    want = plan.hosts(name)
    if rec["hosts"] != want:
        raise BenchError(f"{origin}: ranks ran on {rec['hosts']}, the "
                         f"placement says {want}")
    rec.update(placement=name, cut=plan.cut(name), uplink_rate=s.uplink_rate)
    return [rec]


def medians(records: Sequence[Dict], key: str,
            names: Sequence[str]) -> Dict[str, Dict]:
    """Per name (of record field `key`): median, min, max and every wall
    time, median time per iteration, the first run's hosts (and its cut
    by level, for a placement)."""
    out = {}
    for name in names:
        mine = [r for r in records if r[key] == name]
        if not mine:
            continue
        walls = [r["wall_s"] for r in mine]
        out[name] = {"wall_s": statistics.median(walls), "runs": walls,
                     "min_s": min(walls), "max_s": max(walls),
                     "per_iter_us": statistics.median(
                         r["per_iter_us"] for r in mine),
                     "hosts": mine[0]["hosts"]}
        if "cut" in mine[0]:
            out[name]["cut"] = mine[0]["cut"]
    return out


def print_table(summ: Dict[str, Dict], out) -> None:
    print_grid(*report.halo_table(summ), out)
    for name, s in summ.items():
        out.write(f"{name}: ranks on {' '.join(s['hosts'])}\n")


def compare(s: HaloSettings, bench: str, cluster: ClusterSession,
            key: str, names: Sequence[str], versus: str,
            steps: Callable[[ClusterSession], List[Tuple[str, Callable]]],
            print_summary: Callable, out_dir: Path,
            json_path: Optional[Path], out=None, log=None,
            redo_report: bool = True, **fields) -> int:
    """run_benchmark of the halo job under each of `names` (its records'
    `key`), `steps` alternating in s.reps rounds on `cluster`, then
    report.publish into OUT_DIR/BENCH.json: the records every run
    (docs/demo.md), `summary` their medians, the target round-robin
    over names[1] (`versus` in its name); 1 if a run or the report
    failed."""
    def measure() -> BenchResults:
        res = BenchResults()
        with cluster:
            measure_rounds(res, bench, s.reps, steps(cluster), log)
        res.records, res.runs = res.runs, []
        res.fields.update(cluster=cluster.describe(),
                          summary=medians(res.records, key, names))
        return res

    def targets(res: BenchResults) -> List[Target]:
        summ = res.fields["summary"]
        return [ratio_target(f"halo wall time round-robin / {versus}",
                             summ.get("round-robin"), summ.get(names[1]),
                             "wall_s", ">=", 1.3, f"{key} missing")]
    return run_benchmark(
        bench, s.quick, measure, targets,
        lambda res, out: print_summary(res.fields["summary"], out), out=out,
        publish=functools.partial(report.publish, bench, out=out_dir,
                                  json_path=json_path, stdout=out,
                                  redo_report=redo_report),
        transport=s.transport, face_bytes=s.face, iters=s.iters,
        reps=s.reps, **fields)


def run(s: HaloSettings, out_dir: Path, json_path: Optional[Path] = None,
        keep_cluster: bool = False, out=None, log=None) -> int:
    """Both placements on a cluster of its own (compare)."""
    require_root("halo")
    program("mpi-halo")  # refuse before building anything
    try:
        plan = make_plan(log)
    except (graphs.GraphError, PlacementError) as e:
        raise BenchError(f"cannot place the halo ranks: {e}") from e
    return compare(
        s, "halo", ClusterSession("halo", SERVERS, INSTANCES, VCPUS,
                                  s.uplink_rate, keep=keep_cluster, log=log),
        "placement", PLACEMENTS, "planned",
        lambda cluster: [(name, functools.partial(
            run_once, cluster, plan, name, s)) for name in PLACEMENTS],
        print_table, out_dir, json_path, out, log, ranks=RANKS,
        dims=plan.dims, pattern=f"halo2d:{plan.dims[0]}x{plan.dims[1]}",
        partitioner=plan.partitioner,
        rankfile=rankfile_lines(plan.topo, plan.placements["planned"]),
        rankfile_used=rankfile_text(
            plan.hosts("planned"),
            {h: VCPUS for h in plan.hosts("planned")}).splitlines())


# ---------------------------------------------------------------- slurm

def slurm_args(name: str, s: HaloSettings) -> List[str]:
    """srun's arguments and mpi-halo's for allocation `name`."""
    args = [f"--nodes={SLURM_NODES}",
            f"--ntasks-per-node={SLURM_RANKS // SLURM_NODES}",
            # 4 ranks on 2 cores: waiting ranks give the CPU away, as in
            # the mpirun runs above
            "--export=ALL,OMPI_MCA_mpi_yield_when_idle=1"]
    if name == "round-robin":
        args.append(f"--nodelist={','.join(SLURM_SPREAD)}")
    prog = halo_argv(s, f"slurm-{name}")
    if s.transport == "tcp":   # the task prolog's BTL list, without ours
        prog = ["env", "OMPI_MCA_btl=self,vader,tcp"] + prog
    return args + prog


def run_once_slurm(cluster: ClusterSession, name: str,
                   s: HaloSettings) -> List[Dict]:
    origin = f"halo {name}"
    # the last job's nodes may still be completing: on an idle cluster
    # the tree allocation has every server to choose from
    wait_idle(cluster.state, s.timeout_s)
    stdout, _ = checked_run(functools.partial(cluster.srun,
                                              slurm_args(name, s)),
                            s.timeout_s, origin)
    rec = parse_records(stdout, origin, KEYS)[0]
    insts = cluster.state["instances"]
    servers = sorted({insts[h]["server"] for h in rec["hosts"]
                      if h in insts})
    want = (sorted({insts[h]["server"] for h in SLURM_SPREAD})
            if name == "round-robin" else servers[:1])
    if len(rec["hosts"]) != SLURM_RANKS or servers != want:
        raise BenchError(f"{origin}: ranks ran on {rec['hosts']}, not on "
                         f"servers {want}")
    rec.update(allocation=name, servers=servers, uplink_rate=s.uplink_rate)
    return [rec]


def print_table_slurm(summ: Dict[str, Dict], out) -> None:
    rows = [[name, f"{v['wall_s']:.3f}", f"{v['min_s']:.3f}..{v['max_s']:.3f}",
             f"{v['per_iter_us']:.0f}", " ".join(v["hosts"])]
            for name, v in summ.items()]
    print_grid(["allocation", "wall s (median)", "min..max", "per iteration us",
                "ranks on"], rows, out)


def run_slurm(s: HaloSettings, out_dir: Path,
              json_path: Optional[Path] = None, keep_cluster: bool = False,
              out=None, log=None) -> int:
    """The halo job under Slurm's tree allocation against a round-robin
    one (compare), written to OUT_DIR/halo-slurm.json."""
    require_root("halo")
    program("mpi-halo")
    dims = graphs.dims_create(SLURM_RANKS, 2)
    return compare(
        s, "halo-slurm", ClusterSession(
            "halos", SERVERS, INSTANCES, VCPUS, s.uplink_rate,
            keep=keep_cluster, log=log, slurm=SlurmOptions()),
        "allocation", ALLOCATIONS, "tree allocation",
        lambda cluster: [(f"slurm {name}", functools.partial(
            run_once_slurm, cluster, name, s)) for name in ALLOCATIONS],
        print_table_slurm, out_dir, json_path, out, log, redo_report=False,
        ranks=SLURM_RANKS, nodes=SLURM_NODES, dims=dims,
        pattern=f"halo2d:{dims[0]}x{dims[1]}")
