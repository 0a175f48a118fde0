"""Mesh-convergence studies: one problem at several in-plane cell sizes.

    from micromag import convergence, problem
    prob = problem.load("examples/sp4.toml")
    text = convergence.problem_toml(prob, cell=5.0, layers=3)   # TOML
    ... run each (``ivcloud mag converge`` does it) ...
    curves = {5.0: convergence.read_curve("out/h5"), ...}
    report = convergence.compare(curves, times=[0.1e-9, 0.5e-9, 1e-9])

    ref = convergence.reference_for(prob)          # SP4 field 1: OOMMF
    report = convergence.compare(curves, times, reference=ref)

A study refines the structured box's in-plane cells (hx = hy = cell)
with a fixed number of element layers across the thickness, runs the
problem's stages unchanged (relaxation, then the dynamics) and compares
<m>(t) of the last `llg` stage, measured from that stage's start, between
successive refinements. A run still going (or stopped) is read from its
staging directory and compared up to the time it reached.

A reference solution, when there is one, goes into the table and the
plot, with the difference of every cell size to it: for µMAG standard
problem 4, field 1 the published OOMMF solution below, for field 2 a
converged finite-difference run and the spread of the published
<m>(1 ns) (both recognised from the problem's geometry, material and
field), or any curve read from a file of `t mx my mz` columns
(`read_reference`).

Field 2's published <m>(1 ns) scatter (the reversal passes close to a
bifurcation), so its check is the first zero crossing of <mx>, which
converges: within SP4_FIELD2_CROSSING_TOL_S of the reference run's, and
<m>(1 ns) inside the published spread (`checks`).
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

# µMAG standard problem 4, field 1 (https://www.ctcms.nist.gov/~rdm/std4/
# spec4.html): <m> of the OOMMF solution with 2.5 x 2.5 x 3 nm cells that
# fidimag compares against, read from its data file (repository
# computationalmodelling/fidimag, examples/micromagnetic/std4/oommf.txt,
# git blob e8c88a0f1e077213b10170c5892714512889ba59, 1 ps rows); mumax3's
# regression test (128 x 32 cells) expects the same <m>(1 ns) within 1e-3.
# Provenance and the other published values: docs/mag-sp4-references.md.
# Only these rows are tabulated: a time between them has no reference
# value (the curve oscillates with a period of ~0.1 ns, so interpolating
# between rows 0.1 ns apart would invent figures).
SP4_FIELD1_REFERENCE = {
    "name": "OOMMF, 2.5 nm cells",
    "source": "computationalmodelling/fidimag "
              "examples/micromagnetic/std4/oommf.txt (blob e8c88a0f); "
              "docs/mag-sp4-references.md",
    "interpolate": False,
    "first_crossing_s": 0.1385e-9,
    "t": [0.02e-9, 0.05e-9, 0.1e-9, 0.2e-9, 0.3e-9, 0.4e-9, 0.5e-9,
          0.6e-9, 0.7e-9, 0.8e-9, 0.9e-9, 1.0e-9],
    "m": [[+0.95514, +0.16228, -0.02439],
          [+0.87807, +0.32511, -0.05355],
          [+0.52146, +0.66498, -0.08469],
          [-0.81590, -0.06182, -0.15274],
          [-0.74274, -0.00910, +0.06935],
          [-0.77738, +0.40906, -0.02967],
          [-0.91916, -0.22449, +0.04779],
          [-0.91297, +0.31022, -0.06827],
          [-0.94567, +0.20000, +0.05466],
          [-0.96120, -0.16407, -0.01341],
          [-0.92918, +0.33530, -0.03560],
          [-0.98451, +0.12745, +0.04315]],
}
# mumax3's regression test of field 1 (repository mumax/3,
# test/standardproblem4.go at 09b03867, 128 x 32 cells of 3.9 nm): the
# certified <m>(1 ns), within 1e-3 of the OOMMF curve above
SP4_FIELD1_CERTIFIED_1NS = (-0.9845, 0.1268, 0.0432)
# µMAG standard problem 4, field 2: <m>(1 ns) of the published solutions
# whose numbers are public (docs/mag-sp4-references.md, "Field 2"):
# their spread, per component, is what ours must fall inside
SP4_FIELD2_PUBLISHED_1NS = {
    "Albuquerque, 2 nm (NIST submission)": (-0.97099, -0.08595, +0.00192),
    "Albuquerque, 4 nm (NIST submission)": (-0.96519, -0.11632, -0.00843),
    "mumax3, 3.9 nm (its regression test)": (-0.96923, -0.12040, -0.00531),
}
# their first <mx> zero crossings (OOMMF's: the time in the name of its
# published snapshot at the crossing, to 1 ps)
SP4_FIELD2_PUBLISHED_CROSSING_S = {
    "OOMMF, 1 nm (NIST, Donahue and Porter)": 0.137e-9,
    "Albuquerque, 2 nm (NIST submission)": 0.13824e-9,
    "Albuquerque, 4 nm (NIST submission)": 0.13622e-9,
}
# field 2's check: the first crossing within this of the reference run's
SP4_FIELD2_CROSSING_TOL_S = 2e-12
# The reference of field 2: NeuralMag (nodal finite differences, Newell
# demag) at 1.25 nm cells, <m> every 1 ps (provenance, command and the
# 2.5 nm run beside it: docs/mag-sp4-references.md, "Field 2"); its rows
# at the times field 1's OOMMF curve is tabulated, the crossing from its
# 1 ps rows
SP4_FIELD2_REFERENCE = {
    "name": "NeuralMag, 1.25 nm cells",
    "source": "ivcloud/bench/peers/neuralmag_sp4.py 1.25 2 1e-12; "
              "docs/mag-sp4-references.md",
    "interpolate": False,
    "first_crossing_s": 0.136631e-9,
    "t": [0.02e-9, 0.05e-9, 0.1e-9, 0.2e-9, 0.3e-9, 0.4e-9, 0.5e-9,
          0.6e-9, 0.7e-9, 0.8e-9, 0.9e-9, 1.0e-9],
    "m": [[+0.95804, +0.11233, +0.00533],
          [+0.89802, +0.04226, +0.01322],
          [+0.55733, -0.18638, +0.03804],
          [-0.47932, +0.33222, -0.00451],
          [-0.27571, -0.27914, +0.06514],
          [-0.38448, -0.16814, +0.04700],
          [-0.81759, -0.09532, +0.07930],
          [-0.85205, +0.10498, -0.03266],
          [-0.82759, -0.41756, +0.03212],
          [-0.95701, +0.05167, -0.06425],
          [-0.94476, -0.08759, +0.04365],
          [-0.96279, -0.10457, -0.00004]],
}
# what makes a problem standard problem 4 (SI units), and its two fields
_SP4 = {"size": (500e-9, 125e-9, 3e-9), "Ms": 8.0e5, "A": 1.3e-11,
        "alpha": 0.02, "gamma": 2.211e5}
SP4_FIELDS_MT = {1: (-24.6, 4.3, 0.0), 2: (-35.5, -6.3, 0.0)}


def problem_toml(prob: problem_mod.Problem, cell: float, layers: int,
                 duration: Optional[float] = None,
                 method: Optional[str] = None,
                 edge_h: Optional[float] = None) -> str:
    """The effective TOML of `prob` with in-plane cells of `cell` (in the
    mesh's unit) and `layers` element layers across z; `duration` (s)
    shortens the last llg stage; `method` sets the demag method and
    `edge_h` grades the cells towards the lateral faces (both: as given
    in the problem when None). Snapshots only at the stage's end. m
    uniform through the thickness (`uniform_z`) is kept for one layer
    only: several layers are there to resolve m across z."""
    cfg = prob.config
    mesh = cfg["mesh"]
    if mesh["shape"] != "box" or not mesh.get("structured", False):
        raise ProblemError("a convergence study needs a structured box mesh")
    if not (cell > 0 and layers >= 1):
        raise ProblemError("cell size and layers must be positive")
    lz = mesh["size"][2]
    mesh["h"] = [float(cell), float(cell), lz / layers]
    if layers > 1 and mesh.get("uniform_z"):
        mesh["uniform_z"] = False
    if edge_h is not None:
        mesh["edge_h"] = float(edge_h)
    if method is not None:
        cfg["demag"]["method"] = method
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
    None past the end of the curve; a curve marked "interpolate": False
    has values only at its own rows."""
    ts = np.asarray(curve["t"], dtype=float)
    if len(ts) == 0 or t > ts[-1] * (1 + 1e-9) + 1e-18:
        return None
    m = np.asarray(curve["m"], dtype=float)
    if not curve.get("interpolate", True):
        i = int(np.argmin(np.abs(ts - t)))
        if abs(ts[i] - t) > 1e-6 * max(abs(t), 1e-15):
            return None
        return m[i].copy()
    return np.array([np.interp(t, ts, m[:, c]) for c in range(3)])


def first_crossing(curve: Dict[str, np.ndarray]) -> Optional[float]:
    """Stage time of the first zero crossing of <mx> from above (linear
    between table rows), or None."""
    if "first_crossing_s" in curve:
        return curve["first_crossing_s"]
    t = np.asarray(curve["t"], dtype=float)
    mx = np.asarray(curve["m"], dtype=float)[:, 0] if len(t) else t
    below = np.flatnonzero((mx[:-1] > 0) & (mx[1:] <= 0))
    if not len(below):
        return None
    i = below[0]
    return float(t[i] + (t[i + 1] - t[i]) * mx[i] / (mx[i] - mx[i + 1]))


def sp4_field(prob: problem_mod.Problem) -> Optional[int]:
    """1 or 2 if `prob` is µMAG standard problem 4 with that field (box,
    material, the last llg stage's static field), else None."""
    mesh = prob.mesh
    if mesh.shape != "box" or len(prob.materials) != 1:
        return None
    mat = prob.materials[0]

    def close(a, b):
        return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
                   for x, y in zip(a, b))
    if not (close([v * mesh.metres for v in mesh.size], _SP4["size"])
            and close([getattr(mat, k) for k in ("Ms", "A", "alpha",
                                                 "gamma")],
                      [_SP4[k] for k in ("Ms", "A", "alpha", "gamma")])
            and mat.K1 == 0 and mat.Kc1 == 0 and mat.Kc2 == 0):
        return None
    llg = [s for s in prob.stages if s.type == "llg"]
    if not llg:
        return None
    fields = prob.fields + llg[-1].field
    if len(fields) != 1:
        return None
    f = fields[0]
    k = problem_mod.FIELD_UNITS[f.unit] / problem_mod.FIELD_UNITS["mT"]
    static = (not any(f.amplitude) and f.ramp == 0
              and f.t_on == 0 and math.isinf(f.t_off))
    if not static:
        return None
    return next((n for n, h in SP4_FIELDS_MT.items()
                 if close([v * k for v in f.H], h)), None)


