"""Micromagnetic solver (micromag): analytic checks of the field terms
and the integrator, parallel == serial through mpirun, bad input, and the
thesis's bar, the benchmark's report, the solver's own command.
Standard problem 4: test_sp4.py."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

petsc4py = pytest.importorskip("petsc4py")

from mag_helpers import EXAMPLES, mag_cli, table                  # noqa: E402
from micromag import mesh as meshmod                              # noqa: E402
from micromag import problem as problem_mod                       # noqa: E402
from micromag.constants import GAMMA0, MU0, NM                    # noqa: E402
from micromag.fem import FEMSpace                                 # noqa: E402
from micromag.llg import Dynamics, integrate, minimize            # noqa: E402
from micromag.parallel import clean_mpi_env                       # noqa: E402
from micromag.state import State                                  # noqa: E402
from micromag.terms import (CubicAnisotropy, Exchange,            # noqa: E402
                            UniaxialAnisotropy, Zeeman)

# ---------------------------------------------------------------- mesh, FEM

def test_structured_box_space():
    mesh = meshmod.box(20 * NM, 10 * NM, 30 * NM, 5 * NM, structured=True)
    sp = FEMSpace(mesh)
    assert sp.n == 5 * 3 * 7 and len(sp.mesh.tets) == 6 * 4 * 2 * 6
    assert np.all(sp.volumes > 0)
    assert sp.mass.sum() == pytest.approx(6000 * NM ** 3, rel=1e-12)
    x, y = sp.scalar_vec(), sp.scalar_vec()
    x.set(1.0)
    sp.K.mult(x, y)                           # constants: no gradient
    assert y.norm() < 1e-12 * NM
    sp.set_global(x, sp.mesh.points[:, 2])    # |grad z|^2 integrates to V
    sp.K.mult(x, y)
    assert x.dot(y) == pytest.approx(6000 * NM ** 3, rel=1e-10)
    # boundary: closed, outward, area of the box
    p, f = sp.mesh.points, sp.boundary_facets
    n = np.cross(p[f[:, 1]] - p[f[:, 0]], p[f[:, 2]] - p[f[:, 0]]) / 2
    assert np.abs(n.sum(axis=0)).max() < 1e-12 * NM ** 2
    area = 2 * (200 + 600 + 300) * NM ** 2
    assert np.linalg.norm(n, axis=1).sum() == pytest.approx(area, rel=1e-12)
    flux = np.einsum("ij,ij->", n, p[f].mean(axis=1))   # div(x) = 3
    assert flux == pytest.approx(3 * 6000 * NM ** 3, rel=1e-10)
    # the original numbering is recovered through perm
    assert np.allclose(sp.to_original(sp.mesh.points), mesh.points)


def test_gmsh_shapes_and_file_roundtrip(tmp_path):
    pytest.importorskip("gmsh")
    import meshio
    cyl = meshmod.cylinder(10 * NM, 20 * NM, 4 * NM)
    assert cyl.volume == pytest.approx(math.pi * 100 * 20 * NM ** 3, rel=0.03)
    ell = meshmod.ellipsoid(20 * NM, 10 * NM, 10 * NM, 4 * NM)
    assert ell.volume == pytest.approx(4 / 3 * math.pi * 2000 * NM ** 3,
                                       rel=0.05)
    box = meshmod.box(10 * NM, 10 * NM, 10 * NM, 3 * NM)
    assert box.volume == pytest.approx(1000 * NM ** 3, rel=1e-9)
    # .msh drawn in nm comes back in metres
    path = tmp_path / "box.msh"
    meshio.write(str(path), meshio.Mesh(box.points / NM,
                                        [("tetra", box.tets)]),
                 file_format="gmsh22", binary=False)
    back = meshmod.load(path)
    assert back.volume == pytest.approx(box.volume, rel=1e-9)
    # a Netgen .vol (1-based, negative orientation is repaired)
    vol = tmp_path / "one.vol"
    vol.write_text("mesh3d\nvolumeelements\n1\n1 4 1 3 2 4\n"
                   "points\n4\n0 0 0\n1 0 0\n0 1 0\n0 0 1\n")
    one = meshmod.load(vol, scale=NM)
    assert one.volume == pytest.approx(NM ** 3 / 6)
    with pytest.raises(meshmod.MeshError, match="not found"):
        meshmod.load(tmp_path / "missing.msh")


# ---------------------------------------------------------------- terms

def _state(mesh, Ms=8e5, alpha=0.5):
    return State(FEMSpace(mesh), Ms, alpha_tet=alpha)


def test_exchange_energy_of_a_spiral():
    """m = (cos kz, sin kz, 0): E = A k^2 V, H = -2A k^2/(mu0 Ms) m."""
    L = 40 * NM
    st = _state(meshmod.box(10 * NM, 10 * NM, L, 1 * NM, structured=True))
    A, k = 1.3e-11, 2 * math.pi / L
    st.set_m(lambda p: np.stack([np.cos(k * p[:, 2]), np.sin(k * p[:, 2]),
                                 0 * p[:, 2]], axis=1))
    ex = Exchange(st, A)
    V = 10 * 10 * 40 * NM ** 3
    exact = A * k * k * V
    assert ex.E(st) == pytest.approx(exact, rel=0.01)
    # the interior field is antiparallel to m with the analytic size
    h = st.space.vector_vec()
    ex.h(st, h)
    hv = st.space.local(h)
    m = st.m_local()
    inner = np.all((st.space.mesh.points[st.space.rstart:st.space.rend]
                    > 0.5 * NM) & (st.space.mesh.points[
                        st.space.rstart:st.space.rend]
                    < np.array([9.5, 9.5, 39.5]) * NM), axis=1)
    ratio = np.einsum("ij,ij->i", hv, m)[inner]
    assert np.allclose(ratio, -2 * A * k * k / (MU0 * 8e5), rtol=0.02)


def test_uniaxial_and_zeeman_energies():
    st = _state(meshmod.box(10 * NM, 10 * NM, 10 * NM, 5 * NM,
                            structured=True))
    V = 1000 * NM ** 3
    K1, theta = 5e5, 0.3
    st.set_m([math.sin(theta), 0.0, math.cos(theta)])
    an = UniaxialAnisotropy(st, K1, [0, 0, 1])
    assert an.E(st) == pytest.approx(-K1 * V * math.cos(theta) ** 2,
                                     rel=1e-12)
    h = st.space.vector_vec()
    an.h(st, h)
    expect = 2 * K1 / (MU0 * 8e5) * math.cos(theta) * np.array([0, 0, 1])
    assert np.allclose(st.space.local(h), expect, rtol=1e-12)
    H = np.array([1e4, -2e4, 3e4])
    z = Zeeman(st, H)
    m = np.array([math.sin(theta), 0.0, math.cos(theta)])
    assert z.E(st) == pytest.approx(-MU0 * 8e5 * V * m @ H, rel=1e-12)
    zt = Zeeman(st, lambda t: H * math.cos(t))
    st.t = math.pi
    assert zt.E(st) == pytest.approx(MU0 * 8e5 * V * m @ H, rel=1e-12)


def test_cubic_anisotropy_field_is_minus_energy_gradient():
    st = _state(meshmod.box(5 * NM, 5 * NM, 5 * NM, 5 * NM, structured=True))
    cub = CubicAnisotropy(st, 4e4, -1e4, [1, 1, 0], [-1, 1, 0])
    V = 125 * NM ** 3
    m0 = np.array([0.3, 0.5, 0.81])
    m0 /= np.linalg.norm(m0)
    st.set_m(m0)
    # energy against the formula in the crystal frame
    c1 = np.array([1, 1, 0]) / math.sqrt(2)
    c2 = np.array([-1, 1, 0]) / math.sqrt(2)
    a = np.array([m0 @ c1, m0 @ c2, m0 @ np.cross(c1, c2)]) ** 2
    e = 4e4 * (a[0] * a[1] + a[1] * a[2] + a[2] * a[0]) - 1e4 * a.prod()
    assert cub.E(st) == pytest.approx(e * V, rel=1e-12)
    # H = -1/(mu0 Ms V) dE/dm, by central differences of the energy
    h = st.space.vector_vec()
    cub.h(st, h)
    hv = st.space.local(h)[0]
    grad = np.zeros(3)
    for k in range(3):
        d = np.zeros(3)
        d[k] = 1e-6
        st.space.set_global(st.m, np.tile(m0 + d, (st.space.n, 1)))
        ep = cub.E(st)
        st.space.set_global(st.m, np.tile(m0 - d, (st.space.n, 1)))
        em = cub.E(st)
        grad[k] = (ep - em) / 2e-6
    assert np.allclose(hv, -grad / (MU0 * 8e5 * V), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- dynamics

def test_precession_frequency_of_a_single_domain_particle():
    """f = gamma mu0 H / 2 pi for m perpendicular to H, alpha = 0."""
    st = _state(meshmod.box(5 * NM, 5 * NM, 5 * NM, 5 * NM, structured=True),
                alpha=0.0)
    st.set_m([1, 0, 0])
    B = 0.1                                    # mu0 H in T
    dyn = Dynamics(st, [Exchange(st, 1.3e-11), Zeeman(st, [0, 0, B / MU0])])
    f = GAMMA0 * (B / MU0) / (2 * math.pi)
    T = 1 / f
    rec = []
    integrate(dyn, 2 * T, rtol=1e-8, atol=1e-8, output_every=T / 40,
              callback=lambda r: rec.append((r.t, *st.average_m(r.m))))
    rec = np.array(rec)
    phase = np.unwrap(np.arctan2(rec[:, 2], rec[:, 1]))
    measured = np.polyfit(rec[:, 0], phase, 1)[0] / (2 * math.pi)
    assert measured == pytest.approx(f, rel=1e-6)
    assert np.abs(np.linalg.norm(rec[:, 1:], axis=1) - 1).max() < 1e-9
    assert np.abs(rec[:, 3]).max() < 1e-9       # no damping: stays in plane


def test_damped_switching_follows_the_field_and_integrators_agree():
    """With damping, m turns towards H as tan(theta/2) = tan(theta0/2)
    exp(-alpha gamma H t / (1 + alpha^2)), with rk5dp, rk3bs, bdf and
    fixed-step rk4."""
    results = {}
    alpha, H, T = 0.1, 0.5 / MU0, 50e-12
    theta0 = math.acos(0.1 / math.sqrt(1.01))
    theta = 2 * math.atan(math.tan(theta0 / 2) * math.exp(
        -alpha * GAMMA0 * H * T / (1 + alpha ** 2)))
    for method, kw in (("rk5dp", {}), ("rk3bs", {}), ("bdf", {}),
                       ("rk4", {"dt": 2e-13, "adaptive": False})):
        st = _state(meshmod.box(5 * NM, 5 * NM, 5 * NM, 5 * NM,
                                structured=True), alpha=0.1)
        st.set_m([1, 0, 0.1])
        dyn = Dynamics(st, [Zeeman(st, [0, 0, 0.5 / MU0])])
        integrate(dyn, 50e-12, method=method, rtol=1e-7, atol=1e-7, **kw)
        results[method] = st.average_m()
    for method, m in results.items():
        assert m[2] == pytest.approx(math.cos(theta), abs=2e-5), method
        assert np.allclose(m, results["rk5dp"], atol=1e-4), method


def test_petsc_table_values_win_over_the_integrators_defaults():
    """A problem's [petsc] table (the options database) sets what the
    bdf integrator would otherwise default: its value is used and stays;
    the integrator's own defaults are set for the run only."""
    st = _state(meshmod.box(5 * NM, 5 * NM, 5 * NM, 5 * NM,
                            structured=True), alpha=0.1)
    st.set_m([1, 0, 0.1])
    opts = st.space.PETSc.Options()
    opts["mag_snes_lag_jacobian"] = 7
    try:
        dyn = Dynamics(st, [Zeeman(st, [0, 0, 0.5 / MU0])])
        integrate(dyn, 5e-12, method="bdf", rtol=1e-6, atol=1e-6)
        assert opts.getInt("mag_snes_lag_jacobian") == 7
        assert not opts.hasName("mag_snes_lag_jacobian_persists")
        # what the method needs wins: a fixed step has no adaptor, and
        # the user's adaptor comes back after the stage
        opts["mag_ts_adapt_type"] = "basic"
        stats = integrate(dyn, st.t + 1e-12, method="rk4", dt=1e-13,
                          adaptive=False)
        assert stats["steps"] == 10
        assert opts.getString("mag_ts_adapt_type") == "basic"
    finally:
        opts.delValue("mag_snes_lag_jacobian")
        opts.delValue("mag_ts_adapt_type")


