"""Demagnetizing field (hybrid FEM/BEM, micromag/terms/demag.py), real PETSc.

Checks, from the pieces to the whole: the Lindholm double-layer integrals
against brute-force quadrature; the fast assembly kernel against the plain
formula; B.1 = -1 with solid angles taken from the volume mesh; the
demagnetizing factors of a sphere, a prolate ellipsoid, a cube and a thin
film against their analytic values; energy, caching and Ms scaling; and the
field on 2 MPI ranks against 1 rank (and with the fast-multipole boundary
operator on 2 and 4; its other tests: test_demag_fmm.py).
"""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

petsc4py = pytest.importorskip("petsc4py")
pytest.importorskip("mpi4py")

from mag_helpers import (MS, NM, demag_factors,         # noqa: E402
                         mpirun_python, prism_factor_z)
from micromag import mesh as meshes                     # noqa: E402
from micromag.constants import MU0                      # noqa: E402
from micromag.fem import FEMSpace                       # noqa: E402
from micromag.terms.demag import (DemagField,           # noqa: E402
                                  _BoundaryKernel, bem_rows,
                                  double_layer_weights, vertex_solid_angles)



# ----------------------------------------------------------------- helpers

def prolate_factors(aspect):
    """(N_long, N_short) of a prolate spheroid, long/short = aspect > 1."""
    m = float(aspect)
    s = math.sqrt(m * m - 1.0)
    n_long = (m / (2 * s) * math.log((m + s) / (m - s)) - 1.0) / (m * m - 1)
    return n_long, (1.0 - n_long) / 2.0


def quadrature_weights(x, tri, n=200):
    """int_T lambda_i(y) n.(x-y)/|x-y|^3 dS by the centroid rule on n^2
    sub-triangles (smooth integrand: x is off the triangle)."""
    r0, r1, r2 = tri
    cross = np.cross(r1 - r0, r2 - r0)
    area = np.linalg.norm(cross) / 2
    normal = cross / (2 * area)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    up = i + j < n
    down = i + j < n - 1
    l1 = np.concatenate([(i[up] + 1 / 3), (i[down] + 2 / 3)]) / n
    l2 = np.concatenate([(j[up] + 1 / 3), (j[down] + 2 / 3)]) / n
    l0 = 1 - l1 - l2
    y = l0[:, None] * r0 + l1[:, None] * r1 + l2[:, None] * r2
    d = x - y
    kernel = (d @ normal) / np.linalg.norm(d, axis=1) ** 3 * area / n ** 2
    return np.array([(l0 * kernel).sum(), (l1 * kernel).sum(),
                     (l2 * kernel).sum()])


@pytest.fixture(scope="module")
def sphere_space():
    return FEMSpace(meshes.sphere(10 * NM, 1.5 * NM))


# ----------------------------------------------------------------- pieces

def test_lindholm_integrals_match_quadrature():
    rng = np.random.default_rng(3)
    tri = np.array([[0.0, 0.0, 0.0], [1.0, 0.1, 0.0], [0.3, 0.9, 0.2]])
    observers = np.vstack([
        [[0.4, 0.3, 0.8], [0.4, 0.3, -0.8], [2.0, -1.0, 0.5],
         [0.5, 0.4, 0.15]],           # close above the face
        rng.normal(size=(4, 3)) * 1.5])
    w = double_layer_weights(observers, tri[None])[:, 0, :]
    for x, wx in zip(observers, w):
        ref = quadrature_weights(x, tri, n=400)
        assert np.allclose(wx, ref, rtol=2e-4, atol=1e-7), (x, wx, ref)
    # the three weights sum to the signed solid angle: a point just below
    # the middle of a huge triangle sees almost a half space (-2 pi)
    big = np.array([[[-1e3, -1e3, 0.0], [1e3, -1e3, 0.0], [0.0, 1e3, 0.0]]])
    below = double_layer_weights(np.array([[0.0, 0.0, -1e-3]]), big)
    assert below.sum() == pytest.approx(-2 * math.pi, rel=1e-5)
    # in the plane (a corner, a point beside it): principal value 0
    beside = tri[0] + 2.0 * (tri[1] - tri[0]) - 0.5 * (tri[2] - tri[0])
    flat = double_layer_weights(np.array([tri[1], beside]), tri[None])
    assert np.all(flat == 0.0)


