"""The demagnetizing tensor of a regular grid of cuboid cells (Newell).

N(R) is the cell-averaged field -H of one uniformly magnetized cell
(M = 1) at the cell whose centre is R away: H_c = -sum_c' N(c - c') M_c'.
It is exact for cuboids: Newell, Williams and Dunlop (J. Geophys. Res.
98, 9551, 1993) give it as a sixfold second difference of two
functions f (diagonal) and g (off-diagonal) over the cell sizes.

That difference cancels: f is of order (R/h)^3 and N of order (h/R)^3,
so float64 keeps about 16 - 6 log10(R/h) digits. Near the source
(|R| <= NEAR_REACH times the largest cell size) the formula is used as it stands; farther
out N is the same integral, the point-dipole kernel averaged over the two
cells, by Gauss quadrature: the average of G(R + s) with the tent
weight prod_k (h_k - |s_k|) (the convolution of two cells), Gauss-Jacobi
points on each half of every tent. The kernel is smooth there, the error
falls as (h/d)^(2p) with p points per half and d the distance to the
nearest singularity; p is chosen per offset for FAR_TOL
(tests/micromag/test_demag_grid.py checks both parts against each other
where they meet, and the self-term against Aharoni's prism formula).
"""

from __future__ import annotations

import math

import numpy as np

# Offsets up to this distance, in units of the largest cell size, use
# Newell's formula (float64 keeps about 12 digits there, 10 for cells
# ten times flatter than wide); beyond it, quadrature. Every pair of
# touching cells is within it.
NEAR_REACH = 4.0
# Relative accuracy asked of the far-field quadrature.
FAR_TOL = 1e-12
# Offsets per block of the far-field quadrature (bounds its temporaries).
_FAR_BLOCK = 4096


def _safe_asinh_ratio(num, den):
    """asinh(num / den), 0 where den is 0 (the factor in front is 0 there)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.arcsinh(num / den)
    return np.where(den > 0, out, 0.0)


def _safe_atan_ratio(num, den):
    """atan(num / den), 0 where den is 0 (likewise)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.arctan(num / den)
    return np.where(den != 0, out, 0.0)


def newell_f(x, y, z):
    """Newell's f, even in every argument."""
    x, y, z = np.abs(x), np.abs(y), np.abs(z)
    x2, y2, z2 = x * x, y * y, z * z
    r = np.sqrt(x2 + y2 + z2)
    out = (2.0 * x2 - y2 - z2) * r / 6.0
    out = out + 0.5 * y * (z2 - x2) * _safe_asinh_ratio(y, np.sqrt(x2 + z2))
    out = out + 0.5 * z * (y2 - x2) * _safe_asinh_ratio(z, np.sqrt(x2 + y2))
    out = out - x * y * z * _safe_atan_ratio(y * z, x * r)
    return out


def newell_g(x, y, z):
    """Newell's g: odd in x and in y, even in z."""
    z = np.abs(z)
    x2, y2, z2 = x * x, y * y, z * z
    r = np.sqrt(x2 + y2 + z2)
    out = -x * y * r / 3.0
    out = out + x * y * z * _safe_asinh_ratio(z, np.sqrt(x2 + y2))
    out = out + y / 6.0 * (3.0 * z2 - y2) * _safe_asinh_ratio(
        x, np.sqrt(y2 + z2))
    out = out + x / 6.0 * (3.0 * z2 - x2) * _safe_asinh_ratio(
        y, np.sqrt(x2 + z2))
    out = out - z2 * z / 6.0 * _safe_atan_ratio(x * y, z * r)
    out = out - 0.5 * z * y2 * _safe_atan_ratio(x * z, y * r)
    out = out - 0.5 * z * x2 * _safe_atan_ratio(y * z, x * r)
    return out


# the second difference -f(x-h) + 2 f(x) - f(x+h) along each axis
_STENCIL = ((-1, -1.0), (0, 2.0), (1, -1.0))


def _sixfold(fn, X, Y, Z, hx, hy, hz):
    acc = np.zeros(np.broadcast(X, Y, Z).shape)
    for i, ci in _STENCIL:
        for j, cj in _STENCIL:
            for k, ck in _STENCIL:
                acc += (ci * cj * ck) * fn(X + i * hx, Y + j * hy,
                                           Z + k * hz)
    return acc / (4.0 * math.pi * hx * hy * hz)


def newell_tensor(X, Y, Z, h):
    """(6, ...) components xx, yy, zz, xy, xz, yz of N at offsets
    (X, Y, Z) for cells of size h = (hx, hy, hz), by Newell's formula."""
    hx, hy, hz = (float(v) for v in h)
    X, Y, Z = np.broadcast_arrays(*(np.asarray(v, dtype=float)
                                    for v in (X, Y, Z)))
    return np.stack([
        _sixfold(newell_f, X, Y, Z, hx, hy, hz),
        _sixfold(newell_f, Y, X, Z, hy, hx, hz),
        _sixfold(newell_f, Z, Y, X, hz, hy, hx),
        _sixfold(newell_g, X, Y, Z, hx, hy, hz),
        _sixfold(newell_g, X, Z, Y, hx, hz, hy),
        _sixfold(newell_g, Y, Z, X, hy, hz, hx)])


def _tent_rule(p: int, h: float):
    """Points s and weights w on [-h, h] with sum w f(s) ~ int f(s)
    (h - |s|) ds: p Gauss-Jacobi points on each half (weight linear,
    vanishing at +-h)."""
    from scipy.special import roots_jacobi
    x, w = roots_jacobi(p, 1.0, 0.0)       # weight (1 - x) on [-1, 1]
    t = (x + 1.0) / 2.0                    # weight (1 - t) on [0, 1]
    wt = w / 4.0
    s = np.concatenate([-t * h, t * h])
    return s, np.concatenate([wt, wt]) * h * h


