"""A Slurm node of a VM cluster while its guest migrates (docs/cluster.md,
"Migration"): drained in Slurm for the move, so that no job starts on it
meanwhile (a job's prolog would plug the job's device into a QEMU that
is about to go), and resumed after, unless it was drained or down before.

A job that runs on the node has a region of its own on the guest's
server, plugged by the controller's prolog for the job's life
(guest_regions): the move takes the job's ranks in the guest off it
(the provider's drain), gives the job a region of its own on the new
server and the guest a device on it (migrate.py); a job whose ranks
cannot leave a region (the Open MPI BTL), or one being set up or
ending, keeps the guest where it is.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

from ...errors import ClusterFailure
from .nodes import binary, query

# what `scontrol update` records as the reason of a node drained for a
# move: a node that still has it after the move (a migration killed in
# between) is taken as the next migration's own and resumed after it
REASON = "ivcloud migrate"


def node_state(state: Dict, node: str) -> tuple:
    """(Slurm's state of `node`, the reason it is drained or down)."""
    out = query(state, [binary("sinfo"), "--noheader", "--Node",
                         f"--nodes={node}", "--format=%T|%E"])
    line = (out.strip().splitlines() or ["|"])[0]
    st, _, reason = line.partition("|")
    return st.strip().lower(), reason.strip()


def job_list(state: Dict, node: str) -> List[Tuple[int, str, str, str]]:
    """The jobs that slurmctld has on `node` (being set up, running,
    suspended or completing): (id, Slurm's state of it (CF, R, S, CG),
    "Slurm job ID (NAME, user USER)", its node list as Slurm writes
    it)."""
    out = query(state, [binary("squeue"), "--noheader", f"--nodelist={node}",
                         "--states=CF,R,S,CG", "--format=%i|%t|%N|%j|%u"])
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5 and parts[0].isdigit():
            jobs.append((int(parts[0]), parts[1],
                         f"Slurm job {parts[0]} ({parts[3]}, user "
                         f"{parts[4]})", parts[2]))
    return jobs


def job_nodes(state: Dict, nodelist: str) -> List[str]:
    """Slurm's node list expression (s0i[0-1],s1i0) as node names."""
    return query(state, [binary("scontrol"), "show", "hostnames",
                         nodelist]).split() if nodelist else []


def _update(state: Dict, node: str, *settings: str) -> None:
    query(state, [binary("scontrol"), "update", f"NodeName={node}",
                   *settings])


@contextlib.contextmanager
def held(state: Dict, node: str, say) -> Iterator[None]:
    """Node `node` drained in Slurm for the block (no new job starts on
    it; its running jobs run on), resumed after it however it ends,
    unless someone else drained it or it was down before."""
    st, reason = node_state(state, node)
    ours = reason == REASON   # a killed migration's: resumed after this one
    if not ours and (st.startswith("drain") or st.startswith("down")
                     or st.startswith("fail")):
        say(f"slurm: node {node} is {st} already; left so")
        yield
        return
    if not ours:
        _update(state, node, "State=DRAIN", f"Reason={REASON}")
    try:
        yield
    finally:
        try:
            _update(state, node, "State=RESUME")
        except ClusterFailure as e:   # the move's own error is the one
            say(f"slurm: node {node} not resumed: {e} (`scontrol update "
                f"NodeName={node} State=RESUME` in the head node)")