def test_fast_kernel_matches_plain_formula(sphere_space):
    sp = sphere_space
    pts = sp.mesh.points
    facets = sp.boundary_facets
    surface = pts[sp.boundary_nodes[:40]]
    obs = np.vstack([surface, surface[:10] * 0.5,          # inside
                     surface[:5] * 3.0])                   # outside
    plain = double_layer_weights(obs, pts[facets])          # (R, F, 3)
    fast = _BoundaryKernel(pts, facets, 20 * NM).weights(obs)  # (3, F, R)
    assert np.isfinite(fast).all()
    assert np.abs(fast.transpose(2, 1, 0) - plain).max() < 1e-11
    # interior points see the whole closed surface: -4 pi; outside: 0
    total = fast.sum(axis=(0, 1))
    assert np.allclose(total[40:50], -4 * math.pi, atol=1e-10)
    assert np.allclose(total[50:], 0.0, atol=1e-10)


def test_solid_angles_and_bem_row_sums():
    # structured cube: exact solid angles 4pi, 2pi (faces), pi (edges),
    # pi/2 (corners)
    box = meshes.box(4 * NM, 4 * NM, 4 * NM, 1 * NM, structured=True)
    omega = vertex_solid_angles(box.points, box.tets)
    on = (np.isclose(box.points, 0.0, atol=1e-3 * NM)
          | np.isclose(box.points, 4 * NM, atol=1e-3 * NM))
    faces = on.sum(axis=1)
    expect = np.array([4 * math.pi, 2 * math.pi, math.pi, math.pi / 2])
    assert np.allclose(omega, expect[faces], atol=1e-12)

    # a constant u1 gives u2 = -u1 (u = 0): B.1 = -1 to round-off, with the
    # diagonal taken from the volume mesh, independent of the integrals
    for mesh in (box, meshes.sphere(10 * NM, 3 * NM)):
        sp = FEMSpace(mesh)
        om = vertex_solid_angles(sp.mesh.points, sp.mesh.tets)
        nb = len(sp.boundary_nodes)
        B = bem_rows(sp.mesh.points, sp.boundary_nodes, sp.boundary_facets,
                     om, np.arange(nb))
        assert np.abs(B.sum(axis=1) + 1.0).max() < 1e-12
        # distributed matrix from DemagField is the same
        field = DemagField(sp, MS)
        assert field.n_boundary == nb
        assert np.abs(field.bem.getDenseArray() - B).max() < 1e-14


# ----------------------------------------------------------------- physics

def test_sphere_demag_factor_one_third(sphere_space):
    field = DemagField(sphere_space, MS)
    N, E, V = demag_factors(sphere_space, field)
    assert np.allclose(N, 1 / 3, rtol=0.01), N
    # E = mu0/2 N Ms^2 V, exactly in the discretisation, ~1 % analytically
    assert E == pytest.approx(0.5 * MU0 * N.mean() * MS ** 2 * V, rel=1e-9)
    assert E == pytest.approx(0.5 * MU0 / 3 * MS ** 2 * V, rel=0.01)
    # the field inside a uniformly magnetized sphere is uniform
    state = SimpleNamespace(m=sphere_space.vector_vec())
    sphere_space.set_global(state.m, np.tile([0.0, 0.0, 1.0],
                                             (sphere_space.n, 1)))
    out = sphere_space.vector_vec()
    field.h(state, out)
    H = sphere_space.gather(out, to_all=True)
    r = np.linalg.norm(sphere_space.mesh.points, axis=1)
    inner = r < 6 * NM
    assert np.allclose(H[inner, 2], -MS / 3, rtol=0.02)
    assert np.abs(H[inner, :2]).max() < 0.02 * MS
    # and its potential is u = Ms z / 3 everywhere in the sphere
    u = sphere_space.gather(field.potential(state.m), to_all=True)
    z = sphere_space.mesh.points[:, 2]
    assert np.abs(u - MS * z / 3).max() < 0.01 * MS * 10 * NM


