"""Magnetocrystalline anisotropy: uniaxial (E = -K1 (m.u)^2) and cubic
(E = Kc1 (a1^2 a2^2 + a2^2 a3^2 + a3^2 a1^2) + Kc2 a1^2 a2^2 a3^2,
a_k = m.c_k)."""

from __future__ import annotations

import numpy as np

from ..parallel import global_sum
from .base import Term, nodal_scale


class UniaxialAnisotropy(Term):
    """E = -K1 (m.u)^2 with K1 (J/m^3) and unit axis u per tetrahedron
    (scalar/3-vector or arrays). Nodal axes are the K1-weighted average
    of the tetrahedra's axes, renormalized."""

    name = "anisotropy"

    def __init__(self, state, K1_tet, axis_tet):
        super().__init__()
        sp = state.space
        M = len(sp.mesh.tets)
        K1 = np.broadcast_to(np.asarray(K1_tet, float), (M,))
        axis = np.broadcast_to(np.asarray(axis_tet, float), (M, 3))
        axis = axis / np.linalg.norm(axis, axis=1)[:, None]
        self.coef = 2.0 * nodal_scale(state, K1)          # 2 K1/(mu0 Ms)
        u = np.stack([sp.node_average(np.abs(K1) * axis[:, c])
                      for c in range(3)], axis=1)[sp.rstart:sp.rend]
        norm = np.linalg.norm(u, axis=1)
        u[norm > 0] /= norm[norm > 0, None]
        self.axis = u

    def h(self, state, out_vec) -> None:
        m = state.m_local()
        mu = np.einsum("ij,ij->i", m, self.axis)
        with out_vec as o:
            o.reshape(-1, 3)[:] = (self.coef * mu)[:, None] * self.axis


class CubicAnisotropy(Term):
    """Cubic anisotropy with constants Kc1, Kc2 (J/m^3) and two
    orthogonal crystal axes c1, c2 (c3 = c1 x c2), uniform or per
    tetrahedron (the nodal axes are those of the nearest... lumped
    average, re-orthonormalized)."""

    name = "cubic"
    quadratic = False

    def __init__(self, state, Kc1_tet, Kc2_tet=0.0,
                 c1=(1.0, 0.0, 0.0), c2=(0.0, 1.0, 0.0)):
        super().__init__()
        sp = state.space
        M = len(sp.mesh.tets)
        Kc1 = np.broadcast_to(np.asarray(Kc1_tet, float), (M,))
        Kc2 = np.broadcast_to(np.asarray(Kc2_tet, float), (M,))
        sl = slice(sp.rstart, sp.rend)
        self.k1V = sp.node_average(Kc1)[sl] * state.V_local
        self.k2V = sp.node_average(Kc2)[sl] * state.V_local
        self.coef1 = nodal_scale(state, Kc1)                 # Kc1/(mu0 Ms)
        self.coef2 = nodal_scale(state, Kc2)

        def nodal_axis(c):
            c = np.broadcast_to(np.asarray(c, float), (M, 3))
            c = c / np.linalg.norm(c, axis=1)[:, None]
            v = np.stack([sp.node_average(c[:, k]) for k in range(3)],
                         axis=1)[sl]
            return v

        a1 = nodal_axis(c1)
        a2 = nodal_axis(c2)
        a1 /= np.linalg.norm(a1, axis=1)[:, None]
        a2 -= np.einsum("ij,ij->i", a1, a2)[:, None] * a1
        a2 /= np.linalg.norm(a2, axis=1)[:, None]
        self.axes = np.stack([a1, a2, np.cross(a1, a2)], axis=1)  # (n,3,3)

    def _components(self, state):
        m = state.m_local()
        return m, np.einsum("ikc,ic->ik", self.axes, m)          # a_k = m.c_k

    def h(self, state, out_vec) -> None:
        _, a = self._components(state)
        a2 = a * a
        s = a2.sum(axis=1, keepdims=True)
        # dE/da_k = 2 Kc1 a_k (s - a_k^2) + 2 Kc2 a_k prod_{j != k} a_j^2
        prod_others = np.stack([a2[:, 1] * a2[:, 2], a2[:, 0] * a2[:, 2],
                                a2[:, 0] * a2[:, 1]], axis=1)
        g = (-2.0 * self.coef1[:, None] * a * (s - a2)
             - 2.0 * self.coef2[:, None] * a * prod_others)
        with out_vec as o:
            o.reshape(-1, 3)[:] = np.einsum("ik,ikc->ic", g, self.axes)

    def E(self, state) -> float:
        _, a = self._components(state)
        a2 = a * a
        e1 = a2[:, 0] * a2[:, 1] + a2[:, 1] * a2[:, 2] + a2[:, 2] * a2[:, 0]
        e2 = a2[:, 0] * a2[:, 1] * a2[:, 2]
        local = float((self.k1V * e1 + self.k2V * e2).sum())
        return global_sum(state.space.comm, local)
