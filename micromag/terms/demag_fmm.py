"""The boundary operator u2|bnd = B u1|bnd of demag.py without forming B.

B u = 1/(4 pi) sum_T int_T u(y) n.(x - y)/|x - y|^3 dS_y + (Omega/(4 pi) - 1) u
at every boundary node x, for the P1 function u on the flat boundary
triangles T (docs/mag-demag.md). Split by distance:

- far field: each triangle's integral by a fixed quadrature rule, i.e. point
  dipoles of moment u(y_q) w_q A_T n_T at its quadrature points y_q,
  summed at the boundary nodes by the Laplace fast multipole method of
  the Flatiron Institute's FMM3D (PyPI `fmm3dpy`, kernel 1/(4 pi r), so its
  dipole potential is exactly the integrand above) to relative precision
  `eps`. The dipole moments are a sparse linear map of u (the hat
  functions at the quadrature points), so the whole operator is linear.
- near field: for the pairs (node i, triangle T) with |x_i - c_T| <
  eta * diam(T) the quadrature is poor (the kernel is nearly singular);
  there the FMM's quadrature term is subtracted again and the exact
  Lindholm weights (demag._BoundaryKernel) are added. These corrections
  and the diagonal solid-angle term are one sparse matrix, assembled once.

So B u = FMM(Q u) + C u with Q (quadrature points x nodes) and C (nodes x
nodes) sparse: O(N) memory and about O(N log N) time per product.

Rule and eta come from the tolerance: the quadrature error of the far
field does not depend on the mesh size (everything scales with the
triangle size), so it was measured once, as the relative 2-norm error of
B u against the dense matrix for random and smooth u on spheres (399 and
1601 boundary nodes) and a box (edges and corners): the `_SCHEMES` table.
The cheapest scheme whose error is below tol/2 is used and the FMM is
asked for eps = tol; the measured total error is then 0.1 to 0.6 tol
(tests/micromag/test_demag_fmm.py).

Parallel: rank r owns the boundary nodes in its node range (the rows of B)
and the triangles whose smallest node it owns (their quadrature points
are its FMM sources). A product gathers u on the boundary to every rank
(Nb doubles), each rank sums its sources' potential at all boundary nodes,
and a reduce-scatter adds the parts up at the owners. Splitting the
sources, not the targets, is the cheaper of the two since there are 3 to
16 times more sources than targets. Results depend on the rank count only
through the FMM's error (different source sets give different trees).
"""

from __future__ import annotations

import numpy as np

from ..constants import FOUR_PI
from ..errors import ProblemError, SimulationError

# Pairs (node, triangle) of the near field evaluated per numpy block.
_PAIRS_PER_BLOCK = 200_000


# ---------------------------------------------------------------------------
# Quadrature on the triangle: barycentric points (q, 3), weights summing to 1
# ---------------------------------------------------------------------------

def _rule_3():
    """Degree 2: the three points (2/3, 1/6, 1/6) and permutations."""
    pts = np.full((3, 3), 1.0 / 6.0)
    np.fill_diagonal(pts, 2.0 / 3.0)
    return pts, np.full(3, 1.0 / 3.0)


def _rule_7():
    """Degree 5 (Radon's rule): the centroid and two orbits of three."""
    s = np.sqrt(15.0)
    pts, wts = [np.full(3, 1.0 / 3.0)], [9.0 / 40.0]
    for a, w in (((6.0 - s) / 21.0, (155.0 - s) / 1200.0),
                 ((6.0 + s) / 21.0, (155.0 + s) / 1200.0)):
        for k in range(3):
            p = np.full(3, a)
            p[k] = 1.0 - 2.0 * a
            pts.append(p)
            wts.append(w)
    return np.array(pts), np.array(wts)


def _rule_16():
    """Degree 7: 4 x 4 collapsed Gauss (Gauss-Jacobi(1, 0) in the
    collapsed direction, Gauss-Legendre along it)."""
    from scipy.special import roots_jacobi
    xj, wj = roots_jacobi(4, 1.0, 0.0)      # weight (1 - x) on [-1, 1]
    xl, wl = np.polynomial.legendre.leggauss(4)
    s, ws = (xj + 1.0) / 2.0, wj / 4.0      # int_0^1 f(s) (1 - s) ds
    t, wt = (xl + 1.0) / 2.0, wl / 2.0
    l1 = np.repeat(s, 4)
    l2 = np.outer(1.0 - s, t).reshape(-1)
    pts = np.stack([1.0 - l1 - l2, l1, l2], axis=1)
    return pts, 2.0 * np.outer(ws, wt).reshape(-1)