def test_prolate_ellipsoid_factors():
    sp = FEMSpace(meshes.ellipsoid(20 * NM, 10 * NM, 10 * NM, 2 * NM))
    N, _, _ = demag_factors(sp, DemagField(sp, MS))
    n_long, n_short = prolate_factors(2.0)
    assert N[0] == pytest.approx(n_long, rel=0.02)
    assert N[1] == pytest.approx(n_short, rel=0.02)
    assert N[2] == pytest.approx(n_short, rel=0.02)


def test_cube_and_thin_film_factors():
    cube = FEMSpace(meshes.box(20 * NM, 20 * NM, 20 * NM, 2 * NM,
                               structured=True))
    N, _, _ = demag_factors(cube, DemagField(cube, MS))
    assert np.allclose(N, 1 / 3, rtol=0.02), N

    # 40 x 40 x 2 nm film: N_z close to 1, in-plane factors small
    lx, ly, lz = 40 * NM, 40 * NM, 2 * NM
    film = FEMSpace(meshes.box(lx, ly, lz, 2 * NM, structured=True))
    N, _, _ = demag_factors(film, DemagField(film, MS))
    assert N[2] == pytest.approx(prism_factor_z(lx, ly, lz), rel=0.03)
    assert N[2] > 0.85 and N[0] < 0.07
    assert N[0] == pytest.approx(N[1], rel=1e-9)      # symmetric mesh


def test_film_in_plane_factors_converge_with_layers():
    # µMAG problem 4's film (500 x 125 x 3 nm) at 10 nm cells: its in-plane
    # factors, which set the shape anisotropy the switching runs against,
    # are limited by the element layers across the 3 nm, not by the cells
    # in the plane (docs/mag-demag.md, "Thin films need layers").
    lx, ly, lz = 500 * NM, 125 * NM, 3 * NM
    exact = np.array([prism_factor_z(ly, lz, lx), prism_factor_z(lz, lx, ly)])
    err = {}
    for layers in (3, 6):
        film = FEMSpace(meshes.box(lx, ly, lz, (10 * NM, 10 * NM, lz / layers),
                                   structured=True))
        N, _, _ = demag_factors(film, DemagField(film, MS, method="dense"))
        err[layers] = np.abs(N[:2] / exact - 1)
    assert np.all(err[6] < [0.02, 0.01]), err
    assert err[6][1] < err[3][1] / 2, err          # N_y: 1.8 % -> 0.8 %


def test_energy_caching_and_ms_scaling(sphere_space):
    sp = sphere_space
    pts = sp.mesh.points
    vortex = np.stack([-pts[:, 1], pts[:, 0], np.full(sp.n, 3 * NM)], axis=1)
    vortex /= np.linalg.norm(vortex, axis=1)[:, None]
    field = DemagField(sp, MS)
    state = SimpleNamespace(m=sp.vector_vec())
    sp.set_global(state.m, vortex)
    out = sp.vector_vec()
    out.set(1e9)                                      # h overwrites
    field.h(state, out)
    H1 = sp.gather(out, to_all=True).copy()
    E1 = field.E(state)
    # E = -(mu0/2) sum V_i Ms m_i.H_i with the lumped volumes
    vol = sp.gather(sp.mass, to_all=True)
    assert E1 == pytest.approx(
        -0.5 * MU0 * MS * np.einsum("i,ij,ij->", vol, vortex, H1), rel=1e-9)
    assert 0 < E1 < 0.5 * MU0 / 3 * MS ** 2 * vol.sum()   # below uniform

    # changing m in place must not return the cached field
    sp.set_global(state.m, np.tile([0.0, 0.0, 1.0], (sp.n, 1)))
    field.h(state, out)
    H2 = sp.gather(out, to_all=True)
    assert np.abs(H2 - H1).max() > 0.1 * MS
    sp.set_global(state.m, vortex)
    field.h(state, out)
    assert np.allclose(sp.gather(out, to_all=True), H1, rtol=0,
                       atol=1e-7 * MS)

    # H is linear in Ms: per-node array, doubled
    double = DemagField(sp, np.full(sp.n, 2 * MS))
    double.h(state, out)
    assert np.allclose(sp.gather(out, to_all=True), 2 * H1, rtol=0,
                       atol=1e-7 * MS)
    # no magnetic material: zero field, no solver failure after a warm start
    field_none = DemagField(sp, 0.0)
    field_none.h(state, out)
    assert out.norm() == 0.0 and field_none.E(state) == 0.0
    with pytest.raises(ValueError):
        DemagField(sp, -1.0)


