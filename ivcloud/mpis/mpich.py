"""MPICH from PyPI (`mpich` 5.0.2: ch4 with the ofi and ucx netmods, its
own libfabric 2.5.1 with tcp and shm built in); its launcher line and
variables: docs/mpi.md, "On a cluster: `ivcloud cluster mpirun --mpi
NAME`". MPIR_CVAR_NOLOCAL makes every peer a remote one, so that
libfabric's shm provider can be measured against MPICH's own shared
memory."""

from __future__ import annotations

from typing import Dict, Sequence

from . import provider
from .hydra import HydraFlavor


class Mpich(HydraFlavor):
    name = "mpich"
    title = "MPICH 5.0.2"
    wheel = "mpich==5.0.2"
    in_task_prolog = True
    # its PMI client speaks PMI-2's wire protocol to slurmstepd
    slurm_mpi = "pmi2"

    def launcher_options(self, agent: str) -> Sequence[str]:
        return ["-launcher", "ssh", "-launcher-exec", agent]

    def transport_env(self, transport: str) -> Dict[str, str]:
        # own-shm: the netmod opens a provider even when every peer is
        # local, and ch4 polls it in every progress call: shm's poll is
        # the cheapest (tcp's doubled the 8 B latency)
        env = {"MPIR_CVAR_CH4_NETMOD": "ofi",
               "FI_PROVIDER": {"ivshmem": provider.NAME, "tcp": "tcp"}.get(
                   transport, "shm")}
        if transport == "shm":
            env["MPIR_CVAR_NOLOCAL"] = "1"
        return env