def _far_points(R_over_h: np.ndarray) -> np.ndarray:
    """Gauss points per half-tent for offsets at R / h (cell units, the
    distance to the nearest singularity being R - 1 cells per axis)."""
    d = np.maximum(R_over_h - 1.0, 1e-3)
    # error ~ (1 / (2 d))^(2p): take p with that below FAR_TOL
    p = np.ceil(np.log(FAR_TOL) / (2.0 * np.log(1.0 / (2.0 * d))))
    return np.clip(p, 2, 12).astype(int)


def dipole_average(X, Y, Z, h, p: int):
    """(6, n) components of N at offsets (X, Y, Z) ((n,) arrays) as the
    two-cell average of the point-dipole kernel, p Gauss points per half
    tent and axis (far field only: the kernel must be smooth over
    R +- h)."""
    hx, hy, hz = (float(v) for v in h)
    vol = hx * hy * hz
    sx, wx = _tent_rule(p, hx)
    sy, wy = _tent_rule(p, hy)
    sz, wz = _tent_rule(p, hz)
    S = np.stack(np.meshgrid(sx, sy, sz, indexing="ij"), axis=-1
                 ).reshape(-1, 3)
    W = (wx[:, None, None] * wy[None, :, None] * wz[None, None, :]
         ).reshape(-1) / vol
    R = np.stack([X, Y, Z], axis=-1)                      # (n, 3)
    out = np.zeros((6, len(R)))
    for a in range(0, len(R), _FAR_BLOCK):
        r = R[a:a + _FAR_BLOCK, None, :] + S[None, :, :]  # (b, q, 3)
        r2 = np.einsum("bqc,bqc->bq", r, r)
        inv5 = W[None, :] / (4.0 * math.pi * r2 ** 2.5)
        rx, ry, rz = r[..., 0], r[..., 1], r[..., 2]
        out[0, a:a + len(r)] = ((r2 - 3 * rx * rx) * inv5).sum(axis=1)
        out[1, a:a + len(r)] = ((r2 - 3 * ry * ry) * inv5).sum(axis=1)
        out[2, a:a + len(r)] = ((r2 - 3 * rz * rz) * inv5).sum(axis=1)
        out[3, a:a + len(r)] = (-3 * rx * ry * inv5).sum(axis=1)
        out[4, a:a + len(r)] = (-3 * rx * rz * inv5).sum(axis=1)
        out[5, a:a + len(r)] = (-3 * ry * rz * inv5).sum(axis=1)
    return out


def octant_tensor(n, h, near_reach: float = NEAR_REACH,
                  part=(0, 1)) -> np.ndarray:
    """(6, nx, ny, nz): N at the offsets (i hx, j hy, k hz), 0 <= i < nx
    etc., the other octants following by symmetry (`full_tensor`).
    part = (r, size): compute only every size-th offset from the r-th
    (the rest left zero), to share the work between ranks."""
    n = tuple(int(v) for v in n)
    h = np.asarray(h, dtype=float)
    scale = float(h.max())
    hs = h / scale                                        # order one
    I, J, K = np.meshgrid(*(np.arange(v) for v in n), indexing="ij")
    cells = np.stack([I, J, K]).reshape(3, -1).astype(float)
    out = np.zeros((6, cells.shape[1]))
    X = cells * hs[:, None]
    reach = np.sqrt((X * X).sum(axis=0))              # in units of h.max()
    mine = np.zeros(cells.shape[1], dtype=bool)
    mine[part[0]::part[1]] = True
    near = np.flatnonzero(mine & (reach <= near_reach))
    if len(near):
        out[:, near] = newell_tensor(X[0, near], X[1, near], X[2, near], hs)
    far = np.flatnonzero(mine & (reach > near_reach))
    if len(far):
        p = _far_points(reach[far])
        for pv in np.unique(p):
            sel = far[p == pv]
            out[:, sel] = dipole_average(X[0, sel], X[1, sel], X[2, sel],
                                         hs, int(pv))
    return out.reshape((6,) + n)


# sign of each component under a reflection of (x, y, z)
_PARITY = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1],
                    [-1, -1, 1], [-1, 1, -1], [1, -1, -1]])


def full_tensor(octant: np.ndarray, shape, slab=None) -> np.ndarray:
    """(6, px, py, pz): the octant's tensor laid out circularly on a
    padded grid of `shape` (p_k >= 2 n_k - 1, or 1 where n_k = 1), offset
    -i at index p - i, ready for an FFT convolution. slab = (axis, a, b):
    only the indices a <= i < b along that axis (a distributed FFT's
    local part)."""
    n = octant.shape[1:]
    lo = [0, 0, 0]
    hi = list(shape)
    if slab is not None:
        axis, lo[axis], hi[axis] = slab
    out = np.zeros((6,) + tuple(b - a for a, b in zip(lo, hi)))
    for signs in np.ndindex(2, 2, 2):
        flip = [bool(v) for v in signs]
        if any(f and n[k] == 1 for k, f in enumerate(flip)):
            continue
        src, dst = [], []
        for k in range(3):
            i = np.arange(1, n[k]) if flip[k] else np.arange(n[k])
            d = (-i if flip[k] else i) % shape[k]
            keep = (d >= lo[k]) & (d < hi[k])
            src.append(i[keep])
            dst.append(d[keep] - lo[k])
        if any(len(v) == 0 for v in src):
            continue
        block = octant[(slice(None),) + np.ix_(*src)]
        sign = np.prod(np.where(np.array(flip)[None, :], _PARITY, 1),
                       axis=1)
        out[(slice(None),) + np.ix_(*dst)] = sign[:, None, None, None] * block
    return out
