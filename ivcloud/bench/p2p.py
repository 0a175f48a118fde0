"""Point-to-point latency and bandwidth: libivshm against references.

libivshm's rings and window, memcpy, TCP (loopback, and between two
network namespaces unless --skip-netns), Open MPI's vader, oversubscribed
pairs and a blocked peer, on this machine (BENCHMARKS.md,
"Point-to-point").
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import netns, process
from ..errors import BenchError, InvalidRequest
from .toolkit import (MIB, BenchResults, Target, checked_run, count, csv,
                      fmt_size, measure_rounds, mpi_job, parse_records,
                      print_grid, program, ratio_target, run_benchmark, spread,
                      tail)

FULL_SIZES = [8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 1 << 20,
              4 << 20]
QUICK_SIZES = [8, 4096, MIB]
MAX_SIZE = 64 * MIB
KEYS = ("transport", "mode", "size", "latency_us", "bandwidth_MBps")


def check_sizes(sizes: Sequence[int]) -> List[int]:
    sizes = list(sizes)
    if not sizes or any(not 1 <= x <= MAX_SIZE for x in sizes):
        raise InvalidRequest("sizes must be 1 B .. 64 MiB")
    return sizes


@dataclass
class P2pSettings:
    sizes: List[int]
    iters: int          # round trips for the small sizes
    budget: int         # bytes per size and direction (caps iterations)
    pair_trips: int     # oversubscribed, a pair per CPU: round trips
    split_trips: int    # oversubscribed, pairs across CPUs: round trips
    wait_ms: int        # blocked peer: how long it waits
    timeout_s: int      # per program run
    netns: bool         # include TCP between two network namespaces
    rounds: int = 3     # of alternating transports (figures: medians)
    quick: bool = False

    @classmethod
    def make(cls, quick: bool = False, sizes: Optional[Sequence[int]] = None,
             iters: Optional[int] = None, netns: bool = True,
             rounds: Optional[int] = None) -> "P2pSettings":
        """The full run, or a quick plumbing check; `sizes` and `iters`
        override the defaults of either."""
        return cls(sizes=check_sizes(sizes) if sizes
                   else list(QUICK_SIZES if quick else FULL_SIZES),
                   iters=(count("round trips", iters)
                          or (300 if quick else 20000)),
                   budget=(16 if quick else 512) * MIB,
                   pair_trips=60 if quick else 400,
                   split_trips=10000 if quick else 100000,
                   wait_ms=300 if quick else 1000,
                   timeout_s=60 if quick else 300,
                   netns=netns,
                   rounds=count("rounds", rounds) or (1 if quick else 3),
                   quick=quick)


# ---------------------------------------------------------------- helpers

def _run(cmd: Sequence[str], timeout_s: int, origin: str) -> List[Dict]:
    stdout, _ = checked_run(functools.partial(process.run_launcher,
                                              list(cmd), dict(os.environ)),
                            timeout_s, origin)
    return parse_records(stdout, origin, KEYS)


# ---------------------------------------------------------------- transports

def run_ivshm(s: P2pSettings) -> List[Dict]:
    pp = str(program("ivshm-pingpong"))
    common = ["--sizes", csv(s.sizes), "--iters", str(s.iters),
              "--budget", str(s.budget), "--timeout", str(s.timeout_s)]
    recs = []
    for spin in ("-1", "0"):  # never block / library default budget
        recs += _run([pp, "--mode", "msg", "--spin", spin, *common],
                     s.timeout_s + 10, f"ivshm-pingpong msg spin={spin}")
    recs += _run([pp, "--mode", "put", *common], s.timeout_s + 10,
                 "ivshm-pingpong put")
    big = sorted({sz for sz in s.sizes if sz >= 64 * 1024} | {MIB})
    recs += _run([pp, "--mode", "memcpy", "--sizes", csv(big),
                  "--iters", str(s.iters), "--budget", str(s.budget)],
                 s.timeout_s + 10, "ivshm-pingpong memcpy")
    return recs


def run_contention(s: P2pSettings) -> List[Dict]:
    pp = str(program("ivshm-pingpong"))
    recs = []
    # "pair": each pair shares a CPU, so a spinning waiter holds the CPU
    # its partner needs (few rounds: spinning costs a time slice per
    # hop). "split": one end of each pair per CPU, scheduler-friendly.
    for placement, rounds in (("pair", s.pair_trips),
                              ("split", s.split_trips)):
        for spin in ("-1", "0"):
            recs += _run([pp, "--mode", "oversub", "--spin", spin,
                          "--placement", placement, "--rounds", str(rounds),
                          "--timeout", str(s.timeout_s)], s.timeout_s + 10,
                         f"ivshm-pingpong oversub {placement} spin={spin}")
    for spin in ("0", "-1"):
        recs += _run([pp, "--mode", "blocked", "--spin", spin, "--wait-ms",
                      str(s.wait_ms), "--timeout", str(s.timeout_s)],
                     s.timeout_s + 10, f"ivshm-pingpong blocked spin={spin}")
    return recs


def _read_port(proc: subprocess.Popen, timeout_s: float, origin: str) -> int:
    line = process.first_line(proc.stdout, timeout_s)
    if not line:    # none in time, or the server closed its stdout: exited
        err = proc.stderr.read().decode(errors="replace") \
            if line == "" or proc.poll() is not None else ""
        raise BenchError(f"{origin}: server did not start: {tail(err)}")
    if not line.startswith("PORT "):
        raise BenchError(f"{origin}: unexpected server output {line!r}")
    return int(line.split()[1])


def _tcp_pair(s: P2pSettings, transport: str, bind: str, connect: str,
              server_argv: Callable[[List[str]], List[str]] = list,
              client_argv: Callable[[List[str]], List[str]] = list
              ) -> List[Dict]:
    """tcp-pingpong's server and client, each argv as wrapped (default:
    as is)."""
    tp = str(program("tcp-pingpong"))
    server = subprocess.Popen(
        server_argv([tp, "server", "--bind", bind, "--port", "0",
                     "--timeout", str(s.timeout_s)]),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        port = _read_port(server, 15, transport)
        recs = _run(client_argv([tp, "client", "--connect", connect,
                                 "--port", str(port), "--sizes",
                                 csv(s.sizes), "--iters", str(s.iters),
                                 "--budget", str(s.budget),
                                 "--transport", transport,
                                 "--timeout", str(s.timeout_s)]),
                    s.timeout_s + 10, f"tcp-pingpong client ({transport})")
        server.wait(timeout=15)
        return recs
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        server.stderr.close()


def run_tcp_loopback(s: P2pSettings) -> List[Dict]:
    return _tcp_pair(s, "tcp-loopback", "127.0.0.1", "127.0.0.1")


def run_tcp_bridge(s: P2pSettings) -> List[Dict]:
    with netns.BridgedPair() as net:
        return _tcp_pair(s, "tcp-bridge", net.addr_a, net.addr_a,
                         functools.partial(net.exec_args, "a"),
                         functools.partial(net.exec_args, "b"))


def run_mpi(s: P2pSettings) -> List[Dict]:
    """mpi-pingpong over Open MPI's vader, launched as `ivcloud mpirun
    --transport vader` launches (ob1 and self,vader: UCX, where
    installed, would otherwise win)."""
    recs, _ = mpi_job("vader", 2, [str(program("mpi-pingpong")), "--sizes",
                                   csv(s.sizes), "--iters", str(s.iters),
                                   "--budget", str(s.budget)],
                      s.timeout_s + 30, "mpi-pingpong (vader)", KEYS)
    return recs


# ---------------------------------------------------------------- targets

def targets(res: BenchResults) -> List[Target]:
    def rec(transport: str, mode: Optional[str] = None,
            size: Optional[int] = None, **extra) -> Optional[Dict]:
        return res.find(transport=transport, mode=mode, size=size, **extra)

    ivshm8 = rec("ivshm", "spin-then-block", 8)
    vader8 = rec("mpi-vader", None, 8)
    put1m = rec("ivshm", "put", MIB)
    blocked = rec("ivshm-blocked", "spin-then-block")
    return [
        ratio_target("8 B latency ivshm / mpi-vader", ivshm8, vader8,
                     "latency_us", "<=", 1.0, "no 8 B ivshm/vader record"),
        ratio_target("8 B latency tcp-bridge / ivshm",
                     rec("tcp-bridge", None, 8), ivshm8, "latency_us", ">=",
                     50.0, "no 8 B tcp-bridge/ivshm record"),
        ratio_target("1 MiB bandwidth put / mpi-vader", put1m,
                     rec("mpi-vader", None, MIB), "bandwidth_MBps", ">=",
                     2.0, "no 1 MiB put/vader record"),
        ratio_target("1 MiB bandwidth put / memcpy", put1m,
                     rec("memcpy", None, MIB), "bandwidth_MBps", ">=", 0.25,
                     "no 1 MiB put/memcpy record"),
        ratio_target("oversub (pair/CPU) wall spin / spin-then-block",
                     rec("ivshm-oversub", "spin", placement="pair"),
                     rec("ivshm-oversub", "spin-then-block",
                         placement="pair"),
                     "wall_s", ">=", 5.0, "no oversubscribed record"),
        Target("blocked peer CPU fraction",
               blocked.get("cpu_fraction") if blocked else None,
               "<", 0.05, "" if blocked else "no blocked record"),
    ]


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, out) -> None:
    rows = []
    for r in res.records:
        extra = []
        if "wall_s" in r and r["transport"] == "ivshm-oversub":
            extra.append(f"wall {r['wall_s']:.3f} s, {r.get('rounds')} "
                         f"round trips x {r.get('pairs', 2)} pairs, "
                         f"placement {r.get('placement')}")
        if "cpu_fraction" in r:
            extra.append(f"waiter CPU {100 * r['cpu_fraction']:.2f}% of "
                         f"{r.get('wall_s', 0):.2f} s; latency = wake-up")
        rows.append([r["transport"], r["mode"], fmt_size(r["size"]),
                     f"{r['latency_us']:.3f}", spread(r, "latency_us"),
                     f"{r['bandwidth_MBps']:.1f}", "; ".join(extra)])
    print_grid(["transport", "mode", "size", "latency_us", "(min..max)",
                "MB/s", "notes"], rows, out, left=(0, 1, 6))


# ---------------------------------------------------------------- driver

def measure(s: P2pSettings, log=None) -> BenchResults:
    res = BenchResults()
    steps = [("ivshm", run_ivshm), ("tcp-loopback", run_tcp_loopback)]
    if s.netns:
        reason = netns.available()
        if reason:
            res.notes.append(f"tcp-bridge skipped: {reason}")
        else:
            steps.append(("tcp-bridge", run_tcp_bridge))
    else:
        res.notes.append("tcp-bridge skipped (left out by the settings)")
    steps += [("mpi-vader", run_mpi), ("contention", run_contention)]
    return measure_rounds(
        res, "p2p", s.rounds,
        [(name, functools.partial(fn, s)) for name, fn in steps], log,
        ("transport", "mode", "size", "placement"),
        ("latency_us", "bandwidth_MBps", "wall_s", "cpu_fraction"))


def run(s: P2pSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`: 1 if a step failed."""
    return run_benchmark("p2p", s.quick, lambda: measure(s, log), targets,
                         print_table, json_path, out, sizes=s.sizes,
                         rounds=s.rounds)
