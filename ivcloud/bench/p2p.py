"""Point-to-point latency and bandwidth: libivshm against references.

Runs, in one go and on this machine: libivshm rings (spin, and
spin-then-block), libivshm window put+flush, a memcpy reference, TCP over
loopback, TCP between two network namespaces over a bridge, Open MPI's
vader BTL, two oversubscribed ping-pong pairs, and the CPU use of a
blocked peer. Prints one table, the targets as ratios measured in this
run (informational), and optionally writes every record as JSON.

One-way latency is half a round trip; bandwidth = size / one-way latency.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import netns
from ..native import native_dir
from ..cli import positive_int
from .common import machine_info, write_doc

FULL_SIZES = [8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 1 << 20,
              4 << 20]
QUICK_SIZES = [8, 4096, 1 << 20]
MIB = 1 << 20


class BenchError(RuntimeError):
    pass


@dataclass
class Settings:
    sizes: List[int]
    iters: int          # round trips for the small sizes
    budget: int         # bytes per size and direction (caps iterations)
    rounds: int         # oversubscribed, a pair per CPU: round trips
    split_rounds: int   # oversubscribed, pairs across CPUs: round trips
    wait_ms: int        # blocked peer: how long it waits
    timeout_s: int      # per program run
    netns: bool

    @classmethod
    def from_args(cls, args) -> "Settings":
        sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
        return cls(sizes=sizes,
                   iters=args.iters or (300 if args.quick else 20000),
                   budget=(16 if args.quick else 512) * MIB,
                   rounds=60 if args.quick else 400,
                   split_rounds=10000 if args.quick else 100000,
                   wait_ms=300 if args.quick else 1000,
                   timeout_s=60 if args.quick else 300,
                   netns=not args.skip_netns)


@dataclass
class Results:
    records: List[Dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)

    def find(self, transport: str, mode: Optional[str] = None,
             size: Optional[int] = None, **extra) -> Optional[Dict]:
        for r in self.records:
            if (r["transport"] == transport
                    and (mode is None or r["mode"] == mode)
                    and (size is None or r["size"] == size)
                    and all(r.get(k) == v for k, v in extra.items())):
                return r
        return None


# ---------------------------------------------------------------- helpers

def _binary(name: str) -> Path:
    path = native_dir() / name
    if not os.access(path, os.X_OK):
        raise BenchError(f"{path} not found (run `make build` or set "
                         f"IVCLOUD_NATIVE_DIR)")
    return path


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
        for key in ("transport", "mode", "size", "latency_us",
                    "bandwidth_MBps"):
            if key not in rec:
                raise BenchError(f"{origin}: record without '{key}'")
        records.append(rec)
    return records


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def _run(cmd: Sequence[str], timeout_s: int, origin: str) -> List[Dict]:
    try:
        proc = subprocess.run(list(cmd), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{origin}: no result within {timeout_s} s")
    if proc.returncode != 0:
        raise BenchError(f"{origin}: exit status {proc.returncode}: "
                         f"{_tail(proc.stderr)}")
    recs = _parse_records(proc.stdout, origin)
    if not recs:
        raise BenchError(f"{origin}: produced no records")
    return recs


def _csv(sizes: Sequence[int]) -> str:
    return ",".join(str(s) for s in sizes)


# ---------------------------------------------------------------- transports

def run_ivshm(s: Settings) -> List[Dict]:
    pp = str(_binary("ivshm-pingpong"))
    common = ["--sizes", _csv(s.sizes), "--iters", str(s.iters),
              "--budget", str(s.budget), "--timeout", str(s.timeout_s)]
    recs = []
    for spin in ("-1", "0"):  # never block / library default budget
        recs += _run([pp, "--mode", "msg", "--spin", spin, *common],
                     s.timeout_s + 10, f"ivshm-pingpong msg spin={spin}")
    recs += _run([pp, "--mode", "put", *common], s.timeout_s + 10,
                 "ivshm-pingpong put")
    big = sorted({sz for sz in s.sizes if sz >= 64 * 1024} | {MIB})
    recs += _run([pp, "--mode", "memcpy", "--sizes", _csv(big),
                  "--iters", str(s.iters), "--budget", str(s.budget)],
                 s.timeout_s + 10, "ivshm-pingpong memcpy")
    return recs


def run_contention(s: Settings) -> List[Dict]:
    pp = str(_binary("ivshm-pingpong"))
    recs = []
    # "pair": each pair shares a CPU, so a spinning waiter holds the CPU
    # its partner needs (few rounds: spinning costs a time slice per
    # hop). "split": one end of each pair per CPU, scheduler-friendly.
    for placement, rounds in (("pair", s.rounds), ("split", s.split_rounds)):
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
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") \
                if proc.poll() is not None else ""
            raise BenchError(f"{origin}: server did not start: {_tail(err)}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 256)
            if not chunk:
                continue
            buf += chunk
    line = buf.split(b"\n", 1)[0].decode()
    if not line.startswith("PORT "):
        raise BenchError(f"{origin}: unexpected server output {line!r}")
    return int(line.split()[1])


def _tcp_pair(s: Settings, transport: str,
              server_argv: Callable[[List[str]], List[str]],
              client_argv: Callable[[List[str]], List[str]],
              bind: str, connect: str) -> List[Dict]:
    tp = str(_binary("tcp-pingpong"))
    server = subprocess.Popen(
        server_argv([tp, "server", "--bind", bind, "--port", "0",
                     "--timeout", str(s.timeout_s)]),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        port = _read_port(server, 15, transport)
        recs = _run(client_argv([tp, "client", "--connect", connect,
                                 "--port", str(port), "--sizes",
                                 _csv(s.sizes), "--iters", str(s.iters),
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


def _as_is(argv: List[str]) -> List[str]:
    return argv


def run_tcp_loopback(s: Settings) -> List[Dict]:
    return _tcp_pair(s, "tcp-loopback", _as_is, _as_is, "127.0.0.1",
                     "127.0.0.1")


def run_tcp_bridge(s: Settings) -> List[Dict]:
    with netns.BridgedPair() as net:
        return _tcp_pair(s, "tcp-bridge",
                         lambda argv: net.exec_args("a", argv),
                         lambda argv: net.exec_args("b", argv),
                         net.addr_a, net.addr_a)


def mpirun_argv(binary: Path, extra: Sequence[str]) -> List[str]:
    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise BenchError("mpirun not found (Open MPI)")
    # ob1 + self,vader pins the path to vader's shared-memory BTL (UCX
    # would otherwise win where it is installed).
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
            "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
            str(binary), *extra]


def run_mpi(s: Settings) -> List[Dict]:
    binary = _binary("mpi-pingpong")
    cmd = mpirun_argv(binary, ["--sizes", _csv(s.sizes), "--iters",
                               str(s.iters), "--budget", str(s.budget)])
    return _run(cmd, s.timeout_s + 30, "mpi-pingpong (vader)")


# ---------------------------------------------------------------- targets

@dataclass
class Target:
    name: str
    value: Optional[float]
    op: str
    threshold: float
    why_missing: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "N/A"
        ok = (self.value <= self.threshold if self.op == "<="
              else self.value >= self.threshold if self.op == ">="
              else self.value < self.threshold)
        return "PASS" if ok else "MISS"

    def to_json(self) -> Dict:
        return {"name": self.name, "value": self.value, "op": self.op,
                "threshold": self.threshold, "status": self.status,
                **({"missing": self.why_missing} if self.value is None
                   else {})}


def _ratio(num: Optional[Dict], den: Optional[Dict], key: str,
           what: str) -> Tuple[Optional[float], str]:
    if num is None or den is None:
        return None, f"no {what} record"
    if not den[key]:
        return None, "zero denominator"
    return num[key] / den[key], ""


def targets(res: Results) -> List[Target]:
    ivshm8 = res.find("ivshm", "spin-then-block", 8)
    vader8 = res.find("mpi-vader", None, 8)
    bridge8 = res.find("tcp-bridge", None, 8)
    put1m = res.find("ivshm", "put", MIB)
    vader1m = res.find("mpi-vader", None, MIB)
    memcpy1m = res.find("memcpy", None, MIB)
    os_spin = res.find("ivshm-oversub", "spin", placement="pair")
    os_block = res.find("ivshm-oversub", "spin-then-block", placement="pair")
    blocked = res.find("ivshm-blocked", "spin-then-block")

    out = []
    v, why = _ratio(ivshm8, vader8, "latency_us", "8 B ivshm/vader")
    out.append(Target("8 B latency ivshm / mpi-vader", v, "<=", 1.0, why))
    v, why = _ratio(bridge8, ivshm8, "latency_us", "8 B tcp-bridge/ivshm")
    out.append(Target("8 B latency tcp-bridge / ivshm", v, ">=", 50.0, why))
    v, why = _ratio(put1m, vader1m, "bandwidth_MBps", "1 MiB put/vader")
    out.append(Target("1 MiB bandwidth put / mpi-vader", v, ">=", 2.0, why))
    v, why = _ratio(put1m, memcpy1m, "bandwidth_MBps", "1 MiB put/memcpy")
    out.append(Target("1 MiB bandwidth put / memcpy", v, ">=", 0.25, why))
    v, why = _ratio(os_spin, os_block, "wall_s", "oversubscribed")
    out.append(Target("oversub (pair/CPU) wall spin / spin-then-block", v,
                      ">=", 5.0, why))
    out.append(Target("blocked peer CPU fraction",
                      blocked.get("cpu_fraction") if blocked else None,
                      "<", 0.05, "" if blocked else "no blocked record"))
    return out


# ---------------------------------------------------------------- output

def _fmt_size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_table(res: Results, out=sys.stdout) -> None:
    head = (f"{'transport':<15} {'mode':<16} {'size':>9} {'latency_us':>12} "
            f"{'MB/s':>11}  notes")
    out.write(head + "\n" + "-" * len(head) + "\n")
    for r in res.records:
        extra = []
        if "wall_s" in r and r["transport"] == "ivshm-oversub":
            extra.append(f"wall {r['wall_s']:.3f} s, {r.get('rounds')} "
                         f"round trips x {r.get('pairs', 2)} pairs, "
                         f"placement {r.get('placement')}")
        if "cpu_fraction" in r:
            extra.append(f"waiter CPU {100 * r['cpu_fraction']:.2f}% of "
                         f"{r.get('wall_s', 0):.2f} s; latency = wake-up")
        out.write(f"{r['transport']:<15} {r['mode']:<16} "
                  f"{_fmt_size(r['size']):>9} {r['latency_us']:>12.3f} "
                  f"{r['bandwidth_MBps']:>11.1f}  {'; '.join(extra)}\n")


def print_targets(ts: List[Target], out=sys.stdout) -> None:
    out.write("\nTargets (ratios from this run; informational):\n")
    for t in ts:
        val = "n/a" if t.value is None else (
            f"{100 * t.value:.2f}%" if "fraction" in t.name
            else f"{t.value:.3g}")
        thr = (f"{100 * t.threshold:g}%" if "fraction" in t.name
               else f"{t.threshold:g}")
        why = f"  ({t.why_missing})" if t.value is None else ""
        out.write(f"  {t.status:<4}  {t.name:<44} {val:>9} {t.op} {thr}"
                  f"{why}\n")


# ---------------------------------------------------------------- driver

def _sizes_arg(text: str) -> List[int]:
    from ..server import parse_size
    try:
        sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    if not sizes or any(not 1 <= x <= 64 * MIB for x in sizes):
        raise argparse.ArgumentTypeError("sizes must be 1 B .. 64 MiB")
    return sizes




def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the records and targets as JSON")
    p.add_argument("--sizes", type=_sizes_arg, default=None,
                   help="comma-separated message sizes (K/M suffixes)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="round trips per small size (big sizes use fewer)")
    p.add_argument("--quick", action="store_true",
                   help="few sizes and iterations (plumbing check)")
    p.add_argument("--skip-netns", action="store_true",
                   help="skip the two-namespace TCP bridge transport")


def measure(s: Settings, log=sys.stderr) -> Results:
    res = Results()
    steps = [("ivshm", run_ivshm), ("tcp-loopback", run_tcp_loopback)]
    if s.netns:
        reason = netns.available()
        if reason:
            res.notes.append(f"tcp-bridge skipped: {reason}")
        else:
            steps.append(("tcp-bridge", run_tcp_bridge))
    else:
        res.notes.append("tcp-bridge skipped (--skip-netns)")
    steps += [("mpi-vader", run_mpi), ("contention", run_contention)]
    for name, fn in steps:
        log.write(f"bench p2p: {name} ...\n")
        log.flush()
        t0 = time.monotonic()
        try:
            res.records += fn(s)
        except (BenchError, netns.NetnsError, OSError,
                subprocess.SubprocessError) as e:
            res.failed.append(name)
            res.notes.append(f"{name} failed: {e}")
            log.write(f"bench p2p: {name} failed: {e}\n")
        else:
            log.write(f"bench p2p: {name} done in "
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
            "benchmark": "p2p",
            "quick": bool(args.quick),
            **machine_info(started),
            "sizes": s.sizes,
            "records": res.records,
            "targets": [t.to_json() for t in ts],
            "notes": res.notes,
        }
        path = Path(args.json)
        write_doc(path, doc)
        print(f"wrote {len(res.records)} records to {path}")
    return 1 if res.failed else 0
