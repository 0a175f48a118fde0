"""The Slurm configuration of a cluster, as text: slurm.conf,
topology.conf, the task prolog, the hook wrappers. Pure functions of the
cluster's topology and paths; nothing here starts or writes anything
(daemons.py does).

Every path Slurm and munge use is under the cluster's state directory
(SlurmPaths), but for slurmd's spool, which is /tmp/slurmd: each
instance has a /tmp of its own, as a node has a local disk, and it goes
away with the instance. Daemons run as root (SlurmUser=root): no
account is made.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ... import mpis
from ...errors import ClusterError
from ..regions import SLURM_JOB_KEY_PREFIX, job_server_paths, slurm_job_key
from ..state import below
from ..topology import HEAD_ADDRESS, HEAD_HOSTNAME, ClusterTopology

# each instance's own /tmp (holder.py): local to the node, gone with it
SPOOL_DIR = "/tmp/slurmd"
PARTITION = "cloud"
TOPOLOGIES = ("tree", "flat")
# Seconds before slurmctld sets a silent slurmd's node DOWN and ends its
# jobs (it pings every third of this); MessageTimeout stays Slurm's 10.
SLURMD_TIMEOUT_S = 10
# Seconds between SIGTERM and SIGKILL of a job's tasks at its end, and
# before an allocation whose srun died is given up.
KILL_WAIT_S = 5
INACTIVE_LIMIT_S = 30


@dataclass(frozen=True)
class SlurmPaths:
    """STATE_DIR/slurm/: what the head node and every instance see."""
    root: Path

    conf = below("root", "slurm.conf")
    topology = below("root", "topology.conf")
    mpi_conf = below("root", "mpi.conf")     # read from beside slurm.conf
    munge_dir = below("root", "munge")
    munge_key = below("munge_dir", "munge.key")
    munge_socket = below("munge_dir", "munge.socket")
    ctld_state = below("root", "ctld")
    log_dir = below("root", "log")
    pid_dir = below("root", "run")
    jobs_dir = below("root", "jobs")     # hostfiles of jobs given a rankfile
    task_prolog = below("root", "task-prolog")
    prolog = below("root", "prolog-slurmctld")
    epilog = below("root", "epilog-slurmctld")

    def pidfile(self, daemon: str) -> Path:
        """munged, slurmctld, or slurmd-NODE."""
        return self.pid_dir / f"{daemon}.pid"

    def log(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"


def cluster_name(name: str) -> str:
    """Slurm's ClusterName: lower case (Slurm maps upper case silently,
    which would surprise), letters, digits and '_'."""
    return re.sub(r"[^a-z0-9_]", "_", name.lower())


def slurm_conf_text(topo: ClusterTopology, paths: SlurmPaths,
                    time_slice_s: int = 0) -> str:
    """slurm.conf. Nodes are the instances (NodeName = hostname, its
    address, vCPUs as CPUs: SlurmdParameters=config_overrides makes
    slurmd report these, not the host's). No cgroups (nested ones may
    not be usable here): processes tracked by their parentage
    (proctrack/linuxproc), no task binding (an instance's affinity is
    its vCPU set already). time_slice_s > 0: gang scheduling, two jobs
    per CPU taking turns (docs/operators.md, "Slurm")."""
    p = paths
    lines = [
        "# the emulated cluster's Slurm (ivcloud/cluster/slurm/conf.py)",
        f"ClusterName={cluster_name(topo.name)}",
        f"SlurmctldHost={HEAD_HOSTNAME}({HEAD_ADDRESS})",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={p.munge_socket}",
        "CredType=cred/munge",
        f"StateSaveLocation={p.ctld_state}",
        f"SlurmdSpoolDir={SPOOL_DIR}",
        f"SlurmctldPidFile={p.pidfile('slurmctld')}",
        f"SlurmdPidFile={p.pid_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={p.log('slurmctld')}",
        f"SlurmdLogFile={p.log_dir}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "MpiDefault=pmix",
        "TopologyPlugin=topology/tree",
        "ReturnToService=2",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        f"KillWait={KILL_WAIT_S}",
        f"InactiveLimit={INACTIVE_LIMIT_S}",
        "JobRequeue=0",
        "MailProg=/bin/true",
        f"PrologSlurmctld={p.prolog}",
        f"EpilogSlurmctld={p.epilog}",
        f"TaskProlog={p.task_prolog}",
    ]
    oversubscribe = "NO"
    if time_slice_s:
        lines += ["PreemptMode=GANG", f"SchedulerTimeSlice={time_slice_s}"]
        oversubscribe = "FORCE:2"
    for inst in _boot_order(topo):
        lines.append(f"NodeName={inst.hostname} NodeAddr={inst.address} "
                     f"CPUs={topo.vcpus} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES "
                 f"MaxTime=INFINITE State=UP OverSubscribe={oversubscribe}")
    return "\n".join(lines) + "\n"


def _boot_order(topo: ClusterTopology):
    """The instances in the order a cloud spreading them over its
    servers starts them (s0i0, s1i0, s0i1, ...): nothing in Slurm's
    node list says which share a server; only topology.conf does."""
    return sorted(topo.instance_list(), key=lambda i: (i.index, i.server))


# mpi.conf: every PMIx fence over Slurm's ring; over its default tree a
# rank could leave MPI_Finalize, and exit, before a co-resident peer read
# its last message from the region (docs/cluster.md, "Slurm's PMIx
# fences")
MPI_CONF = ("# ivcloud/cluster/slurm/conf.py: fences over the ring, which\n"
            "# synchronises (the tree did not: see MPI_CONF)\n"
            "PMIxCollFence=ring\n")
# cgroup.conf of a VM cluster's guests: slurmd would ask systemd over
# D-Bus, which the image has not, for a scope for its cgroups, and not
# start without one (docs/cluster.md, "Slurm on VM clusters")
GUEST_CGROUP_CONF = (
    "# a VM cluster's guests (ivcloud/cluster/slurm/conf.py): no\n"
    "# D-Bus there; slurmd makes its cgroups itself\n"
    "IgnoreSystemd=yes\n")


def topology_conf_text(topo: ClusterTopology, shape: str = "tree") -> str:
    """topology.conf for the tree plugin. tree: a leaf switch per server
    over its instances, a top switch over the leaves, so that Slurm
    gives a job the fewest servers that hold it. flat: one switch over
    every instance, so that Slurm cannot tell servers apart (a
    topology-blind allocation, for comparison)."""
    if shape not in TOPOLOGIES:
        raise ClusterError(f"unknown Slurm topology '{shape}' (choose from "
                           f"{', '.join(TOPOLOGIES)})")
    if shape == "flat":
        nodes = ",".join(i.hostname for i in _boot_order(topo))
        return f"SwitchName=top Nodes={nodes}\n"
    lines = []
    for srv in topo.server_list():
        nodes = ",".join(i.hostname for i in topo.instance_list()
                         if i.server == srv.index)
        lines.append(f"SwitchName=s{srv.index} Nodes={nodes}")
    leaves = ",".join(f"s{s.index}" for s in topo.server_list())
    lines.append(f"SwitchName=top Switches={leaves}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- tasks

# The MPIs whose tasks find the job's region without options of their
# own (Flavor.in_task_prolog): every task gets the variables each one's
# flavour gives a rank started by somebody else (Flavor.task_env), so
# their keys must not collide. MPICH's tasks start with `srun
# --mpi=pmi2` (its PMI client speaks PMI-2), Open MPI's with --mpi=pmix.
# The others' jobs name theirs (job_mpi_env).
TASK_MPIS = tuple(n for n in mpis.NAMES if mpis.flavor(n).in_task_prolog)


def _task_launch(topo: ClusterTopology, site_env: Dict[str, str],
                 installed: bool, interface: Optional[str]) -> mpis.Launch:
    """The launch a task on an instance of `topo` is one rank of, over
    the ivshmem transport."""
    hosts = tuple((i.hostname, topo.vcpus) for i in topo.instance_list())
    return mpis.Launch(["task"], 1, transport="ivshmem", hosts=hosts,
                       installed=installed, interface=interface,
                       env=site_env)


def task_env(topo: ClusterTopology, site_env: Dict[str, str],
             installed: bool, interface: Optional[str] = None,
             shared: Sequence[str] = ()) -> Dict[str, str]:
    """The variables of TASK_MPIS for a task on an instance of `topo`
    over the ivshmem transport; installed: the instances are our guests
    (the MPIs their image has and those of the host directories they
    see, `shared`; the transports of their packages, not this
    checkout's build)."""
    launch = _task_launch(topo, site_env, installed, interface)
    env: Dict[str, str] = {}
    for name in TASK_MPIS:
        flavor = mpis.flavor(name)
        if not installed or flavor.guest_needs(shared) is None:
            env.update(flavor.task_env(launch))
    return env


def job_mpi_env(name: str, topo: ClusterTopology, site_env: Dict[str, str],
                installed: bool, interface: Optional[str] = None,
                shared: Sequence[str] = ()) -> Dict[str, str]:
    """What makes a job's tasks MPI `name`'s over the ivshmem transport
    (task_env's arguments), as variables of srun's or sbatch's
    environment, which Slurm hands to the tasks and which win over the
    TaskProlog's: the flavour's task_env and its PMI plugin
    (SLURM_MPI_TYPE, srun's default for --mpi). MpiFlavorError for an
    unknown MPI, ClusterError for one the instances lack."""
    flavor = mpis.flavor(name)
    if installed:
        need = flavor.guest_needs(shared)
        if need is not None:
            raise ClusterError(need, setting="mpi")
    launch = _task_launch(topo, site_env, installed, interface)
    return {"SLURM_MPI_TYPE": flavor.slurm_mpi, **flavor.task_env(launch)}


def task_prolog_text(topo: ClusterTopology, servers_dir: Path,
                     env: Dict[str, str]) -> str:
    """Slurm's TaskProlog, run before every task on its node: its
    `export` lines set the task's IVSHM_SOCKET, the socket of the job's
    region on the node's server (made by the PrologSlurmctld, hooks.py),
    and the MPI variables of `env` that the task does not set itself.
    A shell script, not Python: it runs once per task."""
    cases = []
    for srv in topo.server_list():
        nodes = "|".join(i.hostname for i in topo.instance_list()
                         if i.server == srv.index)
        # the socket job_server_paths gives slurm_job_key(ID)
        sample = job_server_paths(servers_dir, srv.name, srv.index,
                                  slurm_job_key(0))
        sock = (f"{sample.dir.parent}/{SLURM_JOB_KEY_PREFIX}${{SLURM_JOB_ID}}"
                f"s{srv.index}/{sample.socket.name}")
        cases.append(f'  {nodes}) echo "export IVSHM_SOCKET={sock}" ;;')
    lines = ["#!/bin/sh",
             "# Slurm TaskProlog (ivcloud/cluster/slurm/conf.py): the task's",
             "# region, and what its MPI needs to use it; a variable the",
             "# task sets itself wins.",
             'case "$SLURMD_NODENAME" in', *cases, "esac"]
    return "\n".join(lines + _export_unset(env)) + "\n"


# a guest's device by ivshm-bind's names of its settings (packaging/
# guest/ivshm-bind writes them): the BTL's parameter of each and the
# value given (an unknown position is -1: the BTL reads it from BAR0),
# and the provider's variable (docs/provider.md), given only when known
# (the provider reads what is missing from BAR0)
GUEST_DEVICE = (
    ("IVSHM_BAR2", "btl_ivshmem_region", "$val", "FI_IVSHM_REGION"),
    ("IVSHM_UIO", "btl_ivshmem_uio_dev", "$val", "FI_IVSHM_UIO_DEV"),
    ("IVSHM_BAR0", "btl_ivshmem_bar0", "$val", "FI_IVSHM_BAR0"),
    ("IVSHM_POSITION", "btl_ivshmem_position", "${val:--1}",
     "FI_IVSHM_POSITION"))


def guest_task_prolog_text(env: Dict[str, str], job_dir: str) -> str:
    """The TaskProlog of a VM cluster's guests: `env`, the settings of
    ranks in the guests (task_env, the flavours' settings), then the job's own
    device, which the controller's prolog plugged and whose ivshm-bind
    env file it copied to JOB_DIR/$SLURM_JOB_ID.env
    (guest_regions.py), in place of the guest's device of boot (on the
    standing region, which the guests' Open MPI defaults name, as the
    guest's ivshm.env does the provider's): the BTL's parameters and the
    provider's variables of it. A task without that file gets no
    ivshmem BTL, and the provider no region, rather than the standing
    region."""
    # every BTL parameter, empty too: the guests' Open MPI defaults name
    # the device of boot, whose doorbell is not the job's
    case = [f'        {key}) [ -n "${{OMPI_MCA_{param}+set}}" ] || '
            f'echo "export OMPI_MCA_{param}={value}"; '
            f'[ -z "$val" ] || [ -n "${{{fi}+set}}" ] || '
            f'echo "export {fi}=$val" ;;'
            for key, param, value, fi in GUEST_DEVICE]
    return "\n".join([
        "#!/bin/sh",
        "# Slurm TaskProlog of a VM cluster's guests",
        "# (ivcloud/cluster/slurm/conf.py): what a rank needs to use the",
        "# job's ivshmem device; a variable the task sets itself wins.",
        *_export_unset(env),
        f'f={job_dir}/"$SLURM_JOB_ID".env',
        'if [ -r "$f" ]; then',
        # the provider's rejoin after a move reads the job's file again,
        # which the move rewrites for the device on the new server
        # (docs/migration.md, "A Slurm job's ranks")
        '    [ -n "${FI_IVSHM_DEVICE_ENV+set}" ] || '
        'echo "export FI_IVSHM_DEVICE_ENV=$f"',
        "    while IFS== read -r k val; do",
        '        case "$k" in',
        *case,
        "        esac",
        '    done < "$f"',
        "else",
        '    [ -n "${OMPI_MCA_btl+set}" ] || '
        'echo "export OMPI_MCA_btl=self,vader,tcp"',
        # a region file that is not there: the provider says so once and
        # delegates every peer (docs/provider.md, "Without a region")
        '    [ -n "${FI_IVSHM_REGION+set}" ] || '
        'echo "export FI_IVSHM_REGION=/nonexistent"',
        "fi"]) + "\n"


def _export_unset(env: Dict[str, str]) -> List[str]:
    """TaskProlog lines exporting each of `env` the task has not set."""
    return [f'[ -n "${{{key}+set}}" ] || '
            f'echo {shlex.quote(f"export {key}={value}")}'
            for key, value in env.items()]


def hook_script_text(hook: str, state_dir: Path, repo: Path,
                     native_dir: Path, cluster: str, log: Path) -> str:
    """PrologSlurmctld / EpilogSlurmctld: slurmctld runs them with a
    bare environment (no PATH), so everything is spelled out."""
    return ("#!/bin/sh\n"
            f"# Slurm's {hook.capitalize()}Slurmctld of cluster {cluster} "
            f"(ivcloud/cluster/slurm/hooks.py)\n"
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
            f"PYTHONPATH={shlex.quote(str(repo))}\n"
            f"IVCLOUD_NATIVE_DIR={shlex.quote(str(native_dir))}\n"
            f"IVCLOUD_CLUSTER={shlex.quote(cluster)}\n"
            "export PATH PYTHONPATH IVCLOUD_NATIVE_DIR IVCLOUD_CLUSTER\n"
            f"exec {shlex.quote(sys.executable)} -m ivcloud.cluster.slurm.hooks "
            f"{hook} --state-dir {shlex.quote(str(state_dir))} "
            f">> {shlex.quote(str(log))} 2>&1\n")


def hosts_of_rankfile(text: str, known: Sequence[str]) -> List[str]:
    """The host of each rank, in rank order, of an Open MPI rankfile
    (`rank R=HOST slot=...`, as `ivcloud place --cluster` writes);
    ClusterError for a line that is not one, a rank missing, or a host
    that is not an instance."""
    by_rank: Dict[int, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"rank\s+(\d+)\s*=\s*(\S+)(\s+slot=\S+)?", line)
        if not m:
            raise ClusterError(f"rankfile line {n}: expected 'rank R=HOST "
                               f"slot=S', not '{line}'")
        rank, host = int(m.group(1)), m.group(2)
        if host not in known:
            raise ClusterError(f"rankfile line {n}: '{host}' is not an "
                               f"instance of the cluster")
        if rank in by_rank:
            raise ClusterError(f"rankfile line {n}: rank {rank} twice")
        by_rank[rank] = host
    if not by_rank:
        raise ClusterError("the rankfile places no rank")
    missing = sorted(set(range(len(by_rank))) - set(by_rank))
    if missing:
        raise ClusterError(f"the rankfile places no rank {missing[0]}")
    return [by_rank[r] for r in range(len(by_rank))]
