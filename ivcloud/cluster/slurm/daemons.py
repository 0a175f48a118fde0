"""Bringing a cluster's Slurm up (`cluster up --scheduler slurm`;
docs/cluster.md, "Slurm"), and what `status` says of it.

Every daemon in a holder is started through the launch agent's way into
it (nodes.start_in_holder), so it lives in the cluster's namespaces and
carries IVCLOUD_CLUSTER: `down`'s sweep stops it with everything else
there, also after `up` was killed. Nothing outside the state directory
is written, and no account is made (SlurmUser=root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ...errors import ClusterError, ClusterFailure, MpiSetupError
from ...mpis.openmpi import component_dir, stock_component_dir
from .. import kinds
from ..regions import SLURM_JOB_KEY_LONGEST, job_server_paths
from ..state import StateDir
from ..topology import HEAD_HOSTNAME, ClusterTopology
from .nodes import binary, start_in_holder
from .conf import (MPI_CONF, SlurmPaths, hook_script_text,
                   slurm_conf_text, task_env, task_prolog_text,
                   topology_conf_text)

SCHEDULERS = ("none", "slurm")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue")
# Slurm's mpi/pmix plugin dlopens this name (libpmix-dev has it)
PMIX_LIBRARY = "libpmix.so"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
_SUN_PATH_MAX = 107
MIN_TIME_SLICE_S = 5      # Slurm's bounds of SchedulerTimeSlice
MAX_TIME_SLICE_S = 65533


@dataclass(frozen=True)
class SlurmOptions:
    """What `cluster up --scheduler slurm` was asked for."""
    time_slice_s: int = 0   # > 0: gang scheduling with slices this long


def paths_of(sd: StateDir) -> SlurmPaths:
    return SlurmPaths(sd.dir / "slurm")


class Slurm:
    """The scheduler of a cluster that `up` builds."""

    def __init__(self, options: SlurmOptions = SlurmOptions()):
        self.options = options

    def preflight(self, topo: ClusterTopology, sd: StateDir,
                  kind: "kinds.InstanceKind") -> None:
        """Refusals before anything exists (ClusterError: bad input)."""
        kind.slurm_nodes()   # refuses a kind that runs no slurmd
        slice_s = self.options.time_slice_s
        if slice_s and not MIN_TIME_SLICE_S <= slice_s <= MAX_TIME_SLICE_S:
            raise ClusterError(f"a time slice must be {MIN_TIME_SLICE_S}.."
                               f"{MAX_TIME_SLICE_S} s, not {slice_s}",
                               setting="slurm_time_slice")
        missing = [n for n in DAEMONS + CLIENTS if binary(n) is None]
        if not any(Path(d, PMIX_LIBRARY).exists() for d in LIBRARY_DIRS):
            missing.append(PMIX_LIBRARY)
        if missing:
            raise ClusterError(f"Slurm needs {', '.join(missing)}"
                               f" (apt-get install slurmctld slurmd "
                               f"slurm-client munge libpmix-dev)",
                               setting="scheduler")
        try:
            component_dir()
            stock_component_dir()
        except MpiSetupError as e:
            raise ClusterError(str(e))
        paths = paths_of(sd)
        if len(str(paths.munge_socket)) > _SUN_PATH_MAX:
            raise ClusterError(f"run dir {sd.run_dir} is too long for "
                               f"munge's socket", setting="run_dir")
        for srv in topo.server_list():
            job_server_paths(sd.servers, srv.name, srv.index,
                             SLURM_JOB_KEY_LONGEST)   # refuses long sockets

    def record(self, sd: StateDir) -> Dict:
        paths = paths_of(sd)
        return {"scheduler": "slurm",
                "slurm": {"dir": str(paths.root), "conf": str(paths.conf),
                          "topology": "tree",
                          "time_slice_s": self.options.time_slice_s,
                          "daemons": {}}}

    # ------------------------------------------------------------ up

    def write_files(self, b) -> None:
        """Everything Slurm and munge read, under STATE_DIR/slurm (which
        the instances are then given to see)."""
        from ...native import native_dir
        paths = paths_of(b.sd)
        for d in (paths.root, paths.munge_dir, paths.log_dir, paths.pid_dir,
                  paths.jobs_dir):
            d.mkdir(mode=0o755)
        paths.ctld_state.mkdir(mode=0o700)
        # munged wants its key private to its user (root here)
        fd = os.open(paths.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        paths.conf.write_text(slurm_conf_text(b.topo, paths,
                                              self.options.time_slice_s))
        paths.topology.write_text(topology_conf_text(b.topo, "tree"))
        paths.mpi_conf.write_text(MPI_CONF)
        env = task_env(b.topo, {}, installed=False)
        _write_script(paths.task_prolog,
                      task_prolog_text(b.topo, b.sd.servers, env))
        repo = Path(__file__).resolve().parents[3]
        for hook, path in (("prolog", paths.prolog),
                           ("epilog", paths.epilog)):
            _write_script(path, hook_script_text(
                hook, b.sd.dir, repo, native_dir().resolve(), b.topo.name,
                paths.log("hooks")))
        b.keep_visible.append(paths.root)

    def start(self, b) -> None:
        """munged and slurmctld in the head node, slurmd in every
        instance, then until every node is idle."""
        paths = paths_of(b.sd)
        daemons = b.state["slurm"]["daemons"]
        nodes = kinds.of_state(b.state).slurm_nodes()
        b.step("slurm munged")
        daemons["munged"] = start_in_holder(b.state, HEAD_HOSTNAME, [
            binary("munged"), f"--socket={paths.munge_socket}",
            f"--key-file={paths.munge_key}",
            f"--pid-file={paths.pidfile('munged')}",
            f"--seed-file={paths.munge_dir / 'munged.seed'}",
            f"--log-file={paths.log('munged')}"], paths.log("munged"),
            paths.pidfile("munged"))
        b.step("slurm slurmctld")
        daemons["slurmctld"] = start_in_holder(
            b.state, HEAD_HOSTNAME, [binary("slurmctld")],
            paths.log("slurmctld"), paths.pidfile("slurmctld"))
        b.save()
        nodes.prepare(b.state, paths)
        for inst in b.topo.instance_list():
            b.step(f"slurm slurmd {inst.hostname}")
            daemons.update(nodes.start(b.state, paths, inst.hostname))
            b.save()
        b.step("slurm nodes")
        from .client import wait_idle
        wait_idle(b.state, nodes.ready_timeout_s)
        b.log(f"  slurm: slurmctld on {HEAD_HOSTNAME}, slurmd on "
              f"{len(b.topo.instance_list())} instances "
              f"(SLURM_CONF={paths.conf})")


def _write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


# ---------------------------------------------------------------- status

def status(state: Dict) -> Optional[Dict]:
    """For `cluster status`: each daemon's pid and whether it lives, and
    the nodes' states as slurmctld sees them; None without Slurm."""
    if state.get("scheduler") != "slurm":
        return None
    from .client import node_states
    nodes = kinds.of_state(state).slurm_nodes()
    daemons = {name: {"pid": rec.get("pid"), "host": rec.get("host"),
                      "alive": nodes.alive(state, rec)}
               for name, rec in state["slurm"].get("daemons", {}).items()}
    try:
        nodes = node_states(state)
    except ClusterFailure:
        nodes = {}
    return {"conf": state["slurm"]["conf"],
            "topology": state["slurm"].get("topology", "tree"),
            "daemons": daemons, "nodes": nodes,
            "healthy": bool(daemons) and all(d["alive"]
                                             for d in daemons.values())}
