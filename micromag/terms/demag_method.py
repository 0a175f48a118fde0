"""Which demagnetizing-field method a problem gets, and building it.

    grid    the P1 magnetization on a regular grid, Newell's tensor by
            FFT (demag_grid.py): exact for bodies that fill their
            bounding box (boxes, films), first order at curved surfaces
    dense   FEM/BEM (demag.py), the dense boundary matrix: second order
            for every shape, Nb^2 doubles of memory
    fmm     FEM/BEM with the fast-multipole boundary operator
            (demag_fmm.py): the same discretisation in O(N) memory
    auto    grid for a body that fills its bounding box, else FEM/BEM
            with dense or fmm by the memory the dense matrix would take

docs/mag-demag.md has the accuracy and cost of each.
"""

from __future__ import annotations

import math

from ..errors import ProblemError

METHODS = ("auto", "grid", "dense", "fmm")

# A body fills its bounding box when their volumes agree to this
# relative difference (round-off of the element volumes).
FILL_RTOL = 1e-9


def fills_bounding_box(mesh) -> bool:
    """Whether the mesh's volume is that of its bounding box: a box or a
    film, on which the grid method's cells cover the body exactly."""
    lo, hi = mesh.bounding_box()
    box = float((hi - lo).prod())
    return box > 0 and abs(mesh.volume - box) <= FILL_RTOL * box


def choose(method: str, mesh) -> str:
    """'grid' or the FEM/BEM choice ('dense', 'fmm' or 'auto', which
    demag.DemagField settles by memory) for the method asked for."""
    if method not in METHODS:
        raise ProblemError(f"demag method '{method}' unknown "
                           f"({', '.join(METHODS)})")
    if method == "auto":
        return "grid" if fills_bounding_box(mesh) else "auto"
    return method


def make_demag(space, Ms_nodes, method: str = "auto", *, rtol: float = 1e-10,
               tol: float = 1e-5, grid_tol=None, grid_h=None,
               length: float = math.inf):
    """The demagnetizing-field term for `method` (collective): a
    demag_grid.GridDemag (grid_tol, grid_h in m, `length` the exchange
    length the grid spacing is chosen for) or a demag.DemagField (rtol
    of its solvers, tol of the fast multipole operator)."""
    kind = choose(method, space.mesh)
    if kind == "grid":
        from .demag_grid import GRID_TOL, GridDemag
        return GridDemag(space, Ms_nodes,
                         tol=GRID_TOL if grid_tol is None else grid_tol,
                         length=length, spacing=grid_h)
    from .demag import DemagField
    return DemagField(space, Ms_nodes, rtol=rtol, method=kind, tol=tol)