# ----------------------------------------------------------------- parallel

PARALLEL_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    from micromag.mesh import Mesh
    from micromag.fem import FEMSpace
    from micromag.terms.demag import DemagField

    data = np.load(sys.argv[1])
    if sys.argv[4] == "direct":     # the simulation's choice of u1 solve
        from micromag.parallel import petsc
        from micromag.simulation import POISSON_DIRECT, POISSON_SCHUR
        opts = petsc().Options()
        for key, value in (POISSON_SCHUR if MPI.COMM_WORLD.size > 1
                           else POISSON_DIRECT).items():
            opts[key] = value
    sp = FEMSpace(Mesh(data["points"], data["tets"]))
    field = DemagField(sp, data["ms"][sp.perm.argsort()],
                       method=sys.argv[3], tol=1e-6)
    class State: pass
    state = State()
    state.m = sp.vector_vec()
    sp.set_global(state.m, data["m"][sp.perm.argsort()])
    out = sp.vector_vec()
    field.h(state, out)
    H = sp.gather(out)
    E = field.E(state)
    from micromag.terms import schur
    fits = schur.fits(sp.K) if MPI.COMM_WORLD.size > 1 else False
    if MPI.COMM_WORLD.rank == 0:
        np.savez(sys.argv[2], H=sp.to_original(H), E=E,
                 nb=field.n_boundary, size=MPI.COMM_WORLD.size,
                 method=field.method,
                 pc=field._poisson.getPC().getType(), fits=fits)
