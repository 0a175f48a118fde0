"""Demagnetizing field on a regular grid of cuboid cells (`method = "grid"`).

The finite-element magnetization M(x) = sum_i phi_i(x) Ms_i m_i (P1) is
transferred to a regular grid of cells over the mesh's bounding box, the
grid's field is the exact cell-to-cell demagnetizing tensor of Newell
(newell.py) applied by FFT convolution, and the field comes back to the
nodes through the adjoint of the transfer:

    M_c = sum_i T_ci m_i                 T_ci = Ms_i <phi_i>_c
    H_c = -sum_c' N(c - c') M_c'         (zero-padded FFT convolution)
    H_i = sum_c V_c T_ci H_c / (Ms_i V_i)

<phi_i>_c is the average of the hat function over cell c (outside the
body M = 0), computed exactly by cutting the elements along the grid
planes. The third line being the second's adjoint, the grid's energy
E = -(mu0/2) sum_c V_c M_c.H_c equals the nodal one the solver uses,
-(mu0/2) sum_i Ms_i V_i m_i.H_i, and H_i is -1/(mu0 Ms_i V_i) times its
gradient with respect to m_i: the field stays the energy's gradient
whatever the grid, so energy minimisation and the energy balance of
the dynamics hold exactly (tests/micromag/test_demag_grid.py).

Where it is exact: for a body that fills its bounding box (boxes,
films; the grid then covers it exactly) and a magnetization uniform
over every cell the grid field is exact, so a uniformly magnetized box
gets Aharoni's factors to round-off whatever the cell count. Otherwise
the error is the cell averaging of M (second order in the cell size
against the length on which m turns) and, for curved or holed bodies,
the staircase of the cells the surface cuts (first order): there the
FEM/BEM methods (demag.py) are the accurate ones.

Grid spacing: along each axis the largest spacing that divides the
bounding box evenly and is at most (a) the mesh's element extent along
the axis, or the integer fraction of it that also meets (b) length *
sqrt(tol / GRID_ERROR_COEF), `length` the smallest exchange length of
the materials: (b) is where the measured relative error of the grid's
energy of a magnetization turning on that length is tol
(docs/mag-demag.md, "Grid method"). On a structured mesh the grid
planes then pass through its nodes.

Parallel: every rank holds the transfer's columns of its own nodes. One
field: a sparse product per rank, the partial grids summed onto slabs
of the unpadded grid (each rank sends only the layers its nodes touch,
Alltoallv), the transform of each slab along the other axes, a global
transpose (mpi4py-fft's pencil redistribution), the transform along
the first axis, the kernel product and the way back, the field of those
layers back to each rank (Alltoallv) and a sparse product per rank
(_SlabConvolution). Every pass runs only over
the lines that hold data, split evenly over the ranks. One rank
transforms the whole grid (_SerialConvolution: FFTW's plans where pyfftw
is installed, else scipy.fft), and so does every rank where mpi4py-fft
is missing.
"""

from __future__ import annotations

import math

import numpy as np

from ..constants import MU0
from ..errors import ProblemError, SetupError
from .base import Term
from .newell import full_tensor, octant_tensor

# The relative error of the grid's demagnetizing energy of a
# magnetization that turns on the length l, in cells of size h, is
# about GRID_ERROR_COEF (h/l)^2 (measured on smooth fields and a vortex
# in a cube: 0.03-0.065; docs/mag-demag.md, "Grid method").
GRID_ERROR_COEF = 0.07
# Default relative energy accuracy the grid spacing is chosen for: cells
# of up to 0.65 exchange lengths, where the P1 elements' own error is of
# the same order, so the default grid follows the mesh.
GRID_TOL = 0.03


class CellGrid:
    """A regular grid of n = (nx, ny, nz) cells of size h from `origin`;
    cell (i, j, k) has the flat index (i ny + j) nz + k."""

    def __init__(self, origin, h, n):
        self.origin = np.asarray(origin, dtype=float)
        self.h = np.asarray(h, dtype=float)
        self.n = tuple(int(v) for v in n)
        self.cells = int(np.prod(self.n))
        self.cell_volume = float(np.prod(self.h))

    def __repr__(self) -> str:
        return (f"CellGrid({' x '.join(map(str, self.n))} cells of "
                f"{' x '.join(f'{v * 1e9:.4g}' for v in self.h)} nm)")


def element_extent(points, tets) -> np.ndarray:
    """Median extent of the elements along each axis (m)."""
    p = points[tets]
    return np.median(p.max(axis=1) - p.min(axis=1), axis=0)


def exchange_length(Ms, A) -> float:
    """The smallest sqrt(2 A / (mu0 Ms^2)) of the materials with A > 0
    and Ms > 0 (m), or inf."""
    Ms, A = np.asarray(Ms, dtype=float), np.asarray(A, dtype=float)
    ok = (Ms > 0) & (A > 0)
    if not ok.any():
        return math.inf
    return float(np.sqrt(2.0 * A[ok] / (MU0 * Ms[ok] ** 2)).min())


