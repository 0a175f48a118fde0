"""Small messages: 8 B latency, message rate, exchange and ring against
vader, round by round, split by the machine's state.

Each round runs short jobs back to back, vader, our BTL in every build
(each from a fresh copy of its file, --copies), vader again, and divides
each figure of ours by the mean of the two vader figures around it; the
rounds are split into states by vader's latency (BENCHMARKS.md, "BTL:
small messages" and "Handoff").
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..mpis import openmpi
from ..errors import InvalidRequest
from .toolkit import (BenchResults, Target, count, measure_rounds, mpi_job,
                      print_grid, program, run_benchmark)

THIS = "ivshmem"      # this build's BTL
REFERENCE = "vader"
# figure -> what the table calls it; every figure is a time, so that a
# ratio below 1 is better than vader for each
FIGURES = {"latency": "8 B latency, one way",
           "rate": "8 B message rate (time per message, window 64)",
           "exchange": "8 B exchange",
           "ring": "8 B ring (half an iteration)"}
# The most of vader's time each figure may take: none more than vader's,
# but the ring, which stands for HPCC's ring latency and its target of
# 0.9 of one instance's speed.
LIMITS = {"latency": 1.0, "rate": 1.0, "exchange": 1.0, "ring": 1 / 0.9}
STEADY = 0.10
STATES_APART = 1.5
REALTIME_PRIORITY = "5"
OSU_KEYS = ("test", "size", "latency_us")
PINGPONG_KEYS = ("size", "latency_us")
BTL_MODULE = f"btl/{openmpi.COMPONENT_FILE}"
COPIES = 4


@dataclass
class SmallSettings:
    rounds: int
    iters: int            # mpi-osu operations; exchange and ring do half
    timeout_s: int        # per job
    builds: List[Tuple[str, Path]] = field(default_factory=list)
    realtime: bool = True
    copies: int = COPIES  # of each BTL's file, one a round in turn
    quick: bool = False

    @property
    def configs(self) -> List[str]:
        """Our BTL's configurations: this build, then the others."""
        return [THIS] + [label for label, _ in self.builds]

    @classmethod
    def make(cls, quick: bool = False, rounds: Optional[int] = None,
             iters: Optional[int] = None,
             builds: Sequence[Tuple[str, os.PathLike]] = (),
             realtime: Optional[bool] = None,
             copies: Optional[int] = None) -> "SmallSettings":
        """Defaults for a measurement (20 rounds) or a plumbing check;
        `builds` are (label, native build directory) of other builds whose
        BTL runs beside this one's; `realtime` (None: when we may) runs
        the ranks in a real-time class; `copies` of each BTL's file take
        turns (default COPIES, quick 1)."""
        checked = []
        for label, path in builds:
            path = Path(path)
            if (not label or label in (THIS, REFERENCE)
                    or label in (b for b, _ in checked)):
                raise InvalidRequest(f"a build needs a label of its own, "
                                     f"not '{label}'")
            if not (path / BTL_MODULE).is_file():
                raise InvalidRequest(f"build '{label}': no {BTL_MODULE} in "
                                     f"{path}")
            checked.append((label, path.resolve()))
        may = os.geteuid() == 0 and shutil.which("chrt") is not None
        if realtime and not may:
            raise InvalidRequest("a real-time class needs root and chrt")
        return cls(rounds=count("rounds", rounds) or (2 if quick else 20),
                   iters=count("operations", iters)
                   or (2000 if quick else 200000),
                   timeout_s=60 if quick else 300, builds=checked,
                   realtime=may if realtime is None else realtime,
                   copies=count("copies", copies) or (1 if quick else COPIES),
                   quick=quick)


# ---------------------------------------------------------------- running

