"""Launching unmodified MPI programs over ivshmem (`ivcloud mpirun`).

Open MPI carries the traffic through our BTL component
(mca_btl_ivshmem.so, built from native/btl) when it is on the component
path and named in the BTL list; the component attaches to one region
(a formatted file, or an ivshmem-server socket) given as an MCA
parameter. This module builds that mpirun command line and, when no
region is named, formats a private one in /dev/shm for the job and
removes it afterwards whatever happens.

The Python API is plain functions of their arguments (no state kept
here), for reuse by other launchers:

    cmd = mpirun_command(["./app"], np=4, transport="ivshmem",
                         region="/dev/shm/r")
    status = run(["./app"], np=4)          # private region, exit status
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import procfs
from .errors import MpiError, MpiSetupError
from .server import MAX_PEERS

TRANSPORTS = ("ivshmem", "tcp", "vader")
COMPONENT_FILE = "mca_btl_ivshmem.so"
# Where Debian's Open MPI keeps its own components; mca_base_component_path
# replaces the default search path, so it must be listed next to ours.
STOCK_COMPONENT_DIR = Path("/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3")
MIB = 1 << 20
MAX_PEERS_LIMIT = MAX_PEERS   # ivshm_geometry.max_peers upper bound
PRIVATE_MIN_PEERS = 8         # room for a few ranks more than asked
PRIVATE_MIN_SIZE = 64 * MIB
PRIVATE_HEAP = 32 * MIB       # on top of the receive areas: windows, big messages
# Receive areas of MPI regions (one per rank, linear in ranks): a queue of
# MPI_QUEUE_SLOTS cells every sender appends to, and MPI_FAST_CHANNELS
# rings for the busiest senders. A slot holds one whole BTL fragment (the
# BTL sizes max_send_size to one slot's payload), so the BTL packs
# fragments into the region and delivers them from it in place.
# MPI_RING_SHAPES lists (slots, slot size) from the preferred shape down;
# many ranks get shorter rings to keep the areas in the budget. The slots
# stay at 16 KiB + 64 as long as possible: the BTL's fragments are about
# 32 KiB in whole slots, so only a payload above 16 KiB makes a fragment
# exactly one slot (smaller slots would send every fragment through the
# copying path). 64 slots of 16 KiB rather than 16 of 64 KiB (the same
# 1 MiB per ring): PTRANS's many mid-sized messages keep more fragments
# in flight (PTRANS 0.85 of vader against 0.77, ring bandwidth still 1.6x
# vader's; BENCHMARKS.md). From about 100 ranks on, 4 KiB slots, whose
# fragments span several slots and go through the copying path.
MPI_RING_SHAPES = ((64, 16 * 1024 + 64), (32, 16 * 1024 + 64),
                   (16, 16 * 1024 + 64), (16, 4096))
MPI_QUEUE_SLOTS = 64
MPI_FAST_CHANNELS = 8
PRIVATE_RING_BUDGET = 300 * MIB
TERMINATE_GRACE_S = 10.0      # mpirun gets this long to tear a job down


# ---------------------------------------------------------------- lookup

def stock_component_dir() -> Path:
    """Open MPI's own component directory (ompi_info's pkglibdir)."""
    if (STOCK_COMPONENT_DIR / "mca_btl_self.so").exists():
        return STOCK_COMPONENT_DIR
    ompi_info = shutil.which("ompi_info")
    if ompi_info:
        try:
            out = subprocess.run([ompi_info, "--path", "pkglibdir"],
                                 capture_output=True, text=True, timeout=30,
                                 stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "pkglibdir" and value.strip():
                return Path(value.strip())
    raise MpiSetupError("cannot find Open MPI's component directory "
                        "(is openmpi-bin installed?)")


def component_dir(native: Optional[Path] = None) -> Path:
    """Directory holding mca_btl_ivshmem.so: <native>/btl, where native
    defaults to $IVCLOUD_NATIVE_DIR or <repo>/build/native."""
    if native is None:
        from .native import native_dir
        native = native_dir()
    d = Path(native) / "btl"
    if not (d / COMPONENT_FILE).exists():
        raise MpiSetupError(f"{d / COMPONENT_FILE} not found (run `make "
                            f"build`, or set IVCLOUD_NATIVE_DIR to the "
                            f"native build directory)")
    return d.resolve()


def find_mpirun() -> str:
    path = shutil.which("mpirun")
    if not path:
        raise MpiSetupError("mpirun not found (install openmpi-bin)")
    return path


# ---------------------------------------------------------------- command

def btl_list(transport: str, tcp_fallback: bool = True) -> str:
    """The --mca btl value for a transport. With ivshmem, tcp stays in
    the list (unless tcp_fallback is off) so that ranks our component
    cannot reach (no region, region full, another host) still talk."""
    if transport == "ivshmem":
        return "self,ivshmem,tcp" if tcp_fallback else "self,ivshmem"
    if transport in ("tcp", "vader"):
        return f"self,{transport}"
    raise MpiError(f"unknown transport '{transport}' (choose from "
                   f"{', '.join(TRANSPORTS)})")


def mpirun_command(program: Sequence[str], np: int,
                   transport: str = "ivshmem",
                   region: Optional[os.PathLike] = None,
                   socket: Optional[os.PathLike] = None,
                   verbose_btl: bool = False,
                   tcp_fallback: bool = True,
                   osc: Optional[str] = None,
                   extra_mca: Sequence[Tuple[str, str]] = (),
                   mpi4py_thread_level: Optional[str] = "serialized",
                   mpirun: Optional[str] = None,
                   components: Optional[Path] = None,
                   stock_components: Optional[Path] = None) -> List[str]:
    """The mpirun argv that runs `program` on `np` ranks over `transport`.

    ivshmem: region (a formatted file) or socket (an ivshmem-server
    socket), at most one; with neither, the component falls back to
    $IVSHM_REGION / $IVSHM_SOCKET, and without those it stays out of the
    way (tcp carries the job when tcp_fallback is on). One-sided
    communication goes through osc pt2pt (messages, so through our BTL)
    unless `osc` says otherwise; as osc pt2pt refuses windows under
    MPI_THREAD_MULTIPLE, which mpi4py asks for by default, mpi4py
    programs are told to ask for `mpi4py_thread_level` instead (None:
    leave them alone).
    """
    program = [str(a) for a in program]
    if not program or not program[0]:
        raise MpiError("no program given")
    if not isinstance(np, int) or np < 1:
        raise MpiError(f"the number of ranks must be a positive integer, not {np!r}")
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

    cmd = [mpirun or find_mpirun()]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-np", str(np)]
    mca: List[Tuple[str, str]] = []
    if transport == "ivshmem":
        ours = components or component_dir()
        stock = stock_components or stock_component_dir()
        mca.append(("mca_base_component_path", f"{stock}:{ours}"))
    # ob1 is the PML that drives BTLs; UCX (when installed) would bypass
    # them all and the BTL list would carry nothing.
    mca.append(("pml", "ob1"))
    mca.append(("btl", btl_list(transport, tcp_fallback)))
    if transport == "ivshmem":
        if region is not None:
            mca.append(("btl_ivshmem_region", str(region)))
        if socket is not None:
            mca.append(("btl_ivshmem_socket", str(socket)))
        if verbose_btl:
            mca.append(("btl_ivshmem_verbose", "1"))
        mca.append(("osc", osc or "pt2pt"))
    elif osc:
        mca.append(("osc", osc))
    mca += [(str(k), str(v)) for k, v in extra_mca]
    for key, value in mca:
        cmd += ["--mca", key, value]
    if (transport == "ivshmem" and (osc or "pt2pt") == "pt2pt"
            and mpi4py_thread_level):
        cmd += ["-x", f"MPI4PY_RC_THREAD_LEVEL={mpi4py_thread_level}"]
    return cmd + program


# ---------------------------------------------------------------- region

def mpi_geometry(max_peers: int) -> Dict[str, int]:
    """Geometry of an MPI region for `max_peers` peers (keyword arguments
    of format_region / min_region_size besides max_peers): the first
    ring shape whose receive areas fit PRIVATE_RING_BUDGET. The region grows
    linearly with max_peers, so beyond the budget (some hundreds of
    ranks) it keeps the smallest slot and grows past it."""
    from .native import min_region_size
    geometry = {}
    for ring_slots, slot_size in MPI_RING_SHAPES:
        geometry = dict(ring_slots=ring_slots, slot_size=slot_size,
                        queue_slots=MPI_QUEUE_SLOTS,
                        fast_channels=MPI_FAST_CHANNELS)
        if min_region_size(max_peers, **geometry) <= PRIVATE_RING_BUDGET:
            break
    return geometry


def private_geometry(np: int) -> Tuple[int, int]:
    """(max_peers, size in bytes) of a private region for `np` ranks
    (receive areas shaped by mpi_geometry(max_peers))."""
    from .native import min_region_size
    if np > MAX_PEERS_LIMIT:
        raise MpiError(f"a region holds at most {MAX_PEERS_LIMIT} ranks, "
                       f"not {np}")
    max_peers = max(PRIVATE_MIN_PEERS, np)
    need = min_region_size(max_peers, **mpi_geometry(max_peers)) + PRIVATE_HEAP
    size = max(PRIVATE_MIN_SIZE, (need + MIB - 1) // MIB * MIB)
    return max_peers, size


def private_region_path() -> Path:
    return Path("/dev/shm") / f"ivcloud-mpi-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def private_region(np: int, path: Optional[Path] = None) -> Iterator[Path]:
    """A freshly formatted region file for one job (mode 0600), removed
    when the block ends, also on an exception or KeyboardInterrupt."""
    from .native import IvshmError, format_region
    max_peers, size = private_geometry(np)
    geometry = mpi_geometry(max_peers)
    path = Path(path) if path else private_region_path()
    try:
        # O_EXCL: never adopt (and later delete) somebody else's file
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        raise MpiSetupError(f"cannot create {path}: {e.strerror}")
    os.close(fd)
    try:
        try:
            format_region(path, size, max_peers=max_peers, mode=0o600,
                          **geometry)
        except (IvshmError, OSError) as e:
            raise MpiSetupError(f"cannot format {path}: {e}")
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------- running

def _exit_status(returncode: int) -> int:
    # a signal death (-N from subprocess) reads as the shell's 128+N
    return 128 - returncode if returncode < 0 else returncode


def _stop(proc: subprocess.Popen) -> None:
    """Ask mpirun to tear the job down (it forwards SIGTERM to the ranks
    and cleans up), and kill it if it does not within the grace time.
    Then what was below mpirun when we came to stop it is stopped too:
    mpirun killed, or slow on a busy machine, can leave ranks behind,
    orphaned, still running. (A job whose mpirun has already exited is
    not looked for: its orphans are no longer below us.)"""
    if proc.poll() is not None:
        return
    # pinned now: once mpirun is gone its ranks are no longer below us
    job = procfs.descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        job.update(procfs.descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    procfs.kill_pinned(job, grace_s=1.0)


def run_command(cmd: Sequence[str], timeout: Optional[float] = None,
                env: Optional[Mapping[str, str]] = None,
                stdout=None, stderr=None) -> int:
    """Run an mpirun command line; its exit status. The job is torn down
    if we are interrupted or `timeout` (seconds) expires, which raises
    subprocess.TimeoutExpired after the teardown."""
    # Always an explicit environment: a process that initialised MPI
    # itself (mpi4py, petsc4py) carries singleton PMIx/ORTE variables set
    # with setenv() behind os.environ, and an mpirun inheriting them exits
    # at once without a word.
    pending: List[int] = []
    proc = _start(list(cmd), dict(env if env else os.environ), stdout,
                  stderr, pending)
    try:
        for signum in pending:          # now they find the job to stop
            os.kill(os.getpid(), signum)
        proc.wait(timeout=timeout)
    except BaseException:
        _stop(proc)
        raise
    return _exit_status(proc.returncode)


_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _start(cmd: List[str], env: Dict[str, str], stdout, stderr,
           pending: List[int]) -> subprocess.Popen:
    """Popen with the interrupting signals held back into `pending`: one
    arriving while Popen waits for the exec (long on a busy machine)
    would raise out of it with mpirun started and unknown to us, left
    running. (Handlers, not a signal mask: mpirun must not inherit a
    mask.) Outside the main thread nothing can be held back."""
    saved = {}
    try:
        for signum in _DEFERRED:
            saved[signum] = signal.signal(
                signum, lambda n, _frame: pending.append(n))
    except ValueError:                  # not the main thread
        pass
    try:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    except BaseException:
        _restore(saved)
        for signum in pending:          # no job: the signal acts as usual
            os.kill(os.getpid(), signum)
        raise
    finally:
        _restore(saved)


def _restore(saved: Dict[int, object]) -> None:
    for signum, handler in saved.items():
        # None: a handler installed outside Python; the default is nearest
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _check_file(path: os.PathLike, what: str, is_kind, kind: str) -> Path:
    """`path`, if it exists and `is_kind(st_mode)`; else MpiError naming
    it as `what`."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise MpiError(f"{what} {p}: {e.strerror}")
    if not is_kind(st.st_mode):
        raise MpiError(f"{what} {p} is not {kind}")
    return p


