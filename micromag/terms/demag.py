"""Demagnetizing field by the hybrid FEM/BEM method of Fredkin and Koehler.

The magnetic scalar potential u (H = -grad u) is split as u = u1 + u2:

1. u1 solves the Poisson problem inside the magnet with the Neumann
   condition du1/dn = M.n and is zero outside; its weak form is
   ``K u1 = D m`` with D[j, 3k+c] = sum_e V_e/4 * dphi_j/dx_c * Ms_k.
   K is singular (constants); the right-hand side is orthogonal to the
   constants by construction, so CG with the constant null space works.
2. u2 is harmonic inside and outside and jumps by u1 across the surface:
   it is the double-layer potential of u1. Its boundary values are
   ``u2|bnd = B u1|bnd`` with the dense matrix
   ``B_ij = 1/(4 pi) sum_T w_T,j(x_i) + delta_ij (Omega_i/(4 pi) - 1)``,
   where w_T,j(x) is the exact double-layer integral of the hat function of
   node j over the flat boundary triangle T (Lindholm 1984) and Omega_i is
   the interior solid angle at boundary node i.
3. u2 inside: Laplace problem with those Dirichlet values.

H = -grad u is projected to the nodes with the lumped mass, and
E = -(mu0/2) int Ms m.H = (mu0/2) u.(D m) (identical in this discretisation).

Parallel layout follows the FEM space: every rank owns the contiguous nodes
[rstart, rend) and the boundary nodes among them, which are also the rows of
B that it computes and stores (PETSc MPIDENSE). Nothing here depends on the
number of ranks except round-off and solver tolerance.
"""

from __future__ import annotations

import numpy as np

from ..constants import FOUR_PI, MU0
from ..errors import MeshError, ProblemError, SimulationError
from ..parallel import global_min
from .base import Term
from .demag_fmm import FMMBoundaryOperator, scheme_for
from .demag_method import host_memory_bytes, resolve

# PETSc comes from the FEM space (fem.py initialises petsc4py without
# reading sys.argv), so importing this module does not start PETSc.

# Pairs (observer, triangle) evaluated per numpy block: bounds the
# temporaries of the BEM assembly to a few tens of MB.
_PAIRS_PER_BLOCK = 50_000


# ---------------------------------------------------------------------------
# Geometry: exact double-layer integrals over flat P1 triangles, solid angles
# ---------------------------------------------------------------------------

def _triangle_frames(tri):
    """Per-triangle data the observer loop reuses.

    tri: (F, 3, 3) corner coordinates, counter-clockwise seen from the
    outward normal. Returns unit normals (F,3), edge lengths (F,3) of edges
    j -> j+1, hat-function gradients (F,3,3) and the matrix
    grad(lambda_i) . nu_e (F,3,3) of gradients against outward in-plane edge
    normals.
    """
    edges = np.roll(tri, -1, axis=1) - tri            # e_j = r_{j+1} - r_j
    cross = np.cross(edges[:, 0], -edges[:, 2])       # (r1-r0) x (r2-r0)
    twice_area = np.linalg.norm(cross, axis=1)
    if np.any(twice_area <= 0.0):
        raise MeshError("degenerate boundary triangle (zero area)")
    normal = cross / twice_area[:, None]
    length = np.linalg.norm(edges, axis=2)
    edge_normal = np.cross(edges, normal[:, None, :]) / length[:, :, None]
    # lambda_i vanishes on the opposite edge e_{i+1} = r_{i+2} - r_{i+1}.
    grad_hat = (np.cross(normal[:, None, :], np.roll(edges, -1, axis=1))
                / twice_area[:, None, None])
    grad_dot_nu = np.einsum("fic,fec->fie", grad_hat, edge_normal)
    return normal, length, grad_hat, grad_dot_nu


