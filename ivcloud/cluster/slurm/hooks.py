"""Slurm's PrologSlurmctld and EpilogSlurmctld: a region of the job's
own on each server it uses, for exactly the job's life.

    python -m ivcloud.cluster.slurm.hooks prolog|epilog --state-dir DIR

slurmctld runs the prolog (in the head node, once per job, with the
job's id and node list in SLURM_JOB_ID and SLURM_JOB_NODELIST) before
it lets the job start, and the epilog once the job ended, however it
ended. The prolog starts an ivshmem-server per emulated server that one
of the job's nodes is on (jobs.start_regions, named after the job:
jobs.slurm_job_key); a failure fails the job before any rank started.
The task prolog (conf.task_prolog_text) hands each task its server's
socket. The epilog stops those servers. Why the controller's hooks
rather than each node's Prolog/Epilog or a SPANK plugin: docs/cluster.md,
"Slurm".

A VM cluster's jobs get the same servers, and in each of the job's
guests a device on its server's one, hot-plugged by the prolog and
unplugged by the epilog (guest_regions.py); the guests' task prolog
names that device to the BTL. The epilog also ends the job's processes
in guests whose slurmd died (guests.end_job), before it unplugs: a rank
left holding the device would keep the guest from giving it back.

A node whose slurmd died (killed, or its instance gone) runs no epilog
and cannot end the job's tasks: its slurmstepd and tasks would live on,
still holding the job's region. So the epilog also ends, on each of the
job's nodes whose slurmd is no longer alive, the processes of that job
(those in the instance's namespaces carrying SLURM_JOB_ID=ID, and its
slurmstepd), as the cloud would power such a node off.

Each run appends one line to slurm/log/hooks.log; exit status 0 when
all went well (a prolog's non-zero status makes slurmctld cancel the
job: JobRequeue=0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ... import procfs
from ...errors import IvcloudError
from .. import holder, jobs
from ..state import StateDir, load
from . import guest_regions, guests
from .daemons import binary, daemon_alive, runs_in_guests


def expand_nodelist(state: Dict, nodelist: str) -> List[str]:
    """Slurm's hostlist expression (s0i[0-1],s1i0) as node names, by
    Slurm's own `scontrol show hostnames`."""
    if not nodelist:
        return []
    p = subprocess.run([binary("scontrol"), "show", "hostnames", nodelist],
                       env={**os.environ, "SLURM_CONF": state["slurm"]["conf"]},
                       stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=30)
    if p.returncode != 0:
        raise IvcloudError(f"cannot expand node list '{nodelist}': "
                           f"{p.stderr.strip()}")
    return p.stdout.split()


def servers_of(state: Dict, nodes: Sequence[str]) -> List[int]:
    return sorted({state["instances"][n]["server"] for n in nodes
                   if n in state["instances"]})


def prolog(state: Dict, job: int, nodes: Sequence[str]) -> str:
    servers = servers_of(state, nodes)
    key = jobs.slurm_job_key(job)
    in_guests = runs_in_guests(state)
    # a guest's device could not be unplugged after a leave notice
    # (docs/server-protocol.md, "Quiet leaves")
    sockets = jobs.start_regions(state, key, servers,
                                 leave_notices=not in_guests)
    if not in_guests:
        return f"regions on servers {servers}"
    try:
        devices = guest_regions.plug(state, job, nodes, sockets)
    except BaseException:
        jobs.stop_regions(state, key, servers)   # the plug's error counts
        raise
    return (f"regions on servers {servers}; devices "
            + ", ".join(f"{h} {a}" for h, a in sorted(devices.items())))


def epilog(state: Dict, job: int, nodes: Sequence[str]) -> str:
    servers = servers_of(state, nodes)
    problems: List[str] = []
    if runs_in_guests(state):
        ended = guests.end_job(state, job, nodes)
        gone = (f"; ended the job's processes on {', '.join(ended)}, whose "
                f"slurmd is gone" if ended else "")
        problems += guest_regions.unplug(state, job, nodes)
        what = f"devices and regions on servers {servers} removed{gone}"
    else:
        ended_n = end_orphans(state, job, nodes)
        what = (f"regions on servers {servers} removed"
                + (f"; ended {ended_n} processes on nodes whose slurmd is "
                   f"gone" if ended_n else ""))
    problems += jobs.stop_regions(state, jobs.slurm_job_key(job), servers)
    if problems:
        raise IvcloudError("; ".join(problems))
    return what


def _of_job(pid: int, job: int) -> bool:
    """A task of Slurm job `job` (its environment says so), or its
    slurmstepd ("slurmstepd: [JOB.STEP]")."""
    argv = procfs.cmdline(pid)
    if argv and argv[0].startswith(f"slurmstepd: [{job}."):
        return True
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"SLURM_JOB_ID={job}".encode() in env


def end_orphans(state: Dict, job: int, nodes: Sequence[str],
                grace_s: float = 1.0) -> int:
    """Kill job `job`'s processes on those of `nodes` whose slurmd is
    not alive; how many."""
    daemons = state["slurm"].get("daemons", {})
    victims: List[int] = []
    for node in nodes:
        rec = daemons.get(f"slurmd-{node}")
        ns = state.get("namespaces", {}).get(node)
        if rec is None or not ns or daemon_alive(state, rec):
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


HOOKS = {"prolog": prolog, "epilog": epilog}


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] not in HOOKS or args[1] != "--state-dir":
        sys.stderr.write("usage: python -m ivcloud.cluster.slurm.hooks "
                         "prolog|epilog --state-dir DIR\n")
        return 2
    hook, state_dir = args[0], Path(args[2])
    t0 = time.monotonic()
    job = os.environ.get("SLURM_JOB_ID", "?")
    try:
        sd = StateDir(state_dir.name[len("cluster-"):], state_dir.parent)
        state = load(sd)
        if state is None:
            raise IvcloudError(f"no cluster state in {state_dir}")
        nodes = expand_nodelist(state,
                                os.environ.get("SLURM_JOB_NODELIST", ""))
        what = HOOKS[hook](state, int(job), nodes)
        ok = True
    except (IvcloudError, ValueError, OSError,
            subprocess.SubprocessError) as e:
        what, ok = f"failed: {' '.join(str(e).split())}", False
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {hook} job {job}: {what} "
          f"({time.monotonic() - t0:.2f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
