"""Hydra, the process manager of MPICH and of Intel MPI: one launcher
line for both, told apart by how each names its remote launcher.

Hydra starts one proxy per host through the launcher (`AGENT HOST
hydra_pmi_proxy ...`, as ssh) and the proxies start the ranks. By
default mpiexec would hand its own environment to every rank; with an
agent the ranks get what the agent gives them (as a login over ssh
would: the instance's region socket among it) plus the -genv pairs."""

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
