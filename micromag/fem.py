"""P1 finite-element space on a tetrahedral mesh, distributed over MPI
the way Magpar does it: the mesh (small) is replicated on every rank, the
*nodes* are partitioned (PT-Scotch, see partition.py) and renumbered so
that rank r owns the contiguous range [rstart, rend); vectors and
matrices are PETSc objects whose rows follow that ownership.

Public interface (kept stable; the demagnetization module builds on it):

``FEMSpace(mesh, comm=None, stacks=None)``
    mesh: :class:`micromag.mesh.Mesh`; comm: an mpi4py communicator
    (default COMM_WORLD); stacks: (n,) int group of every node (input
    numbering, e.g. mesh.stacks), each group kept on one rank (the
    partition is of the groups). Collective. Attributes:

    comm            mpi4py communicator; ``pcomm`` the PETSc one
    mesh            the renumbered Mesh, identical on every rank
    n               number of nodes
    rstart, rend    this rank's owned node range (new numbering)
    ranges          (size+1,) int64 offsets: rank r owns ranges[r]:ranges[r+1]
    perm            (n,) int64, old node id -> new node id
    stacks          (n,) int64 group of every node (new numbering), or
                    None
    volumes         (M,) tetrahedron volumes (m^3), positive
    grads           (M, 4, 3) gradients of the 4 P1 basis functions (1/m)
    K               PETSc AIJ n x n, K_ij = integral grad(phi_i).grad(phi_j),
                    rows distributed as the nodes
    mass            PETSc Vec (n), lumped node volumes sum(vol/4) (m^3)
    mass_local      numpy view of this rank's part of ``mass``
    boundary_facets (F, 3) int64 node ids (new numbering), ordered so that
                    (b - a) x (c - a) points out of the body
    boundary_nodes  sorted unique node ids of boundary_facets

    Methods:
    scalar_vec()            PETSc Vec of n, owned rows [rstart, rend)
    vector_vec()            PETSc Vec of 3n, block size 3, interleaved
                            (x, y, z) per node, owned rows 3*[rstart, rend)
    gather(vec, to_all=False)
                            the whole vector as numpy, shape (n,) or (n, 3)
                            (by block size): on rank 0 (None elsewhere), or
                            on every rank with to_all=True
    local(vec)              numpy view of the owned part, (nloc,) or (nloc, 3)
    set_global(vec, array)  fill vec from a full (n,) / (n, 3) numpy array
                            given on every rank (new numbering)
    stiffness(coef=None, block=1)
                            AIJ of integral coef grad(phi_i).grad(phi_j),
                            coef per tetrahedron (default 1); block=3 gives
                            the same operator on each component of an
                            interleaved vector_vec (size 3n)
    node_average(per_tet)   volume-weighted nodal average of a per-tet
                            quantity, (n,) numpy on every rank
    to_original(array)      reorder a per-node (n, ...) array from the new
                            numbering back to the input mesh's

Field terms (micromag.terms: one module per term, all subclasses of
terms.base.Term) share one convention:

    term.h(state, out_vec)  overwrite out_vec (a vector_vec) with the
                            term's field H in A/m; collective
    term.E(state)           the term's energy in J, same value on every
                            rank; collective
    state.m                 vector_vec, unit magnetization
    state.t                 time in s
    state.space             the FEMSpace

Determinism: the partition is computed on rank 0, reproducibly (see
partition.py), and broadcast; every rank assembles its own rows from the
same elements in the same order, so results depend on the number of
ranks only through floating-point summation order and iterative-solver
tolerances.
"""

from __future__ import annotations

import numpy as np

from .errors import MeshError
from .mesh import Mesh
from .parallel import comm_world, petsc
from .partition import partition_nodes


def p1_gradients(points: np.ndarray, tets: np.ndarray):
    """(volumes (M,), grads (M, 4, 3)) of P1 basis functions."""
    p = points[tets]
    e1, e2, e3 = (p[:, k] - p[:, 0] for k in (1, 2, 3))
    # grad lambda_k are the columns of inv([e1; e2; e3]): the cross
    # products of the other two edges over the determinant (np.linalg.inv
    # of every 3 x 3 block took ~80 ms of every rank's set-up at 20,000
    # elements)
    c1, c2, c3 = np.cross(e2, e3), np.cross(e3, e1), np.cross(e1, e2)
    det = np.einsum("ij,ij->i", e1, c1)
    g = np.empty((len(tets), 4, 3))
    g[:, 1], g[:, 2], g[:, 3] = (c / det[:, None] for c in (c1, c2, c3))
    g[:, 0, :] = -g[:, 1:, :].sum(axis=1)
    return np.abs(det) / 6.0, g


