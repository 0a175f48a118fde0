"""Mesh-convergence studies: one problem at several in-plane cell sizes.

    from micromag import convergence, problem
    prob = problem.load("examples/sp4.toml")
    text = convergence.problem_toml(prob, cell=5.0, layers=3)   # TOML
    ... run each (``ivcloud mag converge`` does it) ...
    curves = {5.0: convergence.read_curve("out/h5"), ...}
    report = convergence.compare(curves, times=[0.1e-9, 0.5e-9, 1e-9])

A study refines the structured box's in-plane cells (hx = hy = cell)
with a fixed number of element layers across the thickness, runs the
problem's stages unchanged (relaxation, then the dynamics) and compares
<m>(t) of the last `llg` stage, measured from that stage's start, between
successive refinements. A run still going (or stopped) is read from its
staging directory and compared up to the time it reached.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import problem as problem_mod
from .errors import ProblemError


def problem_toml(prob: problem_mod.Problem, cell: float, layers: int,
                 duration: Optional[float] = None) -> str:
    """The effective TOML of `prob` with in-plane cells of `cell` (in the
    mesh's unit) and `layers` element layers across z; `duration` (s)
    shortens the last llg stage. Snapshots only at the stage's end."""
    cfg = copy.deepcopy(prob.config)
    mesh = cfg["mesh"]
    if mesh["shape"] != "box" or not mesh.get("structured", False):
        raise ProblemError("a convergence study needs a structured box mesh")
    if not (cell > 0 and layers >= 1):
        raise ProblemError("cell size and layers must be positive")
    lz = mesh["size"][2]
    mesh["h"] = [float(cell), float(cell), lz / layers]
    llg = [s for s in cfg["stage"] if s["type"] == "llg"]
    if not llg:
        raise ProblemError("a convergence study needs an llg stage")
    if duration is not None:
        llg[-1]["duration"] = float(duration)
    for s in cfg["stage"]:
        if s["type"] == "llg":
            s["snapshot_every"] = 0.0
    text = problem_mod.to_toml(cfg)
    problem_mod.from_dict(_parse(text), name="convergence problem")
    return text


def _parse(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # pragma: no cover - python < 3.11
        import tomli as tomllib
    return tomllib.loads(text)


def table_path(run_dir) -> Optional[Path]:
    """table.csv of a finished run, else of its staging directory."""
    d = Path(run_dir)
    for p in (d / "table.csv", d / ".incomplete" / "table.csv"):
        if p.is_file():
            return p
    return None


def read_curve(run_dir) -> Dict[str, np.ndarray]:
    """{"t": stage time (s), "m": (k, 3)} of the last llg stage in a run's
    table (rows of one time kept once, the last)."""
    path = table_path(run_dir)
    if path is None:
        raise ProblemError(f"{run_dir}: no table.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    stages = sorted({int(float(r["stage"])) for r in rows})
    if not stages:
        return {"t": np.zeros(0), "m": np.zeros((0, 3))}
    last = stages[-1]
    sel = [r for r in rows if int(float(r["stage"])) == last]
    t = np.array([float(r["t"]) for r in sel])
    m = np.array([[float(r["mx"]), float(r["my"]), float(r["mz"])]
                  for r in sel])
    t = t - t[0]
    # a relax stage's table has a row before and after at the same t
    _, idx = np.unique(t[::-1], return_index=True)
    keep = len(t) - 1 - idx
    return {"t": t[keep], "m": m[keep]}


def value_at(curve: Dict[str, np.ndarray], t: float) -> Optional[np.ndarray]:
    """<m> at stage time t (linear interpolation between table rows), or
    None past the end of the curve."""
    ts = curve["t"]
    if len(ts) == 0 or t > ts[-1] * (1 + 1e-9) + 1e-18:
        return None
    return np.array([np.interp(t, ts, curve["m"][:, c]) for c in range(3)])


def compare(curves: Dict[float, Dict[str, np.ndarray]],
            times: Sequence[float]) -> Dict[str, list]:
    """<m> at `times` for each cell size (coarse to fine) and the change
    between successive refinements, per component and as the largest
    component (None where a run has not reached the time)."""
    cells = sorted(curves, reverse=True)
    values = []
    for c in cells:
        row = []
        for t in times:
            v = value_at(curves[c], t)
            row.append(None if v is None else [float(x) for x in v])
        values.append({"cell": c, "m": row,
                       "t_reached": float(curves[c]["t"][-1])
                       if len(curves[c]["t"]) else 0.0})
    diffs = []
    for a, b in zip(values, values[1:]):
        row = []
        for va, vb in zip(a["m"], b["m"]):
            if va is None or vb is None:
                row.append(None)
            else:
                d = [vb[k] - va[k] for k in range(3)]
                row.append({"dm": d, "max": max(abs(x) for x in d)})
        diffs.append({"from": a["cell"], "to": b["cell"], "at": row})
    return {"times": list(times), "values": values, "differences": diffs}


def format_table(report: Dict[str, list]) -> str:
    """The differences of `compare` as a text table."""
    times = report["times"]
    head = "refinement        " + "".join(f"{t * 1e9:>24.3g} ns"
                                          for t in times)
    lines = [head]
    for d in report["differences"]:
        cells = []
        for x in d["at"]:
            if x is None:
                cells.append(f"{'(not reached)':>27}")
            else:
                cells.append("   " + " ".join(f"{v:+.4f}" for v in x["dm"]))
        lines.append(f"{d['from']:g} -> {d['to']:g} nm".ljust(18)
                     + "".join(cells))
    return "\n".join(lines)


def plot(curves: Dict[float, Dict[str, np.ndarray]], path,
         title: str = "") -> None:
    """<m>(t) of every cell size in one PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (1, 1))]
    colors = ("tab:red", "tab:green", "tab:blue")
    for i, c in enumerate(sorted(curves, reverse=True)):
        cv = curves[c]
        for k, name in enumerate(("mx", "my", "mz")):
            ax.plot(cv["t"] * 1e9, cv["m"][:, k], color=colors[k],
                    linestyle=styles[i % len(styles)], linewidth=1.2,
                    label=f"<{name}> {c:g} nm")
    ax.set_xlabel("t (ns)")
    ax.set_ylabel("<m>")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def converged(report: Dict[str, list], tol: float) -> List[float]:
    """Cell sizes c whose step to the next finer size changed no
    component by tol or more at any compared time (all reached)."""
    out = []
    for d in report["differences"]:
        if all(x is not None and x["max"] < tol for x in d["at"]):
            out.append(d["from"])
    return out


def parse_cells(text: str) -> List[float]:
    try:
        cells = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProblemError(f"'{text}' is not a list of cell sizes")
    if not cells or any(not (c > 0 and math.isfinite(c)) for c in cells):
        raise ProblemError(f"'{text}': cell sizes must be positive")
    return cells
