"""Exchange: E = int A |grad m|^2, H = 2/(mu0 Ms) div(A grad m)."""

from __future__ import annotations

import numpy as np

from ..constants import MU0
from .base import Term


class Exchange(Term):
    """Exchange with stiffness A (J/m) per tetrahedron (scalar or (M,))."""

    name = "exchange"

    def __init__(self, state, A_tet):
        super().__init__()
        sp = state.space
        M = len(sp.mesh.tets)
        A = np.broadcast_to(np.asarray(A_tet, float), (M,))
        self.A_tet = A.copy()
        # H_i = -2/(mu0 Ms_i V_i) (K_A m)_i: fold the row scaling into the
        # matrix so that the field is one matrix-vector product
        K = sp.stiffness(coef=A, block=3)
        scale = np.zeros(sp.nlocal)
        mag = state.magnetic_local
        scale[mag] = -2.0 / (MU0 * state.MsV_local[mag])
        d = sp.vector_vec()
        with d as a:
            a[:] = np.repeat(scale, 3)
        K.diagonalScale(L=d)
        self.matrix = K

    def h(self, state, out_vec) -> None:
        self.matrix.mult(state.m, out_vec)

    def stack_field(self, state):
        # the Galerkin operator R Kx P: a stack couples to the stacks of
        # both its nodes' neighbours, on half the rows
        if getattr(self, "_stack_matrix", None) is None:
            self._stack_matrix = state.stacks.nodes_to_stacks(self.matrix)
        M = self._stack_matrix
        return lambda st, u, out: M.mult(u, out)
