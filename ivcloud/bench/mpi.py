"""MPI over ivshmem: OSU-style latency, bandwidth, RMA and allreduce.

Runs the mpi-osu program (native/bench/osu.c) under Open MPI on this
machine for three BTL sets: self,ivshmem (our component; tcp is left out
so every figure provably went through it, which its counters confirm),
self,vader (Open MPI's shared memory) and self,tcp (loopback).
Point-to-point and one-sided tests use 2 ranks, allreduce 4. One-sided
operations go through osc pt2pt for every transport, so the BTLs are
what is compared. Prints one table, the targets as ratios measured in
this run (informational), and optionally writes every record as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .. import mpi
from ..cli import CliError, positive_int
from ..native import native_dir
from .common import machine_info, write_doc
from .p2p import Target, print_targets

MIB = 1 << 20
FULL_SIZES = [8, 64, 512, 4096, 32768, 262144, MIB, 4 * MIB]
QUICK_SIZES = [8, MIB]
FULL_ALLREDUCE_SIZES = [8, 1024, 65536, MIB]
QUICK_ALLREDUCE_SIZES = [8]
TRANSPORTS = ["ivshmem", "vader", "tcp"]
PAIR_TESTS = "latency,bw,put,get,put-fence,get-fence"
ALLREDUCE_RANKS = 4


class BenchError(RuntimeError):
    pass


@dataclass
class Settings:
    sizes: List[int]
    allreduce_sizes: List[int]
    iters: int          # operations per size for the small sizes
    budget: int         # bytes per size (caps operations of big ones)
    timeout_s: int      # per mpirun job
    transports: List[str]

    @classmethod
    def from_args(cls, args) -> "Settings":
        quick = args.quick
        return cls(sizes=QUICK_SIZES if quick else FULL_SIZES,
                   allreduce_sizes=(QUICK_ALLREDUCE_SIZES if quick
                                    else FULL_ALLREDUCE_SIZES),
                   iters=args.iters or (300 if quick else 10000),
                   budget=(16 if quick else 256) * MIB,
                   timeout_s=60 if quick else 300,
                   transports=args.transports or list(TRANSPORTS))


@dataclass
class Results:
    records: List[Dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)

    def find(self, transport: str, test: str, size: int,
             ranks: Optional[int] = None) -> Optional[Dict]:
        for r in self.records:
            if (r["transport"] == transport and r["test"] == test
                    and r["size"] == size
                    and (ranks is None or r["ranks"] == ranks)):
                return r
        return None


# ---------------------------------------------------------------- running

def _binary() -> Path:
    path = native_dir() / "mpi-osu"
    if not os.access(path, os.X_OK):
        raise BenchError(f"{path} not found (run `make build` or set "
                         f"IVCLOUD_NATIVE_DIR)")
    return path


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines()
             if ln.strip() and not ln.startswith("---")]
    return lines[-1].strip() if lines else "no message"


def _parse_records(text: str, origin: str) -> List[Dict]:
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise BenchError(f"{origin}: unparsable output line: {line[:120]}")
        for key in ("transport", "test", "ranks", "size", "latency_us",
                    "bandwidth_MBps"):
            if key not in rec:
                raise BenchError(f"{origin}: record without '{key}'")
        records.append(rec)
    return records


def _job(transport: str, np: int, argv: Sequence[str], timeout_s: int,
         origin: str) -> List[Dict]:
    """One mpirun job of mpi-osu; its records. ivshmem jobs get a private
    region and must show traffic in every rank's BTL counters."""
    kwargs = dict(transport=transport, osc="pt2pt")
    if transport == "ivshmem":
        kwargs.update(tcp_fallback=False, verbose_btl=True)
    with tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        try:
            if transport == "ivshmem":
                with mpi.private_region(np) as region:
                    cmd = mpi.mpirun_command(argv, np, region=region,
                                             **kwargs)
                    status = mpi.run_command(cmd, timeout_s, stdout=out,
                                             stderr=err)
            else:
                cmd = mpi.mpirun_command(argv, np, **kwargs)
                status = mpi.run_command(cmd, timeout_s, stdout=out,
                                         stderr=err)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{origin}: no result within {timeout_s} s")
        except CliError as e:
            raise BenchError(f"{origin}: {e}")
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if status != 0:
        raise BenchError(f"{origin}: exit status {status}: {_tail(stderr)}")
    recs = _parse_records(stdout, origin)
    if not recs:
        raise BenchError(f"{origin}: produced no records")
    if transport == "ivshmem":
        counters = mpi.parse_btl_counters(stderr)
        idle = [r for r in range(np) if r not in counters
                or counters[r]["sent_msgs"] == 0
                or counters[r]["recv_msgs"] == 0]
        if idle:
            raise BenchError(f"{origin}: btl_ivshmem counters show no "
                             f"traffic for rank(s) {idle}")
        sleeps = sum(c["sleeps"] for c in counters.values())
        for rec in recs:
            rec["btl_sleeps"] = sleeps
    for rec in recs:
        rec["btl"] = mpi.btl_list(transport, tcp_fallback=False)
        if rec["test"] not in ("latency", "bw", "allreduce"):
            rec["osc"] = "pt2pt"
    return recs