def test_bb_minimizer_finds_the_stoner_wohlfarth_angle():
    """Easy axis z, field along x below the anisotropy field:
    sin(theta) = mu0 Ms H / (2 K1)."""
    st = _state(meshmod.box(5 * NM, 5 * NM, 5 * NM, 5 * NM, structured=True))
    K1, Ms = 5e4, 8e5
    H = 0.4 * 2 * K1 / (MU0 * Ms)
    st.set_m([0.01, 0.0, 1.0])
    dyn = Dynamics(st, [UniaxialAnisotropy(st, K1, [0, 0, 1]),
                        Zeeman(st, [H, 0, 0])])
    res = minimize(dyn, tol=1e-9)
    assert res["converged"] and res["iterations"] < 200
    m = st.average_m()
    assert m[0] == pytest.approx(0.4, abs=1e-6)
    assert m[2] == pytest.approx(math.sqrt(1 - 0.16), abs=1e-6)


# ---------------------------------------------------------------- problems

def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


SMALL = """
title = "small"
[mesh]
shape = "box"
size = [20.0, 20.0, 40.0]
h = 4.0
structured = true
[material]
Ms = 8.6e5
A = 1.3e-11
alpha = 0.5
[initial]
m = [1.0, 0.0, 1.0]
[demag]
enabled = {demag}
[[stage]]
type = "llg"
duration = 10e-12
integrator = "rk4"
adaptive = false
dt = 1e-13
output_every = 1e-12
[[stage.field]]
H = [10.0, 0.0, 0.0]
unit = "mT"
frequency = 20e9
amplitude = [0.0, 5.0, 0.0]
"""


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    """SMALL with demag through `ivcloud mag run --np N`, N = 1, 2, 4:
    {N: output directory}. The tests only read them."""
    d = tmp_path_factory.mktemp("small-runs")
    prob = _write(d / "small.toml", SMALL.format(demag="true"))
    outs = {}
    for np_ in (1, 2, 4):
        out = d / f"np{np_}"
        r = mag_cli("run", str(prob), "--out", str(out), "--np", str(np_),
                    "--quiet")
        assert r.returncode == 0, r.stderr
        outs[np_] = out
    return outs