def check_region(region: os.PathLike) -> Path:
    return _check_file(region, "region", stat.S_ISREG, "a regular file")


def check_socket(sock: os.PathLike) -> Path:
    return _check_file(sock, "socket", stat.S_ISSOCK, "a socket")


def env_attachment(env: Mapping[str, str]) -> Dict[str, str]:
    """region/socket named by $IVSHM_REGION / $IVSHM_SOCKET, if any."""
    if env.get("IVSHM_SOCKET"):
        return {"socket": env["IVSHM_SOCKET"]}
    if env.get("IVSHM_REGION"):
        return {"region": env["IVSHM_REGION"]}
    return {}


def run(program: Sequence[str], np: int, transport: str = "ivshmem",
        region: Optional[os.PathLike] = None,
        socket: Optional[os.PathLike] = None,
        verbose_btl: bool = False, tcp_fallback: bool = True,
        extra_mca: Sequence[Tuple[str, str]] = (),
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        stdout=None, stderr=None) -> int:
    """Run `program` on `np` ranks; mpirun's exit status.

    With transport ivshmem and neither region nor socket (nor
    $IVSHM_REGION / $IVSHM_SOCKET in `env`), a private region is
    formatted for the job and removed afterwards."""
    if region is not None:
        check_region(region)
    if socket is not None:
        check_socket(socket)
    kwargs = dict(transport=transport, verbose_btl=verbose_btl,
                  tcp_fallback=tcp_fallback, extra_mca=extra_mca)
    try:
        if transport == "ivshmem" and region is None and socket is None:
            named = env_attachment(env if env is not None else os.environ)
            if named:
                kwargs.update(named)
            else:
                # validate before making anything
                mpirun_command(program, np, region="/dev/null", **kwargs)
                with private_region(np) as path:
                    cmd = mpirun_command(program, np, region=path, **kwargs)
                    return run_command(cmd, timeout, env, stdout, stderr)
        cmd = mpirun_command(program, np, region=region, socket=socket,
                             **kwargs)
        return run_command(cmd, timeout, env, stdout, stderr)
    except FileNotFoundError as e:      # mpirun gone since find_mpirun
        raise MpiSetupError(f"cannot run mpirun: {e}") from None


