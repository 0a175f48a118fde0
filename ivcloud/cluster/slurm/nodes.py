"""What Slurm needs of a cluster's instances, one class per instance
kind (Nodes here for namespaces, guests.GuestNodes for QEMU guests): the slurmd of a node, and what a job's prolog and epilog do in
its nodes beyond the job's regions (hooks.py). The instance kind hands
out its own (kinds.py, `InstanceKind.slurm_nodes`); the daemons, the
client and the hooks ask it and test no kind.

    ready_timeout_s         how long `up` waits for every node to be idle
    leave_notices           whether a job's servers may tell clients that
                            a peer left (regions.start_regions)
    prepare(state, paths)   once the instances are up, before any slurmd
    start(state, paths, host)    munged (where needed) and slurmd of a node;
                            their records for state.json
    alive(state, rec)       whether the daemon of a record lives
    log_line(state, paths, node) the last line of a node's slurmd log
    workdir(cwd)            the directory a job's tasks start in
    task_settings(state)    what the nodes' tasks are ranks of (conf.py's
                            task_env arguments after the topology)
    check_placement(command, hosts)  refuse a task list the nodes
                            cannot read
    attach_job(state, job, nodes, sockets)  the prolog's part in the nodes
    detach_job(state, job, nodes)    the epilog's: (what it did, with
                            "{regions}" for the regions, problems)

Daemons in the head node (munged, slurmctld) start with `start_in_holder`
in both kinds: the head node is a namespace holder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ... import procfs
from ...errors import ClusterError, ClusterFailure
from .. import holder
from ..launch import enter_command, working_dir
from ..topology import HEAD_HOSTNAME
from ..topology import topology_from_dict
from .conf import SlurmPaths, job_mpi_env

START_TIMEOUT_S = 30.0
# a Slurm command in the head node (query)
CLIENT_TIMEOUT_S = 30.0


def binary(name: str) -> Optional[str]:
    return shutil.which(name, path="/usr/local/sbin:/usr/local/bin:"
                                   "/usr/sbin:/usr/bin:/sbin:/bin")


def slurm_env(state: Dict, base: Dict[str, str]) -> Dict[str, str]:
    return {**base, "SLURM_CONF": state["slurm"]["conf"]}


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split()) if lines else ""


def start_in_holder(state: Dict, host: str, argv: List[str], log: Path,
                    pidfile: Path) -> Dict:
    """Run a daemon's start command in holder `host` (it forks the daemon
    and returns; its early complaints go to `log`); the daemon's record
    {pid, start, host} once it wrote `pidfile`."""
    full, env, cpus = enter_command(state, host, argv)
    with open(log, "ab") as out:
        try:
            p = subprocess.run(full, env=slurm_env(state, env), cwd="/",
                               stdin=subprocess.DEVNULL, stdout=out,
                               stderr=out, timeout=START_TIMEOUT_S,
                               preexec_fn=lambda: os.sched_setaffinity(0,
                                                                       cpus))
        except subprocess.TimeoutExpired:
            raise ClusterFailure(f"{Path(argv[0]).name} on {host} did not "
                                 f"start within {START_TIMEOUT_S:.0f} s")
    if p.returncode != 0:
        raise ClusterFailure(f"{Path(argv[0]).name} on {host} failed: "
                             f"{last_line(log) or f'exit {p.returncode}'}")
    return _daemon_record(pidfile, host)


def _daemon_record(pidfile: Path, host: str, timeout_s: float = 10.0
                   ) -> Dict:
    """{pid, start, host} of the daemon that writes `pidfile`, once it
    has."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = None
        start = procfs.start_time(pid) if pid else None
        if start is not None:
            return {"pid": pid, "start": start, "host": host}
        if time.monotonic() > deadline:
            raise ClusterFailure(f"{pidfile.name[:-4]} on {host} wrote no "
                                 f"pid file ({pidfile})")
        time.sleep(0.05)


def holder_daemon_alive(rec: Dict) -> bool:
    return rec.get("pid") is not None and \
        procfs.start_time(rec["pid"]) == rec.get("start")


