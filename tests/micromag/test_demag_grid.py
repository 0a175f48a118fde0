"""The grid method of the demagnetizing field (micromag/terms/
demag_grid.py): the transfer of the P1 magnetization to the cells is
exact (node weights = lumped mass, cells covered = Ms), the transfer and
its adjoint keep energy and field consistent to round-off (the field is
minus the energy's gradient), a uniformly magnetized film gets Aharoni's
factors to 1e-9 at any cell size, a vortex in a box gets the dense
FEM/BEM field and energy, `auto` takes the grid for boxes only, and the
field on 2 and 3 ranks (distributed FFT) is the field on 1."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("petsc4py")

from mag_helpers import (MS, NM, demag_factors, mpirun_python,    # noqa: E402
                         prism_factors)
from micromag import mesh as meshes                               # noqa: E402
from micromag.constants import MU0                                # noqa: E402
from micromag.errors import ProblemError                          # noqa: E402
from micromag.fem import FEMSpace                                 # noqa: E402
from micromag.terms import demag_grid                             # noqa: E402
from micromag.terms.demag import DemagField                       # noqa: E402
from micromag.terms.demag_grid import (GridDemag, band_plan,       # noqa: E402
                                       grid_for)
from micromag.terms.demag_method import (make_demag, resolve,     # noqa: E402
                                         resolve_for)


def _state(space, m):
    st = SimpleNamespace(m=space.vector_vec(), t=0.0, space=space)
    m = np.broadcast_to(np.asarray(m, dtype=float), (space.n, 3))
    space.set_global(st.m, m / np.linalg.norm(m, axis=1)[:, None])
    return st


def _vortex(points, centre, core):
    d = points - centre
    m = np.stack([-d[:, 1], d[:, 0],
                  3 * core * np.exp(-(d[:, 0] ** 2 + d[:, 1] ** 2)
                                    / core ** 2)], axis=1)
    return m / np.linalg.norm(m, axis=1)[:, None]


def _field(space, term, st):
    out = space.vector_vec()
    term.h(st, out)
    return space.gather(out, to_all=True)


@pytest.mark.parametrize("mesh_h,grid_h", [
    ((2.5, 2.5, 3.0), (2.5, 2.5, 3.0)),        # planes through the nodes
    ((10.0, 10.0, 3.0), (2.5, 2.5, 3.0)),      # every element cut
    ((5.0, 5.0, 1.5), (3.0, 2.2, 1.0))])       # nothing aligned
def test_transfer_is_exact(mesh_h, grid_h):
    mesh = meshes.box(100 * NM, 25 * NM, 3 * NM, np.array(mesh_h) * NM,
                      structured=True)
    sp = FEMSpace(mesh)
    grid = grid_for(sp.mesh.points, sp.mesh.tets, spacing=np.array(grid_h) * NM)
    T = demag_grid.transfer_matrix(sp.mesh.points, sp.mesh.tets, MS, grid,
                                   (0, sp.n))
    weights = np.asarray(T.sum(axis=0)).ravel() * grid.cell_volume
    lumped = sp.gather(sp.mass, to_all=True)
    assert np.abs(weights / (MS * lumped) - 1).max() < 1e-12
    assert np.abs(np.asarray(T.sum(axis=1)).ravel() / MS - 1).max() < 1e-12


def test_transfer_on_an_unstructured_box_and_a_sphere():
    box = FEMSpace(meshes.box(20 * NM, 12 * NM, 8 * NM, 3 * NM))
    grid = grid_for(box.mesh.points, box.mesh.tets)
    T = demag_grid.transfer_matrix(box.mesh.points, box.mesh.tets, MS, grid,
                                   (0, box.n))
    lumped = box.gather(box.mass, to_all=True)
    assert np.allclose(np.asarray(T.sum(axis=0)).ravel() * grid.cell_volume,
                       MS * lumped, rtol=1e-11, atol=0)
    assert resolve_for(box, "auto") == "grid"
    # a sphere fills part of its cells: the weights still add up to the
    # volume, the cells hold a fraction between 0 and 1 of Ms
    ball = FEMSpace(meshes.sphere(8 * NM, 2 * NM))
    grid = grid_for(ball.mesh.points, ball.mesh.tets)
    T = demag_grid.transfer_matrix(ball.mesh.points, ball.mesh.tets, MS,
                                   grid, (0, ball.n))
    fill = np.asarray(T.sum(axis=1)).ravel() / MS
    assert fill.min() >= -1e-12 and fill.max() <= 1 + 1e-12
    assert fill.sum() * grid.cell_volume == pytest.approx(ball.mesh.volume,
                                                          rel=1e-11)
    assert 0 < (fill < 1 - 1e-9).sum()
    assert resolve_for(ball, "auto") == "dense"   # FEM/BEM, small


def test_energy_is_the_nodal_energy_and_the_field_its_gradient():
    sp = FEMSpace(meshes.box(30 * NM, 20 * NM, 6 * NM, (4 * NM, 4 * NM,
                                                       2 * NM),
                             structured=True))
    term = GridDemag(sp, MS, spacing=np.array([3.0, 2.5, 1.5]) * NM)
    rng = np.random.default_rng(1)
    m = rng.normal(size=(sp.n, 3))
    st = _state(sp, m)
    H = _field(sp, term, st)
    m = sp.gather(st.m, to_all=True)
    V = sp.gather(sp.mass, to_all=True)
    E = term.E(st)
    nodal = -0.5 * MU0 * MS * np.einsum("i,ij,ij->", V, m, H)
    assert E == pytest.approx(nodal, rel=1e-12)
    # E is quadratic in m: its derivative along dm is -mu0 Ms sum V H.dm
    dm = rng.normal(size=m.shape)
    eps = 1e-3
    energies = []
    for s in (eps, -eps):
        shifted = SimpleNamespace(m=sp.vector_vec())
        sp.set_global(shifted.m, m + s * dm)
        energies.append(term.E(shifted))
    slope = (energies[0] - energies[1]) / (2 * eps)
    assert slope == pytest.approx(-MU0 * MS * np.einsum("i,ij,ij->", V, H,
                                                        dm), rel=1e-9)


def test_film_factors_are_aharonis_at_any_cell_size():
    size = np.array([500.0, 125.0, 3.0]) * NM
    exact = prism_factors(*size)
    for mesh_h in ((10.0, 10.0, 1.5), (25.0, 25.0, 3.0)):
        sp = FEMSpace(meshes.box(*size, np.array(mesh_h) * NM,
                                 structured=True))
        term = make_demag(sp, MS, "auto", length=5.7 * NM)
        assert isinstance(term, GridDemag)
        N, E, vol = demag_factors(sp, term)
        assert np.allclose(N, exact, rtol=1e-9, atol=0), (mesh_h, N, exact)
        assert E == pytest.approx(0.5 * MU0 * MS ** 2 * vol / 3 * N.sum(),
                                  rel=1e-9)


def _work(space, term, m_from, m_to):
    """-mu0 sum_i Ms V_i m_to,i . H_i(m_from): the field as a bilinear
    form, comparable between meshes (m given as functions of x)."""
    pts = space.mesh.points
    H = _field(space, term, _state(space, m_from(pts)))
    V = space.gather(space.mass, to_all=True)
    return -MU0 * MS * np.einsum("i,ij,ij->", V, m_to(pts), H)


def test_vortex_in_a_box_against_dense_fem_bem():
    """A vortex in a 24 x 24 x 12 nm box: on the same 2 nm mesh the grid
    method and the dense FEM/BEM give energies and field works that
    agree within a few per cent, and the grid's are closer to those of
    the FEM/BEM on a 1 nm mesh (its boundary layers resolved better)
    than the FEM/BEM's own on 2 nm."""
    centre = np.array([12, 12, 6]) * NM

    def vortex(x):
        return _vortex(x, centre, 4 * NM)

    def tilted(x):
        m = np.stack([np.cos(x[:, 2] / (6 * NM)), np.sin(x[:, 2] / (6 * NM)),
                      0.5 + 0 * x[:, 0]], axis=1)
        return m / np.linalg.norm(m, axis=1)[:, None]

    def forms(h, term_for):
        sp = FEMSpace(meshes.box(24 * NM, 24 * NM, 12 * NM, h * NM,
                                 structured=True))
        term = term_for(sp)
        return np.array([_work(sp, term, vortex, vortex),
                         _work(sp, term, vortex, tilted),
                         _work(sp, term, tilted, tilted)])

    fine = forms(1.0, lambda sp: DemagField(sp, MS, method="dense"))
    bem = forms(2.0, lambda sp: DemagField(sp, MS, method="dense"))
    grid = forms(2.0, lambda sp: GridDemag(sp, MS))
    scale = np.abs(fine).max()
    assert np.abs(grid - bem).max() < 0.1 * scale
    assert np.abs(grid - fine).max() < 0.03 * scale
    assert np.abs(grid - fine).max() < np.abs(bem - fine).max()