""")


def test_field_solves_energy_reuses(sphere_space, monkeypatch):
    """h() solves at every call without comparing m with the last call's
    (a whole-vector compare and an allreduce per field evaluation); E()
    right after it reuses that potential, and a later E at another m does
    not."""
    sp = sphere_space
    field = DemagField(sp, MS)
    state = SimpleNamespace(m=sp.vector_vec())
    sp.set_global(state.m, np.tile([0.6, 0.0, 0.8], (sp.n, 1)))
    calls = {"solves": 0, "compares": 0}
    solve = field._solve

    def counting_solve(*args):
        calls["solves"] += 1
        return solve(*args)
    monkeypatch.setattr(field, "_solve", counting_solve)
    out = sp.vector_vec()
    field.h(state, out)
    H1 = sp.gather(out, to_all=True).copy()
    assert calls["solves"] == 2                       # u1 and u2
    field.h(state, out)                               # the same m: solved
    assert calls["solves"] == 4
    assert np.allclose(sp.gather(out, to_all=True), H1, rtol=0,
                       atol=1e-9 * MS)
    E = field.E(state)                                # reuses h's potential
    assert calls["solves"] == 4
    vol = sp.gather(sp.mass, to_all=True)
    m = sp.gather(state.m, to_all=True)
    assert E == pytest.approx(
        -0.5 * MU0 * MS * np.einsum("i,ij,ij->", vol, m, H1), rel=1e-9)
    pts = sp.mesh.points                              # a vortex: lower E
    vortex = np.stack([-pts[:, 1], pts[:, 0], np.full(sp.n, 3 * NM)], axis=1)
    sp.set_global(state.m, vortex / np.linalg.norm(vortex, axis=1)[:, None])
    E2 = field.E(state)                               # new m: solved again
    assert calls["solves"] == 6 and 0 < E2 < 0.9 * E


@pytest.fixture(scope="module")
def parallel_case(tmp_path_factory):
    """The ellipsoid, vortex-like m and two materials that
    test_parallel_equals_serial's scripts read (never write), meshed once
    for all its cases."""
    mesh = meshes.ellipsoid(16 * NM, 10 * NM, 8 * NM, 2 * NM)
    pts = mesh.points
    m = np.stack([-pts[:, 1], pts[:, 0] + 4 * NM, np.full(len(pts), 5 * NM)],
                 axis=1)
    m /= np.linalg.norm(m, axis=1)[:, None]
    ms = MS * (1.0 + 0.2 * (pts[:, 0] > 0))           # two materials
    case = tmp_path_factory.mktemp("demag-parallel") / "case.npz"
    np.savez(case, points=pts, tets=mesh.tets, m=m, ms=ms)
    return case


# dense: round-off and solver tolerance only; fmm (tol 1e-6): each rank
# runs the FMM on its own triangles, so the trees and their errors differ;
# direct: the u1 solve of simulation.py (the replicated Cholesky factor on
# one rank, the interface Schur complement of terms/schur.py on several)
@pytest.mark.parametrize("method,ranks,rel,solver", [
    ("dense", (1, 2), 1e-6, "cg"),
    ("fmm", (1, 2, 4), 1e-5, "cg"),
    ("dense", (1, 2, 3), 1e-6, "direct")])
def test_parallel_equals_serial(tmp_path, parallel_case, method, ranks,
                                rel, solver):
    if method == "fmm":
        pytest.importorskip("fmm3dpy")
    case = parallel_case
    script = tmp_path / "demag_parallel.py"
    script.write_text(PARALLEL_SCRIPT)
    results = {}
    for np_ in ranks:
        result = tmp_path / f"H{np_}.npz"
        proc = mpirun_python(script, np_, case, result, method, solver,
                             timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results[np_] = np.load(result)
        assert int(results[np_]["size"]) == np_
        assert str(results[np_]["method"]) == method
        if solver == "direct":
            assert str(results[np_]["pc"]) == ("python" if np_ > 1
                                               else "redundant")
            # what Simulation asks before it chooses the Schur solve
            assert bool(results[np_]["fits"]) == (np_ > 1)
    H1 = results[1]["H"]
    scale = np.abs(H1).max()
    assert scale > 0.1 * MS
    for np_ in ranks[1:]:
        assert np.abs(results[np_]["H"] - H1).max() <= rel * scale
        assert float(results[np_]["E"]) == pytest.approx(
            float(results[1]["E"]), rel=rel)


def test_direct_neumann_solve_matches_cg(sphere_space):
    """The simulation's u1 solve (simulation.POISSON_DIRECT: one
    application of a replicated Cholesky factor, no Krylov method) gives
    the field of the CG solve, and K u1 = D m to round-off."""
    from micromag.parallel import petsc
    from micromag.simulation import POISSON_DIRECT
    sp = sphere_space
    pts = sp.mesh.points
    vortex = np.stack([-pts[:, 1], pts[:, 0], np.full(sp.n, 3 * NM)], axis=1)
    vortex /= np.linalg.norm(vortex, axis=1)[:, None]
    state = SimpleNamespace(m=sp.vector_vec())
    sp.set_global(state.m, vortex)
    reference = DemagField(sp, MS, rtol=1e-12)
    out = sp.vector_vec()
    reference.h(state, out)
    H_cg = sp.gather(out, to_all=True).copy()
    opts = petsc().Options()

    def direct_field(ms):
        for key, value in POISSON_DIRECT.items():
            opts[key] = value
        try:
            return DemagField(sp, ms)
        finally:
            for key in POISSON_DIRECT:
                opts.delValue(key)

    direct = direct_field(MS)
    assert direct._poisson.getType() == "preonly"
    for _ in range(2):                  # a second m: no stale warm start
        direct.h(state, out)
        H = sp.gather(out, to_all=True)
        assert np.abs(H - H_cg).max() <= 1e-8 * np.abs(H_cg).max()
        resid = direct._b.duplicate()
        sp.K.mult(direct._u1, resid)
        resid.axpy(-1.0, direct._b)
        assert resid.norm() <= 1e-10 * direct._b.norm()
        assert abs(direct._u1.sum()) <= 1e-10 * direct._u1.norm() * sp.n
        sp.set_global(state.m, np.tile([0.0, 0.6, 0.8], (sp.n, 1)))
        reference.h(state, out)
        H_cg = sp.gather(out, to_all=True).copy()
    assert direct.E(state) == pytest.approx(reference.E(state), rel=1e-9)
    # no magnetic material: a zero right-hand side gives a zero field
    direct_field(0.0).h(state, out)
    assert out.norm() == 0.0
