"""MPI helpers shared by the solver's modules, and the environment rules
for starting the solver under a launcher.

mpi4py and petsc4py are imported on first use, so importing micromag
stays cheap and does not initialise MPI.
"""

from __future__ import annotations

import os
from typing import Mapping


def petsc():
    """petsc4py's PETSc module, initialised without reading sys.argv
    (options come from problem files, not from our command line)."""
    import petsc4py
    petsc4py.init([])
    from petsc4py import PETSc
    return PETSc


def comm_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def global_max(comm, value: float) -> float:
    from mpi4py import MPI
    return comm.allreduce(float(value), op=MPI.MAX)


def global_min(comm, value: float) -> float:
    from mpi4py import MPI
    return comm.allreduce(float(value), op=MPI.MIN)


def global_sum(comm, value: float) -> float:
    return float(comm.allreduce(float(value)))


# Set by a launcher for its own ranks (or by a singleton MPI_Init in the
# process that started us): a new mpirun must not see them.
LAUNCHER_VARS = ("PMIX_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_orte_",
                 "OMPI_APP_CTX_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE",
                 "OMPI_FIRST_RANKS", "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION")


def clean_mpi_env(environ: Mapping[str, str]) -> dict:
    """`environ` without the variables of the launcher that started this
    process: the environment for a new, independent mpirun."""
    return {k: v for k, v in environ.items()
            if not k.startswith(LAUNCHER_VARS)}


def under_mpirun(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a rank that a launcher (mpirun, a PMI) started."""
    return "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ
