"""The processes we start and the signals that end them: one place.

- :func:`interrupts`: inside it SIGTERM and SIGHUP unwind like Ctrl-C
  (:class:`Interrupted`, a KeyboardInterrupt), so every `finally` and
  teardown on the way runs: a job's launcher is stopped, a cluster
  being brought up rolls back, a session's cluster goes down. The CLI
  then exits 128 + the signal's number.
- :func:`shielded`: Ctrl-C, SIGTERM and SIGHUP held back while a
  teardown must finish, then the first of them delivered; :func:`undo`,
  a rollback's steps run that way.
- :func:`run_launcher`: a launcher (mpirun, mpiexec, srun, nsenter into
  an instance) run to its end; interrupted or past its timeout, it is
  asked to end its job (SIGTERM), killed after a grace time, and what
  ran below it is killed too.
- :func:`first_line`: what a child that keeps running says first (a
  namespace holder's "ready", a server's port), waited for up to a
  deadline.
- :func:`job_scope`: what a job on this host leaves behind (its ranks,
  Open MPI's shared-memory segments and session directory, a private
  region) ended and removed when the job's launcher returns, and also
  when the launcher itself is killed with SIGKILL: a reaper in a session
  of its own sees it go and does the same. :func:`own_job_scope`: the
  same for a job that is this process (a singleton MPI rank), ended
  when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import (Callable, Dict, Iterator, List, Mapping, Optional,
                    Sequence, Tuple)

from . import procfs
from .errors import OperationFailed

# a launcher gets this long to tear its job down after SIGTERM
TERMINATE_GRACE_S = 10.0
_UNWINDING = (signal.SIGTERM, signal.SIGHUP)
_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (or Ctrl-C: signum SIGINT) while work runs."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """SIGTERM/SIGHUP raise Interrupted for the block's duration (in the
    main thread; elsewhere signals cannot be handled and nothing
    changes). Nested blocks are fine."""
    saved: Dict[int, object] = {}
    try:
        for signum in _UNWINDING:
            saved[signum] = signal.signal(signum, _raise_interrupted)
    except ValueError:                  # not the main thread
        pass
    try:
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def _holding(pending: List[int]) -> Iterator[None]:
    """The interrupting signals held back into `pending` for the block's
    duration (handlers, not a signal mask: a child must not inherit a
    mask; outside the main thread nothing can be held back)."""
    saved: Dict[int, object] = {}
    try:
        try:
            for signum in _DEFERRED:
                saved[signum] = signal.signal(
                    signum, lambda n, _frame: pending.append(n))
        except ValueError:                  # not the main thread
            pass
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back for the block's duration: a
    second one (or a supervisor's SIGTERM after the Ctrl-C) must not
    leave half a teardown, nor be lost: the first one held back is sent
    again when the block ends."""
    held: List[int] = []
    try:
        with _holding(held):
            yield
    finally:
        if held:
            os.kill(os.getpid(), held[0])


def undo(steps: List[Tuple[str, Callable[[], None]]],
         say: Callable[[str], None],
         describe: Callable[[BaseException], str] = str) -> List[str]:
    """Run the undo of each of `steps` ((what, function), in the order
    they were done), latest first, each tried, shielded; says each one
    done or not (a signal held back meanwhile ends the caller after it,
    with no return), empties `steps` and returns the problems ("what:
    why")."""
    problems = []
    with shielded():
        while steps:
            what, fn = steps.pop()
            try:
                fn()
                say(f"rolled back: {what}")
            except BaseException as e:
                problems.append(f"{what}: {describe(e)}")
                say(f"not rolled back: {problems[-1]}")
    return problems