class Nodes:
    """The nodes of namespace instances: slurmd in each instance's
    namespaces, reading the host's files (they see the state dir)."""

    ready_timeout_s = 60.0
    leave_notices = True

    def prepare(self, state: Dict, paths: SlurmPaths) -> None:
        pass

    def start(self, state: Dict, paths: SlurmPaths, host: str
              ) -> Dict[str, Dict]:
        name = f"slurmd-{host}"
        return {name: start_in_holder(state, host,
                                      [binary("slurmd"), "-N", host],
                                      paths.log(name), paths.pidfile(name))}

    def alive(self, state: Dict, rec: Dict) -> bool:
        return holder_daemon_alive(rec)

    def log_line(self, state: Dict, paths: SlurmPaths, node: str) -> str:
        return last_line(paths.log(f"slurmd-{node}"))

    def workdir(self, cwd: Optional[str]) -> str:
        return working_dir(cwd)

    def task_settings(self, state: Dict) -> Dict:
        # this checkout's build: the instances see the host's files
        return {"site_env": {}, "installed": False}

    def mpi_env(self, state: Dict, name: str) -> Dict[str, str]:
        """conf.job_mpi_env of MPI `name` for these nodes' tasks."""
        return job_mpi_env(name, topology_from_dict(state["topology"]),
                           **self.task_settings(state))

    def check_placement(self, command: str, hosts: Sequence[str]) -> None:
        pass

    def attach_job(self, state: Dict, job: int, nodes: Sequence[str],
                   sockets: Dict[int, str]) -> str:
        return ""

    def detach_job(self, state: Dict, job: int, nodes: Sequence[str]
                   ) -> Tuple[str, List[str]]:
        n = end_orphans(state, job, nodes, self)
        return "{regions} removed" + (
            f"; ended {n} processes on nodes whose slurmd is gone"
            if n else ""), []


def _of_job(pid: int, job: int) -> bool:
    """A task of Slurm job `job` (its environment says so), or its
    slurmstepd ("slurmstepd: [JOB.STEP]")."""
    argv = procfs.cmdline(pid)
    if argv and argv[0].startswith(f"slurmstepd: [{job}."):
        return True
    return holder.carries(pid, f"SLURM_JOB_ID={job}")


def end_orphans(state: Dict, job: int, nodes: Sequence[str], kind: Nodes,
                grace_s: float = 1.0) -> int:
    """Kill job `job`'s processes on those of `nodes` (namespace
    instances) whose slurmd is not alive; how many."""
    daemons = state["slurm"].get("daemons", {})
    victims: List[int] = []
    for node in nodes:
        rec = daemons.get(f"slurmd-{node}")
        ns = state.get("namespaces", {}).get(node)
        if rec is None or not ns or kind.alive(state, rec):
            continue
        # While the instance's holder lives, its namespace is certainly
        # the instance's; a gone holder's inode number may be another's
        # by now, so then only processes that say they are the
        # cluster's (slurmstepd, with an empty environment, does not).
        rec_holder = state.get("holders", {}).get(node)
        alive = rec_holder is not None and \
            holder.Holder.from_dict(rec_holder).alive()
        inside = holder.processes_in({"net": {ns["net"]}},
                                     cluster=None if alive else state["name"])
        victims += [pid for pid in inside if _of_job(pid, job)]
    if victims:
        procfs.kill_pids(sorted(set(victims)), grace_s)
    return len(set(victims))


def paths(state: Dict) -> SlurmPaths:
    if state.get("scheduler") != "slurm":
        raise ClusterError(f"cluster '{state['name']}' runs no Slurm (bring "
                           f"it up with Slurm as its scheduler)")
    return SlurmPaths(Path(state["slurm"]["dir"]))


def head_command(state: Dict, argv: Sequence[str]
                 ) -> Tuple[List[str], Dict[str, str], List[int]]:
    """(argv, env, cpus) running a Slurm command in the head node."""
    paths(state)
    full, env, cpus = enter_command(state, HEAD_HOSTNAME, argv)
    return full, slurm_env(state, env), cpus


def query(state: Dict, argv: Sequence[str],
          timeout_s: float = CLIENT_TIMEOUT_S) -> str:
    """The output of a Slurm command (sinfo, scontrol, squeue) run in
    the head node; ClusterFailure with its last line if it fails."""
    full, env, _ = head_command(state, argv)
    try:
        p = subprocess.run(full, env=env, cwd="/", stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterFailure(f"{argv[0]} did not answer in {timeout_s:.0f} s")
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        raise ClusterFailure(f"{' '.join(argv[:2])}: "
                             f"{lines[-1] if lines else p.returncode}")
    return p.stdout