def _programs(s: SmallSettings) -> Tuple[List[str], Dict[str, List[str]]]:
    """The argv of the mpi-osu job and of each mpi-pingpong job by its
    pattern (before the transport), each rank in a real-time class if
    asked."""
    wrap = ["chrt", "-f", REALTIME_PRIORITY] if s.realtime else []
    osu = [*wrap, str(program("mpi-osu")), "--test", "latency,bw",
           "--sizes", "8", "--iters", str(s.iters)]
    pingpong = {pattern: [*wrap, str(program("mpi-pingpong")), "--sizes",
                          "8", "--iters", str(max(1, s.iters // 2)),
                          "--pattern", pattern]
                for pattern in ("exchange", "ring")}
    return osu, pingpong


def run_config(s: SmallSettings, config: str, side: int = 0,
               components: Optional[Path] = None) -> List[Dict]:
    """One round's figures of one configuration (three jobs): records of
    config, figure and us; `side` tells the two vader jobs of a round
    apart; `components`: the directory our BTL is loaded from."""
    transport = REFERENCE if config == REFERENCE else THIS
    osu, pingpong = _programs(s)
    recs, _ = mpi_job(transport, 2, osu + ["--transport", transport],
                      s.timeout_s, f"mpi-osu {config}", OSU_KEYS,
                      components=components)
    figures = {"latency": [r for r in recs if r["test"] == "latency"],
               "rate": [r for r in recs if r["test"] == "bw"]}
    for pattern, argv in pingpong.items():
        figures[pattern], _ = mpi_job(transport, 2, argv, s.timeout_s,
                                      f"mpi-pingpong {pattern} {config}",
                                      PINGPONG_KEYS, components=components)
    return [{"config": config, "side": side, "figure": f,
             "us": rs[0]["latency_us"]}
            for f, rs in figures.items() if rs]


# ---------------------------------------------------------------- analysis

def _steady(vader: Sequence[Dict]) -> Optional[Dict[str, float]]:
    """A round's vader figures (the mean of its two jobs) on which both
    jobs agree within STEADY; None unless they agree on the latency, by
    which the round's state is told."""
    out = {}
    for f in FIGURES:
        us = [r["us"] for r in vader if r["figure"] == f]
        if len(us) == 2 and min(us) > 0 and max(us) / min(us) - 1 <= STEADY:
            out[f] = sum(us) / 2
    return out if "latency" in out else None


def states(latencies: Sequence[float]) -> Tuple[Optional[float], List[str]]:
    """The state of each steady round by vader's latency in it: 'fast' and
    'slow' split at the geometric middle of the extremes when those lie
    more than STATES_APART apart (that middle is returned too), else one
    state, 'single'."""
    if not latencies:
        return None, []
    lo, hi = min(latencies), max(latencies)
    if hi / lo <= STATES_APART:
        return None, ["single"] * len(latencies)
    middle = math.sqrt(lo * hi)
    return middle, ["fast" if v < middle else "slow" for v in latencies]


def analyse(runs: Sequence[Dict], configs: Sequence[str]
            ) -> Tuple[List[Dict], List[str]]:
    """Per state, configuration and figure, the median of the steady
    rounds' ratios to vader (ratio, ratio_min, ratio_max, runs) and of
    the figures themselves (us, vader_us); and notes on what was left
    out."""
    rounds = sorted({r["round"] for r in runs})
    steady = []
    for rnd in rounds:
        mine = [r for r in runs if r["round"] == rnd]
        ref = _steady([r for r in mine if r["config"] == REFERENCE])
        if ref:
            steady.append((ref, mine))
    notes = []
    if len(steady) < len(rounds):
        notes.append(f"{len(rounds) - len(steady)} of {len(rounds)} rounds "
                     f"left out: their two vader jobs' latencies differed "
                     f"by more than {100 * STEADY:.0f} % (the machine "
                     f"changed state), or one failed")
    unsteady = {f: sum(1 for ref, _ in steady if f not in ref)
                for f in FIGURES}
    if any(unsteady.values()):
        notes.append("of the other rounds, left out for one figure (its two "
                     "vader jobs differed by more than "
                     f"{100 * STEADY:.0f} %): " + ", ".join(
                         f"{f} {n}" for f, n in unsteady.items() if n))
    middle, names = states([ref["latency"] for ref, _ in steady])
    if middle is not None:
        notes.append(f"two states: vader's 8 B latency below {middle:.3g} us "
                     f"(fast) and above (slow)")
    records = []
    for state in dict.fromkeys(names):
        group = [x for x, n in zip(steady, names) if n == state]
        for config in configs:
            for f in FIGURES:
                pairs = [(r["us"], ref[f]) for ref, mine in group
                         if f in ref for r in mine
                         if r["config"] == config and r["figure"] == f]
                if not pairs:
                    continue
                ratios = [us / v for us, v in pairs]
                records.append({
                    "state": state, "config": config, "figure": f,
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "us": statistics.median(us for us, _ in pairs),
                    "vader_us": statistics.median(v for _, v in pairs),
                    "runs": len(pairs)})
    return records, notes


# ---------------------------------------------------------------- targets

def targets(res: BenchResults) -> List[Target]:
    """This build within its LIMITS of vader's time in every figure and
    state."""
    out = []
    for r in res.records:
        if r["config"] == THIS:
            out.append(Target(f"{r['figure']} {THIS} / {REFERENCE} "
                              f"({r['state']})", r["ratio"], "<=",
                              round(LIMITS[r["figure"]], 3),
                              best=r["ratio_min"]))
    if not out:
        out.append(Target(f"8 B figures {THIS} / {REFERENCE}", None, "<=",
                          1.0, "no steady round"))
    return out


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, out) -> None:
    configs = list(dict.fromkeys(r["config"] for r in res.records))
    rows = []
    for state in dict.fromkeys(r["state"] for r in res.records):
        for f, name in FIGURES.items():
            recs = {r["config"]: r for r in res.records
                    if r["state"] == state and r["figure"] == f}
            if not recs:
                continue
            first = next(iter(recs.values()))
            row = [state, str(first["runs"]), name,
                   f"{first['vader_us']:.4f}"]
            for c in configs:
                r = recs.get(c)
                row.append("" if r is None else
                           f"{r['us']:.4f}  {r['ratio']:.3f} "
                           f"({r['ratio_min']:.3f}..{r['ratio_max']:.3f})")
            rows.append(row)
    print_grid(["state", "rounds", "figure", "vader (us)",
                *(f"{c}: us, x vader (min..max)" for c in configs)], rows,
               out)


# ---------------------------------------------------------------- driver

def _copy_btls(s: SmallSettings, into: Path) -> Dict[str, List[Path]]:
    """Per configuration of ours, s.copies directories each holding a
    fresh copy of its BTL's file (new pages in the page cache)."""
    sources = {THIS: openmpi.component_dir(),
               **{label: path / "btl" for label, path in s.builds}}
    copies = {}
    for n, (config, src) in enumerate(sources.items()):
        copies[config] = []
        for k in range(s.copies):
            d = into / f"{n}-{k}"
            d.mkdir()
            shutil.copyfile(src / openmpi.COMPONENT_FILE, d / openmpi.COMPONENT_FILE)
            copies[config].append(d)
    return copies


def measure(s: SmallSettings, log=None) -> BenchResults:
    """Every configuration once a round, vader first and last, in
    toolkit.measure_rounds' alternating order; each BTL from its next
    copy (its k-th job from copy k mod s.copies, so a round's jobs share
    a copy number)."""
    res = BenchResults()
    with contextlib.ExitStack() as stack:
        copies = _copy_btls(s, Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="ivcloud-small-"))))
        turns = {config: itertools.count() for config in copies}

        def step(config: str, side: int) -> List[Dict]:
            if config not in copies:
                return run_config(s, config, side)
            k = next(turns[config]) % s.copies
            return [dict(r, copy=k) for r in
                    run_config(s, config, side, copies[config][k])]

        steps = ([(f"{REFERENCE} (first)",
                   functools.partial(step, REFERENCE, 0))]
                 + [(c, functools.partial(step, c, 0)) for c in s.configs]
                 + [(f"{REFERENCE} (second)",
                     functools.partial(step, REFERENCE, 1))])
        measure_rounds(res, "small", s.rounds, steps, log)
    res.records, notes = analyse(res.runs, s.configs)
    res.notes.extend(notes)
    return res


def run(s: SmallSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`: 1 if a job failed."""
    return run_benchmark(
        "small", s.quick, lambda: measure(s, log), targets, print_table,
        json_path, out, rounds=s.rounds, iters=s.iters,
        realtime=s.realtime, steady=STEADY, copies=s.copies,
        builds={label: str(path) for label, path in s.builds})