def _csv(sizes: Sequence[int]) -> str:
    return ",".join(str(s) for s in sizes)


def run_transport(transport: str, s: Settings) -> List[Dict]:
    osu = str(_binary())
    common = ["--iters", str(s.iters), "--budget", str(s.budget),
              "--transport", transport]
    recs = _job(transport, 2, [osu, "--test", PAIR_TESTS, "--sizes",
                               _csv(s.sizes), *common],
                s.timeout_s, f"mpi-osu {transport} (2 ranks)")
    recs += _job(transport, ALLREDUCE_RANKS,
                 [osu, "--test", "allreduce", "--sizes",
                  _csv(s.allreduce_sizes), *common],
                 s.timeout_s, f"mpi-osu {transport} allreduce "
                              f"({ALLREDUCE_RANKS} ranks)")
    return recs


# ---------------------------------------------------------------- targets

def _ratio(num: Optional[Dict], den: Optional[Dict], key: str, name: str,
           op: str, threshold: float) -> Target:
    if num is None or den is None:
        return Target(name, None, op, threshold, "record missing")
    if not den[key]:
        return Target(name, None, op, threshold, "zero denominator")
    return Target(name, num[key] / den[key], op, threshold)


def targets(res: Results) -> List[Target]:
    return [
        _ratio(res.find("ivshmem", "latency", 8), res.find("vader", "latency", 8),
               "latency_us", "8 B latency ivshmem / vader", "<=", 1.15),
        _ratio(res.find("ivshmem", "bw", MIB), res.find("vader", "bw", MIB),
               "bandwidth_MBps", "1 MiB bandwidth ivshmem / vader", ">=",
               1.5),
        _ratio(res.find("ivshmem", "allreduce", 8, ALLREDUCE_RANKS),
               res.find("vader", "allreduce", 8, ALLREDUCE_RANKS),
               "latency_us",
               f"8 B allreduce ({ALLREDUCE_RANKS} ranks) ivshmem / vader",
               "<=", 1.2),
    ]


# ---------------------------------------------------------------- output

def _fmt_size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_table(res: Results, out=sys.stdout) -> None:
    head = (f"{'transport':<9} {'test':<10} {'ranks':>5} {'size':>9} "
            f"{'latency_us':>12} {'MB/s':>11}  notes")
    out.write(head + "\n" + "-" * len(head) + "\n")
    for r in sorted(res.records, key=lambda r: (r["test"], r["size"],
                                                 TRANSPORTS.index(r["transport"])
                                                 if r["transport"] in TRANSPORTS
                                                 else 99)):
        notes = []
        if "window" in r:
            notes.append(f"window {r['window']}")
        if "sync" in r:
            notes.append(f"osc {r.get('osc', '?')}, {r['sync']}")
        out.write(f"{r['transport']:<9} {r['test']:<10} {r['ranks']:>5} "
                  f"{_fmt_size(r['size']):>9} {r['latency_us']:>12.3f} "
                  f"{r['bandwidth_MBps']:>11.1f}  {', '.join(notes)}\n")


# ---------------------------------------------------------------- driver



def _transports(text: str) -> List[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TRANSPORTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"transports are a comma-separated subset of "
            f"{','.join(TRANSPORTS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the records and targets as JSON")
    p.add_argument("--quick", action="store_true",
                   help="two sizes, few iterations (plumbing check)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="operations per small size (big sizes use fewer)")
    p.add_argument("--transports", type=_transports, default=None,
                   help=f"comma-separated subset of {','.join(TRANSPORTS)}")


def measure(s: Settings, log=sys.stderr) -> Results:
    res = Results()
    for transport in s.transports:
        log.write(f"bench mpi: {transport} ...\n")
        log.flush()
        t0 = time.monotonic()
        try:
            res.records += run_transport(transport, s)
        except (BenchError, OSError, subprocess.SubprocessError) as e:
            res.failed.append(transport)
            res.notes.append(f"{transport} failed: {e}")
            log.write(f"bench mpi: {transport} failed: {e}\n")
        else:
            log.write(f"bench mpi: {transport} done in "
                      f"{time.monotonic() - t0:.1f} s\n")
    return res


def run(args) -> int:
    s = Settings.from_args(args)
    started = time.time()
    res = measure(s)
    ts = targets(res)
    print_table(res)
    print_targets(ts)
    for note in res.notes:
        print(f"note: {note}")
    if args.json:
        doc = {
            "benchmark": "mpi",
            "quick": bool(args.quick),
            **machine_info(started),
            "sizes": s.sizes,
            "allreduce_sizes": s.allreduce_sizes,
            "allreduce_ranks": ALLREDUCE_RANKS,
            "records": res.records,
            "targets": [t.to_json() for t in ts],
            "notes": res.notes,
        }
        path = Path(args.json)
        write_doc(path, doc)
        print(f"wrote {len(res.records)} records to {path}")
    return 1 if res.failed else 0
