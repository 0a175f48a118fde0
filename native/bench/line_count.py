#!/usr/bin/env python3
"""Cache-line handoffs per small message, counted from a trace.

Runs ivshm-line-trace (line_trace.c: both ends of a pair in one thread,
each with its own mapping of the region) under valgrind's lackey, which
prints every load and store of the program with its address, and replays
the accesses to the region on a model of two private caches (a line is
invalid, shared or modified in each; no capacity limit):

  transfer   a side touches a line the other side modified since this
             side last had it: the line's data moves between the cores
             (a load, or a store's read-for-ownership, that misses to the
             other core). This is the handoff docs/fast-path.md counts.
  upgrade    a side stores to a line the other side holds a copy of
             (read since the last store): its copy is invalidated, no
             data moves (but the store waits for the invalidation).

Counted only between the driver's begin and end markers, after a warm-up
that brings both the protocol (the pair on its fast channel) and the
model's caches to a steady state. Per message: transfers and upgrades by
line, the distinct lines each side loads and stores in each call (send,
progress), and the instructions each side executes (lackey's count, the
same on every run).

  line_count.py [--trace BIN] [--path ring|queue|fbox]
                [--pattern pingpong|exchange|window] [--messages N]
                [--blocking] [--json FILE]

--path, --pattern and --blocking go to the driver (see line_trace.c); all
of them when left out: one table per path and pattern. Bad arguments:
one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

PATHS = ("ring", "queue", "fbox")
PATTERNS = ("pingpong", "exchange", "window")
LINE = 64
# marker offsets (line_trace.c, enum M_*): begin, end, then the steps
STEPS = {1: "begin", 2: "end", 3: "A send", 4: "A progress",
         5: "B send", 6: "B progress"}
I, S, M = 0, 1, 2


def default_trace() -> Path:
    here = Path(__file__).resolve().parent
    return here.parent.parent / "build" / "native" / "ivshm-line-trace"


class Layout:
    """The driver's description of the run: mappings, marker, labels."""

    def __init__(self, text: str):
        self.maps = {}
        self.labels = []
        self.marker = None
        self.messages = 0
        for line in text.splitlines():
            f = line.split()
            if not f:
                continue
            if f[0] == "map":
                self.maps[f[1]] = (int(f[2], 16), int(f[3]))
            elif f[0] == "marker":
                self.marker = int(f[1], 16)
            elif f[0] == "label":
                self.labels.append((int(f[2]), int(f[3]), f[1]))
            elif f[0] == "iterations":
                self.messages = int(f[3])
        if set(self.maps) != {"A", "B"} or self.marker is None:
            raise SystemExit("line_count: the driver did not describe its "
                             "mappings (is it ivshm-line-trace?)")
        self.labels.sort()
        self.starts = [lo for lo, _, _ in self.labels]

    def name(self, off: int) -> str:
        i = bisect.bisect_right(self.starts, off) - 1
        if i >= 0:
            lo, n, name = self.labels[i]
            if off < lo + n:
                return name
        return "region (other)"


