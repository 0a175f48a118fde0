"""A distributed direct solve of the demag Neumann problem (u1): interface
Schur complement over the ranks' node blocks, as a petsc4py Python PC.

On one rank the replicated Cholesky factor (simulation.POISSON_DIRECT)
is the whole story; on several, its triangular solves run whole on every
rank and become the serial part of a field evaluation. Here each rank
factors only its own interior block:

    Gamma  = owned nodes with a neighbour on a lower rank (the interface)
    I_r    = the other nodes of rank r; no edge joins I_r and I_s (an
             edge between them would put its higher-rank end in Gamma)

    K = [K_II  K_IG]      S = K_GG - sum_r K_GI_r K_I_r^-1 K_I_rG
        [K_GI  K_GG]      (dense, |Gamma| x |Gamma|, held on every rank)

A solve K u = b is one local factor application per rank, one allreduce
of |Gamma| numbers, a dense product with S^-1 and one with the rank's
W_r = K_I_r^-1 K_I_rG: for standard problem 4 and the bar the interface
has a few dozen to a few hundred nodes.

The Neumann matrix is singular (constants). S inherits the null space
(K 1 = 0 gives S 1_G = 0) and its right-hand side keeps a zero sum when
b has one, so S^-1 is the inverse of S + s 1 1^T, which solves S x = g
exactly on that subspace; potential() removes the constant afterwards.
"""

from __future__ import annotations

import atexit

import numpy as np

from ..parallel import petsc

# beyond this many interface nodes S^-1 (dense, on every rank) costs
# more than it saves: 3,000 nodes are 72 MB
MAX_INTERFACE = 3000


def _split(A):
    """(this rank's rows of A as scipy CSR with global columns, boolean
    mask of its interface nodes: those with a neighbour on a lower
    rank)."""
    import scipy.sparse as sps
    rank = A.getComm().getRank()
    r0, r1 = A.getOwnershipRange()
    ranges = np.asarray(A.getOwnershipRanges(), dtype=np.int64)
    nl = r1 - r0
    indptr, cols, vals = A.getValuesCSR()
    csr = sps.csr_matrix((vals, cols, indptr), shape=(nl, A.getSize()[0]))
    rows = np.repeat(np.arange(nl), np.diff(indptr))
    owner = np.searchsorted(ranges, cols, side="right") - 1
    on_gamma = np.zeros(nl, dtype=bool)
    on_gamma[rows[owner < rank]] = True
    return csr, on_gamma


def fits(A) -> bool:
    """Whether the split of A suits InterfaceSchurPC: at most
    MAX_INTERFACE interface nodes and some interior on every rank (a
    rank of interface nodes only would factor an empty block); collective.
    """
    from mpi4py import MPI
    on_gamma = _split(A)[1]
    comm = A.getComm().tompi4py()
    ng = comm.allreduce(int(on_gamma.sum()))
    interior = comm.allreduce(not on_gamma.all(), op=MPI.LAND)
    return bool(ng <= MAX_INTERFACE and interior)


def _release(pc) -> None:
    """Drop the Python implementation of a PC that still exists at the
    interpreter's exit: left to PetscFinalize, it crashes the process."""
    if pc.handle:
        pc.setType("none")


