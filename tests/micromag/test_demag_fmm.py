"""The fast-multipole boundary operator of the demag (micromag/terms/
demag_fmm.py, real fmm3dpy and PETSc): its pieces (quadrature rules, pair
weights), the operator against the dense matrix B on small meshes for two
tolerances, the sphere's demagnetizing factor on surfaces whose dense B
would be large (10,000 boundary nodes here; 41,000 under IVCLOUD_SLOW=1,
13.7 GB dense, in a memory budget of 3 GB), and bad [demag] settings
through `ivcloud mag run`. 1 = 2 = 4 ranks with the FMM: test_demag.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("petsc4py")
pytest.importorskip("mpi4py")
pytest.importorskip("fmm3dpy")

from micromag import mesh as meshes                     # noqa: E402
from micromag.fem import FEMSpace                       # noqa: E402
from micromag.parallel import comm_world                # noqa: E402
from micromag.terms import demag_fmm, demag_method      # noqa: E402
from micromag.terms.demag import (DemagField,           # noqa: E402
                                  _BoundaryKernel, bem_rows,
                                  vertex_solid_angles)
from test_demag import demag_factors                    # noqa: E402
from test_mag import SMALL, mag_cli                     # noqa: E402

NM = 1e-9
MS = 8.0e5
REPO = Path(__file__).resolve().parents[2]
slow = pytest.mark.skipif(os.environ.get("IVCLOUD_SLOW") != "1",
                          reason="slow validation (set IVCLOUD_SLOW=1)")


def graded_sphere(r_nm, h_surface_nm, grade):
    """Sphere meshed with h_surface at the surface, growing by `grade`
    per nm inwards: many boundary nodes for few volume nodes."""
    def build(g):
        g.model.occ.addSphere(0, 0, 0, r_nm)
        g.option.setNumber("Mesh.CharacteristicLengthMin", h_surface_nm)
        g.option.setNumber("Mesh.CharacteristicLengthMax", r_nm)
        g.option.setNumber("Mesh.MeshSizeExtendFromBoundary", 0)
        g.option.setNumber("Mesh.MeshSizeFromPoints", 0)
        field = g.model.mesh.field.add("MathEval")
        g.model.mesh.field.setString(
            field, "F", f"{h_surface_nm} + {grade} * ({r_nm} - "
                        f"Sqrt(x*x + y*y + z*z))")
        g.model.mesh.field.setAsBackgroundMesh(field)
    return meshes._gmsh_mesh(build, h_surface_nm)


# ----------------------------------------------------------------- pieces

@pytest.mark.parametrize("n,degree", [(3, 2), (7, 5), (16, 7)])
def test_quadrature_rules_exact_to_their_degree(n, degree):
    pts, w = demag_fmm.quadrature_rule(n)
    assert pts.shape == (n, 3) and np.allclose(pts.sum(axis=1), 1.0)
    assert np.all(pts > 0) and np.all(w > 0)       # interior points

    def error(d):     # worst monomial l1^a l2^b, a + b = d; mean over T
        return max(abs((w * pts[:, 1] ** a * pts[:, 2] ** (d - a)).sum()
                       - 2 * math.factorial(a) * math.factorial(d - a)
                       / math.factorial(d + 2)) for a in range(d + 1))
    assert max(error(d) for d in range(degree + 1)) < 1e-14
    assert error(degree + 1) > 1e-6


def test_pair_weights_equal_full_kernel():
    sp = FEMSpace(meshes.sphere(10 * NM, 3 * NM))
    pts, facets = sp.mesh.points, sp.boundary_facets
    kernel = _BoundaryKernel(pts, facets, 20 * NM)
    obs = pts[sp.boundary_nodes[:30]]
    full = kernel.weights(obs)                              # (3, F, R)
    rng = np.random.default_rng(5)
    r = rng.integers(0, len(obs), 500)
    f = rng.integers(0, len(facets), 500)
    pairs = kernel.weights(obs[r], f)                       # (3, P)
    assert np.abs(pairs - full[:, f, r]).max() < 1e-13


def test_method_choice_and_bad_settings():
    assert demag_method.resolve("auto", 500) == "dense"
    assert demag_method.resolve("auto",
                                demag_method.DENSE_AUTO_MAX + 1) == "fmm"
    # a host of 24 GB keeps 8 GB dense (31,622 boundary nodes): the 2.5 nm
    # six-layer SP4 film (23,000) stays on the fast product
    big = 24e9
    assert demag_method.dense_auto_max(big) == 31_622
    assert demag_method.resolve("auto", 23_000, big) == "dense"
    assert demag_method.resolve("auto", 31_623, big) == "fmm"
    assert demag_method.resolve("auto", 22_000, 1e9) == "dense"
    assert demag_method.resolve("auto", 23_000, 1e9) == "fmm"
    assert demag_method.resolve("dense", 10 ** 6) == "dense"
    with pytest.raises(ValueError, match="unknown"):
        demag_method.resolve("fast", 10)
    for tol in (0.0, 0.5, -1e-6):
        with pytest.raises(ValueError, match="tol"):
            demag_fmm.scheme_for(tol)
    # tighter tolerances: more points per triangle or a wider near field
    rules = [demag_fmm.scheme_for(t)[:2] for t in (1e-3, 1e-5, 1e-8)]
    assert rules[0] < rules[1] < rules[2]


# ----------------------------------------------------- against the dense B

@pytest.mark.parametrize("shape", ["sphere", "box"])
@pytest.mark.parametrize("tol", [1e-3, 1e-6])
def test_fmm_operator_matches_dense(shape, tol):
    if shape == "sphere":
        mesh = meshes.sphere(10 * NM, 1.5 * NM)
    else:                      # edges and corners: singular potential
        mesh = meshes.box(20 * NM, 16 * NM, 10 * NM, 2 * NM, structured=True)
    sp = FEMSpace(mesh)
    pts, bnodes = sp.mesh.points, sp.boundary_nodes
    nb = len(bnodes)
    omega = vertex_solid_angles(pts, sp.mesh.tets)
    B = bem_rows(pts, bnodes, sp.boundary_facets, omega, np.arange(nb))
    op = demag_fmm.FMMBoundaryOperator(comm_world(), pts, bnodes,
                                       sp.boundary_facets, omega,
                                       np.arange(nb), [nb], tol)
    assert op.near.nnz < 0.25 * nb * nb        # sparse, not B again
    rng = np.random.default_rng(11)
    us = [rng.normal(size=nb) for _ in range(3)]
    us.append(pts[bnodes, 2] / np.abs(pts[bnodes, 2]).max())   # smooth
    us.append(np.ones(nb))                     # B 1 = -1
    for u in us:
        ref = B @ u
        err = np.linalg.norm(op.apply(u) - ref) / np.linalg.norm(ref)
        assert err < tol, (shape, tol, err)    # measured 0.1 - 0.4 tol
        assert err > 1e-4 * tol                # it is not the dense B


# ----------------------------------------------------- large surfaces

def test_sphere_factor_with_fmm_beyond_dense_limit():
    """About 10,000 boundary nodes (the dense B would take 0.8 GB): the
    FMM operator keeps 2 kB per boundary node (2 %)."""
    sp = FEMSpace(graded_sphere(10.0, 0.38, 0.5))
    field = DemagField(sp, MS, method="fmm")    # tol 1e-5
    nb = field.n_boundary
    assert nb > 10_000 and field.method == "fmm"
    assert field.bem is None and field.bem_bytes < 2000 * nb   # O(N)
    N, _, _ = demag_factors(sp, field)
    assert np.allclose(N, 1 / 3, rtol=0.005), N


BIG_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    sys.path[:0] = sys.argv[1:3]
    from test_demag import demag_factors
    from test_demag_fmm import MS, graded_sphere
    from micromag.fem import FEMSpace
    from micromag.terms.demag import DemagField
    sp = FEMSpace(graded_sphere(10.0, 0.19, 0.5))
    t0 = time.perf_counter()
    field = DemagField(sp, MS, method="fmm", tol=1e-4)
    setup = time.perf_counter() - t0
    N, _, _ = demag_factors(sp, field)
    print(json.dumps({"nb": field.n_boundary, "N": list(N),
                      "bem_bytes": field.bem_bytes, "setup_s": setup,
                      "peak_kb": resource.getrusage(
                          resource.RUSAGE_SELF).ru_maxrss}))
""")