class Counter:
    def __init__(self, layout: Layout):
        self.lay = layout
        self.state = {}                 # line -> [state of A, state of B]
        self.measuring = False
        self.step = None
        self.transfers = defaultdict(int)   # (label, from, to)
        self.upgrades = defaultdict(int)    # (label, by)
        self.lines = defaultdict(int)       # (step, "load"/"store", label)
        self.insns = defaultdict(int)       # step -> instructions
        self.calls = defaultdict(int)       # step -> calls
        self.cur_load = set()
        self.cur_store = set()
        (a0, an), (b0, bn) = layout.maps["A"], layout.maps["B"]
        self.ranges = [(a0, a0 + an, 0), (b0, b0 + bn, 1)]

    def close_step(self) -> None:
        if self.measuring and self.step is not None:
            for ln in self.cur_load:
                self.lines[(self.step, "load", self.lay.name(ln * LINE))] += 1
            for ln in self.cur_store:
                self.lines[(self.step, "store",
                            self.lay.name(ln * LINE))] += 1
        self.cur_load = set()
        self.cur_store = set()

    def marker(self, m: int) -> None:
        self.close_step()
        if m == 1:
            self.measuring = True
            self.step = None
        elif m == 2:
            self.measuring = False
            self.step = None
        elif m in STEPS:
            self.step = STEPS[m]
            if self.measuring:
                self.calls[self.step] += 1

    def touch(self, side: int, line: int, store: bool) -> None:
        st = self.state.get(line)
        if st is None:
            st = self.state[line] = [I, I]
        me, other = st[side], st[1 - side]
        name = None
        if self.measuring:
            (self.cur_store if store else self.cur_load).add(line)
        if not store:
            if me == I:
                if other == M:
                    if self.measuring:
                        name = self.lay.name(line * LINE)
                        self.transfers[(name, "AB"[1 - side],
                                        "AB"[side])] += 1
                    st[1 - side] = S
                st[side] = S
            return
        if me != M:
            if other == M and me == I:
                if self.measuring:
                    name = self.lay.name(line * LINE)
                    self.transfers[(name, "AB"[1 - side], "AB"[side])] += 1
            elif other != I:
                if self.measuring:
                    name = self.lay.name(line * LINE)
                    self.upgrades[(name, "AB"[side])] += 1
            st[side] = M
            st[1 - side] = I

    def access(self, kind: str, addr: int, size: int) -> None:
        mk = self.lay.marker
        if mk <= addr < mk + 4096:
            if kind in "SM":
                self.marker((addr - mk) // LINE)
            return
        for lo, hi, side in self.ranges:
            if lo <= addr < hi:
                first = (addr - lo) // LINE
                last = (addr + max(size, 1) - 1 - lo) // LINE
                for line in range(first, last + 1):
                    if kind == "M":
                        self.touch(side, line, False)
                        self.touch(side, line, True)
                    else:
                        self.touch(side, line, kind == "S")
                return

    def instruction(self) -> None:
        if self.measuring and self.step is not None:
            self.insns[self.step] += 1


ACCESS = re.compile(r"^ ([LSM]) ([0-9a-f]+),(\d+)")


def replay(log: Path, layout: Layout) -> Counter:
    c = Counter(layout)
    with open(log, "r", errors="replace") as f:
        for line in f:
            if line.startswith("I"):
                c.instruction()
                continue
            m = ACCESS.match(line)
            if m:
                c.access(m.group(1), int(m.group(2), 16), int(m.group(3)))
    c.close_step()
    return c


def run_one(trace: Path, path: str, pattern: str, messages: int,
            blocking: bool) -> dict:
    argv = [str(trace), "--path", path, "--pattern", pattern,
            "--messages", str(messages)]
    if blocking:
        argv.append("--blocking")
    with tempfile.TemporaryDirectory(prefix="line-count-") as tmp:
        log = Path(tmp) / "lackey.log"
        proc = subprocess.run(
            ["valgrind", "--tool=lackey", "--trace-mem=yes",
             f"--log-file={log}", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"line_count: {' '.join(argv)} failed: "
                             f"{proc.stderr.strip().splitlines()[-1:]}")
        layout = Layout(proc.stdout)
        c = replay(log, layout)
    n = layout.messages
    per = lambda v: round(v / n, 3)  # noqa: E731
    steps = {}
    for step, calls in sorted(c.calls.items()):
        loads = {k[2]: per(v) for k, v in c.lines.items()
                 if k[0] == step and k[1] == "load"}
        stores = {k[2]: per(v) for k, v in c.lines.items()
                  if k[0] == step and k[1] == "store"}
        steps[step] = {"calls_per_message": per(calls),
                       "instructions_per_message": per(c.insns[step]),
                       "lines_loaded_per_message": loads,
                       "lines_stored_per_message": stores}
    return {
        "path": path, "pattern": pattern, "blocking": blocking,
        "messages": n,
        "transfers_per_message": round(sum(c.transfers.values()) / n, 3),
        "upgrades_per_message": round(sum(c.upgrades.values()) / n, 3),
        "transfers": {f"{k[0]} {k[1]}->{k[2]}": per(v)
                      for k, v in sorted(c.transfers.items())},
        "upgrades": {f"{k[0]} by {k[1]}": per(v)
                     for k, v in sorted(c.upgrades.items())},
        "steps": steps,
    }


def short(label: str) -> str:
    """ring[B:0].slots -> ring.slots: which side's area is in the key."""
    return re.sub(r"\[[AB](?::\d+)?\]", "", label)


def print_result(r: dict, out=sys.stdout) -> None:
    out.write(f"\n== {r['path']} {r['pattern']}"
              f"{' (may_sleep)' if r['blocking'] else ''}: "
              f"{r['messages']} messages\n")
    out.write(f"transfers per message {r['transfers_per_message']:.3f}, "
              f"upgrades per message {r['upgrades_per_message']:.3f}\n")
    for k, v in r["transfers"].items():
        out.write(f"  transfer {k:<44} {v:7.3f}\n")
    for k, v in r["upgrades"].items():
        out.write(f"  upgrade  {k:<44} {v:7.3f}\n")
    for step, s in r["steps"].items():
        loads = sum(s["lines_loaded_per_message"].values())
        stores = sum(s["lines_stored_per_message"].values())
        out.write(f"  {step:<11} calls {s['calls_per_message']:6.2f}  "
                  f"instructions {s['instructions_per_message']:8.1f}  "
                  f"lines loaded {loads:5.2f} stored {stores:5.2f}\n")
        for kind in ("loaded", "stored"):
            d = defaultdict(float)
            for k, v in s[f"lines_{kind}_per_message"].items():
                d[short(k)] += v
            if d:
                items = ", ".join(f"{k} {v:.2f}" for k, v in sorted(d.items()))
                out.write(f"      {kind}: {items}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="line_count.py",
        description="cache-line handoffs per small message (valgrind lackey "
                    "over ivshm-line-trace)")
    p.add_argument("--trace", type=Path, default=default_trace())
    p.add_argument("--path", choices=PATHS, action="append")
    p.add_argument("--pattern", choices=PATTERNS, action="append")
    p.add_argument("--messages", type=int, default=256)
    p.add_argument("--blocking", action="store_true",
                   help="both sides may sleep (the spin-then-block case)")
    p.add_argument("--json", type=Path)
    try:
        a = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    if not 1 <= a.messages <= 100000:
        sys.stderr.write("line_count.py: --messages is 1 to 100000\n")
        return 2
    if not os.access(a.trace, os.X_OK):
        sys.stderr.write(f"line_count.py: no driver at {a.trace} "
                         "(make build)\n")
        return 2
    if not shutil.which("valgrind"):
        sys.stderr.write("line_count.py: valgrind is not installed\n")
        return 2
    results = []
    for path in a.path or PATHS:
        for pattern in a.pattern or PATTERNS:
            r = run_one(a.trace, path, pattern, a.messages, a.blocking)
            print_result(r)
            results.append(r)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