def reference_for(prob: problem_mod.Problem) -> Optional[dict]:
    """The reference of `prob` if it is µMAG standard problem 4 (sp4_field):
    field 1's published OOMMF curve, field 2's finite-difference run with
    the published spread of <m>(1 ns) and the crossing's tolerance; with
    "field" set. Else None."""
    field = sp4_field(prob)
    if field == 1:
        ref = copy.deepcopy(SP4_FIELD1_REFERENCE)
    elif field == 2:
        ref = copy.deepcopy(SP4_FIELD2_REFERENCE)
        ref["crossing_tol_s"] = SP4_FIELD2_CROSSING_TOL_S
        ref["published_crossings_s"] = dict(SP4_FIELD2_PUBLISHED_CROSSING_S)
        ref["spread"] = published_spread()
    else:
        return None
    ref["field"] = field
    return ref


def published_spread() -> dict:
    """Field 2: the smallest and largest published <m>(1 ns), per
    component (SP4_FIELD2_PUBLISHED_1NS)."""
    m = np.array(list(SP4_FIELD2_PUBLISHED_1NS.values()))
    return {"t": 1e-9, "min": m.min(axis=0).tolist(),
            "max": m.max(axis=0).tolist(),
            "sources": list(SP4_FIELD2_PUBLISHED_1NS)}


