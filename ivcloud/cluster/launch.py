"""Getting into instances: the launch agent, hostfiles, the mpirun line.

Open MPI starts its daemon (orted) on a remote node with
`AGENT HOST COMMAND...`, like ssh. Our agent (`python -m
ivcloud.cluster.launch --state-dir DIR HOST COMMAND...`, wrapped in the
cluster's `agent` script) looks HOST up in the state file, checks that
the instance's holder is still the process we started, and execs
`nsenter` into its network, UTS, IPC and mount namespaces with

  * the instance's CPUs (nsenter keeps the caller's affinity, not the
    holder's, so the agent sets it: everything orted starts inherits it);
  * a fresh environment as sshd would give (nothing of mpirun's own
    environment leaks in), TMPDIR=/tmp (the instance's private tmpfs,
    where orted and PMIx keep their session directories) and
    IVSHM_SOCKET = the socket of the job's region on the instance's
    server (jobs.py; the server's standing region for a job that shares
    it), which the ivshmem BTL reads when btl_ivshmem_socket is not set,
    and the same as FI_IVSHM_SOCKET for the libfabric provider;
  * COMMAND joined and run by /bin/sh -c, since Open MPI quotes it for
    a remote shell.

mpirun itself runs on the head node (its own namespaces on the core
bridge, no ranks) so that every rank is launched through the agent and
every orted reaches mpirun over the cluster network. The other MPIs
(ivcloud.mpis: hydra of MPICH and Intel MPI, PRRTE of Open MPI 5) start
their proxies through the same agent, from the head node too.

`prepare_job` and `run_job` are `ivcloud cluster mpirun` on namespace
instances: the checks an instance's view of the host needs, the command
entered on the head node, the job's own regions while it runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpis
from ..errors import ClusterError, LaunchError, OperationFailed
from ..mpis import provider
from .holder import CLUSTER_ENV, Holder, enter_argv
from .jobs import JOB_ENV, job_socket, regions_for
from .state import StateDir, load
from .topology import SUBNET, ClusterTopology, topology_from_dict

PLACEMENTS = ("block", "round-robin")
TRANSPORTS = ("tcp", "ivshmem")
# Directories every instance has privately (anything under them on the
# host is invisible inside).
PRIVATE_DIRS = ("/tmp", "/dev/shm")
_KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ")


def visible_inside(path: str) -> bool:
    """Can an instance see this host path? Not under its private dirs,
    unless it is inside a checkout/build kept visible there."""
    from .holder import host_paths_under_tmp
    real = os.path.realpath(path)
    if not any(real == d or real.startswith(d + "/") for d in PRIVATE_DIRS):
        return True
    return any(real == k or real.startswith(k + "/")
               for k in host_paths_under_tmp())


# ---------------------------------------------------------------- files

def host_slots(topo: ClusterTopology,
               placement: str) -> List[Tuple[str, int]]:
    """(hostname, slots) of every instance in the placement's order.
    block: instances server-major, filled slot by slot (--map-by slot);
    round-robin: instance-major order with --map-by node, so consecutive
    ranks land on different servers first."""
    insts = topo.instance_list()
    if placement == "round-robin":
        insts = sorted(insts, key=lambda i: (i.index, i.server))
    return [(i.hostname, topo.vcpus) for i in insts]


def hostfile_text(topo: ClusterTopology, placement: str) -> str:
    return "".join(f"{host} slots={slots}\n"
                   for host, slots in host_slots(topo, placement))


def agent_script_text(state_dir: Path) -> str:
    repo = Path(__file__).resolve().parent.parent.parent
    return ("#!/bin/sh\n"
            "# Open MPI's plm_rsh_agent for this cluster: AGENT HOST CMD...\n"
            f"PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            "export PYTHONPATH\n"
            f"exec {shlex.quote(sys.executable)} -m ivcloud.cluster.launch "
            f"--state-dir {shlex.quote(str(state_dir))} \"$@\"\n")


# ---------------------------------------------------------------- entering

def instance_env(state: Dict, host: str, base: Optional[Dict] = None) -> Dict[str, str]:
    base = os.environ if base is None else base
    env = {k: base[k] for k in _KEEP_ENV if k in base}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                           "/usr/bin:/sbin:/bin")
    env.update(HOME="/root" if os.geteuid() == 0 else base.get("HOME", "/"),
               USER=base.get("USER", "root"), SHELL="/bin/sh",
               TMPDIR="/tmp", IVCLOUD_INSTANCE=host)
    # `down` recognises what runs in an instance by this, too
    env[CLUSTER_ENV] = state["name"]
    if state.get("slurm"):
        env["SLURM_CONF"] = state["slurm"]["conf"]
    inst = state.get("instances", {}).get(host)
    if inst is not None:
        job = base.get(JOB_ENV)
        if job:
            env["IVSHM_SOCKET"] = job_socket(state, inst["server"], job)
        else:
            server = state["servers"][str(inst["server"])]
            env["IVSHM_SOCKET"] = server["socket"]
        env[provider.SOCKET_ENV] = env["IVSHM_SOCKET"]
    return env


def resolve(state: Dict, host: str) -> Holder:
    """The live holder of instance (or head) `host`, or LaunchError."""
    if host not in state.get("instances", {}) and host != "head":
        raise LaunchError(f"no instance '{host}' in cluster "
                          f"'{state['name']}'")
    rec = state.get("holders", {}).get(host)
    if rec is None:
        raise LaunchError(f"instance '{host}' was never started")
    holder = Holder.from_dict(rec)
    if not holder.alive():
        raise LaunchError(f"instance '{host}' is down (holder pid "
                          f"{holder.pid} is gone)")
    return holder


def enter_command(state: Dict, host: str, argv: Sequence[str],
                  shell: bool = False) -> Tuple[List[str], Dict[str, str],
                                                 List[int]]:
    """(argv, env, cpus) that run `argv` inside instance `host`. shell:
    argv is one command line for /bin/sh -c (ssh semantics)."""
    holder = resolve(state, host)
    try:
        cpus = sorted(os.sched_getaffinity(holder.pid))
    except OSError as e:
        raise LaunchError(f"instance '{host}': {e.strerror}")
    if shell or not argv:
        cmd = ["/bin/sh", "-c", " ".join(argv)] if argv else ["/bin/sh", "-l"]
    else:
        cmd = list(argv)
    return enter_argv(holder.pid) + cmd, instance_env(state, host), cpus


def exec_in(state: Dict, host: str, argv: Sequence[str],
            shell: bool = False) -> None:
    """Replace this process by `argv` inside instance `host`."""
    full, env, cpus = enter_command(state, host, argv, shell)
    os.sched_setaffinity(0, cpus)
    # the caller's directory may not exist inside (private /tmp)
    os.chdir("/")
    os.execvpe(full[0], full, env)


# ---------------------------------------------------------------- mpirun

def _set_mca(cmd: List[str], key: str, value: str) -> None:
    """Set --mca key value in an mpirun argv, replacing an existing one
    (a repeated --mca is joined with ',' by Open MPI, not replaced)."""
    for i in range(len(cmd) - 2):
        if cmd[i] in ("--mca", "-mca") and cmd[i + 1] == key:
            cmd[i + 2] = value
            return
    cmd[1:1] = ["--mca", key, value]


def default_btl(transport: str) -> str:
    # vader stays in: ranks inside one instance share its /dev/shm, as
    # they would inside one VM; it cannot reach another instance.
    return {"tcp": "self,vader,tcp",
            "ivshmem": "self,vader,ivshmem,tcp"}[transport]


def working_dir(cwd: Optional[str] = None) -> str:
    """mpirun's --wdir: the caller's directory unless instances cannot
    see it."""
    cwd = os.path.realpath(cwd or os.getcwd())
    return cwd if visible_inside(cwd) else "/"


def mpirun_command(state: Dict, sd: StateDir, program: Sequence[str],
                   np: int, transport: str = "tcp",
                   placement: str = "block", btl: Optional[str] = None,
                   verbose_btl: bool = False,
                   extra_mca: Sequence[Tuple[str, str]] = (),
                   wdir: Optional[str] = None,
                   rankfile: Optional[Path] = None) -> List[str]:
    """The mpirun argv (to run on the head node) for a cluster job.

    Built by ivcloud.mpi.mpirun_command (component path, pml ob1, osc
    pt2pt for ivshmem, run-as-root), then made cluster-aware: our
    hostfile and mapping, the launch agent, the cluster interface, and
    vader in the BTL list. btl_ivshmem_socket is deliberately unset:
    each rank takes its own server's socket from IVSHM_SOCKET. A
    rankfile (e.g. from `ivcloud place`) replaces the placement's
    mapping; it must be on a path the head node sees (not /tmp)."""
    from .. import mpi
    if transport not in TRANSPORTS:
        raise LaunchError(f"unknown transport '{transport}' (choose from "
                          f"{', '.join(TRANSPORTS)})")
    if placement not in PLACEMENTS:
        raise LaunchError(f"unknown placement '{placement}' (choose from "
                          f"{', '.join(PLACEMENTS)})")
    mca = [("plm", "rsh"),
           ("plm_rsh_agent", str(sd.agent)),
           # every orted is started from the head node, by our agent
           ("plm_rsh_no_tree_spawn", "1"),
           ("oob_tcp_if_include", SUBNET),
           ("btl_tcp_if_include", SUBNET),
           *[(str(k), str(v)) for k, v in extra_mca]]
    cmd = mpi.mpirun_command(program, np, transport=transport,
                             verbose_btl=verbose_btl, extra_mca=mca)
    _set_mca(cmd, "btl", btl or default_btl(transport))
    if rankfile is not None:
        mapping = ["--rankfile", str(rankfile)]
    else:
        mapping = ["--map-by",
                   "node" if placement == "round-robin" else "slot"]
    cmd[1:1] = ["--hostfile", str(sd.hostfile(placement)), *mapping,
                # an instance's affinity is its vCPU set; ranks float in
                # it as a guest's processes do on its vCPUs. A rankfile's
                # slot= still pins (Open MPI applies it despite this), so
                # rankfiles for clusters name the whole vCPU range.
                "--bind-to", "none",
                "--wdir", wdir or working_dir()]
    return cmd


def flavor_command(state: Dict, sd: StateDir, mpi: str,
                   program: Sequence[str], np: int, transport: str = "tcp",
                   placement: str = "block", report: bool = False,
                   wdir: Optional[str] = None,
                   hosts: Optional[Sequence[Tuple[str, int]]] = None
                   ) -> List[str]:
    """The launcher argv (to run on the head node) of a job with one of
    the libfabric MPIs (ivcloud.mpis): its own launcher, reaching the
    instances through the launch agent, ranks placed over the instances
    as `placement` says (or on `hosts`, (hostname, slots) in order).
    Each rank's provider finds its server's region through the socket
    the agent gives it."""
    if placement not in PLACEMENTS:
        raise LaunchError(f"unknown placement '{placement}' (choose from "
                          f"{', '.join(PLACEMENTS)})")
    if hosts is None:
        hosts = host_slots(topology_from_dict(state["topology"]), placement)
    unknown = [h for h, _ in hosts if h not in state.get("instances", {})]
    if unknown:
        raise LaunchError(f"no instance '{unknown[0]}' in cluster "
                          f"'{state['name']}'")
    job = mpis.Job(program, np, hosts=hosts,
                   spread=placement == "round-robin", agent=str(sd.agent),
                   transport=transport, report=report,
                   wdir=wdir or working_dir())
    return mpis.flavor(mpi).command(job)


# ---------------------------------------------------------------- a job

def check_visible(path, what: str) -> None:
    """ClusterError unless the instances see `path` (it is not under a
    directory each of them has privately)."""
    if not visible_inside(str(path)):
        raise ClusterError(f"{what} ({path}) is under "
                           f"{' or '.join(PRIVATE_DIRS)}, which every "
                           f"instance has privately (put it elsewhere, "
                           f"e.g. /var/tmp)")


def check_program(program: Sequence[str]) -> List[str]:
    """`program` with its executable found (PATH) and made absolute, on
    a path the instances see; ClusterError otherwise."""
    exe = program[0]
    if "/" not in exe:
        found = shutil.which(exe)
        if not found:
            raise ClusterError(f"program '{exe}' not found on PATH")
        exe = found
    exe = os.path.abspath(exe)
    if not os.path.isfile(exe):
        raise ClusterError(f"program '{program[0]}' does not exist")
    check_visible(exe, f"program '{program[0]}'")
    return [exe] + list(program[1:])


@dataclass
class Job:
    """A job on a namespace cluster, ready to run: the launcher's command
    entered on the head node and its environment; `own_regions`: it gets
    a region of its own on every server while it runs; the rankfile, if
    any, goes to `rankfile` (a path the head node sees) for its run."""
    argv: List[str]
    env: Dict[str, str]
    transport: str
    own_regions: bool
    rankfile: Optional[Path] = None
    rankfile_text: Optional[str] = None


def prepare_job(state: Dict, sd: StateDir, program: Sequence[str], np: int,
                *, mpi: str, transport: str, placement: str,
                btl: Optional[str] = None, report: bool = False,
                extra_mca: Sequence[Tuple[str, str]] = (),
                rankfile_text: Optional[str] = None,
                shared_region: bool = False) -> Job:
    """The job that runs `program` on `np` ranks with MPI `mpi` (a name
    of ivcloud.mpis, checked by the caller): Debian's Open MPI over our
    BTL, or one of the libfabric MPIs over the provider. Checks that the
    instances see the program, the BTL, the launcher and the provider."""
    from .. import mpi as openmpi
    debian = mpi == mpis.DEBIAN_OPENMPI
    program = check_program(program)
    if transport == "ivshmem" and debian:
        check_visible(openmpi.component_dir(), "the ivshmem BTL")
    rankfile = (None if rankfile_text is None
                else sd.dir / f"rankfile.{os.getpid()}")
    if debian:
        cmd = mpirun_command(state, sd, program, np, transport=transport,
                             placement=placement, btl=btl,
                             verbose_btl=report, extra_mca=extra_mca,
                             rankfile=rankfile)
    else:
        cmd = flavor_command(state, sd, mpi, program, np,
                             transport=transport, placement=placement,
                             report=report)
        check_visible(cmd[0], f"{mpi}'s launcher")
        if transport == "ivshmem":
            check_visible(provider.library(), "the ivshm provider")
    argv, env, _ = enter_command(state, "head", cmd)
    return Job(argv, env, transport,
               own_regions=transport == "ivshmem" and not shared_region,
               rankfile=rankfile, rankfile_text=rankfile_text)


def run_job(state: Dict, job: Job, timeout: Optional[float] = None) -> int:
    """Run a prepared job to its end and return its exit status: its own
    regions started before and stopped after (ivcloud.cluster.jobs), its
    rankfile written for the run and removed. subprocess.TimeoutExpired
    past `timeout` (the job torn down first)."""
    from .. import mpi as openmpi
    regions = regions_for(state, job.env, job.transport,
                          shared_region=not job.own_regions)
    try:
        if job.rankfile is not None:
            job.rankfile.write_text(job.rankfile_text or "")
        with regions:
            return openmpi.run_command(job.argv, timeout=timeout, env=job.env)
    except FileNotFoundError as e:
        raise OperationFailed(f"cannot run mpirun: {e}")
    finally:
        if job.rankfile is not None:
            try:
                job.rankfile.unlink()
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- agent

def agent_main(argv: Optional[List[str]] = None) -> int:
    """`python -m ivcloud.cluster.launch --state-dir DIR HOST CMD...`"""
    args = list(sys.argv[1:] if argv is None else argv)
    state_dir = None
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "--state-dir" and args:
            state_dir = Path(args.pop(0))
        elif opt == "--":
            break
        # other options (ssh-style flags some launchers add) are ignored
    if state_dir is None or not args:
        sys.stderr.write("usage: python -m ivcloud.cluster.launch "
                         "--state-dir DIR HOST [COMMAND...]\n")
        return 255
    host, cmd = args[0], args[1:]
    sd = StateDir(state_dir.name[len("cluster-"):], state_dir.parent)
    try:
        state = load(sd)
        if state is None:
            raise LaunchError(f"no cluster state in {state_dir}")
        exec_in(state, host, cmd, shell=True)
    except Exception as e:  # any failure: one line, like ssh
        sys.stderr.write(f"ivcloud cluster agent: {host}: {e}\n")
    return 255  # ssh's status for "could not connect"


if __name__ == "__main__":
    sys.exit(agent_main())
