"""The exact single-domain ellipsoid: demagnetizing factors and the
Stoner-Wohlfarth equilibrium, the reference of the curved-body
benchmark (docs/mag.md, "A curved body: the single-domain ellipsoid").

A uniformly magnetized ellipsoid has a uniform demagnetizing field
H_d = -N M, N = diag(Na, Nb, Nc) along its semi-axes a, b, c, with

    Na = (abc / 2) int_0^inf ds / ((a^2 + s) sqrt((a^2+s)(b^2+s)(c^2+s)))
       = (abc / 3) R_D(b^2, c^2, a^2)

(Carlson's symmetric integral R_D; Osborn's closed forms for spheroids
are the special cases, tests/micromag/test_ellipsoid.py). So a uniform m
has no exchange energy and feels the same field everywhere: when the body
is below the single-domain size it stays uniform, and its equilibrium in
an applied field H is the minimum of the Stoner-Wohlfarth energy density

    e(m) = mu0 Ms^2 / 2 (m . N m) + K1 (1 - (m . u)^2) - mu0 Ms H . m

on the unit sphere, reached from the initial m. Field perpendicular to
the long axis x (H = H e_y, Nb > Na, no crystal anisotropy): m_y = H /
H_K with H_K = (Nb - Na) Ms, the field at which the easy-axis loop
switches.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from .constants import MU0
from .errors import ProblemError


def demag_factors(a: float, b: float, c: float) -> Tuple[float, float, float]:
    """(Na, Nb, Nc) of the ellipsoid with semi-axes a, b, c (any unit);
    they sum to one."""
    from scipy.special import elliprd
    if not (a > 0 and b > 0 and c > 0):
        raise ProblemError("ellipsoid: semi-axes must be positive")
    # scale to the largest axis: R_D is homogeneous of degree -3/2
    s = max(a, b, c)
    a, b, c = a / s, b / s, c / s
    f = a * b * c / 3.0
    return (f * float(elliprd(b * b, c * c, a * a)),
            f * float(elliprd(c * c, a * a, b * b)),
            f * float(elliprd(a * a, b * b, c * c)))


def prolate_factors(ratio: float) -> Tuple[float, float]:
    """Osborn's closed form for a prolate spheroid with long / short axis
    `ratio` > 1: (N along the long axis, N across it)."""
    if not ratio > 1:
        raise ProblemError("prolate spheroid: the axis ratio must exceed 1")
    e = math.sqrt(1.0 - 1.0 / ratio ** 2)
    n_long = (1 - e * e) / (2 * e ** 3) * (math.log((1 + e) / (1 - e))
                                           - 2 * e)
    return n_long, (1.0 - n_long) / 2.0


def equilibrium(factors: Sequence[float], ms: float, h: Sequence[float],
                m0: Sequence[float], k1: float = 0.0,
                axis: Sequence[float] = (0.0, 0.0, 1.0)) -> np.ndarray:
    """The uniform m the Stoner-Wohlfarth energy (module docstring; field
    `h` in A/m, demagnetizing factors along x, y, z) relaxes to from
    `m0`: steepest descent on the sphere, then Newton's polish through
    the tangent-plane torque (exact to 1e-12)."""
    n = np.asarray(factors, dtype=float)
    h = np.asarray(h, dtype=float)
    u = np.asarray(axis, dtype=float)
    u = u / np.linalg.norm(u)
    m = np.asarray(m0, dtype=float)
    m = m / np.linalg.norm(m)

    def h_eff(m):
        # -de/dm / (mu0 Ms), in A/m
        return h - n * ms * m + 2 * k1 / (MU0 * ms) * (m @ u) * u

    scale = max(np.abs(n).max() * ms, np.linalg.norm(h),
                2 * abs(k1) / (MU0 * ms), 1.0)
    for _ in range(200000):
        g = h_eff(m)
        torque = g - (m @ g) * m     # the field's part across m
        if np.linalg.norm(torque) < 1e-13 * scale:
            break
        m = m + 0.2 * torque / scale
        m /= np.linalg.norm(m)
    return m


def reference_for(problem) -> Optional[dict]:
    """The exact <m> at the end of `problem` when it is this model: an
    ellipsoid or sphere of one material with the demag on, a uniform
    initial m, and one relax stage in static fields (no amplitude, ramp or
    switching times). None for any other problem. The dict: the demag
    factors, the field (A/m), the anisotropy field H_K = (N_perp -
    N_long) Ms + 2 K1 / (mu0 Ms) for a long axis along x, and m."""
    from .problem import FIELD_UNITS
    mesh = problem.mesh
    if mesh.shape == "ellipsoid":
        axes = mesh.semi_axes
    elif mesh.shape == "sphere":
        axes = (mesh.radius,) * 3
    else:
        return None
    stages = problem.stages
    fields = tuple(problem.fields) + (tuple(stages[0].field) if stages
                                      else ())
    if (len(problem.materials) != 1 or not problem.demag.enabled
            or problem.initial.type != "uniform" or len(stages) != 1
            or stages[0].type != "relax"
            or problem.materials[0].Kc1 or problem.materials[0].Kc2
            or any(any(f.amplitude) or f.ramp or f.t_on > 0
                   or f.t_off != math.inf for f in fields)):
        return None
    mat = problem.materials[0]
    h = sum((np.asarray(f.H, dtype=float) * FIELD_UNITS[f.unit]
             for f in fields), np.zeros(3))
    n = demag_factors(*axes)
    m = equilibrium(n, mat.Ms, h, problem.initial.m, mat.K1, mat.axis)
    return {"name": "Stoner-Wohlfarth", "demag_factors": list(n),
            "H": [float(v) for v in h],
            "H_K": (n[1] - n[0]) * mat.Ms,
            "m": [float(v) for v in m]}