def inside_spread(m: Sequence[float], spread: dict) -> bool:
    """Whether every component of `m` lies within the spread's range."""
    return all(lo <= v <= hi for v, lo, hi in
               zip(m, spread["min"], spread["max"]))


def read_reference(path) -> dict:
    """A reference curve from a text file of rows `t mx my mz` (t in s;
    '#' starts a comment), interpolated linearly between its rows."""
    try:
        data = np.loadtxt(path, comments="#", ndmin=2)
    except (OSError, ValueError) as e:
        raise ProblemError(f"reference {path}: cannot read ({e})") from None
    if data.shape[1] < 4 or len(data) < 2 or not np.all(np.isfinite(data)) \
            or np.any(np.diff(data[:, 0]) <= 0):
        raise ProblemError(f"reference {path}: need rows 't mx my mz' "
                           f"with increasing t")
    return {"name": Path(path).name, "source": str(path),
            "interpolate": True, "t": data[:, 0], "m": data[:, 1:4]}


def choose_reference(prob: problem_mod.Problem,
                     which: str = "auto") -> Optional[dict]:
    """The reference curve a study of `prob` compares with: "auto" (the
    published one where reference_for knows it, else none), "none", or
    any other text as a file for read_reference."""
    if which == "none":
        return None
    if which == "auto":
        return reference_for(prob)
    return read_reference(which)


