"""The magnetization state: m (unit vectors at the nodes), the time,
and the nodal material data every field term needs.

Nodal quantities use the lumped mass: a node carries the volume V_i = sum
of vol/4 of its tetrahedra, and material parameters are lumped the same
way (Ms_i V_i = sum Ms_e vol_e / 4), so nodes on an interface between two
materials see the volume-weighted mixture.
"""

from __future__ import annotations

import numpy as np

from .constants import GAMMA0
from .errors import ProblemError
from .parallel import global_max


class State:
    """Magnetization m (vector_vec, unit length), time t, and the nodal
    material data every term needs.

    per_tet_* arrays are given per tetrahedron of space.mesh; nodal
    values are their lumped (volume-weighted) averages. ``Ms_nodes`` is
    the full (n,) array on every rank; ``*_local`` arrays cover the owned
    nodes only."""

    def __init__(self, space, Ms_tet, alpha_tet=0.5, gamma_tet=GAMMA0):
        self.space = space
        M = len(space.mesh.tets)
        self.Ms_tet = np.broadcast_to(np.asarray(Ms_tet, float), (M,)).copy()
        self.alpha_tet = np.broadcast_to(np.asarray(alpha_tet, float),
                                         (M,)).copy()
        self.gamma_tet = np.broadcast_to(np.asarray(gamma_tet, float),
                                         (M,)).copy()
        r0, r1 = space.rstart, space.rend
        self.Ms_nodes = space.node_average(self.Ms_tet)
        self.Ms_local = self.Ms_nodes[r0:r1].copy()
        self.V_local = space.mass_local.copy()
        self.MsV_local = self.Ms_local * self.V_local
        self.magnetic_local = self.Ms_local > 0
        self.set_alpha(self.alpha_tet)
        self.gamma_local = space.node_average(self.gamma_tet)[r0:r1].copy()
        self.m = space.vector_vec()
        self.t = 0.0
        # tie_stacks(): the Ms V-weighted average over each stack of
        # nodes (scipy CSR over the owned nodes), or None; and the
        # stacks as unknowns of their own (Stacks), or None
        self.stack_average = None
        self.stacks = None

    def tie_stacks(self) -> None:
        """From now on m is the same at every node of a stack (the
        space's stacks, each owned by one rank): the fields are averaged
        over each stack with the weights Ms_i V_i (`average_stacks`), the
        Galerkin restriction of the energy to such m, and set_m averages
        and normalizes the m it is given. Its use: a film one element
        layer thick, whose stiffest exchange mode (the two node layers
        turning apart) then goes, and with it about a quarter of an
        explicit integrator's field evaluations (docs/mag.md,
        "Performance")."""
        import scipy.sparse as sparse
        sp = self.space
        if sp.stacks is None:
            raise ProblemError("m uniform in z needs a space built with "
                               "stacks")
        group = sp.stacks[sp.rstart:sp.rend]
        every = np.bincount(sp.stacks)
        if np.any(np.bincount(group, minlength=len(every))[group]
                  != every[group]):
            raise ProblemError("a stack of nodes spans two ranks")
        _, g = np.unique(group, return_inverse=True)
        g = g.reshape(-1)
        # Ms V weights; a stack without magnetic material (its field is
        # never used) by volume, so that m stays defined there
        w = self.MsV_local
        w = np.where(np.bincount(g, weights=w)[g] > 0, w, self.V_local)
        inv = 1.0 / np.bincount(g, weights=w)
        n = len(group)
        S = sparse.csr_matrix((w, (g, np.arange(n))), shape=(len(inv), n))
        self.stack_average = (sparse.csr_matrix(
            (inv[g], (np.arange(n), g)), shape=(n, len(inv))) @ S).tocsr()
        self.stacks = Stacks(self, g, (sparse.diags(inv) @ S).tocsr())

    def average_stacks(self, vec) -> None:
        """vec (a vector_vec) <- its Ms V-weighted average over each stack
        of nodes (no-op unless tie_stacks() was called)."""
        if self.stack_average is None:
            return
        with vec as a:
            a3 = a.reshape(-1, 3)
            a3[:] = self.stack_average @ a3

    def set_alpha(self, alpha_tet) -> None:
        M = len(self.space.mesh.tets)
        a = np.broadcast_to(np.asarray(alpha_tet, float), (M,))
        # Damping is averaged with Ms as weight: what matters at a node is
        # the damping of the magnetic material around it.
        msv = self.space.node_average(self.Ms_tet * a)
        ms = self.space.node_average(self.Ms_tet)
        with np.errstate(invalid="ignore", divide="ignore"):
            nodal = np.where(ms > 0, msv / np.where(ms > 0, ms, 1), 0.0)
        self.alpha_local = nodal[self.space.rstart:self.space.rend].copy()

    def m_local(self) -> np.ndarray:
        return self.m.getArray(readonly=True).reshape(-1, 3)

    def set_m(self, m) -> None:
        """m: a 3-vector (uniform), an (n, 3) array in the space's
        numbering, or a callable of the (n, 3) node positions. Normalized;
        nodes without magnetic material keep m as given (normalized)."""
        pts = self.space.mesh.points
        if callable(m):
            arr = np.asarray(m(pts), dtype=float)
        else:
            arr = np.asarray(m, dtype=float)
        arr = np.broadcast_to(arr, (self.space.n, 3)).copy()
        norm = np.linalg.norm(arr, axis=1)
        if np.any(norm == 0) or not np.all(np.isfinite(norm)):
            raise ProblemError("initial magnetization has zero or invalid "
                             "vectors")
        self.space.set_global(self.m, arr / norm[:, None])
        if self.stack_average is not None:
            self.average_stacks(self.m)
            self.normalize()

    def normalize(self, vec=None) -> float:
        """Rescale m (or vec) to unit length; returns the largest
        deviation | |m| - 1 | found (over all ranks)."""
        vec = self.m if vec is None else vec
        with vec as a:
            a3 = a.reshape(-1, 3)
            norm = np.sqrt(np.einsum("ij,ij->i", a3, a3))
            dev = float(np.abs(norm - 1.0).max()) if len(norm) else 0.0
            a3 /= norm[:, None]
        return global_max(self.space.comm, dev)

    def max_norm_deviation(self, vec=None) -> float:
        """max | |m| - 1 | over all ranks, m unchanged."""
        vec = self.m if vec is None else vec
        a3 = vec.getArray(readonly=True).reshape(-1, 3)
        norm = np.sqrt(np.einsum("ij,ij->i", a3, a3))
        dev = float(np.abs(norm - 1.0).max()) if len(norm) else 0.0
        return global_max(self.space.comm, dev)

    def average_m(self, vec=None) -> np.ndarray:
        """Volume average <m> over the magnetic material (Ms-weighted, as
        the total moment over Ms V)."""
        vec = self.m if vec is None else vec
        a = vec.getArray(readonly=True).reshape(-1, 3)
        local = np.concatenate([(a * self.MsV_local[:, None]).sum(axis=0),
                                [self.MsV_local.sum()]])
        tot = np.zeros(4)
        self.space.comm.Allreduce(local, tot)
        return tot[:3] / tot[3]