def double_layer_weights(obs, tri, frames=None):
    """Exact integrals w[r, f, i] = int_T_f lambda_i(y) d/dn_y 1/|x_r - y| dS.

    lambda_i are the three linear hat functions of triangle f, n its outward
    normal; d/dn_y 1/|x-y| = n.(x-y)/|x-y|^3. With h = n.(x - r0) the
    (signed) height of x above the plane and p its projection,

        w_i = lambda_i(p) * S - h * grad(lambda_i) . sum_e nu_e P_e,

    where S = h int 1/|x-y|^3 dS is the signed solid angle of the triangle
    (minus the van Oosterom-Strackee angle for our orientation) and
    P_e = int_e 1/|x-y| dl = ln((a+b+L)/(a+b-L)) the edge integral (a, b the
    distances to the edge ends): the linear part integrates to edge terms by
    the divergence theorem in the plane. The three weights sum to S.
    A point in the plane of a triangle (in particular one of its corners)
    gets 0, the principal value.
    """
    if frames is None:
        frames = _triangle_frames(tri)
    normal, length, grad_hat, grad_dot_nu = frames
    rho = tri[None, :, :, :] - obs[:, None, None, :]          # (R,F,3,3)
    dist = np.linalg.norm(rho, axis=3)                         # (R,F,3)
    height = -np.einsum("rfc,fc->rf", rho[:, :, 0], normal)    # n.(x - r0)
    triple = np.einsum("rfc,rfc->rf", rho[:, :, 0],
                       np.cross(rho[:, :, 1], rho[:, :, 2]))
    dot12 = np.einsum("rfc,rfc->rf", rho[:, :, 1], rho[:, :, 2])
    dot02 = np.einsum("rfc,rfc->rf", rho[:, :, 0], rho[:, :, 2])
    dot01 = np.einsum("rfc,rfc->rf", rho[:, :, 0], rho[:, :, 1])
    denom = (dist[..., 0] * dist[..., 1] * dist[..., 2]
             + dist[..., 0] * dot12 + dist[..., 1] * dot02
             + dist[..., 2] * dot01)
    solid = -2.0 * np.arctan2(triple, denom)                   # (R,F)
    ends = dist + np.roll(dist, -1, axis=2)                    # a + b per edge
    with np.errstate(divide="ignore", invalid="ignore"):
        edge_int = np.log((ends + length[None]) / (ends - length[None]))
        # lambda_i(p) = grad(lambda_i).(x - r_{i+1}) (gradient is in-plane).
        hat_at_x = -np.einsum("fic,rfic->rfi", grad_hat,
                              np.roll(rho, -1, axis=2))
        w = (hat_at_x * solid[..., None]
             - height[..., None] * np.einsum("fie,rfe->rfi", grad_dot_nu,
                                             edge_int))
    # In-plane observers: the exact value is 0, but an edge integral may be
    # infinite there (corner of the triangle, or on an edge's line).
    in_plane = np.abs(height) <= 1e-10 * length.max(axis=1)[None, :]
    w[in_plane] = 0.0
    return w


def vertex_solid_angles(points, tets):
    """Interior solid angle at every node: the sum over the tetrahedra
    touching it of their corner solid angles (4 pi inside the volume, 2 pi on
    a smooth part of the surface). Independent of the boundary triangles, so
    B.1 = -1 checks the BEM integrals against the volume mesh."""
    omega = np.zeros(len(points))
    corners = points[tets]                                     # (M,4,3)
    for a in range(4):
        others = [b for b in range(4) if b != a]
        r = corners[:, others, :] - corners[:, a:a + 1, :]     # (M,3,3)
        d = np.linalg.norm(r, axis=2)
        triple = np.abs(np.einsum("mc,mc->m", r[:, 0],
                                  np.cross(r[:, 1], r[:, 2])))
        denom = (d[:, 0] * d[:, 1] * d[:, 2]
                 + d[:, 0] * np.einsum("mc,mc->m", r[:, 1], r[:, 2])
                 + d[:, 1] * np.einsum("mc,mc->m", r[:, 0], r[:, 2])
                 + d[:, 2] * np.einsum("mc,mc->m", r[:, 0], r[:, 1]))
        omega += np.bincount(tets[:, a], weights=2.0 * np.arctan2(triple,
                                                                  denom),
                             minlength=len(points))
    return omega


