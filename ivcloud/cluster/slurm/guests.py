"""slurmd in the guests of a VM cluster (`cluster up --instance-kind vm
--scheduler slurm`).

munged and slurmctld run in the head node as for namespace instances
(daemons.py). A guest sees none of the host's files, so each is given,
through its command agent (vm_instance.put_files and exec_in), copies
of what its own munged and slurmd read, at the paths slurm.conf names
(STATE_DIR/slurm/... inside the guest's file system, a snapshot that
goes with the guest): slurm.conf, topology.conf, mpi.conf, the guests'
task prolog (conf.guest_task_prolog_text over
conf.task_env, the settings the Open MPI flavour gives ranks in guests,
and the job's own device: guest_regions.py), their cgroup.conf
(conf.guest_cgroup_conf_text) and the cluster's munge key, private to the guest's munge user
as munged requires. Then munged runs as that user and `slurmd -N HOST`
as root, both with the cluster's files: the image's own units of them
are masked (ivcloud/vm/debian.py).

Nothing of this is on the host, so nothing can leak there: the daemons
end with their guest, which `down` stops. state.json records each
daemon's pid in its guest, with "guest": true, so that `status` and the
epilog ask the guest whether it lives.

Jobs run as the user who submits them, root in the head node, so their
tasks are root in the guests, as in namespace instances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

from ...errors import ClusterFailure, IvcloudError
from ...vm import agent
from .. import vm_instance
from . import guest_regions
from ..topology import (HEAD_ADDRESS, HEAD_HOSTNAME, SUBNET,
                        topology_from_dict)
from .conf import (SlurmPaths, guest_cgroup_conf_text,
                   guest_task_prolog_text, task_env)

# how long one agent command of the start may take in a TCG guest
AGENT_TIMEOUT_S = 120.0
# the guest image's (Debian's) account of munged
MUNGE_USER = "munge"


def guest_files(paths: SlurmPaths) -> List[Path]:
    """The host's copies of the files only guests read (their own
    directory: put_files keeps a file's name, and cgroup.conf beside the
    namespace instances' slurm.conf would be read there too)."""
    d = paths.root / "guest"
    return [d / paths.task_prolog.name, d / "cgroup.conf"]


def write_files(state: Dict, paths: SlurmPaths) -> None:
    """The guests' task prolog and cgroup.conf, once the guests are
    booted (the task's settings depend on their accelerator)."""
    env = task_env(topology_from_dict(state["topology"]),
                   vm_instance.rank_env(state), installed=True,
                   interface=SUBNET)
    prolog, cgroup = guest_files(paths)
    prolog.parent.mkdir(mode=0o755, exist_ok=True)
    prolog.write_text(guest_task_prolog_text(env, guest_regions.JOB_DIR))
    prolog.chmod(0o755)
    cgroup.write_text(guest_cgroup_conf_text())


def _munge_files(paths: SlurmPaths) -> Dict[str, str]:
    """munged's files in a guest: all in the munge directory, which its
    user owns (the head's munged, root, keeps its pid and log with the
    other daemons')."""
    d = paths.munge_dir
    return {"socket": str(paths.munge_socket), "key": str(paths.munge_key),
            "pid": str(d / "munged.pid"), "seed": str(d / "munged.seed"),
            "log": str(d / "munged.log")}


def _run(state: Dict, host: str, script: str) -> str:
    try:
        r = vm_instance.exec_in(state, host, ["sh", "-c", script],
                                AGENT_TIMEOUT_S)
    except IvcloudError as e:
        raise ClusterFailure(f"guest {host}: {e}")
    if not r.ok:
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        raise ClusterFailure(f"guest {host}: "
                             f"{lines[-1] if lines else f'exit {r.status}'}")
    return r.output