@slow
def test_sphere_factor_with_fmm_41k_surface_nodes(tmp_path):
    """41,000 boundary nodes: the dense B (13.7 GB) does not fit the 3 GB
    budget this test allows the whole process; the FMM run does."""
    script = tmp_path / "big.py"
    script.write_text(BIG_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=900,
        stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    nb = res["nb"]
    assert nb > 35_000 and 8 * nb * nb > 10e9
    assert res["peak_kb"] * 1024 < 3e9
    assert res["bem_bytes"] < 100e6
    assert np.allclose(res["N"], 1 / 3, rtol=0.005), res["N"]


# ----------------------------------------------------- problem files

@pytest.mark.parametrize("setting,needle", [
    ('method = "fast"', "demag method 'fast' unknown"),
    ("tol = 0.5", "demag tol must be in (0, 0.1]"),
    ("method = 3", "'method' in [demag] must be a string"),
])
def test_bad_demag_settings_exit_2(tmp_path, setting, needle):
    prob = tmp_path / "bad.toml"
    prob.write_text(SMALL.format(demag="true\n" + setting))
    out = tmp_path / "out"
    r = mag_cli("run", str(prob), "--out", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(prob) in lines[0]
    assert not (out / "summary.json").exists()


def test_fmm_run_matches_dense_run(tmp_path):
    """The small LLG problem of test_mag, shortened, with method = "fmm"
    (forced on a small mesh, where the FMM is slow: about 0.1 s per
    product here) and "dense": same <m>(t) to the FMM's tolerance."""
    tables = {}
    for method in ("dense", "fmm"):
        prob = tmp_path / f"{method}.toml"
        prob.write_text(SMALL.format(
            demag=f'true\nmethod = "{method}"\ntol = 1e-4').replace(
                "duration = 10e-12", "duration = 3e-12"))
        out = tmp_path / method
        r = mag_cli("run", str(prob), "--out", str(out), "--quiet")
        assert r.returncode == 0, r.stderr
        tables[method] = np.genfromtxt(out / "table.csv", delimiter=",",
                                       names=True)
    d, f = tables["dense"], tables["fmm"]
    assert len(d) == 4 and abs(d["mz"][-1] - d["mz"][0]) > 1e-4
    assert np.abs(f["E_demag"] - d["E_demag"]).max() > 0   # not dense
    for c in ("mx", "my", "mz", "E_demag"):
        assert np.abs(f[c] - d[c]).max() <= 1e-4 * np.abs(d[c]).max(), c