_RULES = {3: _rule_3, 7: _rule_7, 16: _rule_16}

# (rule, eta, measured relative error of B u): cheapest first.
_SCHEMES = ((3, 1.0, 4e-4), (3, 2.0, 3.5e-5), (3, 3.0, 8e-6),
            (3, 4.0, 3.2e-6), (7, 2.0, 4e-7), (7, 3.0, 3.5e-8),
            (7, 4.0, 5e-9), (16, 3.0, 1.1e-10), (16, 4.0, 1.2e-11))


def scheme_for(tol: float):
    """(points per triangle, eta, FMM eps) for a relative tolerance."""
    if not (0.0 < tol <= 0.1):
        raise ProblemError("demag tol must be in (0, 0.1]")
    for rule, eta, err in _SCHEMES:
        if err <= tol / 2.0:
            break
    return rule, eta, tol


def quadrature_rule(n: int):
    """(barycentric points (n, 3), weights (n,) summing to 1)."""
    return _RULES[n]()


# ---------------------------------------------------------------------------
# The operator
# ---------------------------------------------------------------------------

class FMMBoundaryOperator:
    """This rank's rows of B (its boundary nodes `rows`, positions in
    bnd_nodes) as FMM + sparse near field. Collective over `comm` (mpi4py):
    `counts[r]` is the number of rows of rank r, the rows are contiguous
    and in rank order.

    ``apply(u_own)`` returns (B u)[rows] from u on the own rows. (Not a
    PETSc MATPYTHON shell: petsc4py 3.18 destroys such a matrix after
    PetscFinalize when it is still referenced at exit, and crashes.)
    """

    def __init__(self, comm, points, bnd_nodes, bnd_facets, omega, rows,
                 counts, tol: float):
        from scipy.spatial import cKDTree
        import scipy.sparse as sp
        from .demag import _BoundaryKernel
        self.comm = comm
        self.counts = np.asarray(counts, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        self.rows = rows
        nb = len(bnd_nodes)
        self.n_boundary = nb
        self.rule, self.eta, self.eps = scheme_for(tol)
        self.tol = tol
        bnd_facets = np.asarray(bnd_facets, dtype=np.int64)
        col_of_node = np.full(len(points), -1, dtype=np.int64)
        col_of_node[bnd_nodes] = np.arange(nb)
        fcols = col_of_node[bnd_facets]                         # (F, 3)
        if np.any(fcols < 0):
            raise ValueError("boundary facet uses a node not in "
                             "boundary_nodes")
        # order-one coordinates (the FMM and the weights are scale-free)
        extent = float(np.ptp(points[bnd_nodes], axis=0).max()) or 1.0
        centre = points[bnd_nodes].mean(axis=0)
        xs = (points[bnd_nodes] - centre) / extent              # (Nb, 3)
        kernel = _BoundaryKernel(xs, fcols, 1.0)   # MeshError: degenerate
        tri = xs[fcols]                                         # (F, 3, 3)
        cross = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
        area = 0.5 * np.linalg.norm(cross, axis=1)
        normal = cross / (2.0 * area[:, None])
        diam = np.linalg.norm(np.roll(tri, -1, axis=1) - tri,
                              axis=2).max(axis=1)
        bary, wts = quadrature_rule(self.rule)
        nq = len(wts)

        # --- far field: this rank's triangles' quadrature points as
        # sources. u(y_q) w_q A_T = sum_j lambda_j(y_q) w_q A_T u_j.
        r0 = int(self.counts[:comm.Get_rank()].sum())
        if not np.array_equal(rows, np.arange(r0, r0 + len(rows))):
            raise ValueError("rows must be this rank's contiguous slice")
        mine = np.flatnonzero((fcols.min(axis=1) >= r0)
                              & (fcols.min(axis=1) < r0 + len(rows)))
        self.sources = np.ascontiguousarray(
            np.einsum("qj,fjc->fqc", bary, tri[mine]).reshape(-1, 3).T)
        self.src_normal = np.ascontiguousarray(
            np.repeat(normal[mine], nq, axis=0).T)               # (3, S)
        vals = (bary[None, :, :] * wts[None, :, None]
                * area[mine, None, None])                        # (f, q, 3)
        src_rows = np.repeat(np.arange(len(mine) * nq), 3)
        src_cols = np.repeat(fcols[mine], nq, axis=0).reshape(-1)
        self.moments = sp.csr_matrix(
            (vals.reshape(-1), (src_rows, src_cols)),
            shape=(len(mine) * nq, nb))
        self.targets = np.ascontiguousarray(xs.T)               # (3, Nb)

        # --- near field: (own node, triangle) pairs within eta * diam of
        # the triangle's centroid; exact minus quadrature, / 4 pi.
        own_x = xs[rows]
        pair_node, pair_tri = _near_pairs(cKDTree(own_x) if len(rows) else
                                          None, tri.mean(axis=1),
                                          self.eta * diam)
        ent_r, ent_c, ent_v = [], [], []
        for start in range(0, len(pair_node), _PAIRS_PER_BLOCK):
            pn = pair_node[start:start + _PAIRS_PER_BLOCK]
            pt = pair_tri[start:start + _PAIRS_PER_BLOCK]
            x = own_x[pn]                                         # (P, 3)
            exact = kernel.weights(x, pt)                         # (3, P)
            y = np.einsum("qj,pjc->pqc", bary, tri[pt])           # (P,q,3)
            d = x[:, None, :] - y
            k = (np.einsum("pqc,pc->pq", d, normal[pt])
                 / np.einsum("pqc,pqc->pq", d, d) ** 1.5)
            approx = np.einsum("qj,q,pq->jp", bary, wts, k) * area[pt]
            ent_r.append(np.tile(pn, 3))
            ent_c.append(fcols[pt].T.reshape(-1))
            ent_v.append(((exact - approx) / FOUR_PI).reshape(-1))
        ent_r.append(np.arange(len(rows)))
        ent_c.append(rows)
        ent_v.append(omega[bnd_nodes[rows]] / FOUR_PI - 1.0)
        self.near = sp.csr_matrix(
            (np.concatenate(ent_v), (np.concatenate(ent_r),
                                     np.concatenate(ent_c))),
            shape=(len(rows), nb))
        self.near.sum_duplicates()
        self.n_pairs = len(pair_node)
        self._u_all = np.empty(nb)
        self._pot_own = np.empty(len(rows))

    def nbytes(self) -> int:
        """Bytes this rank keeps for the operator (arrays and matrices)."""
        mats = sum(m.data.nbytes + m.indices.nbytes + m.indptr.nbytes
                   for m in (self.moments, self.near))
        return int(mats + self.sources.nbytes + self.src_normal.nbytes
                   + self.targets.nbytes + self._u_all.nbytes)

    def apply(self, u_own: np.ndarray) -> np.ndarray:
        """(B u)[rows] from u on this rank's rows; collective."""
        import fmm3dpy
        from mpi4py import MPI
        u_all = self._u_all
        counts = self.counts
        self.comm.Allgatherv(np.ascontiguousarray(u_own, dtype=np.float64),
                             [u_all, counts])
        if self.sources.shape[1]:
            dip = self.src_normal * (self.moments @ u_all)[None, :]
            out = fmm3dpy.lfmm3d(eps=self.eps, sources=self.sources,
                                 dipvec=dip, targets=self.targets, pgt=1)
            if getattr(out, "ier", 0):
                raise SimulationError(f"demag: FMM failed (ier {out.ier})")
            pot = np.ascontiguousarray(out.pottarg, dtype=np.float64)
        else:
            pot = np.zeros(self.n_boundary)
        if self.comm.Get_size() > 1:
            self.comm.Reduce_scatter(pot, self._pot_own, list(counts),
                                     op=MPI.SUM)
            far = self._pot_own
        else:
            far = pot
        return far + self.near @ u_all


def _near_pairs(tree, centroids, radius):
    """(node, triangle) index pairs with |x_node - c_T| < radius_T."""
    if tree is None or len(centroids) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    hits = tree.query_ball_point(centroids, radius, return_sorted=False)
    sizes = np.fromiter((len(h) for h in hits), dtype=np.int64,
                        count=len(hits))
    nodes = (np.concatenate([np.asarray(h, dtype=np.int64) for h in hits])
             if sizes.sum() else np.empty(0, np.int64))
    tris = np.repeat(np.arange(len(centroids)), sizes)
    return nodes, tris
