"""`ivcloud mag bench`: the micromagnetic solver on its example problems.

Each run is one `ivcloud mag run` process of an example (the thesis's
bar, µMAG standard problem 4 field 1 or field 2) on a rank count, timed
as a user starts it (time to solution), in alternating rounds; per round
the parallel efficiency T1 / (N TN), and for a problem with a published
solution the largest component of <m> at the end minus the reference
(micromag.convergence.reference_for), for field 2 also its first <mx>
zero crossing against the reference run's and whether <m>(1 ns) lies in
the published spread. With a peer (`--peer neuralmag`, mag_peer.py)
each standard problem 4 also runs in that finite-difference code on as
many cores, in the same rounds.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..apps.mag import TRANSPORTS, run_command
from ..errors import InvalidRequest
from . import mag_curved, mag_peer
from .toolkit import (BenchResults, Target, checked_run, measure_rounds,
                      print_grid, run_benchmark, run_closed, spread,
                      summarize)

REPO = Path(__file__).resolve().parents[2]
PROBLEMS = ("bar", "sp4")
# The goals the benchmark reports against: the bar within 10 s on one
# core, standard problem 4 (relax and 1 ns) within 10 minutes on two
# ranks and within 0.01 of the published <m>(1 ns), two ranks at 80 %
# efficiency of time to solution.
BAR_ONE_CORE_S = 10.0
SP4_TWO_RANKS_S = 600.0
SP4_ERROR = 0.01
# the examples that are standard problem 4, by field (what a peer runs)
SP4_FIELDS = {"sp4": 1, "sp4_field2": 2}
EFFICIENCY = 0.8
# Magpar on the thesis's VMs (seed 000, table 1): the bar on 1 and 4 vCPUs.
ANCHORS = {"magpar_bar_1_vcpu_s": 114, "magpar_bar_4_vcpu_s": 65}
FIELDS = ("time_to_solution_s", "solve_time_s", "setup_time_s",
          "solve_cpu_s_max_rank", "ms_per_field_eval", "peak_rss_mb_per_rank",
          "efficiency_time_to_solution", "efficiency")


@dataclass
class MagBenchSettings:
    problems: Sequence[str] = PROBLEMS
    ranks: Sequence[int] = (1, 2)
    rounds: int = 3
    examples: Path = REPO / "examples"
    transport: str = "vader"
    timeout_s: float = 3600.0
    peer: Optional[str] = None
    files: Dict[str, Path] = field(default_factory=dict)

    def __post_init__(self):
        from micromag.errors import ProblemError
        from micromag.problem import load
        if self.transport not in TRANSPORTS:
            raise InvalidRequest(f"transport '{self.transport}' unknown "
                                 f"({', '.join(TRANSPORTS)})",
                                 setting="transport")
        if not self.problems:
            raise InvalidRequest("no problems to run", setting="problems")
        if not self.ranks or min(self.ranks) < 1:
            raise InvalidRequest("rank counts must be positive",
                                 setting="np")
        if self.rounds < 1:
            raise InvalidRequest("rounds must be at least 1",
                                 setting="rounds")
        for name in self.problems:
            f = Path(self.examples) / f"{name}.toml"
            if not f.is_file():
                raise InvalidRequest(f"example problem {f} not found",
                                     setting="problems")
            try:
                load(f)
            except ProblemError as e:
                raise InvalidRequest(str(e), setting="problems") from None
            self.files[name] = f
        if self.peer is not None:
            self._check_peer()

    def _check_peer(self) -> None:
        """The peer runs standard problem 4 as published, field 1 or 2:
        the run set must have sp4 or sp4_field2 (each file that problem:
        its reference is what both are measured against), and enough
        CPUs for the rank counts; or the curved body
        (ivcloud.bench.mag_curved)."""
        if not self.peer_problems() and \
                mag_curved.EXAMPLE not in self.problems:
            raise InvalidRequest("a peer runs standard problem 4 and "
                                 f"{mag_curved.EXAMPLE} only: the problems "
                                 "must include sp4 (field 1), sp4_field2 "
                                 f"(field 2) or {mag_curved.EXAMPLE}",
                                 setting="peer")
        for name in self.peer_problems():
            if _field_of(self.files[name]) != SP4_FIELDS[name]:
                raise InvalidRequest(f"{self.files[name]} is not standard "
                                     f"problem 4, field {SP4_FIELDS[name]}",
                                     setting="peer")
        mag_peer.python(self.peer)
        mag_peer.cpus_for(max(self.ranks))

    def peer_problems(self) -> List[str]:
        return [n for n in self.problems if n in SP4_FIELDS]


def _field_of(problem: Path) -> Optional[int]:
    from micromag import convergence
    from micromag.problem import load
    return convergence.sp4_field(load(problem))


def _one_run(s: MagBenchSettings, name: str, ranks: int,
             problem: Optional[Path] = None) -> List[Dict]:
    """One `ivcloud mag run` of example `name` (or of the file `problem`,
    a variant of it) on `ranks` ranks: its record."""
    problem = problem or s.files[name]
    with tempfile.TemporaryDirectory(prefix="ivcloud-mag-bench-") as tmp:
        out = Path(tmp) / "run"
        cmd = run_command(problem, out, ranks, s.transport)
        t0 = time.perf_counter()
        checked_run(functools.partial(run_closed, cmd), s.timeout_s,
                    f"{name} on {ranks} rank(s)")
        wall = time.perf_counter() - t0
        summary = json.loads((out / "summary.json").read_text())
        from micromag import convergence
        rec = _record(name, ranks, wall, summary)
        rec.update(_against_reference(problem,
                                      convergence.read_curve(out)))
    return [rec]


def _peer_run(s: MagBenchSettings, name: str, cores: int) -> List[Dict]:
    """Standard problem 4 (example `name`: its field) in the peer on
    `cores` cores: its record, with the same reference as ours."""
    out = mag_peer.run_sp4(s.peer, cores, s.timeout_s,
                           field=SP4_FIELDS[name])
    curve = out.pop("curve")
    rec = {"problem": name, "code": s.peer, "ranks": cores,
           "nodes": (out["cells"][0] + 1) * (out["cells"][1] + 1),
           "demag": f"FD {out['cells'][0]} x {out['cells'][1]}, "
                    f"{out['cell_nm']:g} nm",
           **out}
    rec.update(_against_reference(s.files[name], curve, out["m_final"],
                                  1e-9))
    return [rec]


def _record(name: str, ranks: int, wall: float, s: Dict) -> Dict:
    return {
        "problem": name, "code": "ivcloud", "ranks": ranks,
        "nodes": s["nodes"],
        "boundary_nodes": s["boundary_nodes"],
        "demag": s.get("demag_method") or s["demag"],
        "demag_grid": s.get("demag_grid"),
        "time_to_solution_s": round(wall, 3),
        "solve_time_s": round(s["solve_time_s"], 3),
        "setup_time_s": round(s["setup_time_s"], 3),
        "solve_cpu_s_max_rank": round(s.get("solve_cpu_s", {}).get("max",
                                                                  0.0), 3),
        "steps": s["steps"], "rejected_steps": s["rejected_steps"],
        "relax_iterations": s["relax_iterations"],
        "rhs_evals": s["rhs_evals"], "field_evals": s["field_evals"],
        "field_time_s": round(s.get("field_time_s", 0.0), 3),
        "ms_per_field_eval": round(1e3 * s.get("field_time_s", 0.0)
                                   / max(1, s["field_evals"]), 4),
        "peak_rss_mb_per_rank": round(s["peak_rss_mb"]["max"], 1),
        "peak_rss_mb_ranks": [round(v, 1)
                              for v in s["peak_rss_mb"]["per_rank"]],
        "m_final": [round(v, 5) for v in s["m_final"]],
    }


def _against_reference(problem: Path, curve: Dict,
                       m: Optional[Sequence[float]] = None,
                       t: Optional[float] = None) -> Dict:
    """Where `problem` has a published solution (micromag.convergence):
    <m> at time `t` (default: the end of `curve`, <m>(t) of a run) minus
    the reference there (nothing where the reference does not reach
    `t`), the first <mx> zero crossing of `curve` and, where the
    reference carries them (standard problem 4, field 2), its difference
    to the reference's and whether <m>(1 ns) lies in the published
    spread."""
    from micromag import convergence
    from micromag.problem import load
    ref = convergence.reference_for(load(problem))
    if ref is None:
        return {}
    if t is None:
        t = float(curve["t"][-1])
        m = convergence.value_at(curve, t)
    rec = {}
    r = convergence.value_at(ref, t)
    if m is not None and r is not None:
        diff = [float(a - b) for a, b in zip(m, r)]
        rec = {"reference": ref["name"], "reference_t_s": t,
               "minus_reference": [round(v, 5) for v in diff],
               "error_max": round(max(abs(v) for v in diff), 5)}
    x = convergence.first_crossing(curve)
    rec["first_crossing_s"] = x
    if "crossing_tol_s" in ref:
        rc = convergence.first_crossing(ref)
        rec["crossing_minus_reference_ps"] = (
            None if x is None else round((x - rc) * 1e12, 3))
    if "spread" in ref:
        rec["inside_spread"] = convergence.checks(curve, ref).get(
            "inside_spread")
    return rec


def _add_efficiencies(runs: List[Dict]) -> None:
    """Per round: speed-up and efficiency of every run against the same
    problem's 1-rank run of that round (time to solution and solve)."""
    base = {(r["problem"], r["code"], r["round"]): r for r in runs
            if r["ranks"] == 1}
    for r in runs:
        one = base.get((r["problem"], r["code"], r["round"]))
        if one is None:
            continue
        w = one["time_to_solution_s"] / r["time_to_solution_s"]
        r["speedup_time_to_solution"] = round(w, 3)
        r["efficiency_time_to_solution"] = round(w / r["ranks"], 3)
        if "solve_time_s" in r:
            s = one["solve_time_s"] / r["solve_time_s"]
            r["speedup"] = round(s, 3)
            r["efficiency"] = round(s / r["ranks"], 3)


