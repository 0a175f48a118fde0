"""The cell-to-cell demagnetizing tensor of a regular grid
(micromag/terms/newell.py) against Aharoni's exact prism factors: the
self-term of one cell, and the tensor summed over every pair of cells
of a grid (which is the factor of the whole box, so the far field's
quadrature is checked too), both to 1e-10; Newell's formula and the
quadrature agree where they meet; the circular layout for the FFT
(whole and by slab) follows the tensor's symmetries."""

from __future__ import annotations

import numpy as np
import pytest

from mag_helpers import prism_factors
from micromag.terms import newell


@pytest.mark.parametrize("h", [(1, 1, 1), (2.5, 2.5, 3), (10, 10, 1.5),
                               (1, 2, 3), (500, 125, 3)])
def test_self_term_is_aharonis_prism(h):
    N = newell.newell_tensor(0.0, 0.0, 0.0, h)
    assert np.allclose(N[:3], prism_factors(*h), rtol=1e-10, atol=0)
    assert np.abs(N[3:]).max() < 1e-15
    assert N[:3].sum() == pytest.approx(1.0, abs=1e-13)


def _box_average(octant, n):
    """(6,) mean over the cells c of sum_c' N(c - c'): the demagnetizing
    tensor of the whole grid, by an FFT convolution of the layout."""
    from scipy import fft
    shape = [2 * v if v > 1 else 1 for v in n]
    full = newell.full_tensor(octant, shape)
    ones = np.zeros(shape)
    ones[:n[0], :n[1], :n[2]] = 1.0
    hat = fft.rfftn(ones)
    return np.array([fft.irfftn(fft.rfftn(full[c]) * hat, s=shape)
                     [:n[0], :n[1], :n[2]].mean() for c in range(6)])


@pytest.mark.parametrize("n,h", [((4, 1, 1), (1, 1, 1)),
                                 ((12, 12, 12), (2.5, 2.5, 3)),
                                 ((20, 6, 3), (10, 10, 1.5)),
                                 ((100, 25, 1), (5, 5, 3))])
def test_grid_sums_to_the_factors_of_the_box(n, h):
    octant = newell.octant_tensor(n, h)
    N = _box_average(octant, n)
    box = [k * hk for k, hk in zip(n, h)]
    assert np.allclose(N[:3], prism_factors(*box), rtol=1e-10, atol=0)
    assert np.abs(N[3:]).max() < 1e-14


def test_formula_and_quadrature_agree_where_they_meet():
    h = np.array([2.5, 2.5, 3.0]) / 3.0
    for direction in ((1, 0, 0), (1, 1, 0), (1, 2, 1), (0, 0, 1)):
        d = np.asarray(direction, dtype=float)
        for reach in (newell.NEAR_REACH * 0.9, newell.NEAR_REACH * 1.5):
            X = d / np.linalg.norm(d * h) * reach * h.max() * h
            exact = newell.newell_tensor(*X, h)
            p = int(newell._far_points(np.array([reach]))[0])
            quad = newell.dipole_average(X[:1], X[1:2], X[2:], h, p)[:, 0]
            assert np.abs(quad - exact).max() < 1e-10 * np.abs(exact).max()


def test_layout_symmetries_and_slabs():
    n, h = (5, 4, 3), (1.0, 1.5, 2.0)
    octant = newell.octant_tensor(n, h)
    shape = (9, 8, 5)
    full = newell.full_tensor(octant, shape)
    # the offset (-1, 2, -2) cells sits at index (8, 2, 3), with the
    # signs of the reflected octant entry (1, 2, 2) right
    X = np.array([-1.0, 3.0, -4.0])
    direct = newell.newell_tensor(*X, h)
    assert np.allclose(full[:, 8, 2, 3], direct, rtol=1e-10, atol=0)
    # the parts of a slab decomposition are the slices of the whole
    parts = [newell.full_tensor(octant, shape, slab=(0, a, b))
             for a, b in ((0, 4), (4, 9))]
    assert np.array_equal(np.concatenate(parts, axis=1), full)
    # offsets outside the octant's reach stay zero (no wrap-around)
    assert np.all(full[:, :, 4, :] == 0)          # y: 4 cells, length 8