def grid_for(points, tets, tol: float = GRID_TOL,
             length: float = math.inf, spacing=None) -> CellGrid:
    """The grid over the mesh's bounding box: spacing from the tolerance
    (module docstring) or, if given, at most `spacing` ((3,) or a
    number, m) along each axis."""
    lo, hi = points.min(axis=0), points.max(axis=0)
    extent = hi - lo
    if spacing is not None:
        target = np.broadcast_to(np.asarray(spacing, dtype=float), (3,))
        if not np.all(target > 0):
            raise ProblemError("demag grid spacing must be positive")
    else:
        if not 0.0 < tol <= 1.0:
            raise ProblemError("demag grid_tol must be in (0, 1]")
        # the element extent, or an integer fraction of it: on a
        # structured mesh the grid planes then pass through its nodes
        # and cut no element in the first case
        element = element_extent(points, tets)
        bound = length * math.sqrt(tol / GRID_ERROR_COEF)
        target = element / np.ceil(element / np.minimum(element, bound)
                                   * (1.0 - 1e-9))
    n = np.maximum(1, np.ceil(extent / target * (1.0 - 1e-9))).astype(int)
    return CellGrid(lo, extent / n, n)


# ---------------------------------------------------------------- transfer

# A vertex this close to a grid plane (relative to the cell size) lies on
# it: the plane does not cut the element there.
_PLANE_TOL = 1e-9

# How a tetrahedron whose vertices are ordered "above the plane first"
# splits, by the number of vertices above: the edges it cuts (their
# points are numbered 4, 5, ... in this order) and the pieces above and
# below as tetrahedra over the vertices 0-3 and those points. A prism
# (two triangles a b c / a' b' c') is the three tetrahedra a b c a',
# b c a' b', c a' b' c'.
_SPLITS = {
    # v0 above: a tetrahedron above, the prism v1 v2 v3 / p01 p02 p03
    1: (((0, 1), (0, 2), (0, 3)),
        ((0, 4, 5, 6),),
        ((1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6))),
    # v0 v1 above: the prisms v0 p02 p03 / v1 p12 p13 above and
    # v2 p02 p12 / v3 p03 p13 below
    2: (((0, 2), (0, 3), (1, 2), (1, 3)),
        ((0, 4, 5, 1), (4, 5, 1, 6), (5, 1, 6, 7)),
        ((2, 4, 6, 3), (4, 6, 3, 5), (6, 3, 5, 7))),
    # v0 v1 v2 above: the prism v0 v1 v2 / p03 p13 p23 above, a
    # tetrahedron below
    3: (((0, 3), (1, 3), (2, 3)),
        ((0, 1, 2, 4), (1, 2, 4, 5), (2, 4, 5, 6)),
        ((3, 4, 5, 6),)),
}


def _split(tet, parent, axis, planes):
    """Cut every tetrahedron (K, 4, 3) that a plane of `planes` (sorted
    coordinates along `axis`) crosses into tetrahedra on either side,
    until none is crossed. Returns the pieces and their parents."""
    done_t, done_p = [], []
    tol = _PLANE_TOL * (planes[1] - planes[0] if len(planes) > 1 else 1.0)
    while len(tet):
        x = tet[:, :, axis]
        lo, hi = x.min(axis=1), x.max(axis=1)
        # the first plane strictly inside (lo, hi), if any
        k = np.searchsorted(planes, lo + tol, side="right")
        cut = k < len(planes)
        cut[cut] = planes[k[cut]] < hi[cut] - tol
        done_t.append(tet[~cut])
        done_p.append(parent[~cut])
        if not cut.any():
            break
        tet, parent, plane = tet[cut], parent[cut], planes[k[cut]]
        d = tet[:, :, axis] - plane[:, None]
        d[np.abs(d) <= tol] = 0.0
        above = d > 0
        order = np.argsort(~above, axis=1, kind="stable")   # above first
        v = np.take_along_axis(tet, order[:, :, None], axis=1)
        dv = np.take_along_axis(d, order, axis=1)
        n_above = above.sum(axis=1)
        new_t, new_p = [], []
        for count, (edges, up, down) in _SPLITS.items():
            sel = np.flatnonzero(n_above == count)
            if not len(sel):
                continue
            vs, ds = v[sel], dv[sel]
            pts = np.empty((len(sel), 4 + len(edges), 3))
            pts[:, :4] = vs
            for i, (a, b) in enumerate(edges):
                t = ds[:, a] / (ds[:, a] - ds[:, b])      # da > 0 >= db
                pts[:, 4 + i] = vs[:, a] + t[:, None] * (vs[:, b] - vs[:, a])
            for piece in up + down:
                new_t.append(pts[:, list(piece)])
                new_p.append(parent[sel])
        tet = np.concatenate(new_t)
        parent = np.concatenate(new_p)
    return np.concatenate(done_t), np.concatenate(done_p)