class InterfaceSchurPC:
    """Context of a PETSc PC of type "python" (pc_python_type =
    "micromag.terms.schur.InterfaceSchurPC") for a symmetric MPIAIJ
    matrix whose rows follow the node ownership: applies K^-1 (on the
    complement of the constants for a singular Neumann K)."""

    def setUp(self, pc) -> None:
        PETSc = petsc()
        A, _ = pc.getOperators()
        comm = A.getComm().tompi4py()
        r0 = A.getOwnershipRange()[0]
        csr, on_gamma = _split(A)
        self.g_local = np.flatnonzero(on_gamma)
        self.i_local = np.flatnonzero(~on_gamma)
        gamma = np.concatenate(comm.allgather(r0 + self.g_local))
        ng = len(gamma)
        if ng > MAX_INTERFACE:
            raise ValueError(f"interface of {ng} nodes is too large for "
                             f"the Schur complement solve (at most "
                             f"{MAX_INTERFACE})")
        self.comm = comm
        self.g_pos = np.searchsorted(gamma, r0 + self.g_local)

        # interior block and its factor (this rank only)
        k_ii = csr[self.i_local][:, r0 + self.i_local].tocsr()
        k_ig = csr[self.i_local][:, gamma].tocsc()
        self.adj = np.flatnonzero(np.diff(k_ig.indptr))   # Gamma next to I_r
        k_ig = k_ig[:, self.adj].tocsr()
        self.k_gi = k_ig.T.tocsr()
        ni = len(self.i_local)
        self.K_ii = PETSc.Mat().createAIJ(
            size=(ni, ni), csr=(k_ii.indptr.astype(PETSc.IntType),
                                k_ii.indices.astype(PETSc.IntType),
                                k_ii.data), comm=PETSc.COMM_SELF)
        self.K_ii.assemble()
        self.local = PETSc.PC().create(comm=PETSc.COMM_SELF)
        self.local.setOperators(self.K_ii)
        self.local.setType("cholesky")
        self.local.setFactorOrdering("nd")
        # a body cut off from the interface would leave a singular block
        self.local.setFactorShift(
            shift_type=PETSc.Mat.FactorShiftType.NONZERO)
        self.local.setUp()
        # W_r = K_II^-1 K_IG (columns: the interface nodes next to I_r)
        k = len(self.adj)
        if ni and k:
            rhs = PETSc.Mat().createDense((ni, k), array=np.asfortranarray(
                k_ig.toarray()), comm=PETSc.COMM_SELF)
            sol = PETSc.Mat().createDense((ni, k), comm=PETSc.COMM_SELF)
            sol.setUp()
            self.local.getFactorMatrix().matSolve(rhs, sol)
            self.W = np.ascontiguousarray(sol.getDenseArray())
            rhs.destroy()
            sol.destroy()
        else:
            self.W = np.zeros((ni, k))

        # S = K_GG - sum_r K_GI_r W_r, summed over the ranks
        part = np.zeros((ng, ng))
        if len(self.g_local):
            part[self.g_pos] = csr[self.g_local][:, gamma].toarray()
        if k:
            part[np.ix_(self.adj, self.adj)] -= self.k_gi @ self.W
        S = np.empty_like(part)
        comm.Allreduce(part, S)
        S = 0.5 * (S + S.T)
        shift = max(np.trace(S) / max(ng, 1), 1e-300) / max(ng, 1)
        self.S_inv = np.linalg.inv(S + shift) if ng else np.zeros((0, 0))
        self.ng = ng
        self._b = PETSc.Vec().createSeq(ni, comm=PETSc.COMM_SELF)
        self._y = PETSc.Vec().createSeq(ni, comm=PETSc.COMM_SELF)
        self._c = np.zeros(ng)
        self._g = np.zeros(ng)
        atexit.register(_release, pc)

    def apply(self, pc, x, y) -> None:
        b = x.getArray(readonly=True)
        with self._b as bi:
            bi[:] = b[self.i_local]
        self.local.apply(self._b, self._y)
        yi = self._y.getArray(readonly=True)
        c = self._c
        c[:] = 0.0
        c[self.g_pos] = b[self.g_local]
        if len(self.adj):
            c[self.adj] -= self.k_gi @ yi
        self.comm.Allreduce(c, self._g)
        xg = self.S_inv @ self._g
        with y as out:
            out[self.i_local] = yi - self.W @ xg[self.adj]
            out[self.g_local] = xg[self.g_pos]

    def applyTranspose(self, pc, x, y) -> None:
        self.apply(pc, x, y)                 # K is symmetric

    def destroy(self, pc=None) -> None:
        # with the PC (and so before PETSc finalizes: see _release)
        for name in ("local", "K_ii", "_b", "_y"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.destroy()
                setattr(self, name, None)
