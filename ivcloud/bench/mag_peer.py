"""A finite-difference peer for `ivcloud mag bench --peer neuralmag`:
µMAG standard problem 4 in NeuralMag, timed like our own runs.

NeuralMag (PyPI `neuralmag`, nodal finite differences) runs on JAX,
whose PyPI wheels are CPU-only: it installs here without a GPU stack,
unlike magnum.np, whose torch pulls CUDA from PyPI (docs/mag.md,
"A finite-difference peer"). It lives in a venv of its own,
build/peers/neuralmag (`make peer-neuralmag`, pinned versions), never
imported by ivcloud: each run is its Python running
peers/neuralmag_sp4.py, pinned to as many cores as our run has ranks.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, List

from ..errors import BenchError, InvalidRequest
from .toolkit import checked_run, run_closed

REPO = Path(__file__).resolve().parents[2]
PEERS = ("neuralmag",)
PEER_DIR = REPO / "build" / "peers"
SCRIPT = Path(__file__).resolve().parent / "peers" / "neuralmag_sp4.py"
# NeuralMag's cell size for the comparison: 2.5 nm is its coarsest
# within 0.01 of the published <m>(1 ns) (5 nm: 0.030 off in <my>)
PEER_CELL_NM = 2.5
# <m> sampled every 10 ps for field 1 (only <m>(1 ns) is compared);
# every 1 ps for field 2, whose check is the first zero crossing of <mx>
# (linear between samples: <mx> falls by ~0.017 per ps there, so 1 ps
# rows place it to well under 0.1 ps)
SAMPLE_S = {1: 1e-11, 2: 1e-12}


def python(peer: str) -> Path:
    """The peer's Python; InvalidRequest when it is not installed."""
    if peer not in PEERS:
        raise InvalidRequest(f"peer '{peer}' unknown ({', '.join(PEERS)})",
                             setting="peer")
    exe = PEER_DIR / peer / "bin" / "python"
    if not exe.is_file():
        raise InvalidRequest(f"{peer} is not installed in {exe.parents[1]}"
                             f" (make peer-{peer})", setting="peer")
    return exe


def cpus_for(cores: int) -> List[int]:
    """The first `cores` CPUs this process may run on; InvalidRequest
    when it may run on fewer."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores > len(allowed):
        raise InvalidRequest(f"the peer on {cores} cores: this process may "
                             f"use {len(allowed)} CPU(s)", setting="np")
    return allowed[:cores]


def _run_script(peer: str, cores: int, args: List, timeout_s: float,
                what: str, read: Callable[[Dict], Dict]) -> Dict:
    """A peer script with `args` in `peer`'s Python on `cores` CPUs
    (cpus_for), on the CPU backend: its time to solution, then what
    `read` takes from the JSON object of the last line it printed (its
    result); BenchError if that does not read."""
    cpus = ",".join(str(c) for c in cpus_for(cores))
    cmd = ["taskset", "-c", cpus, str(python(peer)), *map(str, args)]
    env = {**os.environ, "NM_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    stdout, _ = checked_run(functools.partial(run_closed, cmd, env),
                            timeout_s, what)
    wall = time.perf_counter() - t0
    last = (stdout.strip().splitlines() or [""])[-1]
    try:
        return {"time_to_solution_s": round(wall, 3),
                **read(json.loads(last))}
    except (ValueError, KeyError, TypeError, IndexError):
        raise BenchError(f"{what}: unreadable result {last[:80]!r}"
                         ) from None


def run_sp4(peer: str, cores: int, timeout_s: float, field: int = 1,
            cell_nm: float = PEER_CELL_NM) -> Dict:
    """One run of standard problem 4, field `field` (1 or 2; relaxation
    and 1 ns), in `peer` on `cores` CPUs (cpus_for) with cells of
    `cell_nm`: time to solution, <m>(1 ns), the first zero crossing of
    <mx> and the curve <m>(t)."""
    from micromag import convergence
    if field not in SAMPLE_S:
        raise InvalidRequest(f"standard problem 4 has fields 1 and 2, not "
                             f"{field}", setting="problems")

    def read(out: Dict) -> Dict:
        rows = [[float(v) for v in row[:4]] for row in out["curve"]]
        curve = {"t": [r[0] for r in rows], "m": [r[1:] for r in rows]}
        if len(rows) < 2 or any(len(r) != 4 for r in rows):
            raise ValueError("no curve")
        return {"start_and_relax_s": round(out["start_and_relax_s"], 3),
                "cells": [int(v) for v in out["cells"]],
                "cell_nm": float(out["cell_nm"]),
                "field": int(out["field"]),
                "t_end_s": float(out["t_s"]),
                "m_final": [round(float(v), 5) for v in out["m"]],
                "first_crossing_s": convergence.first_crossing(curve),
                "curve": curve}
    return _run_script(
        peer, cores, [SCRIPT, f"{cell_nm:g}", field, repr(SAMPLE_S[field])],
        timeout_s, f"sp4 in {peer} on {cores} core(s)", read)


ELLIPSOID_SCRIPT = SCRIPT.parent / "neuralmag_ellipsoid.py"


def run_ellipsoid(peer: str, cores: int, problem: Path, cell_nm: float,
                  timeout_s: float) -> Dict:
    """The single-domain ellipsoid of `problem` (examples/ellipsoid.toml:
    one material, a uniform initial m, static fields) in `peer` with cubic
    cells of `cell_nm` on `cores` CPUs: time to solution and <m>."""
    from micromag.problem import FIELD_UNITS, load
    p = load(problem)
    unit = p.mesh.metres / 1e-9
    mat = p.materials[0]
    fields = tuple(p.fields) + tuple(p.stages[0].field)
    h = [sum(f.H[i] * FIELD_UNITS[f.unit] for f in fields) for i in range(3)]
    axes = p.mesh.semi_axes or (p.mesh.radius,) * 3
    spec = {"semi_axes_nm": [v * unit for v in axes],
            "Ms": mat.Ms, "A": mat.A, "H": h, "m0": list(p.initial.m)}
    return _run_script(
        peer, cores, [ELLIPSOID_SCRIPT, f"{cell_nm:g}", json.dumps(spec)],
        timeout_s, f"ellipsoid in {peer}, {cell_nm:g} nm",
        lambda out: {"cells": [int(v) for v in out["cells"]],
                     "cells_inside": int(out["cells_inside"]),
                     "steps": int(out["steps"]),
                     "m_final": [round(float(v), 5) for v in out["m"]]})