def _add_peer_ratios(runs: List[Dict], peer: str) -> None:
    """Per problem, round and core count: our time to solution of
    standard problem 4 over the peer's."""
    theirs = {(r["problem"], r["ranks"], r["round"]): r for r in runs
              if r["code"] == peer}
    for r in runs:
        other = theirs.get((r["problem"], r["ranks"], r["round"]))
        if r["code"] == "ivcloud" and other:
            r["time_over_peer"] = round(r["time_to_solution_s"]
                                        / other["time_to_solution_s"], 3)


def measure(s: MagBenchSettings, log=None) -> BenchResults:
    log = log or sys.stderr
    res = BenchResults()
    steps = [(f"{name} on {n} rank(s)",
              (lambda name=name, n=n: _one_run(s, name, n)))
             for name in s.problems for n in s.ranks
             if name != mag_curved.EXAMPLE]
    if mag_curved.EXAMPLE in s.problems:
        steps += mag_curved.steps(s, _one_run)
    if s.peer:
        steps += [(f"{name} in {s.peer} on {n} core(s)",
                   (lambda name=name, n=n: _peer_run(s, name, n)))
                  for name in s.peer_problems() for n in s.ranks]
    measure_rounds(res, "mag", s.rounds, steps, log)
    _add_efficiencies(res.runs)
    if s.peer:
        _add_peer_ratios(res.runs, s.peer)
    res.records = summarize(
        res.runs, ("problem", "code", "ranks", "size_nm"),
        FIELDS + ("time_over_peer",),
        middle=("m_final", "minus_reference", "error_max", "error_rel",
                "first_crossing_s", "crossing_minus_reference_ps",
                "inside_spread"))
    for rec in res.records:
        if rec["ranks"] > 1 and "efficiency" in rec:
            log.write(f"bench mag: {rec['problem']} on {rec['ranks']} "
                      f"ranks: efficiency "
                      f"{rec['efficiency_time_to_solution']:.2f} (time to "
                      f"solution), {rec['efficiency']:.2f} (solve), "
                      f"medians of {rec['runs']} round(s)\n")
    return res


