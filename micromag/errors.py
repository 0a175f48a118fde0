"""Errors of the micromagnetic solver: one hierarchy, one-line messages.

Every error micromag raises on purpose is a :class:`MagError`. Messages
name the problem file, the mesh or the stage, never a command line: the
solver is a library, and whoever calls it (``ivcloud mag``, a script)
decides what an error becomes.

- :class:`ProblemError`: the input cannot be run as given (problem file,
  mesh, material, rank count too large for the mesh) -- bad input;
- :class:`SimulationError`: a valid problem failed while it ran (solver
  divergence, a Krylov solve that did not converge);
- :class:`SetupError`: the machine lacks something the solver needs (a
  PETSc without a graph partitioner).
"""

from __future__ import annotations


class MagError(Exception):
    """Base of micromag's deliberate errors."""


class ProblemError(MagError, ValueError):
    """A problem that cannot be run: one line naming the problem."""


class MeshError(ProblemError):
    """A mesh that cannot be built, read or distributed."""


class SimulationError(MagError, RuntimeError):
    """The run failed after it started (solver divergence etc.)."""


class IntegrationError(SimulationError):
    """Time integration failed or was asked for something it cannot do."""


class SetupError(MagError, RuntimeError):
    """The environment lacks what the solver needs."""