def test_parallel_equals_serial(small_runs):
    """1, 2 and 4 ranks: same <m>(t) to 1e-6 on a fixed-step run with
    demag, through `ivcloud mag run --np N`."""
    runs = {}
    for np_, out in small_runs.items():
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ranks"] == np_ and summary["demag"] is True
        runs[np_] = table(out)
    ref = runs[1]
    assert len(ref) == 11                         # t = 0, 1, ..., 10 ps
    assert abs(ref["mz"][-1] - ref["mz"][0]) > 1e-3   # something happened
    for np_ in (2, 4):
        t = runs[np_]
        assert np.array_equal(t["t"], ref["t"])
        for c in ("mx", "my", "mz"):
            assert np.abs(t[c] - ref[c]).max() <= 1e-6 * np.abs(ref[c]).max()


BAD_INPUT = [
    ("toml", "[mesh\nshape = 'box'", "invalid TOML"),
    ("unknown", SMALL.format(demag="true").replace("alpha = 0.5",
                                                   "alpha = 0.5\nalfa = 1"),
     "unknown key 'alfa' in [material]"),
    ("negative", SMALL.format(demag="true").replace("Ms = 8.6e5",
                                                    "Ms = -8.6e5"),
     "Ms in [material] must be positive"),
    ("missing", SMALL.format(demag="true").replace(
        'shape = "box"\nsize = [20.0, 20.0, 40.0]\nh = 4.0\n'
        'structured = true', 'shape = "file"\nfile = "nowhere.msh"'),
     "nowhere.msh not found"),
]


