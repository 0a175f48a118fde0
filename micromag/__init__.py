"""micromag: finite-element micromagnetics (Magpar class) on PETSc.

Modules:

    constants    MU0, GAMMA0 and unit factors
    errors       MagError and its subclasses (ProblemError, MeshError,
                 SimulationError, IntegrationError, SetupError)
    parallel     MPI helpers (reductions, launcher environment)
    mesh         tetrahedral meshes (builders, gmsh, files)
    partition    node partitioning (PT-Scotch through PETSc)
    fem          the distributed P1 space
    state        the magnetization state and nodal material data
    terms        field terms, one module each, all subclasses of
                 terms.base.Term: exchange, anisotropy (uniaxial, cubic),
                 zeeman (static and time-dependent), demag: demag_grid
                 (cell grid, Newell's tensor by FFT) or demag (FEM/BEM),
                 chosen by demag_method
    llg          LLG time integration and energy minimisation
    problem      TOML problem files
    simulation   running a problem: the Python API
    output       tables, VTU snapshots, plots, progress
    convergence  comparing mesh-convergence runs (published SP4 solution)
    study        a convergence study as one call (ivcloud mag converge)

The package stands on its own (numpy, scipy, petsc4py, mpi4py, gmsh,
meshio); the `ivcloud mag` command (ivcloud/cli/mag.py) is a thin layer
on top that adds launching on N ranks. Heavy dependencies (PETSc, MPI,
gmsh) are imported by the modules that need them, on first use, so that
importing the package stays cheap. See docs/mag.md.
"""

from .errors import (IntegrationError, MagError, MeshError, ProblemError,
                     SetupError, SimulationError)

__version__ = "0.1.0"

__all__ = ["MagError", "ProblemError", "MeshError", "SimulationError",
           "IntegrationError", "SetupError"]
