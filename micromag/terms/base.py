"""The field-term interface: :class:`Term`, and the nodal scaling the
local terms share.

Every term follows the convention of fem.py: ``h(state, out_vec)``
overwrites out_vec with the term's field H (A/m) at the nodes, and
``E(state)`` returns its energy (J), the same on every rank. Nodal
quantities use the lumped mass (see micromag.state).

Energies, with m the unit magnetization and mu0 Ms H the field's
torque density (one module per term):

    exchange.Exchange   E = int A |grad m|^2     H = 2/(mu0 Ms) div(A grad m)
    anisotropy.UniaxialAnisotropy
                        E = -int K1 (m.u)^2      H = 2 K1/(mu0 Ms) (m.u) u
    anisotropy.CubicAnisotropy
                        E = int Kc1 (a1^2 a2^2 + a2^2 a3^2 + a3^2 a1^2)
                              + Kc2 a1^2 a2^2 a3^2,   a_k = m.c_k
    zeeman.Zeeman       E = -mu0 int Ms m.H_ext,  H = H_ext(t) (static or
                        time-dependent)
    demag.DemagField    E = -(mu0/2) int Ms m.H_demag (hybrid FEM/BEM)
    demag_grid.GridDemag
                        the same energy, M on a cell grid (Newell, FFT)

For the quadratic terms E = -(mu0/2) int Ms m.H, which is how their
energy is computed from the field.
"""

from __future__ import annotations

import numpy as np

from ..constants import MU0
from ..parallel import global_sum


def nodal_scale(state, numer_tet) -> np.ndarray:
    """Per owned node: (lumped integral of numer_tet) / (mu0 Ms_i V_i),
    zero where there is no magnetic material."""
    sp = state.space
    lumped = sp.node_average(numer_tet)[sp.rstart:sp.rend] * state.V_local
    out = np.zeros(sp.nlocal)
    mag = state.magnetic_local
    out[mag] = lumped[mag] / (MU0 * state.MsV_local[mag])
    return out


class Term:
    """Base of every field term.

    A term has a ``name`` (its energy column in the output table, E_name)
    and implements ``h(state, out_vec)``. ``E(state)`` is computed from
    the field: E = -(mu0/2) sum Ms_i V_i m_i.H_i for a field linear in m
    (``quadratic = True``: exchange, uniaxial anisotropy), -mu0 sum
    Ms_i V_i m_i.H_i for a field independent of m (``quadratic = False``:
    Zeeman). Terms whose energy is neither (cubic anisotropy) or that
    have a cheaper way (demag) override E."""

    name = "term"
    quadratic = True

    def __init__(self):
        self._scratch = None

    def _work(self, state):
        if self._scratch is None:
            self._scratch = state.space.vector_vec()
        return self._scratch

    def h(self, state, out_vec) -> None:
        """Overwrite out_vec (a vector_vec) with the field H (A/m) at
        state.m, state.t; collective."""
        raise NotImplementedError(f"{type(self).__name__}.h")

    def stack_field(self, state):
        """For m tied over stacks (state.stacks): a function
        f(state, u_vec, out_vec) that overwrites out_vec (a stack vector)
        with R H(P u), the field restricted to the stacks, at u and
        state.t, without the nodes; None where the term has none (the
        caller then computes H on the nodes and restricts it).
        Collective."""
        return None

    def E(self, state) -> float:
        """The term's energy (J), the same on every rank; collective."""
        h = self._work(state)
        self.h(state, h)
        m = state.m_local()
        hv = h.getArray(readonly=True).reshape(-1, 3)
        local = float(np.einsum("i,ij,ij->", state.MsV_local, m, hv))
        scale = -0.5 * MU0 if self.quadratic else -MU0
        return scale * global_sum(state.space.comm, local)