class _BoundaryKernel:
    """Fast evaluation of the double-layer weights of all boundary triangles
    for blocks of observers, the hot loop of the BEM assembly (O(Nb * F)).

    Same formula as :func:`double_layer_weights`, rearranged so that every
    numpy operation is over a (triangles x observers) plane and as few
    passes as possible are made: the triple product of the corner vectors is
    -2 A h, the dot products come from the distances and edge lengths, the
    third hat function and the third edge combination follow from the first
    two (the hats sum to 1, their gradients to 0). Coordinates are scaled to
    order one first (the weights are dimensionless)."""

    def __init__(self, points, facets, scale):
        tri = points[facets] / scale
        normal, length, grad_hat, grad_dot_nu = _triangle_frames(tri)
        self.scale = scale
        self.corner = [tri[:, j, :].T[:, :, None].copy() for j in range(3)]
        self.normal = normal.T[:, :, None].copy()                 # (3,F,1)
        self.offset = np.einsum("fc,fc->f", normal, tri[:, 0])[:, None]
        twice_area = np.linalg.norm(
            np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
        self.twice_area = twice_area[:, None]
        self.length = [length[:, e, None].copy() for e in range(3)]
        self.len_sq = [length[:, e, None] ** 2 for e in range(3)]
        # lambda_i(x) = grad_i . x - grad_i . r_{i+1}, i = 0, 1
        self.grad_hat = [grad_hat[:, i, :].T[:, :, None].copy()
                         for i in range(2)]
        self.hat_offset = [np.einsum("fc,fc->f", grad_hat[:, i],
                                     tri[:, (i + 1) % 3])[:, None]
                           for i in range(2)]
        self.gdn = [[grad_dot_nu[:, i, e, None].copy() for e in range(3)]
                    for i in range(2)]
        self.in_plane_tol = 1e-10 * length.max(axis=1)[:, None]
        self.tiny = np.finfo(np.float64).tiny

    def weights(self, obs, facets=None):
        """(3, F, R) weights of every triangle for observers obs (R, 3), in
        metres. With `facets` ((R,) triangle indices): the (3, R) weights of
        the pairs (obs[r], triangle facets[r]) only (the near field of the
        fast-multipole operator, demag_fmm.py); same arithmetic."""
        if facets is None:
            x = (obs / self.scale).T[:, None, :]                  # (3,1,R)

            def take(a):
                return a
        else:
            x = (obs / self.scale).T                              # (3,R)

            def take(a):
                return a[..., facets, 0]
        corner = [take(c) for c in self.corner]
        normal = take(self.normal)
        length = [take(v) for v in self.length]
        len_sq = [take(v) for v in self.len_sq]
        dist, dist_sq = [], []
        for j in range(3):
            d = corner[j] - x                                     # (3,F,R)
            sq = d[0] * d[0]
            sq += d[1] * d[1]
            sq += d[2] * d[2]
            dist_sq.append(sq)
            dist.append(np.sqrt(sq))
        height = normal[0] * x[0]
        height += normal[1] * x[1]
        height += normal[2] * x[2]
        height -= take(self.offset)
        in_plane = np.abs(height) <= take(self.in_plane_tol)
        height[in_plane] = 0.0
        # rho_i . rho_j = (|rho_i|^2 + |rho_j|^2 - |r_i - r_j|^2) / 2;
        # edge e joins corners e and e+1.
        denom = dist[0] * dist[1]
        denom *= dist[2]
        for i, j, e in ((1, 2, 1), (0, 2, 2), (0, 1, 0)):
            k = 3 - i - j
            dot = dist_sq[i] + dist_sq[j]
            dot -= len_sq[e]
            dot *= 0.5 * dist[k]
            denom += dot
        solid = np.arctan2(take(self.twice_area) * height, denom)
        solid *= 2.0                   # = -2 atan2(triple), triple = -2Ah
        solid[in_plane] = 0.0
        edge_int = []
        for e in range(3):
            ends = dist[e] + dist[(e + 1) % 3]
            num = ends + length[e]
            ends -= length[e]
            np.maximum(ends, self.tiny, out=ends)   # observer on this edge
            num /= ends
            edge_int.append(np.log(num, out=num))
        w = np.empty((3,) + height.shape)
        for i in range(2):
            grad = take(self.grad_hat[i])
            hat = grad[0] * x[0]
            hat += grad[1] * x[1]
            hat += grad[2] * x[2]
            hat -= take(self.hat_offset[i])
            hat *= solid
            gdn = [take(v) for v in self.gdn[i]]
            comb = gdn[0] * edge_int[0]
            comb += gdn[1] * edge_int[1]
            comb += gdn[2] * edge_int[2]
            comb *= height
            np.subtract(hat, comb, out=w[i])
        np.subtract(solid, w[0], out=w[2])
        w[2] -= w[1]
        return w


def bem_rows(points, bnd_nodes, bnd_facets, omega, rows, out=None):
    """Rows `rows` (indices into bnd_nodes) of the boundary matrix B.

    bnd_facets are node numbers; columns of B are positions in bnd_nodes.
    Writes into `out` (len(rows), Nb) if given (it may be a PETSc dense
    array view) and returns it.
    """
    import scipy.sparse as sp
    nb = len(bnd_nodes)
    nf = len(bnd_facets)
    col_of_node = np.full(len(points), -1, dtype=np.int64)
    col_of_node[bnd_nodes] = np.arange(nb)
    fcols = col_of_node[np.asarray(bnd_facets)]
    if np.any(fcols < 0):
        raise ValueError("boundary facet uses a node not in boundary_nodes")
    extent = float(np.ptp(points[bnd_nodes], axis=0).max()) or 1.0
    kernel = _BoundaryKernel(points, bnd_facets, extent)
    # Scatter of the (3, F) weights of one observer into its row: sparse
    # incidence (Nb x 3F), applied to a whole block at once.
    scatter = sp.csr_matrix(
        (np.ones(3 * nf), (fcols.T.reshape(-1), np.arange(3 * nf))),
        shape=(nb, 3 * nf))
    rows = np.asarray(rows, dtype=np.int64)
    if out is None:
        out = np.empty((len(rows), nb))
    block = max(1, _PAIRS_PER_BLOCK // max(1, nf))
    for start in range(0, len(rows), block):
        chunk = rows[start:start + block]
        w = kernel.weights(points[bnd_nodes[chunk]])
        acc = (scatter @ w.reshape(3 * nf, len(chunk))).T      # (R, Nb)
        acc /= FOUR_PI
        acc[np.arange(len(chunk)), chunk] += (omega[bnd_nodes[chunk]]
                                              / FOUR_PI - 1.0)
        out[start:start + len(chunk), :] = acc
    return out


# ---------------------------------------------------------------------------
# The field term
# ---------------------------------------------------------------------------

def _aij_from_coo(PETSc, rows, cols, vals, row0, size, comm):
    """Distributed AIJ from this rank's (global) COO entries of its rows."""
    import scipy.sparse as sp
    (nl, ng), (ml, mg) = size
    csr = sp.csr_matrix((vals, (rows - row0, cols)), shape=(nl, mg))
    csr.sum_duplicates()
    csr.sort_indices()
    mat = PETSc.Mat().createAIJ(
        size=size, csr=(csr.indptr.astype(PETSc.IntType),
                        csr.indices.astype(PETSc.IntType), csr.data),
        comm=comm)
    mat.assemble()
    return mat


class DemagField(Term):
    """Demagnetizing field term.

    ``DemagField(space, Ms_nodes)``: space is a FEMSpace, Ms_nodes the
    saturation magnetization (A/m) per node in the space's numbering, an
    (n,) array identical on every rank, or a scalar. Collective; builds the
    divergence and gradient operators, the two KSPs and the BEM matrix once.

    Solver options can be changed with the PETSc option prefixes
    ``demag_poisson_`` (u1, singular Neumann problem) and ``demag_laplace_``
    (u2, Dirichlet problem); defaults are CG + block Jacobi/ICC(0) with
    rtol = `rtol` (relative to the right-hand side), warm-started from the
    previous call's solutions.

    ``method``: the boundary operator B as a dense matrix ("dense", the
    reference), as fast multipole far field plus sparse exact near field
    ("fmm", relative accuracy `tol`, demag_fmm.py), or "auto": dense while
    it takes at most 4 GB or a third of the smallest host's memory
    (demag_method.resolve), or when fmm3dpy is missing.
    ``self.method`` is the one used, ``self.bem_bytes`` its memory on this
    rank; ``self.bem`` is the dense PETSc matrix (None with the FMM),
    ``self.fmm`` the demag_fmm.FMMBoundaryOperator (None when dense).
    """

    name = "demag"

    def __init__(self, space, Ms_nodes, rtol: float = 1e-10,
                 method: str = "auto", tol: float = 1e-5):
        super().__init__()
        scheme_for(tol)                         # ProblemError if out of range
        PETSc = space.PETSc
        self.PETSc = PETSc
        self.space = space
        n, r0, r1 = space.n, space.rstart, space.rend
        points = space.mesh.points
        tets = space.mesh.tets
        ms = np.broadcast_to(np.asarray(Ms_nodes, dtype=np.float64),
                             (n,)).copy()
        if not np.all(np.isfinite(ms)) or np.any(ms < 0):
            raise ProblemError("Ms must be finite and non-negative")
        self.Ms = ms

        # --- volume operators, our rows only (replicated mesh)
        touch = np.flatnonzero(((tets >= r0) & (tets < r1)).any(axis=1))
        t = tets[touch]
        quarter_vol = space.volumes[touch] / 4.0
        g = space.grads[touch]                                  # (m,4,3)
        # D[j, 3k+c] = sum_e V_e/4 dphi_j/dx_c Ms_k   (rows: j owned)
        rows = np.broadcast_to(t[:, :, None, None], (len(t), 4, 4, 3))
        cols = 3 * t[:, None, :, None] + np.arange(3)[None, None, None, :]
        vals = (quarter_vol[:, None, None, None] * g[:, :, None, :]
                * ms[t][:, None, :, None])
        cols = np.broadcast_to(cols, rows.shape)
        keep = ((rows >= r0) & (rows < r1)).reshape(-1)
        nl = r1 - r0
        self.div = _aij_from_coo(
            PETSc, rows.reshape(-1)[keep], cols.reshape(-1)[keep],
            vals.reshape(-1)[keep], r0, ((nl, n), (3 * nl, 3 * n)),
            space.pcomm)
        # G[3j+c, k] = -sum_e V_e/4 dphi_k/dx_c / mass_j   (rows: j owned):
        # H = -grad u, L2-projected onto P1 with the lumped mass.
        node_vol = np.bincount(tets.reshape(-1),
                               weights=np.repeat(space.volumes / 4.0, 4),
                               minlength=n)
        rows = (3 * t[:, :, None, None]
                + np.arange(3)[None, None, None, :])            # (m,4,1,3)
        cols = t[:, None, :, None]                               # (m,1,4,1)
        vals = -(quarter_vol[:, None, None, None]
                 * g[:, None, :, :]                              # (m,1,4,3)
                 / node_vol[t][:, :, None, None])                # (m,4,1,1)
        shape = (len(t), 4, 4, 3)
        rows = np.broadcast_to(rows, shape).reshape(-1)
        cols = np.broadcast_to(cols, shape).reshape(-1)
        vals = np.broadcast_to(vals, shape).reshape(-1)
        keep = (rows >= 3 * r0) & (rows < 3 * r1)
        self.grad = _aij_from_coo(PETSc, rows[keep], cols[keep], vals[keep],
                                  3 * r0, ((3 * nl, 3 * n), (nl, n)),
                                  space.pcomm)

        # --- boundary layout: owned boundary nodes are a contiguous slice
        bnodes = np.asarray(space.boundary_nodes, dtype=np.int64)
        b0, b1 = np.searchsorted(bnodes, [r0, r1])
        self._bnd_rows = np.arange(b0, b1)
        self._bnd_local = bnodes[b0:b1] - r0          # positions in our part
        self.n_boundary = len(bnodes)

        # --- boundary operator B: our rows, all columns; a dense matrix,
        # or FMM + sparse near field (demag_fmm.py) for large surfaces
        omega = vertex_solid_angles(points, tets)
        nb = len(bnodes)
        # the same choice on every rank: by the smallest host's memory
        host = (global_min(space.comm, host_memory_bytes())
                if method == "auto" else 0)
        self.method = resolve(method, nb, host)
        if self.method not in ("dense", "fmm"):
            raise ProblemError(f"DemagField is FEM/BEM: method "
                               f"'{method}' is not")
        self.tol = tol
        if self.method == "fmm":
            counts = np.diff(np.searchsorted(bnodes, space.ranges))
            self.fmm = FMMBoundaryOperator(
                space.comm, points, bnodes, space.boundary_facets, omega,
                self._bnd_rows, counts, tol)
            self.bem = None
            self.bem_bytes = self.fmm.nbytes()
        else:
            self.fmm = None
            self.bem = PETSc.Mat().createDense(
                ((b1 - b0, nb), (b1 - b0, nb)), comm=space.pcomm)
            self.bem.setUp()
            dense = self.bem.getDenseArray()
            if b1 > b0:
                bem_rows(points, bnodes, np.asarray(space.boundary_facets),
                         omega, self._bnd_rows, out=dense)
            self.bem.assemble()
            self.bem_bytes = dense.nbytes

        # --- solvers, built once and warm-started at every call
        self._b = space.scalar_vec()          # D m
        self._u1 = space.scalar_vec()
        self._u2 = space.scalar_vec()
        self._u = space.scalar_vec()
        self._rhs2 = space.scalar_vec()
        self._g_ext = space.scalar_vec()
        self._bnd_u1, self._bnd_u2 = (
            PETSc.Vec().createMPI((b1 - b0, nb), comm=space.pcomm)
            for _ in range(2))

        self._poisson_mat = space.K.duplicate(copy=True)
        self._constants = PETSc.NullSpace().create(constant=True,
                                                   comm=space.pcomm)
        self._poisson_mat.setNullSpace(self._constants)
        self._poisson_mat.setTransposeNullSpace(self._constants)
        self._poisson = self._make_ksp(self._poisson_mat, "demag_poisson_",
                                       rtol)

        self._laplace_mat = space.K.duplicate(copy=True)
        self._laplace_mat.zeroRowsColumns(bnodes[b0:b1].astype(PETSc.IntType),
                                          diag=1.0)
        self._laplace = self._make_ksp(self._laplace_mat, "demag_laplace_",
                                       rtol)

        self._m_last = space.vector_vec()
        self._have_last = False
        self.iterations = [0, 0]      # of the last (poisson, laplace) solves

    def _make_ksp(self, mat, prefix, rtol):
        PETSc = self.PETSc
        ksp = PETSc.KSP().create(comm=self.space.pcomm)
        ksp.setOperators(mat)
        ksp.setOptionsPrefix(prefix)
        ksp.setType("cg")
        # Block Jacobi with ICC(0) per rank: for the mesh sizes a dense BEM
        # matrix allows (up to some 10^4 - 10^5 nodes) it beats AMG by 2-3x
        # per call, AMG setup included; -demag_*_pc_type gamg for more.
        # (petsc4py 3.18 cannot reach the sub-KSPs: set the sub-PC through
        # the options database, under our prefix, unless the user did.)
        ksp.getPC().setType("bjacobi")
        options = PETSc.Options()
        if not options.hasName(prefix + "sub_pc_type"):
            options.setValue(prefix + "sub_pc_type", "icc")
        ksp.setTolerances(rtol=rtol, atol=0.0, max_it=5000)
        ksp.setInitialGuessNonzero(True)
        ksp.setFromOptions()
        if ksp.getType() == "preonly":
            # a direct solve (simulation.POISSON_DIRECT): nothing to gain
            # from a warm start, and PETSc refuses one
            ksp.setInitialGuessNonzero(False)
        ksp.setUp()
        return ksp

    def _solve(self, ksp, rhs, x, which):
        if ksp.getType() == "preonly":
            # one application of the factor: a zero rhs gives zero, and
            # the norm would cost an allreduce per solve
            ksp.solve(rhs, x)
            self.iterations[which] = 0
            return
        # rtol is relative to |rhs|: a zero rhs (no magnetic material, or
        # u2 = 0 on the boundary) has the zero solution and nothing to
        # converge to from a warm start.
        if rhs.norm() == 0.0:
            x.set(0.0)
            self.iterations[which] = 0
            return
        ksp.solve(rhs, x)
        reason = ksp.getConvergedReason()
        if reason < 0:
            raise SimulationError(f"demag: {ksp.getOptionsPrefix()} solve "
                                  f"did not converge (reason {reason})")
        self.iterations[which] = ksp.getIterationNumber()

    # ------------------------------------------------------------ potential

    def potential(self, m_vec, reuse: bool = True):
        """Total scalar potential u (A) for magnetization directions m_vec
        (a vector_vec). Returns a Vec owned by this object: copy it to keep
        it past the next call. `reuse`: return the last potential if m_vec
        equals the last call's (a comparison of the whole vector and an
        allreduce); the field (`h`) does not ask, as a time integrator
        hardly ever evaluates the same m twice in a row."""
        if reuse and self._have_last and m_vec.equal(self._m_last):
            return self._u
        self.div.mult(m_vec, self._b)
        # u1: Neumann problem; its constant is arbitrary (B.1 = -1 removes
        # it again) but is kept at zero mean so u = u1 + u2 cancels nothing.
        self._solve(self._poisson, self._b, self._u1, 0)
        self._constants.remove(self._u1)
        # u2 on the boundary: B u1|bnd (owned boundary nodes are local)
        u1_local = self._u1.getArray(readonly=True)
        self._bnd_u1.setArray(u1_local[self._bnd_local])
        if self.fmm is not None:
            with self._bnd_u2 as out:
                out[:] = self.fmm.apply(u1_local[self._bnd_local])
        else:
            self.bem.mult(self._bnd_u1, self._bnd_u2)
        g = self._bnd_u2.getArray(readonly=True)
        # u2 inside: K_int u2 = -K_int,bnd g, u2|bnd = g
        # (`with vec as array` restores the array and bumps the Vec's state,
        # so no cached norm outlives the write)
        self._g_ext.set(0.0)
        with self._g_ext as g_ext:
            g_ext[self._bnd_local] = g
        self.space.K.mult(self._g_ext, self._rhs2)
        self._rhs2.scale(-1.0)
        with self._rhs2 as rhs:
            rhs[self._bnd_local] = g
        self._solve(self._laplace, self._rhs2, self._u2, 1)
        self._u2.copy(self._u)
        self._u.axpy(1.0, self._u1)
        m_vec.copy(self._m_last)
        self._have_last = True
        return self._u

    # ------------------------------------------------------------ term API

    def h(self, state, out_vec) -> None:
        """Overwrite out_vec with H_demag (A/m) for state.m."""
        self.grad.mult(self.potential(state.m, reuse=False), out_vec)

    def E(self, state) -> float:
        """Demagnetization energy (J): (mu0/2) int M.grad u."""
        u = self.potential(state.m)
        return 0.5 * MU0 * float(u.dot(self._b))