def targets(res: BenchResults) -> List[Target]:
    ts = []
    for name, ranks, on, goal in (("bar", 1, "1 core", BAR_ONE_CORE_S),
                                  ("sp4", 2, "2 ranks", SP4_TWO_RANKS_S),
                                  ("sp4_field2", 2, "2 ranks",
                                   SP4_TWO_RANKS_S)):
        r = res.find(problem=name, code="ivcloud", ranks=ranks)
        if r is not None:
            ts.append(Target(f"{name}, {on}: time to solution (s)",
                             r["time_to_solution_s"], "<=", goal,
                             best=r.get("time_to_solution_s_min")))
    sp4 = (res.find(problem="sp4", code="ivcloud", ranks=2)
           or res.find(problem="sp4", code="ivcloud"))
    if sp4 is not None and "error_max" in sp4:
        ts.append(Target("sp4: |<m>(1 ns) - reference|, largest component",
                         sp4["error_max"], "<=", SP4_ERROR))
    f2 = (res.find(problem="sp4_field2", code="ivcloud", ranks=2)
          or res.find(problem="sp4_field2", code="ivcloud"))
    if f2 is not None and "crossing_minus_reference_ps" in f2:
        from micromag.convergence import SP4_FIELD2_CROSSING_TOL_S
        d = f2["crossing_minus_reference_ps"]
        ts.append(Target("sp4_field2: |first <mx> crossing - FD 1.25 nm|"
                         " (ps)", None if d is None else abs(d), "<=",
                         SP4_FIELD2_CROSSING_TOL_S * 1e12,
                         why_missing="<mx> never crossed zero"))
    if f2 is not None and "inside_spread" in f2:
        v = f2["inside_spread"]
        ts.append(Target("sp4_field2: <m>(1 ns) inside the published "
                         "spread (1 yes, 0 no)",
                         None if v is None else float(v), ">=", 1.0,
                         why_missing="the run did not reach 1 ns"))
    for name in ("bar", "sp4"):
        two = res.find(problem=name, code="ivcloud", ranks=2)
        if two is not None and "efficiency_time_to_solution" in two:
            ts.append(Target(f"{name}, 2 ranks: efficiency (time to "
                             f"solution)",
                             two["efficiency_time_to_solution"], ">=",
                             EFFICIENCY,
                             best=two.get("efficiency_time_to_solution_max")))
    for r in res.records:
        if "time_over_peer" in r:
            peer = next(p["code"] for p in res.records
                        if p["code"] not in ("ivcloud",))
            ts.append(Target(f"{r['problem']}, {r['ranks']} rank(s): "
                             f"time to solution, ours / {peer}'s on as "
                             f"many cores",
                             r["time_over_peer"], "<=", 1.0,
                             best=r.get("time_over_peer_min")))
    return ts + mag_curved.targets(res)


