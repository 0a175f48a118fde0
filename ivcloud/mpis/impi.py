"""Intel MPI from PyPI (`impi-rt` 2021.18.1: the runtime, its own
libfabric 2.4 with the providers as files beside it; no compiler
wrapper, no headers: programs are built with MPICH's mpi.h, Intel MPI
keeping MPICH's ABI). Ranks float over an instance's vCPUs
(I_MPI_PIN=0), as the other MPIs' do. Its launcher line and variables,
and why: docs/mpi.md, "On a cluster: `ivcloud cluster mpirun --mpi
NAME`"."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Sequence

from ..errors import MpiFlavorError
from . import provider
from .base import Launch
from .hydra import HydraFlavor
from .mpich import Mpich

# Slurm's PMI-2 client library (Debian's libpmi2-0, in the guest
# image), which Intel MPI's tasks under `srun --mpi=pmi2` load for its
# PMI-2 API; without it Intel MPI speaks PMI-1 to slurmstepd, which
# Slurm's pmi2 plugin answers as well (docs/mpi.md, "Under Slurm")
PMI2_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/libpmi2.so.0")
_FABRICS = {"ivshmem": "shm:ofi", "tcp": "shm:ofi", "shm": "ofi",
            "own-shm": "shm"}


class IntelMpi(HydraFlavor):
    name = "impi"
    title = "Intel MPI 2021.18.1"
    wheel = "impi-rt==2021.18.1"
    slurm_mpi = "pmi2"

    def launcher_options(self, agent: str) -> Sequence[str]:
        return ["-bootstrap", "ssh", "-bootstrap-exec", agent]

    def placement(self, launch: Launch) -> List[str]:
        """Intel's hydra reads no slots in -hosts (it would fill a host
        with as many ranks as it has cores): -ppn says how many go to
        each host, the same number for all."""
        if not launch.hosts:
            return []
        slots = {n for _, n in launch.hosts}
        if len(slots) > 1 and not launch.spread:
            raise MpiFlavorError(f"{self.title} places as many ranks on "
                                 f"every host; these hosts have "
                                 f"{sorted(slots)} slots")
        ppn = 1 if launch.spread else slots.pop()
        return ["-hosts", ",".join(h for h, _ in launch.hosts),
                "-ppn", str(ppn)]

    def transport_env(self, transport: str) -> Dict[str, str]:
        # LD_LIBRARY_PATH, as Intel's own environment scripts set it: the
        # program's RUNPATH finds Intel's libmpi, but libmpi's libfabric
        # would be the system's (Debian's 1.17), which knows neither the
        # `+FILE` form nor Intel's providers
        env = {"I_MPI_FABRICS": _FABRICS[transport], "I_MPI_PIN": "0",
               "LD_LIBRARY_PATH": str(self.prefix() / "lib")}
        if transport == "ivshmem":
            # Intel's core registers only the providers FI_PROVIDER names
            # (when set): tcp too, for the peers ivshm delegates
            env.update(I_MPI_OFI_PROVIDER=provider.NAME,
                       FI_PROVIDER=f"{provider.NAME},tcp")
        elif transport != "own-shm":
            env["I_MPI_OFI_PROVIDER"] = transport
        return env

    def task_env(self, launch: Launch) -> Dict[str, str]:
        """A hydra launch's variables, and Slurm's PMI-2 library where
        the tasks have it (srun --mpi=pmi2: the flavour's slurm_mpi)."""
        env = super().task_env(launch)
        if launch.installed or PMI2_LIBRARY.is_file():
            env.update(I_MPI_PMI="pmi2", I_MPI_PMI_LIBRARY=str(PMI2_LIBRARY))
        return env

    def provider_path(self, library: Path) -> str:
        return f"{self.prefix() / 'lib'}:+{library}"

    def compile_command(self, source: os.PathLike, output: os.PathLike,
                        flags: Sequence[str] = ()) -> List[str]:
        lib = self.prefix() / "lib"
        headers = Mpich().prefix() / "include"
        return ["cc", *flags, f"-I{headers}", "-o", str(output),
                str(source), f"-L{lib}", f"-Wl,-rpath,{lib}",
                "-Wl,--enable-new-dtags", "-lmpi"]