def transfer_matrix(points, tets, Ms_nodes, grid: CellGrid, cols):
    """T[:, cols[0]:cols[1]] (scipy CSR, cells x owned nodes) for the
    nodes cols[0] <= i < cols[1]: T_ci = Ms_i <phi_i>_c, exactly. Every
    element that touches an owned node is cut along the grid planes
    into tetrahedra inside one cell each; over a piece, phi_i integrates
    to its volume times phi_i at its centroid (phi_i is linear there).
    So sum_c V_c T_ci = Ms_i V_i, the lumped mass, to round-off."""
    import scipy.sparse as sp
    r0, r1 = cols
    owned = (tets >= r0) & (tets < r1)
    sel = np.flatnonzero(owned.any(axis=1))
    t = tets[sel]
    p = points[t]                                       # (m, 4, 3)
    # barycentric coordinates: lambda_k(x) = g_k . (x - centroid) + 1/4
    inv = np.linalg.inv(p[:, 1:] - p[:, :1])            # columns: grads
    grads = np.empty((len(t), 4, 3))
    grads[:, 1:] = np.transpose(inv, (0, 2, 1))
    grads[:, 0] = -grads[:, 1:].sum(axis=1)
    centroid = p.mean(axis=1)
    pieces, parent = p, np.arange(len(t))
    for axis in range(3):
        planes = grid.origin[axis] + grid.h[axis] * np.arange(
            1, grid.n[axis])
        if len(planes):
            pieces, parent = _split(pieces, parent, axis, planes)
    e = pieces[:, 1:] - pieces[:, :1]
    vol = np.abs(np.einsum("kc,kc->k", e[:, 0],
                           np.cross(e[:, 1], e[:, 2]))) / 6.0
    keep = vol > 1e-12 * vol.max() if len(vol) else vol > 0
    pieces, parent, vol = pieces[keep], parent[keep], vol[keep]
    mid = pieces.mean(axis=1)
    idx = np.floor((mid - grid.origin) / grid.h).astype(np.int64)
    idx = np.clip(idx, 0, np.asarray(grid.n) - 1)
    cell = (idx[:, 0] * grid.n[1] + idx[:, 1]) * grid.n[2] + idx[:, 2]
    lam = np.einsum("pkc,pc->pk", grads[parent],
                    mid - centroid[parent]) + 0.25
    nodes = t[parent]                                   # (q, 4)
    q, k = np.nonzero((nodes >= r0) & (nodes < r1))
    ms = np.broadcast_to(np.asarray(Ms_nodes, dtype=float),
                         (len(points),))
    node = nodes[q, k]
    vals = vol[q] * lam[q, k] * ms[node] / grid.cell_volume
    T = sp.csr_matrix((vals, (cell[q], node - r0)),
                      shape=(grid.cells, r1 - r0))
    T.sum_duplicates()
    return T


# ---------------------------------------------------------------- convolution

def _padded(n: int) -> int:
    """FFT length for a linear convolution over n cells (1 stays 1)."""
    if n == 1:
        return 1
    from scipy.fft import next_fast_len
    return next_fast_len(2 * n - 1, real=True)


# the off-diagonal components (xy, xz, yz) of the tensor and their axes
_OFF_DIAGONAL = ((3, 0, 1), (4, 0, 2), (5, 1, 2))


class _KernelProduct:
    """out[a] = -sum_b N[ab] M[b] in Fourier space, N = (xx, yy, zz, xy,
    xz, yz) the kernel's transform on this rank's frequencies (kept as
    -N).

    That transform is real (each component is even or odd in each
    offset), so it is kept real and repeated to the (re, im) layout of
    the complex arrays: each product is then a real one over their float
    views, a third of a complex product's arithmetic. An off-diagonal
    component whose axis has a single cell is odd in an offset that is
    always 0, so zero (round-off: ~1e-17 of the diagonal's): it is
    skipped (the film of standard problem 4: 5 products instead of 9)."""

    def __init__(self, Nk, n):
        Nk = np.ascontiguousarray(Nk.real)
        self.shape = Nk.shape[1:]           # one component, complex
        zero = {c for c, a, b in _OFF_DIAGONAL if n[a] == 1 or n[b] == 1}
        # stored negated: the sum of the products is then the field
        # without a pass to negate it (the same bits: negation is exact)
        self.N = [None if c in zero else np.repeat(-Nk[c], 2, axis=-1)
                  for c in range(6)]
        self.nbytes = sum(v.nbytes for v in self.N if v is not None)
        self._tmp = np.empty(self.shape[:-1] + (2 * self.shape[-1],))

    def apply(self, Mk, out):
        """out (3, *shape), complex, from Mk (3, *shape), complex."""
        xx, yy, zz, xy, xz, yz = self.N
        m = [np.ascontiguousarray(v).view(np.float64) for v in Mk]
        tmp = self._tmp
        for o, row in zip(out, ((xx, xy, xz), (xy, yy, yz),
                                (xz, yz, zz))):
            of = o.view(np.float64)
            first = True
            for k, mb in zip(row, m):
                if k is None:
                    continue
                if first:
                    np.multiply(k, mb, out=of)
                    first = False
                else:
                    np.multiply(k, mb, out=tmp)
                    of += tmp