def node_graph(n: int, tets: np.ndarray):
    """Symmetric node adjacency (scipy CSR, no diagonal)."""
    import scipy.sparse as sp
    a, b = np.triu_indices(4, 1)
    i = np.concatenate([tets[:, a].ravel(), tets[:, b].ravel()])
    j = np.concatenate([tets[:, b].ravel(), tets[:, a].ravel()])
    g = sp.csr_matrix((np.ones(len(i), dtype=np.int64), (i, j)),
                      shape=(n, n))
    g.sum_duplicates()
    g.data[:] = 1
    return g


def _partition(graph, comm, stacks) -> np.ndarray:
    """Part of every node: of its group where `stacks` groups them (the
    partition of the groups' graph), else its own."""
    if stacks is None:
        return partition_nodes(graph, comm)
    import scipy.sparse as sp
    stacks = np.asarray(stacks, dtype=np.int64)
    k = int(stacks.max()) + 1
    S = sp.csr_matrix((np.ones(len(stacks)), (stacks, np.arange(
        len(stacks)))), shape=(k, len(stacks)))
    q = (S @ graph @ S.T).tocsr()
    q.setdiag(0)
    q.eliminate_zeros()
    q.data[:] = 1
    return partition_nodes(q.astype(np.int64), comm)[stacks]


