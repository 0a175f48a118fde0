"""Many ranks in one region: how ivshmem scales against vader.

mpi-scaling under Open MPI on this machine at 2, 8, 32 and 128 ranks
(oversubscribed), over self,ivshmem and self,vader, alternating in
rounds (BENCHMARKS.md, "Many ranks in one region").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..mpis import regions
from ..errors import BenchError, InvalidRequest
from .toolkit import (MIB, BenchResults, Target, check_transports, count,
                      fmt_size, measure_rounds, mpi_job, print_grid, program,
                      ratio_target, run_benchmark, spread)

FULL_RANKS = [2, 8, 32, 128]
QUICK_RANKS = [2, 4]
TRANSPORTS = ["ivshmem", "vader"]
TESTS = ("latency", "allreduce", "msgrate")
KEYS = ("transport", "test", "ranks", "size", "latency_us",
        "rate_msgs_per_s")
# vader's shared memory: one segment per rank (btl_vader_segment_size,
# Open MPI 4.1's default), holding its FIFO, fast boxes and fragments
VADER_SEGMENT = 4 * MIB
MAX_RANKS = regions.MAX_PEERS_LIMIT


def check_ranks(values: Sequence[int]) -> List[int]:
    ranks = sorted(set(values))
    if not ranks or ranks[0] < 2 or ranks[-1] > MAX_RANKS:
        raise InvalidRequest(f"rank counts must be 2..{MAX_RANKS}")
    return ranks


@dataclass
class ScalingSettings:
    ranks: List[int]
    transports: List[str]
    lat_iters: int       # round trips per timed batch (2 ranks; fewer above)
    allreduce_ops: int   # allreduces per batch at 2 ranks (fewer above)
    windows: int         # message-rate windows of 64 per pair and batch
    timeout_s: int       # per mpirun job
    rounds: int = 3
    quick: bool = False

    @classmethod
    def make(cls, quick: bool = False, ranks: Optional[Sequence[int]] = None,
             transports: Optional[Sequence[str]] = None,
             rounds: Optional[int] = None,
             iters: Optional[int] = None) -> "ScalingSettings":
        """The full run, or a quick plumbing check (2 and 4 ranks, one
        round, few operations); the arguments override the defaults."""
        return cls(ranks=check_ranks(ranks) if ranks
                   else list(QUICK_RANKS if quick else FULL_RANKS),
                   transports=check_transports(transports, TRANSPORTS),
                   lat_iters=count("operations", iters)
                   or (50 if quick else 2000),
                   allreduce_ops=20 if quick else 1000,
                   windows=2 if quick else 20,
                   timeout_s=120 if quick else 600,
                   rounds=count("rounds", rounds) or (1 if quick else 3),
                   quick=quick)

    def argv(self, transport: str, np: int) -> List[str]:
        """mpi-scaling's arguments for `np` ranks. Oversubscribed, an
        operation that involves every rank costs about a scheduling round
        of all of them: the counts shrink with the ranks so that one job
        stays in seconds."""
        per_rank = max(1, np // 2)
        return [str(program("mpi-scaling")), "--transport", transport,
                "--lat-iters", str(max(20, self.lat_iters // per_rank)),
                "--allreduce-iters", str(max(5, self.allreduce_ops // np)),
                "--windows", str(self.windows)]


# ---------------------------------------------------------------- running

def region_bytes(transport: str, np: int) -> int:
    """Shared memory the transport sets up for `np` ranks on one host:
    the private region `ivcloud mpirun` formats (ivshmem), or one segment
    per rank (vader)."""
    if transport == "ivshmem":
        return regions.private_geometry(np)[1]
    return np * VADER_SEGMENT


def run_one(transport: str, np: int, s: ScalingSettings,
            res: BenchResults) -> List[Dict]:
    """One mpirun job of mpi-scaling; its records. vader's failure at a
    rank count is a note in `res`, not a failure (compared where it runs)."""
    try:
        recs, _ = mpi_job(transport, np, s.argv(transport, np), s.timeout_s,
                          f"mpi-scaling {transport} ({np} ranks)", KEYS)
    except BenchError as e:
        if transport == "ivshmem":
            raise
        res.notes.append(f"vader at {np} ranks: {e}")
        return []
    shm = region_bytes(transport, np)
    for rec in recs:
        rec["region_bytes"] = shm
        rec["bytes_per_rank"] = shm // np
    return recs


# ---------------------------------------------------------------- targets

def targets(res: BenchResults) -> List[Target]:
    out = []
    for np in sorted({r["ranks"] for r in res.records}):
        for test, key, op in (("latency", "latency_us", "<="),
                              ("allreduce", "latency_us", "<="),
                              ("msgrate", "rate_msgs_per_s", ">=")):
            out.append(ratio_target(
                f"{test} {np} ranks ivshmem / vader",
                res.find(transport="ivshmem", test=test, ranks=np),
                res.find(transport="vader", test=test, ranks=np),
                key, op, 1.0 if test != "allreduce" else 1.2,
                missing="no vader (or ivshmem) figure at this rank count"))
    return out


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, out) -> None:
    """One row per (ranks, transport): memory, and the three figures with
    their spread over the rounds."""
    def figure(rec: Optional[Dict], key: str, fmt: str,
               unit: float = 1.0) -> List[str]:
        if rec is None:
            return ["nan", ""]
        return [fmt.format(rec[key] / unit), spread(rec, key, fmt, unit)]

    rows = []
    for np, transport in sorted({(r["ranks"], r["transport"])
                                 for r in res.records},
                                key=lambda k: (k[0], TRANSPORTS.index(k[1]))):
        lat, ar, mr = (res.find(transport=transport, ranks=np, test=test)
                       for test in TESTS)
        any_rec = lat or ar or mr
        rows.append([str(np), transport, fmt_size(any_rec["region_bytes"]),
                     fmt_size(any_rec["bytes_per_rank"]),
                     *figure(lat, "latency_us", "{:.2f}"),
                     *figure(ar, "latency_us", "{:.1f}"),
                     *figure(mr, "rate_msgs_per_s", "{:.3f}", 1e6)])
    print_grid(["ranks", "transport", "shared mem", "per rank", "lat 8B us",
                "(min..max)", "allred 8B us", "(min..max)", "Mmsg/s",
                "(min..max)"], rows, out, left=(1,))


# ---------------------------------------------------------------- driver

def measure(s: ScalingSettings, log=None) -> BenchResults:
    res = BenchResults()
    steps = [(f"{t} {np} ranks", functools.partial(run_one, t, np, s, res))
             for np in s.ranks for t in s.transports]
    measure_rounds(res, "scaling", s.rounds, steps, log,
                   ("transport", "test", "ranks"),
                   ("latency_us", "rate_msgs_per_s"))
    cpus = len(os.sched_getaffinity(0))
    over = [np for np in s.ranks if np > cpus]
    if over:
        res.notes.append(
            f"{', '.join(map(str, over))} ranks share the host's {cpus} "
            f"CPUs (oversubscribed): those rows measure how each transport "
            f"waits while the ranks take turns, not its speed")
    return res


def run(s: ScalingSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`: 1 if an ivshmem job failed."""
    return run_benchmark("scaling", s.quick, lambda: measure(s, log),
                         targets, print_table, json_path, out,
                         ranks=s.ranks, transports=s.transports,
                         rounds=s.rounds, vader_segment=VADER_SEGMENT)