class _SerialConvolution:
    """H = -N * M on one rank (also: every rank the whole grid, where a
    distributed FFT does not apply).

    The transforms are pruned: half of the padded input is zeros and
    half of the output is not wanted, so each 1-d pass runs only over
    the lines that matter (2x faster than rfftn/irfftn on a 3-d grid):
    forward, a real-to-complex pass along the last FFT axis, then
    complex passes along the others from the last to the first, each
    over the lines whose input is not all zero; backward the mirror,
    each pass over the lines whose output is wanted. They run in place
    in buffers kept from call to call (the padding set to zero once, or
    before the pass that reads it), with FFTW's plans where pyfftw is
    installed (Debian: python3-pyfftw; its passes take 0.65 of
    pocketfft's time on standard problem 4's grid, docs/mag.md
    "Performance") and scipy.fft otherwise (`engine`: "fftw" or
    "scipy", default the first available). Neither backward pass
    scales: the kernel's transform carries the 1 / (number of padded
    cells)."""

    def __init__(self, grid: CellGrid, octant, engine=None):
        from scipy import fft
        self.n = grid.n
        self.axes = [k for k in range(3) if grid.n[k] > 1]
        self.shape = [_padded(v) for v in grid.n]
        kernel = full_tensor(octant, self.shape)
        if not self.axes:
            self.Nk = kernel[:, 0, 0, 0].copy()
            self.kernel_bytes = self.Nk.nbytes
            return
        ax = [1 + k for k in self.axes]
        size = [grid.n[k] for k in self.axes]           # squeezed grid
        pad = [self.shape[k] for k in self.axes]
        spec = pad[:-1] + [pad[-1] // 2 + 1]
        Nk = fft.rfftn(kernel, axes=ax) / float(np.prod(pad))
        self.kernel = _KernelProduct(Nk.reshape((6,) + tuple(spec)),
                                     grid.n)
        self.kernel_bytes = self.kernel.nbytes
        self.engine = engine or ("fftw" if have_pyfftw() else "scipy")
        empty = _aligned_empty if self.engine == "fftw" else np.empty
        d = len(size)
        # forward: the real input (its last axis padded, zeros beyond
        # the grid), the spectrum; backward: the kernel product's output
        # (transformed in place) and the real output
        self._real = empty((3,) + tuple(size[:-1]) + (pad[-1],))
        self._real[...] = 0.0
        self._spec = empty((3,) + tuple(spec), dtype=complex)
        self._Hk = empty((3,) + tuple(spec), dtype=complex)
        self._out = empty((3,) + tuple(size[:-1]) + (pad[-1],))
        self._in = self._real[(Ellipsis, slice(0, size[-1]))]
        self._result = self._out[(Ellipsis, slice(0, size[-1]))]

        def corner(a, upto):
            # the lines of a along axes < upto limited to the grid
            return a[(slice(None),) + tuple(slice(0, size[k])
                                             for k in range(upto))]
        # forward pass j (along squeezed axis j, from d - 2 down to 0)
        # reads corner(spec, j): its input beyond the grid along axis j
        # is the padding, zeroed first
        r2c_out = corner(self._spec, d - 1)
        fwd, zero = [], []
        for j in range(d - 2, -1, -1):
            view = corner(self._spec, j)
            zero.append(view[(slice(None),) * (1 + j)
                             + (slice(size[j], None),)])
            fwd.append((view, 1 + j))
        bwd = [(corner(self._Hk, j), 1 + j) for j in range(d - 1)]
        c2r_in = corner(self._Hk, d - 1)
        self._zero = zero
        last = d
        if self.engine == "fftw":
            plan = _fftw_pass
            self._r2c = plan(self._real, r2c_out,
                             last, "FFTW_FORWARD")
            self._fwd = [plan(v, v, a, "FFTW_FORWARD") for v, a in fwd]
            self._bwd = [plan(v, v, a, "FFTW_BACKWARD") for v, a in bwd]
            self._c2r = plan(c2r_in, self._out, last, "FFTW_BACKWARD")
        else:
            def r2c():
                r2c_out[...] = fft.rfft(self._real, axis=last)

            def c2c(view, axis, inverse):
                f = fft.ifft if inverse else fft.fft
                norm = "forward" if inverse else "backward"

                def run():
                    view[...] = f(view, axis=axis, norm=norm,
                                  overwrite_x=True)
                return run

            def c2r():
                self._out[...] = fft.irfft(c2r_in, n=pad[-1], axis=last,
                                           norm="forward")
            self._r2c = r2c
            self._fwd = [c2c(v, a, False) for v, a in fwd]
            self._bwd = [c2c(v, a, True) for v, a in bwd]
            self._c2r = c2r

    def forward(self, Mg):
        """The padded transform of Mg (3, nx, ny, nz), scaled by 1 / the
        padded cells (the kernel's): a view of a buffer that the next
        call overwrites."""
        self._in[...] = Mg.reshape(self._in.shape)
        self._r2c()
        for z, run in zip(self._zero, self._fwd):
            z[...] = 0.0
            run()
        return self._spec

    def backward(self, Xk):
        """The unpadded (3, nx, ny, nz) part of the inverse transform of
        Xk, which must be self._Hk (transformed in place)."""
        if Xk is not self._Hk:
            self._Hk[...] = Xk
        for run in self._bwd:
            run()
        self._c2r()
        return self._result.reshape((3,) + self.n)

    def apply(self, M):
        """M (cells, 3) -> H (cells, 3) on every cell."""
        n = self.n
        if not self.axes:
            return -(M @ _tensor_matrix(self.Nk))
        Mg = np.moveaxis(M.reshape(n + (3,)), 3, 0)
        self.kernel.apply(self.forward(Mg), self._Hk)
        H = self.backward(self._Hk)
        return np.ascontiguousarray(np.moveaxis(H, 0, 3)).reshape(-1, 3)


def _tensor_matrix(N6):
    """The symmetric 3 x 3 matrix of (xx, yy, zz, xy, xz, yz)."""
    xx, yy, zz, xy, xz, yz = N6
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])


