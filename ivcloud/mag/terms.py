"""Local field terms and the magnetization state.

Every term follows the convention of fem.py: ``h(state, out_vec)``
overwrites out_vec with the term's field H (A/m) at the nodes, and
``E(state)`` returns its energy (J), the same on every rank. Nodal
quantities use the lumped mass: a node carries the volume V_i = sum of
vol/4 of its tetrahedra, and material parameters are lumped the same way
(Ms_i V_i = sum Ms_e vol_e / 4), so nodes on an interface between two
materials see the volume-weighted mixture.

Energies, with m the unit magnetization and mu0 Ms H the field's
torque density:

    Exchange            E = int A |grad m|^2           H = 2/(mu0 Ms) div(A grad m)
    UniaxialAnisotropy  E = -int K1 (m.u)^2            H = 2 K1/(mu0 Ms) (m.u) u
    CubicAnisotropy     E = int Kc1 (a1^2 a2^2 + a2^2 a3^2 + a3^2 a1^2)
                              + Kc2 a1^2 a2^2 a3^2,   a_k = m.c_k
    Zeeman              E = -mu0 int Ms m.H_ext,       H = H_ext(t)

For the quadratic terms E = -(mu0/2) int Ms m.H, which is how their
energy is computed from the field.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import numpy as np

MU0 = 4e-7 * math.pi
GAMMA0 = 2.211e5          # m/(A s): mu0 times the electron's gyromagnetic ratio


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
            raise ValueError("initial magnetization has zero or invalid "
                             "vectors")
        self.space.set_global(self.m, arr / norm[:, None])

    def normalize(self, vec=None) -> float:
        """Rescale m (or vec) to unit length; returns the largest
        deviation | |m| - 1 | found (over all ranks)."""
        vec = self.m if vec is None else vec
        with vec as a:
            a3 = a.reshape(-1, 3)
            norm = np.sqrt(np.einsum("ij,ij->i", a3, a3))
            dev = float(np.abs(norm - 1.0).max()) if len(norm) else 0.0
            a3 /= norm[:, None]
        return self.space.comm.allreduce(dev, op=_mpi_max())

    def max_norm_deviation(self, vec=None) -> float:
        """max | |m| - 1 | over all ranks, m unchanged."""
        vec = self.m if vec is None else vec
        a3 = vec.getArray(readonly=True).reshape(-1, 3)
        norm = np.sqrt(np.einsum("ij,ij->i", a3, a3))
        dev = float(np.abs(norm - 1.0).max()) if len(norm) else 0.0
        return self.space.comm.allreduce(dev, op=_mpi_max())

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


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def _global_sum(comm, value: float) -> float:
    return float(comm.allreduce(float(value)))


def _nodal_scale(state, numer_tet) -> np.ndarray:
    """Per owned node: (lumped integral of numer_tet) / (mu0 Ms_i V_i),
    zero where there is no magnetic material."""
    sp = state.space
    lumped = sp.node_average(numer_tet)[sp.rstart:sp.rend] * state.V_local
    out = np.zeros(sp.nlocal)
    mag = state.magnetic_local
    out[mag] = lumped[mag] / (MU0 * state.MsV_local[mag])
    return out


class Term:
    """Base: name (column in the output table) and the quadratic-energy
    rule E = -(mu0/2) sum Ms_i V_i m_i.H_i."""

    name = "term"
    quadratic = True

    def __init__(self):
        self._scratch = None

    def _work(self, state):
        if self._scratch is None:
            self._scratch = state.space.vector_vec()
        return self._scratch

    def E(self, state) -> float:
        h = self._work(state)
        self.h(state, h)
        m = state.m_local()
        hv = h.getArray(readonly=True).reshape(-1, 3)
        local = float(np.einsum("i,ij,ij->", state.MsV_local, m, hv))
        scale = -0.5 * MU0 if self.quadratic else -MU0
        return scale * _global_sum(state.space.comm, local)


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
        self.coef = 2.0 * _nodal_scale(state, K1)          # 2 K1/(mu0 Ms)
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
        self.coef1 = _nodal_scale(state, Kc1)                 # Kc1/(mu0 Ms)
        self.coef2 = _nodal_scale(state, Kc2)

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
        return _global_sum(state.space.comm, local)


FieldValue = Union[Sequence[float], np.ndarray, Callable[[float], Sequence[float]]]


class Zeeman(Term):
    """Applied field H (A/m): a constant 3-vector, or a callable of time
    t (s) returning one (time-dependent, uniform), or an (n, 3) array in
    the space's numbering (static, non-uniform)."""

    name = "zeeman"
    quadratic = False

    def __init__(self, state, H: FieldValue, name: Optional[str] = None):
        super().__init__()
        self.state_space = state.space
        if name:
            self.name = name
        self._func = H if callable(H) else None
        self._static = None
        if self._func is None:
            arr = np.asarray(H, dtype=float)
            sp = state.space
            if arr.shape == (3,):
                self._static = np.broadcast_to(arr, (sp.nlocal, 3))
            elif arr.shape == (sp.n, 3):
                self._static = arr[sp.rstart:sp.rend]
            else:
                raise ValueError("Zeeman field must be a 3-vector, an "
                                 "(n, 3) array or a function of t")
        self._mask = state.magnetic_local[:, None]

    def value(self, t: float) -> np.ndarray:
        """The uniform applied field at time t (A/m), or the mean of a
        non-uniform one."""
        if self._func is not None:
            return np.asarray(self._func(t), dtype=float)
        return np.asarray(self._static).mean(axis=0) if len(self._static) \
            else np.zeros(3)

    def h(self, state, out_vec) -> None:
        with out_vec as o:
            o3 = o.reshape(-1, 3)
            if self._func is not None:
                o3[:] = np.asarray(self._func(state.t), dtype=float)
            else:
                o3[:] = self._static
            o3 *= self._mask