class FEMSpace:
    def __init__(self, mesh: Mesh, comm=None, stacks=None):
        from scipy.sparse.csgraph import reverse_cuthill_mckee
        PETSc = petsc()
        self.PETSc = PETSc
        self.comm = comm if comm is not None else comm_world()
        self.pcomm = PETSc.Comm(self.comm)
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        n = len(mesh.points)
        self.n = n

        # --- partition (all ranks) + renumbering (rank 0 decides, all
        # follow)
        if n < size:
            raise MeshError(f"mesh of {n} nodes is too small for "
                            f"{size} ranks")
        graph = node_graph(n, mesh.tets)
        part = _partition(graph, self.comm, stacks)
        if rank == 0:
            # within a part keep a bandwidth-reducing order (cache locality
            # of the matrix-vector products)
            rcm = np.asarray(reverse_cuthill_mckee(graph,
                                                   symmetric_mode=True))
            order = rcm[np.argsort(part[rcm], kind="stable")]
            counts = np.bincount(part, minlength=size)
        else:
            order = counts = None
        order = self.comm.bcast(order, root=0)
        counts = self.comm.bcast(counts, root=0)
        if np.any(counts == 0):
            raise MeshError(f"mesh of {n} nodes is too small for "
                            f"{size} ranks")
        perm = np.empty(n, dtype=np.int64)
        perm[order] = np.arange(n)
        self.perm = perm
        self.stacks = (None if stacks is None
                       else np.asarray(stacks, dtype=np.int64)[order])
        self.ranges = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.rstart = int(self.ranges[rank])
        self.rend = int(self.ranges[rank + 1])
        self.nlocal = self.rend - self.rstart
        self.mesh = Mesh(mesh.points[order], perm[mesh.tets], mesh.regions)

        # --- geometry
        self.volumes, self.grads = p1_gradients(self.mesh.points,
                                                self.mesh.tets)
        tets = self.mesh.tets
        # elements that touch an owned node: enough to assemble our rows
        owned = (tets >= self.rstart) & (tets < self.rend)
        self._local_tets = np.flatnonzero(owned.any(axis=1))

        self.K = self.stiffness()
        node_vol = np.bincount(tets.ravel(),
                               weights=np.repeat(self.volumes / 4.0, 4),
                               minlength=n)
        self.mass = self.scalar_vec()
        self.mass.setArray(node_vol[self.rstart:self.rend])
        self.mass_local = self.mass.getArray(readonly=True)
        self._node_vol = node_vol

        # --- boundary: faces that belong to one tetrahedron only
        faces = np.concatenate([tets[:, [1, 2, 3]], tets[:, [0, 3, 2]],
                                tets[:, [0, 1, 3]], tets[:, [0, 2, 1]]])
        opposite = np.concatenate([tets[:, 0], tets[:, 1], tets[:, 2],
                                   tets[:, 3]])
        keys = np.sort(faces, axis=1)
        if n < 2_000_000:
            # one int64 per face, in the rows' lexicographic order: a 1-d
            # unique, ~10x faster than np.unique(axis=0) (~60 ms of every
            # rank's set-up at 20,000 elements)
            keys = (keys[:, 0] * n + keys[:, 1]) * n + keys[:, 2]
        _, first, count = np.unique(keys, axis=0, return_index=True,
                                    return_counts=True)
        bidx = first[count == 1]
        bf = faces[bidx].copy()
        pts = self.mesh.points
        a, b, c = pts[bf[:, 0]], pts[bf[:, 1]], pts[bf[:, 2]]
        normal = np.cross(b - a, c - a)
        inward = np.einsum("ij,ij->i", normal, pts[opposite[bidx]] - a) > 0
        bf[inward, 1], bf[inward, 2] = bf[inward, 2].copy(), bf[inward, 1].copy()
        self.boundary_facets = bf
        self.boundary_nodes = np.unique(bf)

    # ------------------------------------------------------------ vectors

    def scalar_vec(self):
        v = self.PETSc.Vec().createMPI((self.nlocal, self.n), comm=self.pcomm)
        v.set(0.0)
        return v

    def vector_vec(self):
        v = self.PETSc.Vec().createMPI((3 * self.nlocal, 3 * self.n), bsize=3,
                                       comm=self.pcomm)
        v.set(0.0)
        return v

    def local(self, vec, readonly: bool = False) -> np.ndarray:
        a = vec.getArray(readonly=readonly)
        return a.reshape(-1, 3) if vec.getBlockSize() == 3 else a

    def set_global(self, vec, array) -> None:
        arr = np.asarray(array, dtype=np.float64)
        bs = vec.getBlockSize()
        part = arr[self.rstart:self.rend]
        vec.setArray(part.reshape(-1) if bs == 3 else part)

    def gather(self, vec, to_all: bool = False):
        PETSc = self.PETSc
        if to_all:
            scatter, out = PETSc.Scatter.toAll(vec)
        else:
            scatter, out = PETSc.Scatter.toZero(vec)
        scatter.scatter(vec, out, addv=PETSc.InsertMode.INSERT,
                        mode=PETSc.ScatterMode.FORWARD)
        if not to_all and self.comm.Get_rank() != 0:
            out.destroy()
            scatter.destroy()
            return None
        arr = out.getArray(readonly=True).copy()
        out.destroy()
        scatter.destroy()
        return arr.reshape(-1, 3) if vec.getBlockSize() == 3 else arr

    def to_original(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)[self.perm]

    def node_average(self, per_tet) -> np.ndarray:
        w = np.repeat(self.volumes / 4.0, 4)
        vals = np.repeat(np.asarray(per_tet, dtype=np.float64), 4) * w
        s = np.bincount(self.mesh.tets.ravel(), weights=vals,
                        minlength=self.n)
        return s / self._node_vol

    # ------------------------------------------------------------ matrices

    def stiffness(self, coef=None, block: int = 1):
        """Distributed AIJ of integral coef grad(phi_i).grad(phi_j)."""
        import scipy.sparse as sp
        sel = self._local_tets
        t = self.mesh.tets[sel]
        g = self.grads[sel]
        w = self.volumes[sel]
        if coef is not None:
            w = w * np.asarray(coef, dtype=np.float64)[sel]
        ke = np.einsum("eai,ebi->eab", g, g) * w[:, None, None]
        rows = np.repeat(t, 4, axis=1).ravel()
        cols = np.tile(t, (1, 4)).ravel()
        vals = ke.ravel()
        keep = (rows >= self.rstart) & (rows < self.rend)
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
        if block == 3:
            rows = (3 * rows[:, None] + np.arange(3)).ravel()
            cols = (3 * cols[:, None] + np.arange(3)).ravel()
            vals = np.repeat(vals, 3)
        elif block != 1:
            raise ValueError("block must be 1 or 3")
        r0 = block * self.rstart
        nl, ng = block * self.nlocal, block * self.n
        csr = sp.csr_matrix((vals, (rows - r0, cols)), shape=(nl, ng))
        csr.sum_duplicates()
        csr.sort_indices()
        A = self.PETSc.Mat().createAIJ(
            size=((nl, ng), (nl, ng)), bsize=block,
            csr=(csr.indptr.astype(self.PETSc.IntType),
                 csr.indices.astype(self.PETSc.IntType), csr.data),
            comm=self.pcomm)
        A.assemble()
        return A