class Stacks:
    """m stored once per stack of nodes (State.tie_stacks), for the
    explicit integrators: u_s, one unit vector per stack, with m = P u
    (every node of a stack takes its stack's value: `prolong`) and the
    field of the restricted energy H_s = sum_i Ms_i V_i H_i / W_s over
    the stack's nodes, W_s = sum_i Ms_i V_i (`restrict`, R = W^-1 P^T
    diag(Ms V), the adjoint of P between the lumped inner products).
    The LLG of u with H_s is the LLG of the nodes restricted to such m
    (docs/mag.md, "Discretization"), on half the unknowns of a film two
    node layers thick. Each stack is owned by the rank that owns its
    nodes, so both maps are rank-local.

    g: (nlocal,) local stack of every owned node; R: (nstacks_local,
    nlocal) scipy CSR, rows the weights of each stack."""

    def __init__(self, state: "State", g: np.ndarray, R):
        self.space = state.space
        self.g = g
        # the flat index of every node's components in u (np.take over
        # one axis: half the time of a 2-d take)
        self._take = (3 * g[:, None] + np.arange(3)).reshape(-1)
        self.R = R
        self.nlocal = R.shape[0]
        self._global = None
        # stacks without magnetic material are weighted by volume (see
        # tie_stacks) and do not move
        self.magnetic = (np.bincount(g, weights=state.MsV_local,
                                     minlength=self.nlocal) > 0)

    def global_index(self) -> np.ndarray:
        """(n,) the global number of every node's stack, in the order
        of the stack vectors (rank by rank, each rank's stacks in its
        local order); collective on first use."""
        if self._global is None:
            comm = self.space.comm
            offset = comm.exscan(self.nlocal) if comm.Get_size() > 1 \
                else 0
            self._global = np.concatenate(comm.allgather(
                self.g + (offset or 0)))
            self.offset = offset or 0
        return self._global

    def nodes_to_stacks(self, A):
        """R A P for a distributed nodal matrix A of block size 3 (its
        owned rows as a PETSc AIJ, (3 nlocal, 3 n)): the operator on the
        stacks, a PETSc AIJ of the same layout; collective."""
        import scipy.sparse as sparse
        sp = self.space
        G = self.global_index()
        ns = self.space.comm.allreduce(self.nlocal)
        ip, ix, v = A.getValuesCSR()
        loc = sparse.csr_matrix((v, ix, ip), shape=(3 * sp.nlocal, 3 * sp.n))
        cols = (3 * G[:, None] + np.arange(3)).reshape(-1)
        P = sparse.csr_matrix((np.ones(3 * sp.n), (np.arange(3 * sp.n),
                                                   cols)),
                              shape=(3 * sp.n, 3 * ns))
        R3 = sparse.kron(self.R, sparse.identity(3), format="csr")
        red = (R3 @ loc @ P).tocsr()
        red.sum_duplicates()
        red.sort_indices()
        IT = sp.PETSc.IntType
        M = sp.PETSc.Mat().createAIJ(
            size=((3 * self.nlocal, 3 * ns), (3 * self.nlocal, 3 * ns)),
            bsize=3, csr=(red.indptr.astype(IT), red.indices.astype(IT),
                          red.data), comm=sp.pcomm)
        M.assemble()
        return M

    def prolongation(self):
        """P over the owned nodes, (nlocal, nstacks_local) scipy CSR."""
        import scipy.sparse as sparse
        n = len(self.g)
        return sparse.csr_matrix((np.ones(n), (np.arange(n), self.g)),
                                 shape=(n, self.nlocal))

    def vector(self):
        """A distributed vector of one 3-vector per stack, zero."""
        v = self.space.PETSc.Vec().createMPI(
            (3 * self.nlocal, self.space.PETSc.DECIDE), bsize=3,
            comm=self.space.pcomm)
        v.set(0.0)
        return v

    def average(self, nodal: np.ndarray) -> np.ndarray:
        """(nlocal,) or (nlocal, k) nodal values -> their weighted
        average per stack."""
        return self.R @ nodal

    def prolong(self, u_vec, m_vec) -> None:
        """m_vec (a vector_vec) <- P u_vec."""
        u = u_vec.getArray(readonly=True)
        with m_vec as a:
            np.take(u, self._take, out=a)

    def restrict(self, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (nstacks_local, 3) <- R h, h the (nlocal, 3) nodal field."""
        out[:] = self.R @ h
        return out
