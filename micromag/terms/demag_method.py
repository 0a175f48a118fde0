"""Which demagnetizing-field method a problem gets, and building it: the
one table of methods (METHODS) and the one function that settles
'auto' (resolve).

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
import os

from ..errors import ProblemError, SetupError
from ..parallel import global_min

METHODS = ("auto", "grid", "dense", "fmm")

# A body fills its bounding box when their volumes agree to this
# relative difference (round-off of the element volumes).
FILL_RTOL = 1e-9

# auto off the grid: the dense matrix while it takes at most 4 GB over
# all ranks (8 Nb^2 bytes: Nb <= 22,360), or a third of the smallest host
# memory among the ranks if that is more (its rows may all sit on one
# host, and the rest of the run needs room too). As long as it fits, the
# dense product is 20-300 times faster than fmm3dpy's FMM on this machine
# (docs/mag-demag.md, "Cost"), so memory, not time, decides.
DENSE_AUTO_BYTES = 4e9
DENSE_AUTO_SHARE = 1 / 3
DENSE_AUTO_MAX = int((DENSE_AUTO_BYTES / 8) ** 0.5)   # with little memory


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def dense_auto_max(host_bytes: float) -> int:
    """The most boundary nodes auto keeps dense on hosts of `host_bytes`."""
    limit = max(DENSE_AUTO_BYTES, DENSE_AUTO_SHARE * host_bytes)
    return int((limit / 8) ** 0.5)


def have_fmm() -> bool:
    """Whether the FMM library (PyPI fmm3dpy) can be imported."""
    try:
        import fmm3dpy  # noqa: F401
    except ImportError:
        return False
    return True


def fills_bounding_box(mesh) -> bool:
    """Whether the mesh's volume is that of its bounding box: a box or a
    film, on which the grid method's cells cover the body exactly."""
    lo, hi = mesh.bounding_box()
    box = float((hi - lo).prod())
    return box > 0 and abs(mesh.volume - box) <= FILL_RTOL * box


def resolve(method: str, n_boundary: int, host_bytes: float = 0,
            fills_box: bool = False) -> str:
    """'grid', 'dense' or 'fmm' for the method asked for: 'auto' takes
    the grid for a body that fills its bounding box (`fills_box`), else
    dense while the matrix of `n_boundary` nodes fits hosts of
    `host_bytes` (the smallest among the ranks) or fmm3dpy is missing."""
    if method not in METHODS:
        raise ProblemError(f"demag method '{method}' unknown (choose from "
                           f"{', '.join(METHODS)})")
    if method == "auto":
        if fills_box:
            return "grid"
        return ("fmm" if n_boundary > dense_auto_max(host_bytes)
                and have_fmm() else "dense")
    if method == "fmm" and not have_fmm():
        raise SetupError("demag method 'fmm' needs the Python package "
                         "fmm3dpy (pip install fmm3dpy)")
    return method


def resolve_for(space, method: str) -> str:
    """resolve() for the body of `space`; collective (the same answer on
    every rank: by the smallest host's memory)."""
    if method != "auto":
        return resolve(method, 0)
    return resolve(method, len(space.boundary_nodes),
                   global_min(space.comm, host_memory_bytes()),
                   fills_bounding_box(space.mesh))


def make_demag(space, Ms_nodes, method: str = "auto", *, rtol: float = 1e-10,
               tol: float = 1e-5, grid_tol=None, grid_h=None,
               length: float = math.inf):
    """The demagnetizing-field term for `method` (collective): a
    demag_grid.GridDemag (grid_tol, grid_h in m, `length` the exchange
    length the grid spacing is chosen for) or a demag.DemagField (rtol
    of its solvers, tol of the fast multipole operator)."""
    kind = resolve_for(space, method)
    if kind == "grid":
        from .demag_grid import GRID_TOL, GridDemag
        return GridDemag(space, Ms_nodes,
                         tol=GRID_TOL if grid_tol is None else grid_tol,
                         length=length, spacing=grid_h)
    from .demag import DemagField
    return DemagField(space, Ms_nodes, rtol=rtol, method=kind, tol=tol)