def print_table(res: BenchResults, out) -> None:
    rows = []
    for r in res.records:
        if r["problem"] == mag_curved.EXAMPLE:
            continue        # its own table below
        err = r.get("minus_reference")
        ours = r["code"] == "ivcloud"
        rows.append([
            r["problem"] if ours else f"{r['problem']} ({r['code']})",
            str(r["ranks"]), f"{r['nodes']:,}",
            str(r["demag"]), str(r["runs"]),
            f"{r['time_to_solution_s']:.2f}",
            spread(r, "time_to_solution_s", "{:.2f}"),
            f"{r['solve_time_s']:.2f}" if ours else "",
            f"{r['field_evals']:,}" if ours else "",
            f"{r['ms_per_field_eval']:.3g}" if ours else "",
            f"{r['peak_rss_mb_per_rank']:.0f}" if ours else "",
            "" if "efficiency_time_to_solution" not in r or r["ranks"] == 1
            else f"{r['efficiency_time_to_solution']:.2f}",
            "" if r["ranks"] == 1 else
            spread(r, "efficiency_time_to_solution", "{:.2f}"),
            "" if err is None else
            "(" + ", ".join(f"{v:+.4f}" for v in err) + ")",
            _crossing_cell(r)])
    if rows:
        print_grid(["problem", "ranks", "nodes", "demag", "rounds",
                    "time to solution s", "spread", "solve s",
                    "field evals", "ms/eval", "peak MB/rank", "efficiency",
                    "spread", "<m>(end) - reference", "first <mx> = 0 ns"],
                   rows, out)
    mag_curved.print_table(res, out)


def _crossing_cell(r: Dict) -> str:
    """The first <mx> crossing, with its difference to the reference's
    and the spread check where the problem has them (field 2)."""
    x = r.get("first_crossing_s")
    if x is None:
        return ""
    text = f"{x * 1e9:.4f}"
    d = r.get("crossing_minus_reference_ps")
    if d is not None:
        text += f" ({d:+.2f} ps)"
    if "inside_spread" in r:
        text += (", <m>(1 ns) in spread" if r["inside_spread"]
                 else ", <m>(1 ns) OUTSIDE spread")
    return text


def run(s: MagBenchSettings, json_path: Optional[Path] = None,
        out=None, log=None) -> int:
    """run_benchmark of `s`: 1 if a run failed."""
    return run_benchmark(
        "mag", False, lambda: measure(s, log), targets, print_table,
        json_path, out, problems=list(s.problems), ranks=list(s.ranks),
        rounds=s.rounds, transport=s.transport, peer=s.peer,
        anchors=ANCHORS)
