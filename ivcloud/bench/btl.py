"""MPI over ivshmem: OSU-style latency, bandwidth, RMA and allreduce.

mpi-osu under Open MPI on this machine over self,ivshmem (tcp left out,
so every figure provably went through our BTL), self,vader and
self,tcp, alternating in rounds (BENCHMARKS.md, "MPI over the BTL").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .toolkit import (MIB, BenchResults, Target, check_transports, count, csv,
                      fmt_size, measure_rounds, mpi_job, print_grid, program,
                      ratio_target, run_benchmark, spread)

FULL_SIZES = [8, 64, 512, 4096, 32768, 262144, MIB, 4 * MIB]
QUICK_SIZES = [8, MIB]
FULL_ALLREDUCE_SIZES = [8, 1024, 65536, MIB]
QUICK_ALLREDUCE_SIZES = [8]
TRANSPORTS = ["ivshmem", "vader", "tcp"]
PAIR_TESTS = "latency,bw,put,get,put-fence,get-fence"
ALLREDUCE_RANKS = 4
KEYS = ("transport", "test", "ranks", "size", "latency_us",
        "bandwidth_MBps")


@dataclass
class MpiSettings:
    sizes: List[int]
    allreduce_sizes: List[int]
    iters: int          # operations per size for the small sizes
    budget: int         # bytes per size (caps operations of big ones)
    timeout_s: int      # per mpirun job
    transports: List[str]
    rounds: int = 3
    quick: bool = False

    @classmethod
    def make(cls, quick: bool = False, iters: Optional[int] = None,
             transports: Optional[Sequence[str]] = None,
             rounds: Optional[int] = None) -> "MpiSettings":
        """The full run, or a quick plumbing check; `iters` and
        `transports` (a subset of TRANSPORTS) override the defaults."""
        return cls(sizes=list(QUICK_SIZES if quick else FULL_SIZES),
                   allreduce_sizes=list(QUICK_ALLREDUCE_SIZES if quick
                                        else FULL_ALLREDUCE_SIZES),
                   iters=(count("operations", iters)
                          or (300 if quick else 10000)),
                   budget=(16 if quick else 256) * MIB,
                   timeout_s=60 if quick else 300,
                   transports=check_transports(transports, TRANSPORTS),
                   rounds=count("rounds", rounds) or (1 if quick else 3),
                   quick=quick)


# ---------------------------------------------------------------- running


def _job(transport: str, np: int, argv: Sequence[str], timeout_s: int,
         origin: str) -> List[Dict]:
    """One mpi-osu job (one-sided tests through osc pt2pt)."""
    recs, counters = mpi_job(transport, np, argv, timeout_s, origin, KEYS,
                             osc="pt2pt")
    sleeps = sum(c["sleeps"] for c in counters.values())
    for rec in recs:
        if transport == "ivshmem":
            rec["btl_sleeps"] = sleeps
        if rec["test"] not in ("latency", "bw", "allreduce"):
            rec["osc"] = "pt2pt"
    return recs


def run_transport(transport: str, s: MpiSettings) -> List[Dict]:
    osu = str(program("mpi-osu"))
    common = ["--iters", str(s.iters), "--budget", str(s.budget),
              "--transport", transport]
    recs = _job(transport, 2, [osu, "--test", PAIR_TESTS, "--sizes",
                               csv(s.sizes), *common],
                s.timeout_s, f"mpi-osu {transport} (2 ranks)")
    recs += _job(transport, ALLREDUCE_RANKS,
                 [osu, "--test", "allreduce", "--sizes",
                  csv(s.allreduce_sizes), *common],
                 s.timeout_s, f"mpi-osu {transport} allreduce "
                              f"({ALLREDUCE_RANKS} ranks)")
    return recs


# ---------------------------------------------------------------- targets

def targets(res: BenchResults) -> List[Target]:
    def rec(transport: str, test: str, size: int,
            ranks: Optional[int] = None) -> Optional[Dict]:
        return res.find(transport=transport, test=test, size=size,
                        ranks=ranks)

    return [
        ratio_target("8 B latency ivshmem / vader",
                     rec("ivshmem", "latency", 8), rec("vader", "latency", 8),
                     "latency_us", "<=", 1.0),
        ratio_target("1 MiB bandwidth ivshmem / vader",
                     rec("ivshmem", "bw", MIB), rec("vader", "bw", MIB),
                     "bandwidth_MBps", ">=", 1.5),
        ratio_target(f"8 B allreduce ({ALLREDUCE_RANKS} ranks) ivshmem / "
                     f"vader",
                     rec("ivshmem", "allreduce", 8, ALLREDUCE_RANKS),
                     rec("vader", "allreduce", 8, ALLREDUCE_RANKS),
                     "latency_us", "<=", 1.2),
    ]


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, out) -> None:
    rows = []
    for r in sorted(res.records, key=lambda r: (
            r["test"], r["size"], TRANSPORTS.index(r["transport"]))):
        notes = []
        if "window" in r:
            notes.append(f"window {r['window']}")
        if "sync" in r:
            notes.append(f"osc {r.get('osc', '?')}, {r['sync']}")
        rows.append([r["transport"], r["test"], str(r["ranks"]),
                     fmt_size(r["size"]), f"{r['latency_us']:.3f}",
                     spread(r, "latency_us"), f"{r['bandwidth_MBps']:.1f}",
                     ", ".join(notes)])
    print_grid(["transport", "test", "ranks", "size", "latency_us",
                "(min..max)", "MB/s", "notes"], rows, out, left=(0, 1, 7))


# ---------------------------------------------------------------- driver

def measure(s: MpiSettings, log=None) -> BenchResults:
    return measure_rounds(
        BenchResults(), "mpi", s.rounds,
        [(t, functools.partial(run_transport, t, s)) for t in s.transports],
        log, ("transport", "test", "ranks", "size"),
        ("latency_us", "bandwidth_MBps"))


def run(s: MpiSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`: 1 if a transport failed."""
    return run_benchmark("mpi", s.quick, lambda: measure(s, log), targets,
                         print_table, json_path, out, sizes=s.sizes,
                         allreduce_sizes=s.allreduce_sizes,
                         allreduce_ranks=ALLREDUCE_RANKS, rounds=s.rounds)
