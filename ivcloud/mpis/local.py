"""A job on this host alone (`ivcloud mpirun`): Open MPI 4.1 over our
BTL, in a region given by file or server socket, or in a private one
formatted for the job and removed afterwards whatever happens (docs/mpi.md,
"The short way", shows the calls from Python). What the job leaves (ranks
still running, Open MPI's files in /dev/shm and its session directory,
the private region) goes with it, also when the launcher is killed with
SIGKILL (process.job_scope).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .. import process
from ..errors import MpiError, MpiSetupError
from .base import Launch
from .openmpi import OpenMpi, btl_list
from .regions import private_geometry, private_region, private_region_path

TRANSPORTS = OpenMpi.transports


def mpirun_command(program: Sequence[str], np: int,
                   transport: str = "ivshmem",
                   region: Optional[os.PathLike] = None,
                   socket: Optional[os.PathLike] = None,
                   verbose_btl: bool = False,
                   tcp_fallback: bool = True,
                   osc: Optional[str] = None,
                   extra_mca: Sequence[Tuple[str, str]] = (),
                   components: Optional[Path] = None) -> List[str]:
    """The mpirun argv that runs `program` on `np` ranks of this host
    over `transport`.

    ivshmem: region (a formatted file) or socket (an ivshmem-server
    socket), at most one; with neither, the component falls back to
    $IVSHM_REGION / $IVSHM_SOCKET, and without those it stays out of the
    way (tcp carries the job when tcp_fallback is on). osc: another
    one-sided component than osc pt2pt. components: another directory
    holding the BTL's file (another build's, a copy)."""
    program = [str(a) for a in program]
    if transport not in TRANSPORTS:
        btl_list(transport)  # raises the one error message
    if region is not None and socket is not None:
        raise MpiError("give either a region or a socket, not both")
    if transport != "ivshmem" and (region is not None or socket is not None
                                   or verbose_btl):
        raise MpiError(f"a region, a socket or BTL counters only apply to "
                       f"the ivshmem transport, not '{transport}'")
    if transport != "ivshmem" and not tcp_fallback:
        raise MpiError(f"only the ivshmem transport has a tcp fallback to "
                       f"turn off, not '{transport}'",
                       setting="no_tcp_fallback")
    options: List[Tuple[str, str]] = []
    if not tcp_fallback:
        options.append(("btl", btl_list(transport, tcp_fallback=False)))
    if region is not None:
        options.append(("btl_ivshmem_region", str(region)))
    if socket is not None:
        options.append(("btl_ivshmem_socket", str(socket)))
    if osc:
        options.append(("osc", osc))
    options += [(str(k), str(v)) for k, v in extra_mca]
    launch = Launch(program, np, transport=transport, oversubscribe=True,
                    report=verbose_btl, options=options,
                    components=None if components is None
                    else str(components))
    return OpenMpi().command(launch).argv


def _attachment(np: int, transport: str, region, socket,
                env: Mapping[str, str]) -> Tuple[Dict[str, str], bool]:
    """Where a job attaches ({"region": ...} or {"socket": ...}, or
    nothing) and whether that is a private region to format for it: the
    one given, else $IVSHM_SOCKET / $IVSHM_REGION, else (ivshmem) a
    private region."""
    if region is not None:
        return {"region": str(region)}, False
    if socket is not None:
        return {"socket": str(socket)}, False
    if transport != "ivshmem":
        return {}, False
    if env.get("IVSHM_SOCKET"):
        return {"socket": env["IVSHM_SOCKET"]}, False
    if env.get("IVSHM_REGION"):
        return {"region": env["IVSHM_REGION"]}, False
    private_geometry(np)            # refuses too many ranks
    return {"region": str(private_region_path())}, True


def _check_file(path: os.PathLike, what: str, is_kind, kind: str) -> None:
    """MpiError naming `path` as `what` unless it exists and
    is_kind(st_mode)."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise MpiError(f"{what} {path}: {e.strerror}")
    if not is_kind(st.st_mode):
        raise MpiError(f"{what} {path} is not {kind}")


def run(program: Sequence[str], np: int, transport: str = "ivshmem",
        region: Optional[os.PathLike] = None,
        socket: Optional[os.PathLike] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        stdout=None, stderr=None, **kwargs) -> int:
    """Run `program` on `np` ranks, in a private region where no other
    is named (_attachment); mpirun's exit status (SIGTERM/SIGHUP unwind
    as Ctrl-C: the job is torn down, the region removed; killed, a
    reaper does that: process.job_scope)."""
    if region is not None:
        _check_file(region, "region", stat.S_ISREG, "a regular file")
    if socket is not None:
        _check_file(socket, "socket", stat.S_ISSOCK, "a socket")
    env = dict(env if env is not None else os.environ)
    # validates everything before anything is made
    cmd, private = planned_command(program, np, transport, region, socket,
                                   env, **kwargs)
    try:
        with process.interrupts(), contextlib.ExitStack() as stack:
            # the region made first (O_EXCL): a file that was there
            # already is never the job's, so never removed with it
            if private:
                stack.enter_context(private_region(np, private))
            job = stack.enter_context(
                process.job_scope([private] if private else []))
            return process.run_launcher(cmd, {**env, **job.env()}, timeout,
                                        stdout, stderr)
    except FileNotFoundError as e:      # mpirun gone since it was found
        raise MpiSetupError(f"cannot run mpirun: {e}") from None


def planned_command(program: Sequence[str], np: int,
                    transport: str = "ivshmem",
                    region: Optional[os.PathLike] = None,
                    socket: Optional[os.PathLike] = None,
                    env: Optional[Mapping[str, str]] = None,
                    **kwargs) -> Tuple[List[str], Optional[Path]]:
    """(the mpirun argv, the private region or None) that :func:`run`
    would use, running nothing; its refusals, save that a given region
    or socket need not exist yet."""
    where, private = _attachment(np, transport, region, socket,
                                 env if env is not None else os.environ)
    cmd = mpirun_command(program, np, transport=transport, **where,
                         **kwargs)
    return cmd, Path(where["region"]) if private else None
