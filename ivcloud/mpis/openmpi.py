"""Debian 12's Open MPI 4.1 with our BTL (mca_btl_ivshmem.so, built from
native/btl; in guests, from the ivcloud-guest package).

ob1 drives the BTLs: ours for ivshmem, tcp behind it for ranks the
region cannot reach, vader between ranks of one instance (left out on
this host alone, where the region is the point); one-sided operations
go as messages (osc pt2pt), so mpi4py programs ask for `serialized`
threads (docs/mpi.md, "The exact mpirun settings"). Remote daemons
(orted) start through the launch's agent as plm_rsh_agent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import MpiError, MpiSetupError
from .base import Command, Flavor, Launch, hosts_arg

COMPONENT_FILE = "mca_btl_ivshmem.so"
# Where Debian's Open MPI keeps its own components; mca_base_component_path
# replaces the default search path, so it must be listed next to ours.
STOCK_COMPONENT_DIR = Path("/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3")


def stock_component_dir() -> Path:
    """Open MPI's own component directory (ompi_info's pkglibdir)."""
    if (STOCK_COMPONENT_DIR / "mca_btl_self.so").exists():
        return STOCK_COMPONENT_DIR
    ompi_info = shutil.which("ompi_info")
    if ompi_info:
        try:
            out = subprocess.run([ompi_info, "--path", "pkglibdir"],
                                 capture_output=True, text=True, timeout=30,
                                 stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "pkglibdir" and value.strip():
                return Path(value.strip())
    raise MpiSetupError("cannot find Open MPI's component directory "
                        "(is openmpi-bin installed?)")


def component_dir() -> Path:
    """Directory holding mca_btl_ivshmem.so: the native build's btl/."""
    from ..native import native_file
    return native_file(f"btl/{COMPONENT_FILE}", MpiSetupError).parent.resolve()


def find_mpirun() -> str:
    path = shutil.which("mpirun")
    if not path:
        raise MpiSetupError("mpirun not found (install openmpi-bin)")
    return path


def btl_list(transport: str, tcp_fallback: bool = True,
             in_instances: bool = False) -> str:
    """The --mca btl value for a transport. With ivshmem, tcp stays in
    the list (unless tcp_fallback is off) so that ranks our component
    cannot reach (no region, region full, another host) still talk.
    in_instances: ranks in instances, where vader joins those of one."""
    if transport == "ivshmem":
        btls = ["self", "ivshmem"] + (["tcp"] if tcp_fallback else [])
    elif transport in ("tcp", "vader"):
        btls = ["self", transport]
    else:
        raise MpiError(f"unknown transport '{transport}' (choose from "
                       f"{', '.join(OpenMpi.transports)})")
    if in_instances and "vader" not in btls:
        btls.insert(1, "vader")
    return ",".join(btls)


_COUNTER_RE = re.compile(
    r"btl_ivshmem: rank (\d+) sent (\d+) msgs (\d+) bytes, received (\d+) "
    r"msgs (\d+) bytes, sleeps (\d+)")


def parse_btl_counters(text: str) -> Dict[int, Dict[str, int]]:
    """The per-rank lines the component prints at finalize: {rank:
    {sent_msgs, sent_bytes, recv_msgs, recv_bytes, sleeps}}. A rank
    missing from the result printed nothing (it never used the
    component, or did not finalize)."""
    out: Dict[int, Dict[str, int]] = {}
    for m in _COUNTER_RE.finditer(text):
        rank, sm, sb, rm, rb, sl = (int(g) for g in m.groups())
        out[rank] = {"sent_msgs": sm, "sent_bytes": sb, "recv_msgs": rm,
                     "recv_bytes": rb, "sleeps": sl}
    return out


