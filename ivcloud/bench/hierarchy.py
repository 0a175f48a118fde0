"""MPI latency and bandwidth at the three levels of the cloud hierarchy.

mpi-osu's 2-rank latency and bandwidth on an emulated cluster (2
servers x 2 instances x 2 vCPUs), the two ranks

  level 1  inside one instance (s0i0, s0i0): Open MPI's vader,
  level 2  on two instances of one server (s0i0, s0i1),
  level 3  on two servers (s0i0, s1i0), through both uplinks,

each level over tcp and over ivshmem, the BTL Open MPI reports checked
against the level (BENCHMARKS.md, "Communication hierarchy"). Writes
the records as JSON, and into --out the plots and report.md.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

from ..cluster.job import Job
from ..cluster.session import ClusterSession, VmOptions
from ..errors import BenchError
from . import report
from .toolkit import (MIB, BenchResults, Target, cluster_job, count, csv,
                      find_record, measure_rounds, parse_records, print_grid,
                      program, ratio_target, require_root, run_benchmark)

FULL_SIZES = [4, 8, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, MIB]
QUICK_SIZES = [8, 4096, MIB]
TRANSPORTS = ["tcp", "ivshmem"]
KEYS = ("transport", "test", "ranks", "size", "latency_us",
        "bandwidth_MBps")


@dataclass(frozen=True)
class Level:
    number: int
    name: str
    hosts: Tuple[str, str]     # where ranks 0 and 1 run
    what: str

    def expected_btl(self, transport: str) -> str:
        """The BTL Open MPI must pick for the pair: what the level is
        about, so a silent fallback cannot pass for a measurement."""
        if self.number == 1:
            return "vader"
        if self.number == 2 and transport == "ivshmem":
            return "ivshmem"
        return "tcp"


LEVELS = [
    Level(1, "intra-instance", ("s0i0", "s0i0"),
          "both ranks in one instance"),
    Level(2, "inter-instance", ("s0i0", "s0i1"),
          "two instances of one server"),
    Level(3, "inter-server", ("s0i0", "s1i0"),
          "instances on two servers"),
]


# ---------------------------------------------------------------- BTLs used

BML_RE = re.compile(r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send "
                    r"to \[\[\d+,\d+\],(\d+)\] on node (\S+)")


def btls_used(stderr: str) -> Dict[Tuple[str, int], Set[str]]:
    """{(sending host, receiving rank): {btl, ...}} from the
    btl_base_verbose lines of a job (self left out)."""
    out: Dict[Tuple[str, int], Set[str]] = {}
    for host, btl, rank, _node in BML_RE.findall(stderr):
        if btl != "self":
            out.setdefault((host, int(rank)), set()).add(btl)
    return out


# ---------------------------------------------------------------- settings

@dataclass
class HierarchySettings:
    sizes: List[int]
    iters: int          # round trips (latency) per small size
    budget: int         # bytes per size: caps the operations of big ones
    timeout_s: int      # per job
    uplink_rate: Optional[str]   # None: unshaped
    quick: bool
    rounds: int = 3     # of alternating (level, transport) jobs: medians

    @classmethod
    def make(cls, quick: bool = False, iters: Optional[int] = None,
             uplink_rate: Optional[str] = None,
             rounds: Optional[int] = None) -> "HierarchySettings":
        """The full sweep, or a quick plumbing check; `iters` overrides
        the round trips per small size."""
        return cls(sizes=list(QUICK_SIZES if quick else FULL_SIZES),
                   iters=(count("round trips", iters)
                          or (200 if quick else 2000)),
                   budget=(8 if quick else 64) * MIB,
                   timeout_s=90 if quick else 300,
                   uplink_rate=uplink_rate, quick=quick,
                   rounds=count("rounds", rounds) or (1 if quick else 3))


# ---------------------------------------------------------------- running

def run_level(cluster: ClusterSession, level: Level, transport: str,
              s: HierarchySettings) -> List[Dict]:
    origin = f"level {level.number} ({level.name}) {transport}"
    # The sweep starts with a throw-away round of its first size: early
    # in a job both ranks may still share one CPU (until the scheduler
    # spreads them) and connections open lazily, which the first size
    # would pay for, and would pay more for on a loaded machine.
    sizes = [s.sizes[0]] + s.sizes
    argv = [cluster.stage(program("mpi-osu")), "--test", "latency,bw", "--sizes",
            csv(sizes), "--iters", str(s.iters),
            "--budget", str(s.budget), "--transport", transport]
    stdout, stderr = cluster_job(cluster, Job(
        argv, 2, transport=transport, hosts=level.hosts,
        # Open MPI names the BTL it picked for each peer (bml lines)
        options=[("btl_base_verbose", "10")]), s.timeout_s, origin)
    recs, warmed = [], set()
    for rec in parse_records(stdout, origin, KEYS):
        if rec["test"] in warmed:
            recs.append(rec)
        else:
            warmed.add(rec["test"])  # a test's first record: the warm-up
    if len(recs) != 2 * len(s.sizes):
        raise BenchError(f"{origin}: {len(recs)} records, expected "
                         f"{2 * len(s.sizes)}")
    used = btls_used(stderr)
    forward = used.get((level.hosts[0], 1), set())
    backward = used.get((level.hosts[1], 0), set())
    want = level.expected_btl(transport)
    if forward != {want} or backward != {want}:
        raise BenchError(f"{origin}: Open MPI used {sorted(forward) or '?'} "
                         f"/ {sorted(backward) or '?'} between the ranks, "
                         f"expected {want}")
    for rec in recs:
        rec.update(level=level.number, level_name=level.name,
                   hosts=list(level.hosts), btl=want)
    return recs


def measure(cluster: ClusterSession, s: HierarchySettings,
            log=None, levels: Sequence[Level] = tuple(LEVELS)
            ) -> BenchResults:
    return measure_rounds(
        BenchResults(), "hierarchy", s.rounds,
        [(f"level {lv.number} {t}",
          functools.partial(run_level, cluster, lv, t, s))
         for lv in levels for t in TRANSPORTS], log,
        ("level", "transport", "test", "size"),
        ("latency_us", "bandwidth_MBps"))


# ---------------------------------------------------------------- targets

def targets(records: Sequence[Dict]) -> List[Target]:
    def find(level: int, transport: str, test: str, size: int):
        return find_record(records, level=level, transport=transport,
                           test=test, size=size)

    return [
        # "better latency" as a factor: the slower one over the faster
        ratio_target("level 2, 8 B latency tcp / ivshmem",
                     find(2, "tcp", "latency", 8),
                     find(2, "ivshmem", "latency", 8),
                     "latency_us", ">=", 50.0),
        # seed 000 (fig. 29-32): ivshmem about twice TCP's best at 1 MB
        ratio_target("level 2, 1 MiB bandwidth ivshmem / tcp",
                     find(2, "ivshmem", "bw", MIB),
                     find(2, "tcp", "bw", MIB), "bandwidth_MBps",
                     ">=", 2.0),
    ]


# ---------------------------------------------------------------- output

def print_table(records: Sequence[Dict], out,
                levels: Sequence[Level] = tuple(LEVELS),
                title: Optional[str] = None) -> None:
    if not records:
        out.write("no records\n")
        return
    if title:
        out.write(f"{title}\n")
    for lv in levels:
        out.write(f"L{lv.number} = {lv.name}: {lv.what} "
                  f"({' + '.join(lv.hosts)})\n")
    for test, title in (("latency", "one-way latency (us)"),
                        ("bw", "bandwidth (MB/s)")):
        out.write(f"\n{title}\n")
        print_grid(*report.hierarchy_table(records, test, TRANSPORTS), out)


# ---------------------------------------------------------------- driver

# a VM cluster: the two levels one server has, 2 vCPUs per guest so that
# level 1's two ranks have one each
VM_SHAPE = (1, 2, 2)
# per job on guests: TCP over virtio-net under TCG takes ms per message
VM_TIMEOUT_S = 900


def run(s: HierarchySettings, out_dir: Path,
        json_path: Optional[Path] = None, keep_cluster: bool = False,
        out=None, log=None, vm: Optional[VmOptions] = None) -> int:
    """Every level on a cluster of its own (run_benchmark), then
    report.publish; 1 if a job or the report failed. `vm`: QEMU guests
    (levels 1 and 2)."""
    require_root("hierarchy")
    program("mpi-osu")  # refuse before building anything
    levels = LEVELS if vm is None else LEVELS[:2]
    if vm is not None:
        s = dataclasses.replace(s, timeout_s=max(s.timeout_s, VM_TIMEOUT_S))
    cluster = ClusterSession("hier", *((2, 2, 2) if vm is None else VM_SHAPE),
                             s.uplink_rate, keep=keep_cluster, log=log, vm=vm)

    def measure_levels() -> BenchResults:
        with cluster:
            res = measure(cluster, s, log, levels)
            res.fields["cluster"] = cluster.describe()
        if vm is None:
            res.notes.append("instances are namespaces, not VMs: TCP "
                             "between them has no virtio/vhost path and "
                             "Open MPI's tcp BTL busy-polls, so it is a few "
                             "us, not the tens of us of TCP between VMs")
        else:
            res.notes.append(f"instances are QEMU guests "
                             f"({cluster.accel.upper()}): level 2 tcp is "
                             f"virtio-net through a tap in the server's "
                             f"bridge, level 2 ivshmem the ivshmem-doorbell "
                             f"device on the server's standing region")
        if not s.uplink_rate and vm is None:
            res.notes.append("uplinks unshaped: level 3 crosses two veth "
                             "pairs and three bridges at memory speed, with "
                             "no latency added (the kernel has no netem)")
        return res
    return run_benchmark(
        "hierarchy", s.quick, measure_levels,
        lambda res: targets(res.records),
        lambda res, out: print_table(
            res.records, out, levels,
            None if vm is None else report.guest_title(cluster.accel)),
        out=out, publish=functools.partial(
            report.publish, "hierarchy", out=out_dir, json_path=json_path,
            stdout=out),
        levels=[{"level": lv.number, "name": lv.name,
                 "hosts": list(lv.hosts), "what": lv.what} for lv in levels],
        transports=TRANSPORTS, sizes=s.sizes, rounds=s.rounds)
