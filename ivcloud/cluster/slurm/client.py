"""Slurm's own commands against a cluster's Slurm, run in its head node
(the cluster's login node: the only place outside the instances that
reaches slurmctld and that slurmd reaches back, for srun's I/O).

A rankfile of the placement planner becomes Slurm's arbitrary
distribution: SLURM_HOSTFILE lists each task's node.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import ClusterError, ClusterFailure
from ...mpis import provider
from .. import kinds
from ..state import StateDir, save
from ..topology import topology_from_dict
from .conf import topology_conf_text
from .nodes import binary, head_command, last_line, paths, query

# what `cluster mpirun --report-transport` gives its ranks (Launch.report:
# the provider's exit line, the BTL's counters), as variables of srun's
# or sbatch's environment, which Slurm hands to the tasks (--export=ALL,
# its default)
REPORT_ENV = {provider.REPORT_ENV: "1", "OMPI_MCA_btl_ivshmem_verbose": "1"}
# srun gets this long to end its job after SIGTERM/SIGINT, then SIGKILL
STOP_GRACE_S = 15.0


def node_states(state: Dict) -> Dict[str, str]:
    """{node: its state as slurmctld says (idle, allocated, down, ...)}."""
    out = query(state, [binary("sinfo"), "--noheader", "--Node",
                        "--format=%N %T"])
    return dict(line.split()[:2] for line in out.splitlines()
                if len(line.split()) >= 2)


def wait_idle(state: Dict, timeout_s: float) -> None:
    """Until slurmctld calls every node idle (a job that ended may leave
    its nodes completing): a job placed by the topology then gets the
    nodes it would get on an idle cluster. ClusterFailure after
    `timeout_s`, naming the node (its log's last line) or slurmctld."""
    nodes = sorted(state["instances"])
    deadline = time.monotonic() + timeout_s
    seen: Dict[str, str] = {}
    while True:
        try:
            seen = node_states(state)
        except ClusterFailure:
            seen = {}
        if seen and all(seen.get(n) == "idle" for n in nodes):
            return
        if time.monotonic() > deadline:
            late = [n for n in nodes if seen.get(n) != "idle"]
            log = (paths(state).log(f"slurmd-{late[0]}") if seen
                   else paths(state).log("slurmctld"))
            line = (kinds.of_state(state).slurm_nodes().log_line(
                state, paths(state), late[0]) if seen else last_line(log))
            raise ClusterFailure(
                f"Slurm not idle in {timeout_s:.0f} s: "
                + (f"node {late[0]} is {seen.get(late[0], 'unknown')}"
                   if seen else "slurmctld does not answer")
                + f" (last of {log.name}: {line or 'empty'})")
        time.sleep(0.2)


def set_topology(state: Dict, shape: str) -> None:
    """Rewrite topology.conf as `shape` (conf.topology_conf_text: tree
    or flat) and have slurmctld read it again."""
    p = paths(state)
    text = topology_conf_text(topology_from_dict(state["topology"]), shape)
    tmp = p.topology.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, p.topology)
    query(state, [binary("scontrol"), "reconfigure"])
    state["slurm"]["topology"] = shape
    save(StateDir.of(Path(state["dir"])), state)


def client_command(state: Dict, command: str, args: Sequence[str],
                   hosts: Optional[Sequence[str]] = None,
                   cwd: Optional[str] = None, report: bool = False,
                   mpi: Optional[str] = None
                   ) -> Tuple[List[str], Dict[str, str], List[int],
                              Optional[Path]]:
    """(argv, env, cpus, hostfile) of `srun ARGS` or `sbatch ARGS` in
    the head node, working in `cwd` (nodes.workdir). hosts: task i on
    hosts[i], through the returned hostfile (srun's caller removes it;
    an sbatch job's sruns read it later, and `down` removes it).
    report: with REPORT_ENV. mpi: the tasks are that MPI's ranks over
    the job's region (conf.job_mpi_env: its variables and PMI plugin)."""
    if command not in ("srun", "sbatch"):
        raise ClusterError(f"no Slurm command '{command}' here (srun or "
                           f"sbatch)")
    nodes = kinds.of_state(state).slurm_nodes()
    nodes.check_placement(command, hosts or ())
    mpi_env = nodes.mpi_env(state, mpi) if mpi is not None else {}
    argv = [binary(command), f"--chdir={nodes.workdir(cwd)}"]
    hostfile = None
    if hosts:
        hostfile = paths(state).jobs_dir / (f"hostfile.{command}."
                                            f"{uuid.uuid4().hex[:8]}")
        hostfile.write_text("".join(f"{h}\n" for h in hosts))
        argv += ["--distribution=arbitrary", f"--ntasks={len(hosts)}"]
    full, env, cpus = head_command(state, argv + list(args))
    env.update(mpi_env)
    if hostfile is not None:
        env["SLURM_HOSTFILE"] = str(hostfile)
    if report:
        env.update(REPORT_ENV)
    return full, env, cpus, hostfile