class OpenMpi(Flavor):
    name = "openmpi"
    title = "Open MPI 4.1"
    transports = ("ivshmem", "tcp", "vader")
    options_name = "MCA parameter"
    takes_rankfile = True
    in_task_prolog = True

    def prefix(self) -> Path:
        return Path(find_mpirun()).resolve().parent.parent

    def launcher_path(self) -> Path:
        return Path(find_mpirun())

    def guest_needs(self, shared: Sequence[str] = ()) -> Optional[str]:
        return None     # the guest image's own, with our package's BTL

    def compile_command(self, source: os.PathLike, output: os.PathLike,
                        flags: Sequence[str] = ()) -> List[str]:
        return ["mpicc", *flags, "-o", str(output), str(source)]

    def check(self, transport: str, report: bool = False) -> None:
        super().check(transport, report)
        find_mpirun()

    def build_files(self, transport: str) -> List[Tuple[str, Path]]:
        if transport == "ivshmem":
            return [("the ivshmem BTL", component_dir())]
        return []

    def mca(self, launch: Launch) -> List[Tuple[str, str]]:
        """The MCA parameters of a launch, its own options last: one of a
        key replaces ours in its place (Open MPI would join a repeated
        --mca with ',')."""
        in_instances = bool(launch.hosts or launch.rank_hosts)
        mca: Dict[str, str] = {}
        if launch.transport == "ivshmem" and not launch.installed:
            ours = launch.components or component_dir()
            mca["mca_base_component_path"] = f"{stock_component_dir()}:{ours}"
        mca.update(pml="ob1", btl=btl_list(launch.transport,
                                           in_instances=in_instances))
        if launch.report:
            mca["btl_ivshmem_verbose"] = "1"
        if launch.transport == "ivshmem":
            mca["osc"] = "pt2pt"
        if launch.agent:
            mca.update(plm="rsh", plm_rsh_agent=launch.agent,
                       plm_rsh_no_tree_spawn="1")
        if launch.interface:
            mca.update(oob_tcp_if_include=launch.interface,
                       btl_tcp_if_include=launch.interface)
        mca.update((str(k), str(v)) for k, v in launch.options)
        return list(mca.items())

    def rank_env(self, launch: Launch) -> Dict[str, str]:
        env: Dict[str, str] = {}
        if dict(self.mca(launch)).get("osc") == "pt2pt":
            env["MPI4PY_RC_THREAD_LEVEL"] = "serialized"
        env.update(super().rank_env(launch))
        return env

    def task_env(self, launch: Launch) -> Dict[str, str]:
        return {**{f"OMPI_MCA_{k}": v for k, v in self.mca(launch)},
                **self.rank_env(launch)}

    def launch_line(self, launch: Launch, program: List[str],
                    env: Dict[str, str]) -> Command:
        # installed: the machine's own (a guest's), found on its PATH
        cmd = ["mpirun" if launch.installed else str(self.launcher_path())]
        if os.geteuid() == 0 and not launch.unprivileged:
            cmd.append("--allow-run-as-root")
        if launch.oversubscribe:
            cmd.append("--oversubscribe")
        cmd += ["-np", str(launch.np)]
        files: Dict[str, str] = {}
        rankfile = launch.rankfile
        if launch.rank_hosts:
            rankfile = f"{launch.scratch or '/tmp'}/rankfile." \
                       f"{uuid.uuid4().hex[:8]}"
            files[rankfile] = rankfile_text(launch.rank_hosts,
                                            dict(launch.hosts))
        if launch.hosts:
            cmd += ["--host", hosts_arg(launch.hosts)]
        if rankfile is not None:
            cmd += ["--rankfile", rankfile]
        elif launch.hosts:
            cmd += ["--map-by", "node" if launch.spread else "slot"]
        if launch.hosts or launch.rank_hosts:
            # an instance's affinity is its vCPU set; ranks float in it as
            # a guest's processes do on its vCPUs. A rankfile's slot= still
            # pins (Open MPI applies it despite this), so rankfiles for
            # clusters name the whole vCPU range.
            cmd += ["--bind-to", "none"]
        if launch.wdir:
            cmd += ["--wdir", launch.wdir]
        for key, value in self.mca(launch):
            cmd += ["--mca", key, value]
        for key, value in env.items():
            cmd += ["-x", f"{key}={value}"]
        return Command(cmd + program, files)


def rankfile_text(rank_hosts: Sequence[str], slots: Dict[str, int]) -> str:
    """A rankfile putting rank r on rank_hosts[r], free to run on any of
    its instance's vCPUs. Open MPI binds a rankfile's rank to its slot
    even under --bind-to none, so slot=0 on every instance would pin the
    ranks of all instances to one host CPU; the whole range keeps them
    floating like `--bind-to none` placements do."""
    lines = []
    for r, host in enumerate(rank_hosts):
        n = slots.get(host, 1)
        lines.append(f"rank {r}={host} slot={'0' if n == 1 else f'0-{n - 1}'}")
    return "\n".join(lines) + "\n"
