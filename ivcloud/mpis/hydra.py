"""Hydra, the process manager of MPICH and of Intel MPI: one launcher
line for both, told apart by how each names its remote launcher.

Hydra starts one proxy per host through the launcher (`AGENT HOST
hydra_pmi_proxy ...`, as ssh) and the proxies start the ranks. By
default mpiexec would hand its own environment to every rank; with an
agent the ranks get what the agent gives them (as a login over ssh
would: the instance's region socket among it) plus the -genv pairs."""

from __future__ import annotations

from typing import Dict, List, Sequence

from .base import Flavor, Job, hosts_arg


class HydraFlavor(Flavor):
    # how this hydra is told to run AGENT instead of ssh
    def launcher_options(self, agent: str) -> Sequence[str]:
        raise NotImplementedError

    def placement(self, job: Job) -> List[str]:
        """MPICH's hydra takes every host's slots (`-hosts h:n,...`)."""
        out = ["-hosts", hosts_arg(job.hosts)] if job.hosts else []
        return out + (["-ppn", "1"] if job.spread else [])

    def launch_line(self, job: Job, program: List[str],
                    env: Dict[str, str]) -> List[str]:
        cmd = [str(self.launcher_path())]
        if job.agent:
            cmd += [*self.launcher_options(job.agent), "-genvnone"]
        cmd += self.placement(job)
        if job.wdir:
            cmd += ["-wdir", job.wdir]
        cmd += ["-n", str(job.np)]
        for key, value in env.items():
            cmd += ["-genv", key, value]
        return cmd + program