def planned_command(program: Sequence[str], np: int,
                    transport: str = "ivshmem",
                    region: Optional[os.PathLike] = None,
                    socket: Optional[os.PathLike] = None,
                    env: Optional[Mapping[str, str]] = None,
                    **kwargs) -> Tuple[List[str], Optional[Path]]:
    """What :func:`run` would execute, run nothing: (the mpirun argv, the
    private region it would format for the job and remove afterwards, or
    None when the job attaches to a given region or server). The same
    refusals as a real run, save that a given region or socket need not
    exist yet."""
    private = None
    if transport == "ivshmem" and region is None and socket is None:
        named = env_attachment(env if env is not None else os.environ)
        region, socket = named.get("region"), named.get("socket")
        if not named:
            private_geometry(np)
            region = private = private_region_path()
    cmd = mpirun_command(program, np, transport=transport, region=region,
                         socket=socket, **kwargs)
    return cmd, private


# ---------------------------------------------------------------- counters

_COUNTER_RE = re.compile(
    r"btl_ivshmem: rank (\d+) sent (\d+) msgs (\d+) bytes, received (\d+) "
    r"msgs (\d+) bytes, sleeps (\d+)")


def parse_btl_counters(text: str) -> Dict[int, Dict[str, int]]:
    """The per-rank lines the component prints at
    finalize: {rank: {sent_msgs, sent_bytes, recv_msgs, recv_bytes,
    sleeps}}. A rank missing from the result printed nothing (it never
    used the component, or did not finalize)."""
    out: Dict[int, Dict[str, int]] = {}
    for m in _COUNTER_RE.finditer(text):
        rank, sm, sb, rm, rb, sl = (int(g) for g in m.groups())
        out[rank] = {"sent_msgs": sm, "sent_bytes": sb, "recv_msgs": rm,
                     "recv_bytes": rb, "sleeps": sl}
    return out
