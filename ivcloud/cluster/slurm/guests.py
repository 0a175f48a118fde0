"""slurmd in the guests of a VM cluster (`cluster up --instance-kind vm
--scheduler slurm`; docs/cluster.md, "Slurm on VM clusters").

munged and slurmctld run in the head node as for namespace instances.
A guest sees none of the host's files, so each gets, through its
command agent, copies of what its own munged and slurmd read (conf.py's
files and the cluster's munge key, private to the guest's munge user).
munged then runs as that user and `slurmd -N HOST` as root (the image's
own units are masked: ivcloud/vm/debian.py). They end with their guest;
state.json records each one's pid in its guest ("guest": true), so that
`status` and the epilog ask the guest whether it lives.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import ClusterError, ClusterFailure, IvcloudError
from ...vm import agent
from .. import vm_instance
from . import guest_regions
from ..topology import (HEAD_ADDRESS, HEAD_HOSTNAME, SUBNET,
                        topology_from_dict)
from .conf import (GUEST_CGROUP_CONF, SlurmPaths,
                   guest_task_prolog_text, task_env)
from .nodes import Nodes, holder_daemon_alive

# how long one agent command of the start may take in a TCG guest
AGENT_TIMEOUT_S = 120.0
# the guest image's (Debian's) account of munged
MUNGE_USER = "munge"


class GuestNodes(Nodes):
    """The nodes of QEMU guests: munged and slurmd in each guest with
    copies of their files, a job's device hot-plugged into its guests
    (guest_regions.py)."""

    # slurmd in a TCG guest on a loaded host: registration and its first
    # pings take many times longer
    ready_timeout_s = 300.0
    leave_notices = guest_regions.LEAVE_NOTICES

    def workdir(self, cwd: Optional[str]) -> str:
        # a guest sees none of the host's directories: its /tmp, where
        # the guests' jobs start too (vm_instance.run_launcher)
        return "/tmp"

    def task_settings(self, state: Dict) -> Dict:
        # the guests' packages, the MPI prefixes shared with them, their
        # accelerator's settings, TCP on the cluster's subnet
        return {"site_env": vm_instance.rank_env(state), "installed": True,
                "interface": SUBNET,
                "shared": vm_instance.shared_dirs(state)}

    def check_placement(self, command: str, hosts: Sequence[str]) -> None:
        if hosts and command == "sbatch":
            # the batch script's own sruns would read the hostfile in a
            # guest, which has no copy of it
            raise ClusterError("a batch job placed by task list needs "
                               "namespace instances (in a VM cluster, place "
                               "each srun step instead)", setting="hosts")

    def attach_job(self, state: Dict, job: int, nodes: Sequence[str],
                   sockets: Dict[int, str]) -> str:
        devices = guest_regions.plug(state, job, nodes, sockets)
        return "; devices " + ", ".join(f"{h} {a}" for h, a in
                                        sorted(devices.items()))

    def detach_job(self, state: Dict, job: int, nodes: Sequence[str]
                   ) -> Tuple[str, List[str]]:
        ended = self._end_job(state, job, nodes)
        gone = (f"; ended the job's processes on {', '.join(ended)}, whose "
                f"slurmd is gone" if ended else "")
        return (f"devices and {{regions}} removed{gone}",
                guest_regions.unplug(state, job, nodes))

    @staticmethod
    def guest_files(paths: SlurmPaths) -> List[Path]:
        """The host's copies of the files only guests read (their own
        directory: put_files keeps a file's name, and cgroup.conf beside the
        namespace instances' slurm.conf would be read there too)."""
        d = paths.root / "guest"
        return [d / paths.task_prolog.name, d / "cgroup.conf"]

    def prepare(self, state: Dict, paths: SlurmPaths) -> None:
        """The guests' task prolog and cgroup.conf, once the guests are
        booted (the task's settings depend on their accelerator)."""
        env = task_env(topology_from_dict(state["topology"]),
                       **self.task_settings(state))
        prolog, cgroup = self.guest_files(paths)
        prolog.parent.mkdir(mode=0o755, exist_ok=True)
        prolog.write_text(guest_task_prolog_text(env, guest_regions.JOB_DIR))
        prolog.chmod(0o755)
        cgroup.write_text(GUEST_CGROUP_CONF)

    @staticmethod
    def _run(state: Dict, host: str, script: str) -> str:
        try:
            return vm_instance.shell_in(state, host, script, AGENT_TIMEOUT_S)
        except ClusterFailure:
            raise
        except IvcloudError as e:     # no such guest, its agent is gone
            raise ClusterFailure(f"guest {host}: {e}")

    def start(self, state: Dict, paths: SlurmPaths, host: str
              ) -> Dict[str, Dict]:
        """munged and slurmd in guest `host`; their records ({name: {pid,
        host, guest}}) for state.json."""
        q = agent.quote
        # munged's files: all in the munge directory, which its user owns
        # (the head's munged, root, keeps its pid and log with the other
        # daemons')
        d = paths.munge_dir
        m = {"socket": str(paths.munge_socket), "key": str(paths.munge_key),
             "pid": str(d / "munged.pid"), "seed": str(d / "munged.seed"),
             "log": str(d / "munged.log")}
        self._run(state, host,
             f"mkdir -p {q([paths.root, paths.log_dir, paths.pid_dir])} && "
             f"mkdir -p -m 0700 {q([paths.munge_dir])} && "
             # slurmctld's name, for the daemons' messages (slurm.conf gives
             # its address)
             f"(grep -q '[[:space:]]{HEAD_HOSTNAME}$' /etc/hosts || "
             f"echo '{HEAD_ADDRESS} {HEAD_HOSTNAME}' >> /etc/hosts)")
        vm_instance.put_files(state, host, [paths.conf, paths.topology,
                                            paths.mpi_conf, *self.guest_files(paths)],
                              str(paths.root))
        # into a directory only root may enter until the key is munge's 0400
        vm_instance.put_files(state, host, [paths.munge_key],
                              str(paths.munge_dir))
        pidfile = paths.pidfile(f"slurmd-{host}")
        slurmd_log = paths.log(f"slurmd-{host}")
        out = self._run(state, host, "\n".join([
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

    def alive(self, state: Dict, rec: Dict) -> bool:
        """Whether the daemon of `rec` runs: in its guest (False when the
        guest is gone or does not answer), or in the head node."""
        if not rec.get("guest"):
            return holder_daemon_alive(rec)
        try:
            r = vm_instance.exec_in(state, rec["host"], [
                "kill", "-0", str(rec["pid"])], 30)
        except IvcloudError:
            return False
        return r.ok

    def log_line(self, state: Dict, paths: SlurmPaths, node: str) -> str:
        """The last line of node `node`'s slurmd log, in its guest."""
        try:
            r = vm_instance.exec_in(state, node, [
                "tail", "-n", "1", str(paths.log(f"slurmd-{node}"))], 30)
        except IvcloudError:
            return ""
        return " ".join(r.output.split()) if r.ok else ""

    def _end_job(self, state: Dict, job: int, nodes: Sequence[str]) -> List[str]:
        """Kill job `job`'s processes (its tasks, which carry SLURM_JOB_ID,
        and its slurmstepd) in those of `nodes` whose guest lives but whose
        slurmd does not, which would have ended them; the nodes where it
        did."""
        daemons = state["slurm"].get("daemons", {})
        done = []
        for node in nodes:
            rec = daemons.get(f"slurmd-{node}")
            if rec is None or not rec.get("guest") or self.alive(state, rec):
                continue
            script = (f"for d in /proc/[0-9]*; do "
                      f"if tr '\\0' '\\n' < $d/environ 2>/dev/null | "
                      f"grep -qx 'SLURM_JOB_ID={job}' || "
                      f"grep -qs '^slurmstepd: \\[{job}\\.' $d/cmdline; "
                      f"then kill -KILL ${{d#/proc/}} 2>/dev/null; fi; done; true")
            # its guest may have gone meanwhile: nothing of the job is left
            with contextlib.suppress(IvcloudError):
                vm_instance.exec_in(state, node, ["sh", "-c", script], 60)
                done.append(node)
        return done
