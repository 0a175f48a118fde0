"""The MPIs a job can run with, one Flavor class each (base.py says what
a flavour defines): Debian 12's Open MPI 4.1 with our BTL, and Open MPI
5, MPICH and Intel MPI from PyPI, which `make build` installs under
build/mpi and which reach other ranks through libfabric (our provider
`ivshm`, provider.py, or libfabric's tcp and shm). Beside them:
regions.py (a job's region), local.py (`ivcloud mpirun` on this host).

    cmd = flavor("mpich").command(Launch(["./app"], np=4,
                                         hosts=[("s0i0", 2), ("s0i1", 2)],
                                         transport="ivshmem"))
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


def choices() -> str:
    """The MPIs for a --mpi help text: each name with its MPI, how it
    crosses instances, the default marked."""
    return ", ".join(
        f"{n} ({f.title}"
        f"{' through libfabric' if isinstance(f, OfiFlavor) else ', our BTL'}"
        f"{'; default' if n == DEFAULT else ''})"
        for n, f in _FLAVORS.items())


def flavor(name: str) -> Flavor:
    """The MPI called `name`; MpiFlavorError for an unknown name."""
    if name not in _FLAVORS:
        raise MpiFlavorError(f"unknown MPI '{name}' (choose from "
                             f"{', '.join(NAMES)})")
    return _FLAVORS[name]


__all__ = ["ACROSS_INSTANCES", "Command", "DEFAULT", "Flavor", "Launch",
           "NAMES", "OFI_NAMES", "OfiFlavor", "flavor", "mpi_root"]