def test_spacing_from_the_tolerance_and_bad_settings():
    mesh = meshes.box(100 * NM, 25 * NM, 3 * NM, (2.5 * NM, 2.5 * NM, 3 * NM),
                      structured=True)
    lex = demag_grid.exchange_length(MS, 1.3e-11)
    assert lex == pytest.approx(5.69e-9, rel=1e-3)
    # the default follows the mesh: planes through its nodes
    g = grid_for(mesh.points, mesh.tets, length=lex)
    assert g.n == (40, 10, 1)
    # a tight tolerance halves the cells (an integer fraction of them)
    tight = demag_grid.GRID_ERROR_COEF * (2.0 * NM / lex) ** 2
    g = grid_for(mesh.points, mesh.tets, tol=tight, length=lex)
    assert g.n == (80, 20, 2)
    assert np.all(g.h <= 2.0 * NM * (1 + 1e-9))
    g = grid_for(mesh.points, mesh.tets, spacing=np.array([5, 5, 3]) * NM)
    assert g.n == (20, 5, 1)
    with pytest.raises(ProblemError):
        grid_for(mesh.points, mesh.tets, tol=0.0)
    with pytest.raises(ProblemError):
        grid_for(mesh.points, mesh.tets, spacing=-1.0)
    with pytest.raises(ProblemError):
        resolve("fft", 0)