@pytest.mark.parametrize("case,text,needle", BAD_INPUT,
                         ids=[c[0] for c in BAD_INPUT])
@pytest.mark.parametrize("np_", [1, 2])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, text, needle, np_):
    prob = _write(tmp_path / f"{case}.toml", text)
    out = tmp_path / "out"
    r = mag_cli("run", str(prob), "--out", str(out), "--np", str(np_))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(prob) in lines[0]
    assert not (out / "summary.json").exists()
    assert not (out / "table.odt").exists()


def test_launch_refuses_bad_input_and_builds_the_ranks_job(tmp_path):
    """ivcloud.apps.mag, below `ivcloud mag run --np N`: bad input is
    refused before mpirun starts or anything is written; the ranks get
    the child command, this tree on their path, no launcher variables of
    ours and one thread each."""
    from ivcloud.apps import mag
    from micromag.errors import ProblemError
    bad = _write(tmp_path / "bad.toml", BAD_INPUT[1][1])
    with pytest.raises(ProblemError, match="alfa"):
        mag.run(bad, tmp_path / "out", ranks=2)
    assert not (tmp_path / "out").exists()
    good = _write(tmp_path / "good.toml", SMALL.format(demag="false"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ProblemError, match="not a directory"):
        mag.run(good, tmp_path / "file", ranks=2)
    cmd = mag.rank_command(good, tmp_path / "out", progress=False,
                           resume=True, checkpoint_every=5.0)
    assert cmd[:5] == [sys.executable, "-m", "ivcloud", "mag", "run"]
    assert {mag.CHILD_FLAG, "--quiet", "--resume"} <= set(cmd)
    assert cmd[cmd.index("--checkpoint-every") + 1] == "5.0"
    env = mag.rank_env({"PATH": "/bin", "PYTHONPATH": "/elsewhere",
                        "PMIX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert "PMIX_RANK" not in env and "OMPI_COMM_WORLD_SIZE" not in env
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(EXAMPLES.parent) and path[-1] == "/elsewhere"
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"


def test_problem_defaults_and_effective_config_roundtrip(tmp_path):
    prob = problem_mod.load(EXAMPLES / "sp4.toml")
    cfg = prob.config
    assert cfg["material"][0]["Ms"] == 8.0e5
    assert cfg["stage"][0]["type"] == "relax"
    assert cfg["stage"][1]["field"][0]["H"] == [-24.6, 4.3, 0.0]
    eff = _write(tmp_path / "eff.toml", problem_mod.to_toml(cfg))
    assert problem_mod.load(eff).config == cfg
    H = problem_mod.field_function(prob.stages[1].field, 0.0)(1e-10)
    assert np.allclose(H * MU0 * 1e3, [-24.6, 4.3, 0.0])
    ramp = problem_mod.field_function(
        [dataclasses.replace(prob.stages[1].field[0], ramp=1e-9, t_on=1e-9)],
        1.0)
    assert np.allclose(ramp(1.0 + 0.5e-9), 0)
    assert np.allclose(ramp(1.0 + 1.5e-9) * MU0 * 1e3, [-12.3, 2.15, 0])


# One bad key or value per table: the line names the table and the key.
SMALL_OK = SMALL.format(demag="true")
SECTION_ERRORS = [
    ("top", "", 'titel = "x"\n', "unknown key 'titel' in [top level]"),
    ("mesh-type", "h = 4.0", 'h = "4"', "'h' in [mesh] must be a number"),
    ("mesh-value", 'shape = "box"', 'shape = "cube"',
     "mesh shape 'cube' unknown"),
    ("material", "alpha = 0.5", "alpha = -0.5",
     "alpha in [material] must not be negative"),
    ("initial", "m = [1.0, 0.0, 1.0]", "m = [1.0, 0.0, 1.0]\nseed = 3",
     "'seed' does not apply to initial type 'uniform'"),
    ("demag", "enabled = true", 'enabled = true\nmethod = "foo"',
     "demag method 'foo' unknown (choose from auto, grid, dense, fmm)"),
    ("demag-grid", "enabled = true", "enabled = true\ngrid_tol = 2.0",
     "demag grid_tol must be in (0, 1]"),
    ("field", "frequency = 20e9", "frequency = -1.0",
     "frequency in [stage #1 field #1] must not be negative"),
    ("stage", 'integrator = "rk4"', 'integrator = "rk9"',
     "integrator 'rk9' in [stage #1] unknown (choose from"),
    ("stage-key", "dt = 1e-13", "dt = 1e-13\ntol = 1e-6",
     "'tol' does not apply to an llg stage"),
    ("output", None, "\n[output]\nvtu = 1\n",
     "'vtu' in [output] must be true/false"),
    ("petsc", None, "\n[petsc]\nksp_type = [1]\n",
     "[petsc] option 'ksp_type' must be a string or number"),
]


def _bad_text(old, new):
    if old is None:
        return SMALL_OK + new
    if old == "":
        return new + SMALL_OK
    assert SMALL_OK.count(old) == 1, old
    return SMALL_OK.replace(old, new)


@pytest.mark.parametrize("case,old,new,needle", SECTION_ERRORS,
                         ids=[c[0] for c in SECTION_ERRORS])
def test_each_table_is_checked_when_read(tmp_path, case, old, new, needle):
    prob = _write(tmp_path / f"{case}.toml", _bad_text(old, new))
    from micromag.errors import ProblemError
    with pytest.raises(ProblemError) as err:
        problem_mod.load(prob)
    assert needle in str(err.value) and str(prob) in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_tables_are_one_line_and_exit_2_from_the_cli(tmp_path):
    """`ivcloud mag check` with every bad file, `run` with three."""
    files = {c: _write(tmp_path / f"{c}.toml", _bad_text(old, new))
             for c, old, new, _ in SECTION_ERRORS}
    out = ["--out", str(tmp_path / "o")]
    runs = [("check", c, []) for c in files] + \
        [("run", c, out) for c in ("demag", "stage", "petsc")]
    needles = {c[0]: c[3] for c in SECTION_ERRORS}
    for action, case, extra in runs:
        r = mag_cli(action, str(files[case]), *extra)
        assert r.returncode == 2, (case, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needles[case] in lines[0], r.stderr
        assert str(files[case]) in lines[0] and r.stdout == ""
    assert not (tmp_path / "o").exists()


def test_bar_relaxes_towards_the_long_axis(tmp_path):
    """The thesis's bar (examples/bar.toml, 4,114 nodes): from
    (1,0,1)/sqrt 2, damping 0.5, m turns to the long axis z within
    300 ps. Checks the outputs too."""
    out = tmp_path / "bar"
    r = mag_cli("run", str(EXAMPLES / "bar.toml"), "--out", str(out),
                "--quiet")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes"] == 4114 and summary["demag"]
    t = table(out)
    assert t["mx"][0] == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    assert t["t"][-1] == pytest.approx(300e-12)
    assert t["mz"][-1] > 0.99 and abs(t["mx"][-1]) < 0.03
    assert t["mz"][t["t"] <= 100e-12].max() > 0.97    # most of it early
    assert t["E_total"][-1] < t["E_total"][0]
    assert np.all(np.diff(t["E_total"]) < 1e-22)     # damped: E decreases
    for name in ("table.odt", "m_t.png", "effective.toml", "m_final.vtu",
                 "snapshots/m_00000.vtu"):
        assert (out / name).exists(), name
    assert not (out / ".incomplete").exists()
    import meshio
    snap = meshio.read(out / "m_final.vtu")
    assert np.allclose(np.linalg.norm(snap.point_data["m"], axis=1), 1)
    odt = (out / "table.odt").read_text().splitlines()
    assert odt[0] == "# ODT 1.0" and odt[-1] == "# Table End"


def test_bench_reports_both_efficiencies(tmp_path):
    """`ivcloud mag bench` on a small problem, 1 and 2 ranks: the JSON has
    the time-to-solution efficiency (the goal's figure) next to the
    solve's, consistent with the times it reports."""
    examples = tmp_path / "examples"
    examples.mkdir()
    _write(examples / "small.toml", SMALL.format(demag="true"))
    out = tmp_path / "bench.json"
    r = mag_cli("bench", "--examples", str(examples), "--problems",
                "small", "--np", "1,2", "--rounds", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "mag" and len(doc["runs"]) == 2
    runs = {x["ranks"]: x for x in doc["records"]}
    one, two = runs[1], runs[2]
    assert one["runs"] == two["runs"] == 1
    assert one["efficiency_time_to_solution"] == 1.0
    w = one["time_to_solution_s"] / two["time_to_solution_s"]
    assert two["speedup_time_to_solution"] == pytest.approx(w, abs=1e-3)
    assert two["efficiency_time_to_solution"] == pytest.approx(w / 2,
                                                               abs=1e-3)
    s = one["solve_time_s"] / two["solve_time_s"]
    assert two["efficiency"] == pytest.approx(s / 2, abs=2e-3)
    for x in (one, two):
        assert 0 < x["solve_time_s"] < x["time_to_solution_s"]
        assert x["field_evals"] > 0 and x["ms_per_field_eval"] > 0
    assert "small on 2 ranks: efficiency" in r.stderr
    assert "time to solution s" in r.stdout          # the table


def test_bench_peer_bad_requests(tmp_path):
    """`mag bench --peer`: a peer that is not installed, or a peer without
    standard problem 4 to run, is one line and exit 2 before any run."""
    examples = tmp_path / "examples"
    examples.mkdir()
    _write(examples / "small.toml", SMALL.format(demag="true"))
    r = mag_cli("bench", "--examples", str(examples), "--problems",
                "small", "--peer", "neuralmag", "--rounds", "1")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and ("make peer-neuralmag" in lines[0]
                                or "standard problem 4" in lines[0])
    r = mag_cli("bench", "--peer", "magnum")
    assert r.returncode == 2 and "neuralmag" in r.stderr
    # an unknown problem, and a file named field 2 that is another problem
    r = mag_cli("bench", "--problems", "sp4_field3", "--rounds", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "sp4_field3.toml not found" in r.stderr, r.stderr
    _write(examples / "sp4_field2.toml",
           (EXAMPLES / "sp4.toml").read_text())
    r = mag_cli("bench", "--examples", str(examples), "--problems",
                "sp4_field2", "--peer", "neuralmag", "--rounds", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "is not standard problem 4, field 2" in r.stderr, r.stderr


def test_bench_field_2_targets_and_table():
    """Field 2's records become its two targets (crossing within 2 ps,
    <m>(1 ns) inside the published spread) and a crossing column; a run
    whose <mx> never crossed has no value, not a pass."""
    import io

    from ivcloud.bench import mag as bench
    from ivcloud.bench.toolkit import BenchResults
    base = {"problem": "sp4_field2", "code": "ivcloud", "ranks": 2,
            "nodes": 20502, "demag": "grid", "runs": 1,
            "time_to_solution_s": 200.0, "solve_time_s": 190.0,
            "field_evals": 18536, "ms_per_field_eval": 10.0,
            "peak_rss_mb_per_rank": 300.0,
            "minus_reference": [0.001, -0.01, 0.002]}
    res = BenchResults(records=[dict(
        base, first_crossing_s=0.13687e-9,
        crossing_minus_reference_ps=-0.4, inside_spread=False)])
    ts = {t.name: t for t in bench.targets(res)}
    x = ts["sp4_field2: |first <mx> crossing - FD 1.25 nm| (ps)"]
    assert x.value == 0.4 and x.threshold == 2.0 and x.status == "PASS"
    inside = ts["sp4_field2: <m>(1 ns) inside the published spread "
                "(1 yes, 0 no)"]
    assert inside.status == "MISS"
    out = io.StringIO()
    bench.print_table(res, out)
    assert "0.1369 (-0.40 ps), <m>(1 ns) OUTSIDE spread" in out.getvalue()
    res = BenchResults(records=[dict(
        base, first_crossing_s=None, crossing_minus_reference_ps=None,
        inside_spread=None)])
    ts = {t.name: t for t in bench.targets(res)}
    assert all(t.status == "N/A" for n, t in ts.items() if "field2:" in n
               and "time to solution" not in n)


# ---------------------------------------------------------------- python3 -m micromag

def micromag_main(*args, np_=1, timeout=300):
    """The solver's own command (python3-micromag's), under mpirun with
    np_ ranks as a user without ivcloud starts it."""
    cmd = [sys.executable, "-m", "micromag", *args]
    if np_ > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe",
               "--mca", "btl", "self,vader", "-np", str(np_)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env=clean_mpi_env(os.environ))


def test_own_command_runs_on_the_ranks_it_is_given(tmp_path, small_runs):
    """`mpirun -np 2 python3 -m micromag run` (no ivcloud involved):
    the same table as `ivcloud mag run --np 2` (small_runs)."""
    prob = _write(tmp_path / "small.toml", SMALL.format(demag="true"))
    r = micromag_main("run", str(prob), "--out", str(tmp_path / "own"),
                      "--quiet", np_=2)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert summary["ranks"] == 2
    cli = small_runs[2]
    assert json.loads((cli / "summary.json").read_text())["ranks"] == 2
    own, cli = table(tmp_path / "own"), table(cli)
    assert np.array_equal(own["t"], cli["t"]) and len(own) == 11
    for c in ("mx", "my", "mz"):
        assert np.abs(own[c] - cli[c]).max() <= 1e-12


@pytest.mark.parametrize("np_", [1, 2])
def test_own_command_bad_input_is_one_line_and_exit_2(tmp_path, np_):
    case, text, needle = BAD_INPUT[1]
    prob = _write(tmp_path / f"{case}.toml", text)
    r = micromag_main("run", str(prob), "--out", str(tmp_path / "out"),
                      np_=np_)
    assert r.returncode == 2, r.stderr
    # one line per rank (mpirun adds its own note on the exit status)
    lines = [ln for ln in r.stderr.strip().splitlines()
             if ln.startswith("micromag: error: ")]
    assert len(lines) == np_ and all(needle in ln for ln in lines)
    if np_ == 1:
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out" / "summary.json").exists()
    # an output path that is a file; no problem file; no action
    (tmp_path / "file").write_text("x")
    good = _write(tmp_path / "good.toml", SMALL.format(demag="false"))
    for args, word in (([str(good), "--out", str(tmp_path / "file")],
                        "not a directory"),
                       ([str(tmp_path / "none.toml"), "--out",
                         str(tmp_path / "o")], "none.toml")):
        r = micromag_main("run", *args)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr
    r = micromag_main()
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
