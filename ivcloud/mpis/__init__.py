"""The MPIs a job can run with, one class each (base.py says what a
flavour defines):

    openmpi   Debian 12's Open MPI 4.1 with our BTL (openmpi.py)
    openmpi5  Open MPI 5 from PyPI (openmpi5.py)
    mpich     MPICH from PyPI (mpich.py)
    impi      Intel MPI from PyPI (impi.py)

The last three reach other ranks through libfabric, over our provider
`ivshm` (provider.py) or libfabric's own tcp and shm providers; each is
installed by `make build` in a prefix of its own under build/mpi. A
flavour builds launcher commands (flavor(name).command(Launch(...))) and
programs (compile_command). Beside them: regions.py (the geometry of a
job's region, private regions), local.py (a job on this host alone:
`ivcloud mpirun`).

    f = flavor("mpich")
    cmd = f.command(Launch(["./app"], np=4, hosts=[("s0i0", 2), ("s0i1", 2)],
                           agent="/run/ivcloud/cluster-c/agent",
                           transport="ivshmem", report=True))
    provider.parse_reports(stderr_text)   # {pid: {sent, received, delegated}}
"""

from __future__ import annotations

from typing import Dict

from ..errors import MpiFlavorError
from .base import (ACROSS_INSTANCES, Command, Flavor, Launch, OfiFlavor,
                   mpi_root)
from .impi import IntelMpi
from .mpich import Mpich
from .openmpi import OpenMpi
from .openmpi5 import OpenMpi5

# the first is the default: the MPI a Debian machine has
_FLAVORS: Dict[str, Flavor] = {f.name: f for f in (OpenMpi(), OpenMpi5(),
                                                     Mpich(), IntelMpi())}
NAMES = tuple(_FLAVORS)
DEFAULT = NAMES[0]
OFI_NAMES = tuple(n for n, f in _FLAVORS.items() if isinstance(f, OfiFlavor))


def flavor(name: str) -> Flavor:
    """The MPI called `name`; MpiFlavorError for an unknown name."""
    if name not in _FLAVORS:
        raise MpiFlavorError(f"unknown MPI '{name}' (choose from "
                             f"{', '.join(NAMES)})")
    return _FLAVORS[name]


__all__ = ["ACROSS_INSTANCES", "Command", "DEFAULT", "Flavor", "Launch",
           "NAMES", "OFI_NAMES", "OfiFlavor", "flavor", "mpi_root"]