PARALLEL = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    from micromag.mesh import Mesh
    from micromag.fem import FEMSpace
    from micromag.terms.demag_grid import GridDemag
    data = np.load(sys.argv[1])
    sp = FEMSpace(Mesh(data["points"], data["tets"]))
    term = GridDemag(sp, data["ms"][sp.perm.argsort()], spacing=data["h"])
    class State: pass
    st = State()
    st.m = sp.vector_vec()
    sp.set_global(st.m, data["m"][sp.perm.argsort()])
    out = sp.vector_vec()
    term.h(st, out)
    H = sp.gather(out)
    E = term.E(st)
    # the layers of the unpadded grid each rank transforms first
    lead = next(k for k in range(3) if term.grid.n[k] > 1)
    spans = MPI.COMM_WORLD.gather(term.conv.own if term.distributed
                                  else (0, term.grid.n[lead]))
    # the layers whose cells this rank's nodes touch (what it exchanges)
    bands = MPI.COMM_WORLD.gather(term.conv.need if term.distributed
                                  else (0, term.grid.n[lead]))
    if MPI.COMM_WORLD.rank == 0:
        np.savez(sys.argv[2], H=sp.to_original(H), E=E,
                 distributed=term.distributed, spans=spans, bands=bands,
                 n=term.grid.n)
""")


@pytest.mark.parametrize("size,spacing", [
    ((60, 30, 3), (2.0, 2.0, 3.0)),            # a film: 2-d FFT
    ((3, 30, 60), (3.0, 2.0, 2.0)),            # the same standing: the
                                               # FFT's first axis is y
    ((24, 16, 12), (2.0, 2.0, 2.0))])          # a box: 3-d FFT
def test_parallel_equals_serial(tmp_path, size, spacing):
    mesh = meshes.box(*(np.array(size) * NM), 3 * NM, structured=True)
    m = _vortex(mesh.points, np.array(size) * NM / 2, 5 * NM)
    ms = MS * (1.0 + 0.3 * (mesh.points[:, 0] > size[0] * NM / 2))
    case = tmp_path / "case.npz"
    np.savez(case, points=mesh.points, tets=mesh.tets, m=m, ms=ms,
             h=np.array(spacing) * NM)
    script = tmp_path / "grid_parallel.py"
    script.write_text(PARALLEL)
    out = {}
    for ranks in (1, 2, 3):
        res = tmp_path / f"H{ranks}.npz"
        proc = mpirun_python(script, ranks, case, res, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[ranks] = np.load(res)
        assert bool(out[ranks]["distributed"]) == (ranks > 1)
        # every rank holds data in the first pass, the layers of the
        # first FFT axis split
        # evenly (not slabs of the padded grid, half of them padding)
        spans = out[ranks]["spans"]
        lead = next(k for k in range(3) if out[ranks]["n"][k] > 1)
        nx = int(out[ranks]["n"][lead])
        assert spans[0][0] == 0 and spans[-1][1] == nx
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(b - a for a, b in spans) - min(b - a for a, b in
                                                  spans) <= 1
        # a film along x is cut across its length: each rank exchanges
        # only the layers its nodes touch, less than the whole grid
        bands = out[ranks]["bands"]
        if size == (60, 30, 3) and ranks > 1:
            assert all(b - a < nx for a, b in bands)
    H1 = out[1]["H"]
    assert np.abs(H1).max() > 0.05 * MS
    for ranks in (2, 3):
        assert np.abs(out[ranks]["H"] - H1).max() < 1e-12 * np.abs(H1).max()
        assert float(out[ranks]["E"]) == pytest.approx(float(out[1]["E"]),
                                                       rel=1e-12)


def _emulate_band_exchange(spans, needs, per_layer, partials, fields):
    """Both Alltoallv passes of the slab convolution, by band_plan's
    counts and displacements, in NumPy: each rank's slab of the summed
    partial grids, and each rank's field as it would receive it."""
    size = len(spans)
    plans = [band_plan(spans, needs, r, per_layer) for r in range(size)]
    slabs = []
    for me in range(size):
        counts, offsets = plans[me]["fwd_recv"]
        buf = np.zeros(int(counts.sum()))
        for r in range(size):
            c, d = (v[me] for v in plans[r]["fwd_send"])
            assert c == counts[r]
            buf[offsets[r]:offsets[r] + c] = partials[r][d:d + c]
        slab = np.zeros((spans[me][1] - spans[me][0]) * per_layer)
        for off, c, at in plans[me]["fwd_adds"]:
            slab[at:at + c] += buf[off:off + c]
        slabs.append(slab)
    received = []
    for me in range(size):
        H = np.zeros_like(fields)
        counts, displs = plans[me]["bwd_recv"]
        for s_ in range(size):
            c, d = (v[me] for v in plans[s_]["bwd_send"])
            assert c == counts[s_]
            lo = spans[s_][0] * per_layer
            H[displs[s_]:displs[s_] + c] = fields[lo + d:lo + d + c]
        received.append(H)
    return slabs, received


@pytest.mark.parametrize("seed", range(40))
def test_band_plan_moves_every_layer_once(seed):
    """band_plan's counts and displacements, both passes emulated: every
    slab gets exactly the sum of the ranks' partial grids (which are
    zero outside their bands), every rank gets the field on its whole
    band, with bands that miss slabs, overlap several or are empty."""
    rng = np.random.default_rng(seed)
    size, layers, per_layer = int(rng.integers(2, 5)), 12, 3
    cuts = np.sort(rng.choice(np.arange(1, layers), size - 1,
                              replace=False))
    bounds = [0, *cuts.tolist(), layers]
    spans = [(bounds[r], bounds[r + 1]) for r in range(size)]
    needs = []
    for r in range(size):
        if rng.random() < 0.15:
            needs.append((0, 0))
        else:
            lo = int(rng.integers(0, layers))
            needs.append((lo, int(rng.integers(lo + 1, layers + 1))))
    partials = []
    for lo, hi in needs:
        p = np.zeros(layers * per_layer)
        p[lo * per_layer:hi * per_layer] = rng.random((hi - lo) * per_layer)
        partials.append(p)
    total = np.sum(partials, axis=0)
    fields = rng.random(layers * per_layer)
    slabs, received = _emulate_band_exchange(spans, needs, per_layer,
                                             partials, fields)
    for (lo, hi), slab in zip(spans, slabs):
        assert np.allclose(slab, total[lo * per_layer:hi * per_layer])
    for (lo, hi), H in zip(needs, received):
        band = slice(lo * per_layer, hi * per_layer)
        assert np.array_equal(H[band], fields[band])
        assert not H[:lo * per_layer].any() and not H[hi * per_layer:].any()


@pytest.mark.parametrize("engine", ["scipy", "fftw"])
@pytest.mark.parametrize("n", [(6, 5, 4), (9, 4, 1), (1, 5, 3), (7, 1, 1),
                               (1, 1, 1)])
def test_serial_convolution_is_the_direct_sum(engine, n):
    """The pruned, in-place transforms (scipy.fft, or FFTW's plans where
    pyfftw is installed) give H_c = -sum_c' N(c - c') M_c' summed
    directly over the cell pairs, to round-off, on 3-d grids, films,
    lines and one cell; a second call gives the same bits."""
    if engine == "fftw" and not demag_grid.have_pyfftw():
        pytest.skip("pyfftw (python3-pyfftw) not installed")
    from micromag.terms.newell import octant_tensor
    g = demag_grid.CellGrid((0.0, 0.0, 0.0), (2e-9, 2.5e-9, 3e-9), n)
    octant = octant_tensor(g.n, g.h)
    conv = demag_grid._SerialConvolution(g, octant, engine=engine)
    M = np.random.default_rng(7).standard_normal((g.cells, 3)) * MS
    H = conv.apply(M)
    assert np.array_equal(conv.apply(M), H)
    # N(d) for a signed offset d: the octant's |d|, the off-diagonal
    # components odd in each of their two axes
    idx = np.array(list(np.ndindex(*n)))
    direct = np.zeros_like(M)
    for c, (i, j, k) in enumerate(idx):
        d = np.array([i, j, k]) - idx
        a = np.abs(d)
        N6 = octant[:, a[:, 0], a[:, 1], a[:, 2]].copy()
        s = np.sign(d)
        N6[3] *= s[:, 0] * s[:, 1]
        N6[4] *= s[:, 0] * s[:, 2]
        N6[5] *= s[:, 1] * s[:, 2]
        xx, yy, zz, xy, xz, yz = N6
        mx, my, mz = M.T
        direct[c] = -np.array([xx @ mx + xy @ my + xz @ mz,
                               xy @ mx + yy @ my + yz @ mz,
                               xz @ mx + yz @ my + zz @ mz])
    assert np.abs(H - direct).max() <= 1e-12 * np.abs(direct).max()