def exit_status(returncode: int) -> int:
    """A signal death (-N from subprocess) reads as the shell's 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def run_launcher(argv: Sequence[str], env: Mapping[str, str],
                 timeout: Optional[float] = None, stdout=None, stderr=None,
                 cwd: Optional[str] = None,
                 cpus: Optional[Sequence[int]] = None,
                 grace_s: float = TERMINATE_GRACE_S) -> int:
    """Run a launcher; its exit status. Torn down if we are interrupted
    or `timeout` (seconds) expires, which raises
    subprocess.TimeoutExpired after the teardown. `cpus`: its affinity."""
    # Always an explicit environment: a process that initialised MPI
    # itself (mpi4py, petsc4py) carries singleton PMIx/ORTE variables set
    # with setenv() behind os.environ, and an mpirun inheriting them exits
    # at once without a word.
    pending: List[int] = []
    preexec = None
    if cpus is not None:
        preexec = _affinity(list(cpus))
    proc = _start(list(argv), dict(env), stdout, stderr, cwd, preexec,
                  pending)
    try:
        for signum in pending:          # now they find the job to stop
            os.kill(os.getpid(), signum)
        proc.wait(timeout=timeout)
    except BaseException:
        stop(proc, grace_s)
        raise
    return exit_status(proc.returncode)


def _affinity(cpus: List[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cpus)


def stop(proc: subprocess.Popen, grace_s: float = TERMINATE_GRACE_S) -> None:
    """Ask a launcher to tear its job down (SIGTERM: mpirun and srun
    forward it to the ranks and clean up), and kill it if it does not
    within the grace time. Then what was below it when we came to stop
    it is stopped too: a launcher killed, or slow on a busy machine, can
    leave ranks behind, orphaned, still running. (A job whose launcher
    has already exited is not looked for: its orphans are no longer
    below us.)"""
    if proc.poll() is not None:
        return
    # pinned now: once the launcher is gone its ranks are no longer below us
    job = procfs.descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        job.update(procfs.descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    procfs.kill_pinned(job, grace_s=1.0)


def _start(argv: List[str], env: Dict[str, str], stdout, stderr,
           cwd: Optional[str], preexec, pending: List[int]
           ) -> subprocess.Popen:
    """Popen with the interrupting signals held back into `pending`: one
    arriving while Popen waits for the exec (long on a busy machine)
    would raise out of it with the launcher started and unknown to us,
    left running (_holding)."""
    try:
        with _holding(pending):
            return subprocess.Popen(argv, env=env, stdout=stdout,
                                    stderr=stderr, cwd=cwd,
                                    preexec_fn=preexec)
    except BaseException:
        for signum in pending:          # no job: the signal acts as usual
            os.kill(os.getpid(), signum)
        raise


def _restore(saved: Dict[int, object]) -> None:
    for signum, handler in saved.items():
        # None: a handler installed outside Python; the default is nearest
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def first_line(stream, timeout_s: float) -> Optional[str]:
    """The first line a child writes to pipe `stream`, without its
    newline, read as it comes (the child goes on running); what it wrote
    before it closed the pipe, if it did that first; None if no line came
    within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    fd = stream.fileno()
    out = b""
    while b"\n" not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 256)
            if not chunk:
                break
            out += chunk
    return out.split(b"\n", 1)[0].decode(errors="replace")


# ------------------------------------------------------------ job scope

# in the environment of a job's launcher, and so of every process it
# starts that keeps its environment (Open MPI passes mpirun's to the
# ranks): which job a process belongs to, after its launcher is gone
LAUNCH_ENV = "IVCLOUD_LAUNCH_ID"


class JobScope:
    """One job's token, its directory (for files the job's processes
    make: Open MPI's shared-memory segments and session directory) and
    the environment that puts them there; see :func:`job_scope`."""

    def __init__(self, token: str, directory: Path,
                 owned: Sequence[os.PathLike] = ()):
        self.token, self.directory = token, directory
        self.owned: List[Path] = [directory, *(Path(p) for p in owned)]

    def env(self) -> Dict[str, str]:
        """For the launcher's environment: the token, and Open MPI 4.1's
        vader segments and session directory (orte_tmpdir_base) in the
        job's directory, found there by their path, not by a name
        Open MPI makes up (its jobid) and that another job of ours or
        another user's could share."""
        d = str(self.directory)
        return {LAUNCH_ENV: self.token,
                "OMPI_MCA_btl_vader_backing_directory": d,
                "OMPI_MCA_orte_tmpdir_base": d}


def _job_root() -> Path:
    # vader's segments want a memory-backed file system
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path("/tmp")


