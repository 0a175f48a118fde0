"""Field terms, one module each; every term subclasses
:class:`~micromag.terms.base.Term` (see base.py for the convention and
the energies). Solvers take a list of terms (llg.Dynamics)."""

from .anisotropy import CubicAnisotropy, UniaxialAnisotropy
from .base import Term
from .demag import DemagField
from .demag_grid import GridDemag
from .exchange import Exchange
from .zeeman import Zeeman

__all__ = ["Term", "Exchange", "UniaxialAnisotropy", "CubicAnisotropy",
           "Zeeman", "DemagField", "GridDemag"]
