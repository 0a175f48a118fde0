"""Hydra, the process manager of MPICH and of Intel MPI: one launcher
line for both, told apart by how each names its remote launcher
(docs/mpi.md, "On a cluster: `ivcloud cluster mpirun --mpi NAME`",
says what each line holds and why)."""

from __future__ import annotations

from typing import Dict, List, Sequence

from .base import Command, Launch, OfiFlavor, hosts_arg


class HydraFlavor(OfiFlavor):
    # how this hydra is told to run AGENT instead of ssh
    def launcher_options(self, agent: str) -> Sequence[str]:
        raise NotImplementedError

    def placement(self, launch: Launch) -> List[str]:
        """MPICH's hydra takes every host's slots (`-hosts h:n,...`)."""
        out = ["-hosts", hosts_arg(launch.hosts)] if launch.hosts else []
        return out + (["-ppn", "1"] if launch.spread else [])

    def launch_line(self, launch: Launch, program: List[str],
                    env: Dict[str, str]) -> Command:
        cmd = [str(self.launcher_path())]
        if launch.agent:
            cmd += [*self.launcher_options(launch.agent), "-genvnone"]
        cmd += self.placement(launch)
        if launch.wdir:
            cmd += ["-wdir", launch.wdir]
        cmd += ["-n", str(launch.np)]
        for key, value in env.items():
            cmd += ["-genv", key, value]
        return Command(cmd + program)