@contextlib.contextmanager
def job_scope(owned: Sequence[os.PathLike] = ()) -> Iterator[JobScope]:
    """A job's scope: its directory made (0700), a reaper started, the
    scope yielded; when the block ends (however: returned, raised,
    interrupted), every process that still carries the job's token is
    killed and the job's files removed: its directory and the paths
    `owned` (a private region the caller made). The reaper, in a
    session of its own so that a signal to our process group does not
    reach it, waits on a pipe only we hold: when we die without ending
    the block (killed with SIGKILL, with our process group or alone),
    it does the same (the launcher, mpirun, and ranks that never
    noticed it gone: one still starting, one that never calls MPI);
    otherwise we kill it."""
    scope = _new_scope(owned)
    reaper = None
    try:
        reaper = _open_scope(scope)
        yield scope
    finally:
        with shielded():
            try:
                end_job(scope.token, scope.owned)
            finally:
                if reaper is not None:
                    with contextlib.suppress(ProcessLookupError):
                        reaper.kill()
                    reaper.wait()
                    reaper.stdin.close()


# the write ends of own_job_scope's reapers' pipes: raw descriptors, so
# that nothing in this process closes them before it exits
_OWN_SCOPES: List[int] = []


def own_job_scope() -> JobScope:
    """A job scope whose job is this process and what it starts: its
    environment put into ours (what we start from now on carries the
    token; Open MPI, once initialised here, puts its session directory
    in the scope's directory) and its reaper started. It ends only when
    the process does: a singleton MPI rank is finalized at its exit,
    after everything a `with` block could wrap, and its Open MPI forks
    an orted that must outlive the rank's last MPI call; killed with
    SIGKILL, the rank leaves that orted and the session directory to
    the reaper, as a launcher's job does."""
    scope = _new_scope()
    try:
        reaper = _open_scope(scope)
    except OperationFailed:
        shutil.rmtree(scope.directory, ignore_errors=True)
        raise
    with shielded():
        # not inheritable (os.dup's default), like the pipe it copies
        _OWN_SCOPES.append(os.dup(reaper.stdin.fileno()))
        reaper.stdin.close()
    os.environ.update(scope.env())
    return scope


def _new_scope(owned: Sequence[os.PathLike] = ()) -> JobScope:
    token = f"{os.getpid()}.{secrets.token_hex(6)}"
    return JobScope(token, _job_root() / f"ivcloud-job.{token}", owned)


def _open_scope(scope: JobScope) -> subprocess.Popen:
    """The scope's directory made and its reaper started, signals held
    back meanwhile; the reaper."""
    with shielded():
        try:
            scope.directory.mkdir(mode=0o700)
        except OSError as e:
            raise OperationFailed(f"cannot make the job's directory "
                                  f"{scope.directory}: {e.strerror}") from None
        try:
            return _start_reaper(scope)
        except OSError as e:
            raise OperationFailed(f"cannot start the job's reaper: "
                                  f"{e.strerror}") from None


def _start_reaper(scope: JobScope) -> subprocess.Popen:
    """`python -c` the reaper, its stdin the read end of a pipe whose
    write end (reaper.stdin) only we hold: Python's descriptors are not
    inherited, so the launcher does not get it (or the reaper would
    wait for the launcher too)."""
    env = {k: v for k, v in os.environ.items() if k != LAUNCH_ENV}
    pkg = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [pkg] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = ("import sys; from ivcloud.process import _reaper_main; "
            "_reaper_main(sys.argv[1], sys.argv[2:])")
    return subprocess.Popen(
        [sys.executable, "-c", code, scope.token,
         *(str(p) for p in scope.owned)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=env, cwd="/",
        start_new_session=True, close_fds=True)


def _reaper_main(token: str, paths: List[str]) -> None:
    """In the reaper: block until the job's launcher closes the pipe (by
    dying: a launcher that ends its block kills us first), then end the
    job in its place. Signals that would end a launcher's session do
    not end this."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    end_job(token, [Path(p) for p in paths])


def end_job(token: str, owned: Sequence[Path]) -> None:
    """Kill every process of ours that carries the job's token in its
    environment (SIGTERM, then SIGKILL at once: the job is over), until
    none is left (a rank may fork while we look), then remove the job's
    files."""
    for _ in range(20):
        left = procfs.with_environ(LAUNCH_ENV, token)
        if not left:
            break
        procfs.kill_pinned(left, grace_s=0.0)
    for path in owned:
        # one path that cannot go does not keep the others
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