class _SlabConvolution:
    """H = -N * M with the grid in slabs over the ranks, pruned like the
    serial transform and split evenly in every pass.

    The unpadded grid is cut into slabs along its first FFT axis (the
    lead axis); the ranks' partial grids are summed onto the slabs.
    Each rank transforms its slab along the other axes (only the lines
    that hold data), a global transpose (mpi4py-fft's pencil
    redistribution, Alltoallw) hands every rank a block of the first of
    those frequencies with the whole lead axis, which it transforms
    zero-padded, multiplies by its block of the kernel and transforms
    back; the way back mirrors it.

    A rank's nodes touch only the cells of a band of lead-axis layers
    (`need`: where its partial grid can be non-zero, and where it reads
    the field back), and only the overlap of a band with a slab travels,
    both ways (Alltoallv). The partitioner cuts a long body across its
    length, so where that length lies along the lead axis (x, then y,
    then z: the first with more than one cell) the bands follow the
    slabs and little travels (standard problem 4's film on two ranks: 20
    and 15 of its 200 layers each way); otherwise a band spans the axis
    and as much travels as a reduce-scatter and an allgather would move
    (the bar, long in z).

    The passes run on FFTW's plans in kept buffers where pyfftw is
    installed (as _SerialConvolution's), else on scipy.fft.

    Transforming the padded grid in slabs instead (mpi4py-fft's PFFT)
    gives the ranks holding only padding the same work as the rest: on
    two ranks its first pass is no faster than one rank's pruned one.
    """

    def __init__(self, comm, grid: CellGrid, octant, need):
        from mpi4py import MPI
        from scipy import fft
        self.MPI = MPI
        self.comm = comm
        self.fft = fft
        self.n = grid.n
        self.axes = [k for k in range(3) if grid.n[k] > 1]
        full_shape = [_padded(v) for v in grid.n]
        self.sizes = [grid.n[k] for k in self.axes]      # squeezed grid
        self.pad = [full_shape[k] for k in self.axes]
        # the global array between the passes: components, the lead
        # axis unpadded, the others transformed (the last by rfft)
        between = [3, self.sizes[0]] + self.pad[1:-1] + [self.pad[-1] // 2
                                                          + 1]
        self.slabs, self.blocks = self._pencils(comm, between)
        self.transpose = self.slabs.transfer(self.blocks, complex)
        x0 = self.slabs.substart[1]
        self.own = (x0, x0 + self.slabs.subshape[1])
        lead = self.axes[0]
        per_layer = grid.cells // grid.n[lead] * 3
        self._bands(comm, need, per_layer)
        layers = list(self.n)
        layers[lead] = self.own[1] - self.own[0]
        self._layers = tuple(layers)
        self._squeezed = (3,) + tuple(layers[k] for k in self.axes)
        self._slab = np.empty((self.own[1] - self.own[0]) * per_layer)
        # the field outside this rank's band is never written nor read
        self._H = np.zeros(grid.cells * 3)
        self._across = np.empty(self.slabs.subshape, dtype=complex)
        self._along = np.empty(self.blocks.subshape, dtype=complex)
        # one engine on every rank: the two scale the kernel differently,
        # and a line's passes cross ranks
        every = comm.allreduce(int(have_pyfftw()), op=MPI.MIN)
        self.engine = "fftw" if every else "scipy"
        Nk = self._kernel(comm, octant, full_shape, lead)
        if self.engine == "fftw":
            # the inverse passes do not scale (_SerialConvolution)
            Nk = Nk / float(np.prod(self.pad))
        self.kernel = _KernelProduct(Nk, grid.n)
        self.kernel_bytes = self.kernel.nbytes
        self._Hk = np.empty((3,) + self.kernel.shape, dtype=complex)
        if self.engine == "fftw":
            self._plan_fftw()

    def _plan_fftw(self) -> None:
        """FFTW's plans of the passes (as _SerialConvolution's: in place
        in aligned buffers kept between calls, FFTW_ESTIMATE), the
        transposes between them as with scipy.fft."""
        sq, pad, plan = self._squeezed, self.pad, _fftw_pass
        self._across = _aligned_empty(self.slabs.subshape, complex)
        self._along = _aligned_empty(self.blocks.subshape, complex)
        self._Hk = _aligned_empty(self._Hk.shape, complex)
        self._spec = _aligned_empty(self._Hk.shape, complex)
        self._real = _aligned_empty(sq[:-1] + (pad[-1],))
        self._real[...] = 0.0
        self._real_out = _aligned_empty(sq[:-1] + (pad[-1],))
        self._in = self._real[..., :sq[-1]]
        self._result = self._real_out[..., :sq[-1]]
        last = len(sq) - 1
        if len(sq) == 4:
            # the middle axis: the real-to-complex pass fills its lines
            # that hold data, the rest is padding
            corner = self._across[:, :, :sq[2], :]
            self._pad_middle = self._across[:, :, sq[2]:, :]
            self._middle = plan(self._across, self._across, 2,
                                "FFTW_FORWARD")
            self._imiddle = plan(self._across, self._across, 2,
                                 "FFTW_BACKWARD")
        else:
            corner = self._across
        self._r2c = plan(self._real, corner, last, "FFTW_FORWARD")
        self._c2r = plan(corner, self._real_out, last, "FFTW_BACKWARD")
        self._lead = plan(self._spec, self._spec, 1, "FFTW_FORWARD")
        self._ilead = plan(self._Hk, self._Hk, 1, "FFTW_BACKWARD")

    def _convolve_fftw(self, Mg):
        """The slab's field (3, own layers, ...) from its M, on FFTW's
        plans; a view of a buffer that the next call overwrites."""
        n0 = self.sizes[0]
        self._in[...] = Mg.reshape(self._squeezed)
        self._r2c()
        if len(self._squeezed) == 4:
            self._pad_middle[...] = 0.0
            self._middle()
        self.transpose.forward(self._across, self._along)
        self._spec[:, :n0] = self._along
        self._spec[:, n0:] = 0.0
        self._lead()
        self.kernel.apply(self._spec, self._Hk)
        self._ilead()
        self._along[...] = self._Hk[:, :n0]
        self.transpose.backward(self._along, self._across)
        if len(self._squeezed) == 4:
            self._imiddle()
        self._c2r()
        return self._result

    def _bands(self, comm, need, per_layer) -> None:
        """This rank's plan of the band exchange (band_plan), from every
        rank's slab and band."""
        spans = comm.allgather(self.own)
        needs = comm.allgather(tuple(int(v) for v in need))
        plan = band_plan(spans, needs, comm.Get_rank(), per_layer)
        self._fwd_send, self._fwd_recv = plan["fwd_send"], plan["fwd_recv"]
        self._fwd_adds = plan["fwd_adds"]
        self._fwd_buf = np.empty(int(plan["fwd_recv"][0].sum()))
        self._bwd_send, self._bwd_recv = plan["bwd_send"], plan["bwd_recv"]
        self.need = tuple(needs[comm.Get_rank()])

    @staticmethod
    def _pencils(comm, shape):
        """The slabs (distributed along array axis 1) and the blocks
        (distributed along axis 2, whole along axis 1) of `shape`."""
        from mpi4py import MPI
        from mpi4py_fft.pencil import Pencil
        subcomms = [MPI.COMM_SELF] * len(shape)
        subcomms[1] = comm
        slabs = Pencil(subcomms, shape, axis=2)
        return slabs, slabs.pencil(1)

    def _kernel(self, comm, octant, full_shape, lead):
        """This rank's block of the kernel's transform (real, stored
        complex): the padded kernel in slabs along the lead axis,
        transformed along the others, transposed, transformed along
        the lead axis. Set-up only."""
        shape = [6, self.pad[0]] + self.pad[1:-1] + [self.pad[-1] // 2 + 1]
        slabs, blocks = self._pencils(comm, shape)
        a = slabs.substart[1]
        kernel = full_tensor(octant, full_shape,
                             slab=(lead, a, a + slabs.subshape[1]))
        kernel = kernel.reshape((6, slabs.subshape[1]) + tuple(
            self.pad[1:]))
        X = self._across_axes(kernel, None)
        Y = np.empty(blocks.subshape, dtype=complex)
        slabs.transfer(blocks, complex).forward(
            np.ascontiguousarray(X), Y)
        Nk = self.fft.fft(Y, axis=1).real
        if Nk.shape[2:] != self.blocks.subshape[2:]:
            raise SetupError("demag grid: kernel and field blocks differ")
        return Nk

    def _across_axes(self, X, n):
        """Forward transform along the axes after the lead one, the
        last by rfft; `n`: the padded lengths (None: X is padded)."""
        last = X.ndim - 1
        X = self.fft.rfft(X, n=None if n is None else n[-1], axis=last)
        for a in range(last - 1, 1, -1):
            X = self.fft.fft(X, n=None if n is None else n[a - 1], axis=a)
        return X

    def _convolve_scipy(self, Mg):
        """The slab's field (3, own layers, ...) from its M, scipy.fft."""
        fft = self.fft
        X = self._across_axes(Mg.reshape(self._squeezed), self.pad)
        self._across[...] = X
        self.transpose.forward(self._across, self._along)
        Mk = fft.fft(self._along, n=self.pad[0], axis=1)
        self.kernel.apply(Mk, self._Hk)
        self._along[...] = fft.ifft(self._Hk, axis=1)[:, :self.sizes[0]]
        self.transpose.backward(self._along, self._across)
        X = self._across
        last = X.ndim - 1
        for a in range(2, last):
            X = fft.ifft(X, axis=a)[(slice(None),) * a
                                    + (slice(0, self.sizes[a - 1]),)]
        X = fft.irfft(X, n=self.pad[-1], axis=last)
        return X[(slice(None),) * last + (slice(0, self.sizes[-1]),)]

    def apply(self, M_partial):
        """This rank's partial M (cells, 3), non-zero only in its band
        of layers -> H (cells, 3) on the cells of that band (zero
        elsewhere); collective."""
        D = self.MPI.DOUBLE
        self.comm.Alltoallv([M_partial.reshape(-1), self._fwd_send, D],
                            [self._fwd_buf, self._fwd_recv, D])
        self._slab[:] = 0.0
        for off, count, at in self._fwd_adds:
            self._slab[at:at + count] += self._fwd_buf[off:off + count]
        Mg = np.moveaxis(self._slab.reshape(self._layers + (3,)), 3, 0)
        if self.engine == "fftw":
            H = self._convolve_fftw(Mg)
        else:
            H = self._convolve_scipy(Mg)
        slab = np.ascontiguousarray(
            np.moveaxis(H.reshape((3,) + self._layers), 0, 3)).reshape(-1)
        self.comm.Alltoallv([slab, self._bwd_send, D],
                            [self._H, self._bwd_recv, D])
        return self._H.reshape(-1, 3)


def band_plan(spans, needs, me: int, per_layer: int) -> dict:
    """Rank `me`'s Alltoallv counts and displacements (in doubles, a
    layer being `per_layer` of them) between the ranks' bands of needed
    layers `needs` and their slabs `spans` ([lo, hi) each): forward
    ("fwd_send" from the whole partial grid, "fwd_recv" into a buffer
    of the pieces, "fwd_adds" (buffer offset, count, slab offset) where
    each is added), a band's overlap with each slab to the slab's
    owner; backward ("bwd_send" from the slab, "bwd_recv" into the
    whole field), a slab's overlap with each band to the band's rank."""
    def overlap(a, b):
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        return (lo, hi) if lo < hi else (lo, lo)

    def counts_displs(pairs, base):
        counts = np.array([(hi - lo) * per_layer for lo, hi in pairs],
                          dtype=np.int64)
        displs = np.array([(lo - base) * per_layer for lo, _ in pairs],
                          dtype=np.int64)
        return counts, displs

    own, band = spans[me], needs[me]
    counts, into_slab = counts_displs([overlap(nd, own) for nd in needs],
                                      own[0])
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return {
        "fwd_send": counts_displs([overlap(band, sp) for sp in spans], 0),
        "fwd_recv": (counts, offsets),
        "fwd_adds": [(int(o), int(c), int(d)) for o, c, d in
                     zip(offsets, counts, into_slab) if c],
        "bwd_send": counts_displs([overlap(own, nd) for nd in needs],
                                  own[0]),
        "bwd_recv": counts_displs([overlap(sp, band) for sp in spans], 0),
    }


def _band(T, grid: CellGrid):
    """The layers [lo, hi) of the grid's first FFT axis (the slowest
    varying one of more than one cell) holding the cells of T's non-zero
    rows: those this rank's nodes touch."""
    lead = next(k for k in range(3) if grid.n[k] > 1)
    cells = np.flatnonzero(np.diff(T.indptr))
    if not len(cells):
        return (0, 0)
    per_layer = grid.cells // grid.n[lead]
    return (int(cells[0] // per_layer), int(cells[-1] // per_layer) + 1)


def have_pyfftw() -> bool:
    """Whether pyfftw (Debian: python3-pyfftw) can be imported: the
    serial convolution then runs on FFTW's plans."""
    try:
        import pyfftw  # noqa: F401
    except ImportError:
        return False
    return True


def _fftw_pass(a, b, axis: int, direction: str):
    """One 1-d pass from a to b along `axis` on an FFTW plan (one thread,
    FFTW_ESTIMATE: the same plan, and so the same round-off, every run);
    its execute, which neither allocates nor scales."""
    import pyfftw
    return pyfftw.FFTW(a, b, axes=(axis,), direction=direction,
                       flags=("FFTW_ESTIMATE",), threads=1).execute


def _aligned_empty(shape, dtype=float):
    """An array aligned for FFTW's SIMD codelets, so that the plans, and
    so the round-off, are the same from run to run."""
    import pyfftw
    return pyfftw.empty_aligned(shape, dtype=dtype)


def have_mpi4py_fft() -> bool:
    """Whether mpi4py-fft (Debian: python3-mpi4py-fft) can be imported."""
    try:
        import mpi4py_fft  # noqa: F401
    except ImportError:
        return False
    return True


def _distributable(comm, grid: CellGrid) -> bool:
    """A distributed FFT needs two FFT axes, a slab of the lead axis and
    a block of the next one's frequencies per rank, and mpi4py-fft;
    without them every rank transforms the whole grid (the same field,
    without the speed-up of the FFT's share)."""
    n = [v for v in grid.n if v > 1]
    size = comm.Get_size()
    if size == 1 or len(n) < 2:
        return False
    # the length of the second FFT axis between the passes
    second = _padded(n[1]) if len(n) == 3 else _padded(n[1]) // 2 + 1
    return n[0] >= size and second >= size and have_mpi4py_fft()


# ---------------------------------------------------------------- the term

class GridDemag(Term):
    """Demagnetizing field by the grid method (module docstring).

    ``GridDemag(space, Ms_nodes, tol=GRID_TOL, length=inf, spacing=None)``:
    Ms_nodes (A/m per node, (n,) on every rank, or a scalar) as for
    demag.DemagField; `length` the exchange length the spacing is
    chosen for (`exchange_length`), `spacing` a fixed upper bound of the
    cell size instead (m). Collective. ``self.grid`` is the grid,
    ``self.distributed`` whether the FFT is split over the ranks."""

    name = "demag"
    quadratic = True
    method = "grid"

    def __init__(self, space, Ms_nodes, tol: float = GRID_TOL,
                 length: float = math.inf, spacing=None):
        super().__init__()
        import scipy.sparse as sp
        self.space = space
        comm = space.comm
        mesh = space.mesh
        ms = np.broadcast_to(np.asarray(Ms_nodes, dtype=np.float64),
                             (space.n,)).copy()
        if not np.all(np.isfinite(ms)) or np.any(ms < 0):
            raise ProblemError("Ms must be finite and non-negative")
        self.Ms = ms
        self.grid = grid_for(mesh.points, mesh.tets, tol, length, spacing)
        g = self.grid
        T = transfer_matrix(mesh.points, mesh.tets, ms, g,
                            (space.rstart, space.rend))
        self.T = T
        # H_i = sum_c V_c T_ci H_c / (Ms_i V_i), with V_i the lumped mass
        msv = ms[space.rstart:space.rend] * space.mass_local
        scale = np.divide(1.0, msv, out=np.zeros_like(msv), where=msv > 0)
        self.T_back = (sp.diags(scale) @ T.T.tocsr()
                       * g.cell_volume).tocsr()
        self.distributed = _distributable(comm, g)
        size = comm.Get_size()
        octant = octant_tensor(g.n, g.h, part=(comm.Get_rank(), size))
        if size > 1:
            from mpi4py import MPI
            comm.Allreduce(MPI.IN_PLACE, octant, op=MPI.SUM)
        if self.distributed:
            self.conv = _SlabConvolution(comm, g, octant, _band(T, g))
        else:
            self.conv = _SerialConvolution(g, octant)
        self.bytes = int(T.data.nbytes * 2 + T.indices.nbytes * 2
                         + self.conv.kernel_bytes)

    def grid_magnetization(self, m_local):
        """This rank's part of M on the grid, (cells, 3) A/m: the sum over
        the ranks is the grid magnetization."""
        return self.T @ m_local

    def grid_field(self, m_local, partial=None):
        """H (cells, 3), A/m, for this rank's m (or its `partial` grid
        magnetization): on every cell on one rank; with the FFT over the
        ranks only on the cells this rank's nodes touch (the rest zero,
        and what this rank's T_back and energy read). Collective."""
        if partial is None:
            partial = self.grid_magnetization(m_local)
        if self.distributed:
            return self.conv.apply(partial)
        if self.space.comm.Get_size() > 1:
            from mpi4py import MPI
            partial = partial.copy()
            self.space.comm.Allreduce(MPI.IN_PLACE, partial, op=MPI.SUM)
        return self.conv.apply(partial)

    def h(self, state, out_vec) -> None:
        """Overwrite out_vec with H_demag (A/m) at the nodes for state.m."""
        m = state.m.getArray(readonly=True).reshape(-1, 3)
        H = self.grid_field(m)
        with out_vec as out:
            out.reshape(-1, 3)[:] = self.T_back @ H

    def stack_field(self, state):
        # the transfers premultiplied: M = T P u, H_s = R T_back H
        if getattr(self, "_stack_transfers", None) is None:
            sk = state.stacks
            self._stack_transfers = ((self.T @ sk.prolongation()).tocsr(),
                                     (sk.R @ self.T_back).tocsr())
        TP, RTb = self._stack_transfers

        def f(st, u_vec, out_vec):
            u = u_vec.getArray(readonly=True).reshape(-1, 3)
            H = self.grid_field(None, TP @ u)
            with out_vec as out:
                out.reshape(-1, 3)[:] = RTb @ H
        return f

    def E(self, state) -> float:
        """-(mu0/2) sum_c V_c M_c.H_c (J), the same on every rank; equal
        to the nodal -(mu0/2) sum_i Ms_i V_i m_i.H_i (the transfer's
        adjoint)."""
        m = state.m.getArray(readonly=True).reshape(-1, 3)
        partial = self.grid_magnetization(m)
        H = self.grid_field(m, partial)
        local = float(np.einsum("ij,ij->", partial, H))
        total = self.space.comm.allreduce(local)
        return -0.5 * MU0 * self.grid.cell_volume * total