def start_node(state: Dict, paths: SlurmPaths, host: str) -> Dict[str, Dict]:
    """munged and slurmd in guest `host`; their records ({name: {pid,
    host, guest}}) for state.json."""
    q = agent.quote
    m = _munge_files(paths)
    _run(state, host,
         f"mkdir -p {q([paths.root, paths.log_dir, paths.pid_dir])} && "
         f"mkdir -p -m 0700 {q([paths.munge_dir])} && "
         # slurmctld's name, for the daemons' messages (slurm.conf gives
         # its address)
         f"(grep -q '[[:space:]]{HEAD_HOSTNAME}$' /etc/hosts || "
         f"echo '{HEAD_ADDRESS} {HEAD_HOSTNAME}' >> /etc/hosts)")
    vm_instance.put_files(state, host, [paths.conf, paths.topology,
                                        paths.mpi_conf, *guest_files(paths)],
                          str(paths.root))
    # into a directory only root may enter until the key is munge's 0400
    vm_instance.put_files(state, host, [paths.munge_key],
                          str(paths.munge_dir))
    pidfile = paths.pidfile(f"slurmd-{host}")
    slurmd_log = paths.log(f"slurmd-{host}")
    out = _run(state, host, "\n".join([
        "set -e",
        f"chown {MUNGE_USER}: {q([m['key']])} {q([paths.munge_dir])}",
        f"chmod 0400 {q([m['key']])}",
        f"chmod 0755 {q([paths.munge_dir])}",
        # a daemon that does not start says why at the end of its log
        # (slurmd's last line only says that it failed)
        f"runuser -u {MUNGE_USER} -- munged --socket={q([m['socket']])} "
        f"--key-file={q([m['key']])} --pid-file={q([m['pid']])} "
        f"--seed-file={q([m['seed']])} --log-file={q([m['log']])} || "
        f"{{ echo munged: $(tail -n 1 {q([m['log']])}); exit 1; }}",
        f"SLURM_CONF={q([paths.conf])} slurmd -f {q([paths.conf])} "
        f"-N {q([host])} || "
        f"{{ echo slurmd: $(tail -n 3 {q([slurmd_log])}); exit 1; }}",
        # slurmd writes its pid file once it has detached
        "i=0",
        f"while [ ! -s {q([pidfile])} ] && [ $i -lt 300 ]; do "
        f"sleep 0.1; i=$((i+1)); done",
        f"echo munged $(cat {q([m['pid']])})",
        f"echo slurmd $(cat {q([pidfile])})"]))
    pids = dict(line.split()[:2] for line in out.splitlines()
                if len(line.split()) == 2)
    recs = {}
    for daemon in ("munged", "slurmd"):
        if not pids.get(daemon, "").isdigit():
            raise ClusterFailure(f"{daemon} in guest {host} wrote no pid "
                                 f"file")
        recs[f"{daemon}-{host}"] = {"pid": int(pids[daemon]), "host": host,
                                    "guest": True}
    return recs


def alive(state: Dict, rec: Dict) -> bool:
    """Whether the guest daemon of `rec` runs (False when its guest is
    gone or does not answer)."""
    try:
        r = vm_instance.exec_in(state, rec["host"], [
            "kill", "-0", str(rec["pid"])], 30)
    except IvcloudError:
        return False
    return r.ok


def last_log_line(state: Dict, paths: SlurmPaths, node: str) -> str:
    """The last line of node `node`'s slurmd log, in its guest."""
    try:
        r = vm_instance.exec_in(state, node, [
            "tail", "-n", "1", str(paths.log(f"slurmd-{node}"))], 30)
    except IvcloudError:
        return ""
    return " ".join(r.output.split()) if r.ok else ""


def end_job(state: Dict, job: int, nodes: Sequence[str]) -> List[str]:
    """Kill job `job`'s processes (its tasks, which carry SLURM_JOB_ID,
    and its slurmstepd) in those of `nodes` whose guest lives but whose
    slurmd does not, which would have ended them; the nodes where it
    did."""
    daemons = state["slurm"].get("daemons", {})
    done = []
    for node in nodes:
        rec = daemons.get(f"slurmd-{node}")
        if rec is None or not rec.get("guest") or alive(state, rec):
            continue
        script = (f"for d in /proc/[0-9]*; do "
                  f"if tr '\\0' '\\n' < $d/environ 2>/dev/null | "
                  f"grep -qx 'SLURM_JOB_ID={job}' || "
                  f"grep -qs '^slurmstepd: \\[{job}\\.' $d/cmdline; "
                  f"then kill -KILL ${{d#/proc/}} 2>/dev/null; fi; done; true")
        try:
            vm_instance.exec_in(state, node, ["sh", "-c", script], 60)
            done.append(node)
        except IvcloudError:
            pass   # its guest went meanwhile: nothing of the job is left
    return done
