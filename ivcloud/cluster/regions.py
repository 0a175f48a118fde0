"""A region of its own for every job: one trust domain per region
(docs/security.md; docs/cluster.md, "One region per job", says where
the job's servers live and how its ranks find them). Slurm's hooks make
the same regions, named after its job id. The names are short because
a socket path has at most 107 bytes.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from .. import server as server_mod
from ..errors import ClusterFailure, IvcloudError

# An instance's agent picks the job's sockets by this variable, which
# mpirun passes on to it from the head node.
JOB_ENV = "IVCLOUD_JOB"
# a job of `cluster mpirun` (a random id), or a Slurm job (its job id),
# then the server's index
_JOB_RE = re.compile(r"^(j[0-9a-f]{8}|sj[0-9]{1,8})s[0-9]+$")
SLURM_JOB_KEY_PREFIX = "sj"
# Slurm's job ids stay below MaxJobId (67043328 by default): 8 digits
SLURM_JOB_KEY_LONGEST = f"{SLURM_JOB_KEY_PREFIX}99999999"


def new_job_id() -> str:
    return f"j{secrets.token_hex(4)}"


def slurm_job_key(job_id: int) -> str:
    """The name of Slurm job `job_id`'s regions (as new_job_id's)."""
    return f"{SLURM_JOB_KEY_PREFIX}{int(job_id)}"


def job_server_paths(servers_dir: Path, server_name: str, index: int,
                     job: str) -> server_mod.ServerPaths:
    # in the server's own directory; unique per job and server (in
    # host-file mode it would also name the region file
    # /dev/shm/ivcloud-NAME)
    return server_mod.paths_for(f"{job}s{index}",
                                str(Path(servers_dir) / server_name))


def job_socket(state: Dict, server_index: int, job: str) -> str:
    srv = state["servers"][str(server_index)]
    return str(job_server_paths(Path(state["servers_dir"]), srv["name"],
                                server_index, job).socket)


def _server_paths(state: Dict, job: str, indices: Iterable[int]
                  ) -> List[Tuple[int, server_mod.ServerPaths]]:
    servers_dir = Path(state["servers_dir"])
    return [(k, job_server_paths(servers_dir,
                                 state["servers"][str(k)]["name"], k, job))
            for k in sorted(set(indices))]


def start_regions(state: Dict, job: str, indices: Iterable[int],
                  leave_notices: bool = True) -> Dict[int, str]:
    """Start a server (a region) of job `job`'s own on each emulated
    server of `indices`; {server index: socket}. `leave_notices` False:
    the servers never tell a client that a peer left (server.start).
    All or nothing: when one fails, those started are stopped again."""
    started: List[server_mod.ServerPaths] = []
    sockets: Dict[int, str] = {}
    try:
        for k, paths in _server_paths(state, job, indices):
            srv = state["servers"][str(k)]
            started.append(paths)
            server_mod.start(paths, srv["size"], max_peers=srv["max_peers"],
                             leave_notices=leave_notices,
                             **srv.get("geometry", {}))
            sockets[k] = str(paths.socket)
    except BaseException:
        stop_all(started)   # the job's own error is the one to report
        raise
    return sockets


def stop_regions(state: Dict, job: str, indices: Iterable[int]) -> List[str]:
    """Stop job `job`'s servers on the emulated servers of `indices`
    (those that exist); the problems left."""
    return stop_all([p for _, p in _server_paths(state, job, indices)])


def job_server_pid(state: Dict, index: int, job: str) -> Optional[int]:
    """The pid of job `job`'s server on emulated server `index`, if it
    runs."""
    (_, paths), = _server_paths(state, job, [index])
    return server_mod.running_pid(paths)


def servers_with(state: Dict, job: str) -> List[int]:
    """The emulated servers on which job `job` has a server's directory
    (a region, or what is left of one)."""
    return [k for k, p in _server_paths(state, job,
                                        map(int, state["servers"]))
            if p.dir.is_dir()]


@contextlib.contextmanager
def job_regions(state: Dict, job: str) -> Iterator[Dict[int, str]]:
    """A region of the job's own on every emulated server, for the
    block's duration; yields {server index: socket}."""
    indices = [int(k) for k in state["servers"]]
    sockets = start_regions(state, job, indices)
    try:
        yield sockets
    except BaseException:
        stop_regions(state, job, indices)   # the job's error is reported
        raise
    problems = stop_regions(state, job, indices)
    if problems:
        raise ClusterFailure("job regions not removed: "
                             + "; ".join(problems))


def stop_all(paths_list: List[server_mod.ServerPaths]) -> List[str]:
    """Stop these job servers and remove their files; the problems left."""
    problems = []
    for paths in paths_list:
        if not paths.dir.is_dir():
            continue
        try:
            if server_mod.running_pid(paths) is not None or \
                    server_mod.leftovers(paths):
                server_mod.stop(paths)
            else:
                server_mod.remove_dir(paths)
        except IvcloudError as e:
            problems.append(str(e))
    return problems


def left_behind(servers_dir: Path) -> List[server_mod.ServerPaths]:
    """Job servers found on disk (those of jobs whose launcher died)."""
    servers_dir = Path(servers_dir)
    if not servers_dir.is_dir():
        return []
    return [server_mod.paths_for(d.name, str(d.parent))
            for srv in sorted(p for p in servers_dir.iterdir() if p.is_dir())
            for d in job_dirs(servers_dir, srv.name)]


def job_dirs(servers_dir: Path, server_name: str) -> List[Path]:
    """The job servers' directories of one emulated server."""
    d = Path(servers_dir) / server_name
    return sorted(p for p in d.iterdir()
                  if p.is_dir() and _JOB_RE.match(p.name)) \
        if d.is_dir() else []