def compare(curves: Dict[float, Dict[str, np.ndarray]],
            times: Sequence[float],
            reference: Optional[dict] = None) -> Dict[str, list]:
    """<m> at `times` for each cell size (coarse to fine) and the change
    between successive refinements, per component and as the largest
    component (None where a run has not reached the time); with a
    `reference`, also its values and each size's difference to it (None
    where either has no value) and the first <mx> zero crossings."""
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
    report = {"times": list(times), "values": values, "differences": diffs}
    report["richardson"] = richardson(report)
    for v in values:
        v["first_crossing_s"] = first_crossing(curves[v["cell"]])
    if reference is not None:
        ref_m = []
        for t in times:
            r = value_at(reference, t)
            ref_m.append(None if r is None else [float(x) for x in r])
        to_ref = []
        for v in values:
            row = []
            for vm, rm in zip(v["m"], ref_m):
                if vm is None or rm is None:
                    row.append(None)
                else:
                    d = [vm[k] - rm[k] for k in range(3)]
                    row.append({"dm": d, "max": max(abs(x) for x in d)})
            xc = v["first_crossing_s"]
            rc = first_crossing(reference)
            entry = {"cell": v["cell"], "at": row,
                     "crossing_diff_s": None if xc is None
                     or rc is None else xc - rc}
            entry.update(checks(curves[v["cell"]], reference))
            to_ref.append(entry)
        report["reference"] = {"name": reference["name"],
                               "source": reference["source"],
                               "m": ref_m,
                               "first_crossing_s": first_crossing(reference),
                               "crossing_tol_s":
                               reference.get("crossing_tol_s"),
                               "published_crossings_s":
                               reference.get("published_crossings_s"),
                               "spread": reference.get("spread"),
                               "differences": to_ref}
    return report


def checks(curve: Dict[str, np.ndarray], reference: dict) -> dict:
    """The checks a reference carries, on one curve: "crossing_ok"
    (first <mx> crossing within the reference's crossing_tol_s of its
    own) and "inside_spread" (<m> at the spread's time inside the
    published range); None where the curve has no value yet, absent
    where the reference has no such check."""
    out = {}
    tol = reference.get("crossing_tol_s")
    if tol is not None:
        xc, rc = first_crossing(curve), first_crossing(reference)
        out["crossing_ok"] = (None if xc is None or rc is None
                              else bool(abs(xc - rc) <= tol))
    spread = reference.get("spread")
    if spread is not None:
        m = value_at(curve, spread["t"])
        out["m_at_spread"] = None if m is None else [float(x) for x in m]
        out["inside_spread"] = (None if m is None
                                else inside_spread(m, spread))
    return out


