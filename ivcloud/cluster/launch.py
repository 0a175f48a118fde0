"""Getting into namespace instances: the launch agent (agent_main,
docs/cluster.md, "Commands": what a job's launcher calls instead of
ssh), what the instances see of the host, the order a placement fills
them in.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ClusterError, LaunchError
from ..mpis import provider
from .holder import CLUSTER_ENV, Holder, enter_argv
from .regions import JOB_ENV, job_socket
from .state import StateDir, load
from .topology import ClusterTopology

PLACEMENTS = ("block", "round-robin")
# Directories every instance has privately (anything under them on the
# host is invisible inside).
PRIVATE_DIRS = ("/tmp", "/dev/shm")
_KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ")


def under(path: os.PathLike, dirs: Sequence[str]) -> Optional[str]:
    """The one of `dirs` that host path `path` (resolved) is in, or None."""
    real = os.path.realpath(path)
    return next((d for d in dirs if real == d or real.startswith(d + "/")),
                None)


def visible_inside(path: str) -> bool:
    """Can an instance see this host path? Not under its private dirs,
    unless it is inside a checkout/build kept visible there."""
    from .holder import host_paths_under_tmp
    return not under(path, PRIVATE_DIRS) or \
        under(path, host_paths_under_tmp()) is not None


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


# ---------------------------------------------------------------- a job's view

def working_dir(cwd: Optional[str] = None) -> str:
    """mpirun's --wdir: the caller's directory unless instances cannot
    see it."""
    cwd = os.path.realpath(cwd or os.getcwd())
    return cwd if visible_inside(cwd) else "/"


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
    sd = StateDir.of(state_dir)
    try:
        state = load(sd)
        if state is None:
            raise LaunchError(f"no cluster state in {state_dir}")
        # this process replaced by `cmd` inside instance `host`
        full, env, cpus = enter_command(state, host, cmd, shell=True)
        os.sched_setaffinity(0, cpus)
        # the caller's directory may not exist inside (private /tmp)
        os.chdir("/")
        os.execvpe(full[0], full, env)
    except Exception as e:  # any failure: one line, like ssh
        sys.stderr.write(f"ivcloud cluster agent: {host}: {e}\n")
    return 255  # ssh's status for "could not connect"


if __name__ == "__main__":
    sys.exit(agent_main())
