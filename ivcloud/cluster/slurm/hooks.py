"""Slurm's PrologSlurmctld and EpilogSlurmctld: a region of the job's
own on each server it uses, for exactly the job's life.

    python -m ivcloud.cluster.slurm.hooks prolog|epilog --state-dir DIR

The prolog (in the head node, before the job starts) starts a server
of the job's own on each emulated server its nodes are on; the epilog,
once the job ended however it ended, stops them. What they do in the
nodes beyond that is the instance kind's (nodes.py). Why the
controller's hooks, and the failure cases: docs/cluster.md, "Slurm".

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

from ...errors import IvcloudError
from .. import kinds, regions
from ..state import StateDir, load
from .nodes import binary


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
    key = regions.slurm_job_key(job)
    kind = kinds.of_state(state).slurm_nodes()
    sockets = regions.start_regions(state, key, servers,
                                    leave_notices=kind.leave_notices)
    try:
        more = kind.attach_job(state, job, nodes, sockets)
    except BaseException:
        regions.stop_regions(state, key, servers)   # the plug's error counts
        raise
    return f"regions on servers {servers}{more}"


def epilog(state: Dict, job: int, nodes: Sequence[str]) -> str:
    what, problems = kinds.of_state(state).slurm_nodes().detach_job(
        state, job, nodes)
    # where the job's nodes are now, and wherever else the job has a
    # region: a guest of a VM cluster that moved under the job (`cluster
    # migrate`) took the job's region to its new server, and a move
    # killed half-way may have left one on a server none of them is on
    key = regions.slurm_job_key(job)
    state = load(StateDir.of(Path(state["dir"]))) or state
    servers = sorted(set(servers_of(state, nodes)) |
                     set(regions.servers_with(state, key)))
    problems += regions.stop_regions(state, key, servers)
    if problems:
        raise IvcloudError("; ".join(problems))
    return what.format(regions=f"regions on servers {servers}")


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
        sd = StateDir.of(state_dir)
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