def _observed_order(h1: float, h2: float, h3: float, r: float
                    ) -> Optional[float]:
    """p with (h3^p - h2^p) / (h2^p - h1^p) = r, for h1 > h2 > h3 and
    0 < r < 1 (the ratio falls as p grows); None outside 0.25..8."""
    def ratio(p):
        return (h3 ** p - h2 ** p) / (h2 ** p - h1 ** p)
    lo, hi = 0.25, 8.0
    if not ratio(hi) < r < ratio(lo):
        return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if ratio(mid) > r:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def richardson(report: Dict[str, list]) -> Optional[dict]:
    """Richardson's estimate from the three finest sizes of `compare`:
    if <m>(h) = m0 + C h^p, two successive changes give the observed
    order p and the finest size's distance to m0 (its error), per time
    and component. Only where both changes have the same sign and their
    ratio fits an order between 0.25 and 8 (the asymptotic regime the
    model assumes); None elsewhere, and None without three sizes."""
    values = report["values"]
    if len(values) < 3:
        return None
    (h1, m1), (h2, m2), (h3, m3) = [(v["cell"], v["m"]) for v in values[-3:]]
    rows = []
    for a, b, c in zip(m1, m2, m3):
        row = []
        for k in range(3):
            if a is None or b is None or c is None:
                row.append(None)
                continue
            d1, d2 = b[k] - a[k], c[k] - b[k]
            p = (_observed_order(h1, h2, h3, d2 / d1)
                 if d1 != 0 and d2 * d1 > 0 else None)
            if p is None:
                row.append(None)
                continue
            err = d2 * h3 ** p / (h3 ** p - h2 ** p)  # = C h3^p
            row.append({"p": p, "error": err, "m0": c[k] - err})
        rows.append(None if all(x is None for x in row) else row)
    return {"cells": [h1, h2, h3], "at": rows}


def _cells(row, missing: str = "(not reached)") -> str:
    out = []
    for x in row:
        if x is None:
            out.append(f"{missing:>27}")
        else:
            vals = x["dm"] if isinstance(x, dict) else x
            out.append("   " + " ".join(f"{v:+.4f}" for v in vals))
    return "".join(out)


def format_table(report: Dict[str, list]) -> str:
    """The differences of `compare` as a text table: between successive
    refinements, then (with a reference) the reference's <m> and each
    size's difference to it, and the first <mx> zero crossings."""
    times = report["times"]
    head = "refinement        " + "".join(f"{t * 1e9:>24.3g} ns"
                                          for t in times)
    lines = [head]
    for d in report["differences"]:
        lines.append(f"{d['from']:g} -> {d['to']:g} nm".ljust(18)
                     + _cells(d["at"]))
    ref = report.get("reference")
    if ref is not None:
        lines.append("")
        lines.append(f"reference: {ref['name']} ({ref['source']})")
        lines.append("reference <m>".ljust(18)
                     + _cells(ref["m"], "(no value)"))
        for d in ref["differences"]:
            lines.append(f"{d['cell']:g} nm - ref".ljust(18)
                         + _cells(d["at"], "(none)"))
    rich = report.get("richardson")
    if rich is not None:
        h = ", ".join(f"{c:g}" for c in rich["cells"])
        lines.append("")
        lines.append(f"Richardson from {h} nm (where both changes agree "
                     f"in sign and fit an order of 0.25-8):")
        lines.append(f"{rich['cells'][-1]:g} nm error".ljust(18) + "".join(
            f"{'(not reached)':>27}" if row is None else "   " + " ".join(
                "   n/a " if x is None else f"{x['error']:+.4f}"
                for x in row) for row in rich["at"]))
        lines.append("observed order".ljust(18) + "".join(
            f"{'':>27}" if row is None else "   " + " ".join(
                "   n/a " if x is None else f"{x['p']:7.2f}" for x in row)
            for row in rich["at"]))
    xs = [(v["cell"], v.get("first_crossing_s")) for v in report["values"]]
    if any(x is not None for _, x in xs) or ref is not None:
        lines.append("")
        parts = [f"{c:g} nm " + ("-" if x is None else f"{x * 1e9:.4f} ns")
                 for c, x in xs]
        if ref is not None and ref.get("first_crossing_s") is not None:
            parts.append(f"reference {ref['first_crossing_s'] * 1e9:.4f} ns")
        lines.append("first <mx> = 0: " + ", ".join(parts))
    if ref is not None and ref.get("crossing_tol_s") is not None:
        lines.append(f"crossing within {ref['crossing_tol_s'] * 1e12:g} ps "
                     f"of the reference: " + ", ".join(
                         f"{d['cell']:g} nm {_verdict(d.get('crossing_ok'))}"
                         + ("" if d["crossing_diff_s"] is None else
                            f" ({d['crossing_diff_s'] * 1e12:+.2f} ps)")
                         for d in ref["differences"]))
        pub = ref.get("published_crossings_s")
        if pub:
            lines.append(f"published first crossings: "
                         f"{min(pub.values()) * 1e9:.4f}.."
                         f"{max(pub.values()) * 1e9:.4f} ns "
                         f"({len(pub)} solutions)")
    spread = None if ref is None else ref.get("spread")
    if spread is not None:
        lo = ", ".join(f"{v:+.4f}" for v in spread["min"])
        hi = ", ".join(f"{v:+.4f}" for v in spread["max"])
        lines.append(f"<m>({spread['t'] * 1e9:g} ns) inside the published "
                     f"spread ({lo})..({hi}): " + ", ".join(
                         f"{d['cell']:g} nm "
                         f"{_verdict(d.get('inside_spread'))}"
                         for d in ref["differences"]))
    return "\n".join(lines)


