"""Time and memory per application of the demag's boundary operator B,
dense matrix against fast multipole (micromag/terms/demag_fmm.py), on
spheres of radius 10 nm meshed finely at the surface and coarsely inside
(tests/micromag/test_demag_fmm.py's graded_sphere).

    python examples/demag_bem_bench.py [--surface-h 0.8,0.5,0.38,0.27,0.19]
        [--tols 1e-3,1e-5] [--dense-max 11000] [--rounds 5] [--json F]

One rank. Per size: the set-up time and the bytes of each operator, then
`rounds` rounds in which every operator is applied once to the same
random vector, in turn (so that load from other processes on a shared
machine hits all of them alike); medians and min-max of the rounds, and
the relative difference of each FMM product from the dense one. The
dense matrix is built only up to --dense-max boundary nodes (8 Nb^2
bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "micromag")]

from micromag.fem import FEMSpace                         # noqa: E402
from micromag.parallel import comm_world                  # noqa: E402
from micromag.terms.demag import bem_rows, vertex_solid_angles  # noqa: E402
from micromag.terms.demag_fmm import FMMBoundaryOperator  # noqa: E402
from test_demag_fmm import graded_sphere                  # noqa: E402


def floats(text):
    return [float(v) for v in text.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--surface-h", type=floats,
                    default=[0.8, 0.5, 0.38, 0.27, 0.19])
    ap.add_argument("--tols", type=floats, default=[1e-3, 1e-5])
    ap.add_argument("--dense-max", type=int, default=11000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for hs in args.surface_h:
        sp = FEMSpace(graded_sphere(10.0, hs, 0.5))
        pts, bnodes, facets = (sp.mesh.points, sp.boundary_nodes,
                               sp.boundary_facets)
        nb = len(bnodes)
        omega = vertex_solid_angles(pts, sp.mesh.tets)
        ops = {}
        if nb <= args.dense_max:
            t0 = time.perf_counter()
            B = bem_rows(pts, bnodes, facets, omega, np.arange(nb))
            ops["dense"] = (time.perf_counter() - t0, B.nbytes,
                            lambda u, B=B: B @ u)
        for tol in args.tols:
            t0 = time.perf_counter()
            op = FMMBoundaryOperator(comm_world(), pts, bnodes, facets,
                                     omega, np.arange(nb), [nb], tol)
            ops[f"fmm {tol:g}"] = (time.perf_counter() - t0, op.nbytes(),
                                   op.apply)
        u = np.random.default_rng(1).normal(size=nb)
        times = {k: [] for k in ops}
        results = {}
        for _ in range(args.rounds):
            for name, (_, _, apply) in ops.items():
                t0 = time.perf_counter()
                results[name] = apply(u)
                times[name].append(time.perf_counter() - t0)
        for name, (setup, nbytes, _) in ops.items():
            err = None
            if "dense" in results and name != "dense":
                ref = results["dense"]
                err = float(np.linalg.norm(results[name] - ref)
                            / np.linalg.norm(ref))
            row = {"boundary_nodes": nb, "nodes": sp.n, "operator": name,
                   "setup_s": round(setup, 3),
                   "memory_mb": round(nbytes / 1e6, 2),
                   "apply_s_median": round(statistics.median(times[name]),
                                           4),
                   "apply_s_min": round(min(times[name]), 4),
                   "apply_s_max": round(max(times[name]), 4),
                   "rel_diff_from_dense": err}
            rows.append(row)
            print(f"Nb {nb:6d}  {name:10s} setup {setup:7.2f} s  "
                  f"memory {nbytes / 1e6:9.1f} MB  apply median "
                  f"{row['apply_s_median']:8.4f} s "
                  f"[{row['apply_s_min']:.4f}-{row['apply_s_max']:.4f}]"
                  + (f"  rel. diff {err:.1e}" if err is not None else ""),
                  flush=True)
        for name in [k for k in ops if k != "dense"]:
            if nb > args.dense_max:
                print(f"Nb {nb:6d}  dense would take "
                      f"{8 * nb * nb / 1e9:.1f} GB", flush=True)
                break
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