def _verdict(ok: Optional[bool]) -> str:
    return "not reached" if ok is None else ("yes" if ok else "NO")


def plot(curves: Dict[float, Dict[str, np.ndarray]], path,
         title: str = "", reference: Optional[dict] = None) -> None:
    """<m>(t) of every cell size in one PNG (matplotlib, Agg), with the
    reference (black: a line for a full curve, markers alone for
    tabulated values, which are too far apart to join) when given."""
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
    if reference is not None:
        rt = np.asarray(reference["t"], dtype=float)
        rm = np.asarray(reference["m"], dtype=float)
        # only over the time the runs cover
        t_max = max((float(cv["t"][-1]) for cv in curves.values()
                     if len(cv["t"])), default=rt[-1])
        keep = rt <= t_max * (1 + 1e-9)
        rt, rm = rt[keep] * 1e9, rm[keep]
        full = reference.get("interpolate", True)
        for k, name in enumerate(("mx", "my", "mz")):
            ax.plot(rt, rm[:, k], color="black",
                    linestyle="-" if full else "none",
                    marker=None if full else "xo+"[k], markersize=6,
                    linewidth=0.8,
                    label=f"<{name}> {reference['name']}")
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


def refined_alike(cells: Sequence[float], layers: Sequence[int]) -> bool:
    """Do the runs refine along one parameter: the same layers everywhere,
    or layers in proportion to 1/cell (cell x layers constant within 2 %)?
    Only then is Richardson's estimate over the cell size meaningful."""
    if len(set(layers)) <= 1:
        return True
    prod = [c * n for c, n in zip(cells, layers)]
    return max(prod) <= 1.02 * min(prod)


def parse_layers(text: str, n: int) -> List[int]:
    """`text` is one number of layers for every cell size, or one per cell
    size (n of them), comma-separated: '3' or '3,6,9'."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProblemError(f"'{text}' is not a list of layer counts")
    if not layers or any(v < 1 for v in layers):
        raise ProblemError(f"'{text}': layers must be positive integers")
    if len(layers) == 1:
        return layers * n
    if len(layers) != n:
        raise ProblemError(f"'{text}': give one number of layers, or one "
                           f"per cell size ({n})")
    return layers


def parse_cells(text: str) -> List[float]:
    try:
        cells = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ProblemError(f"'{text}' is not a list of cell sizes")
    if not cells or any(not (c > 0 and math.isfinite(c)) for c in cells):
        raise ProblemError(f"'{text}': cell sizes must be positive")
    return cells
