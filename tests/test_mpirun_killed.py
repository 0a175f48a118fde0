"""A job on this host (`ivcloud mpirun`, and so `ivcloud mag run --np N`)
whose launcher is killed with SIGKILL, its whole process group at once
(what a test harness, a batch system or a user's `kill -9 -PGID` does):
nothing of the job may outlive it.

Open MPI 4.1 puts every rank in a process group of its own, so the
signal reaches the CLI and mpirun only. Ranks inside MPI notice mpirun
gone and abort; a rank still starting (a Python rank importing PETSc) or
one that never calls MPI runs on. Vader's segments (`vader_segment.*`, 4 MiB each) and the session
directory are removed by mpirun at the end of a job; killed, it leaves
them. Both tests start real jobs, kill them
at a point they report themselves, and look for what is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List


SHM = Path("/dev/shm")
GONE_WITHIN_S = 10.0

# a rank in MPI: says (in file argv[1].RANK, not through mpirun's
# output forwarding, which the test does not depend on) its jobid (as
# vader names its segment: hex) and its launcher's pid (mpirun's), then
# waits in MPI
IN_MPI = r'''
import os, sys, time
from mpi4py import MPI
c = MPI.COMM_WORLD
c.Barrier()
with open(f"{sys.argv[1]}.{c.rank}", "w") as f:
    f.write(f"{int(os.environ['OMPI_MCA_ess_base_jobid']):x} {os.getppid()}")
while True:
    c.Barrier()
    time.sleep(0.05)
'''

# a rank that never calls MPI (as one still importing its modules)
NO_MPI = r'''
import os, sys, time
with open(f"{sys.argv[1]}.{os.environ['OMPI_COMM_WORLD_RANK']}", "w") as f:
    f.write(f"{os.getppid()}")
time.sleep(600)
'''


def _launch(ready: str, code: str, *options: str) -> subprocess.Popen:
    """`ivcloud mpirun -np 2 OPTIONS -- python3 -c CODE READY` in a
    session of its own; READY (a path unique to the test) marks the
    ranks' command lines, and each rank writes READY.RANK."""
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "mpirun", "-np", "2", *options,
         "--", sys.executable, "-c", code, str(ready)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def _ready(proc: subprocess.Popen, ready: str, n: int = 2,
           timeout_s: float = 180) -> List[List[str]]:
    """What each of the `n` ranks wrote, once all have."""
    files = [Path(f"{ready}.{r}") for r in range(n)]
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() and f.read_text() for f in files):
        assert proc.poll() is None, f"the job ended (exit " \
            f"{proc.returncode}) before its ranks were ready"
        assert time.monotonic() < deadline, "the ranks never said ready"
        time.sleep(0.05)
    return [f.read_text().split() for f in files]


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _ranks(unique: str) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            continue
        if unique.encode() in argv and state.split()[0] not in "ZX":
            out.append(int(d))
    return out


def _until(predicate, within_s: float = GONE_WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _files_named(root: Path, match) -> List[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        found += [Path(dirpath) / n for n in dirnames + filenames
                  if match(n)]
    return found


def _cleanup(unique: str) -> None:
    for pid in _ranks(unique):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_killed_job_leaves_no_segment_nor_session_dir(tmp_path):
    """2 ranks over vader, killed while in MPI: no vader segment of the
    job's jobid anywhere in /dev/shm, and mpirun's session directory
    (pid.<mpirun's pid>) neither there nor in /tmp."""
    unique = str(tmp_path / "ready")
    # an older run's session directory may carry the pid mpirun gets now
    tops = [SHM, *Path("/tmp").glob("ompi.*")]
    before = {p for top in tops
              for p in _files_named(top, lambda n: n.startswith("pid."))}
    proc = _launch(unique, IN_MPI, "--transport", "vader")
    try:
        ready = _ready(proc, unique)
        jobid, mpirun = ready[0][0], ready[0][1]
        ours = f".{os.geteuid()}.{jobid}."
        # the segments exist while the job runs: what is looked for below
        # is what the job made
        assert _files_named(SHM, lambda n: n.startswith("vader_segment.")
                            and ours in n), "no vader segment of the job"
        _kill_group(proc)
        assert _until(lambda: not _ranks(unique)), _ranks(unique)
        assert _until(lambda: not _files_named(
            SHM, lambda n: n.startswith("vader_segment.") and ours in n)), \
            _files_named(SHM, lambda n: ours in n)
        session = f"pid.{mpirun}"
        tops = [SHM, *Path("/tmp").glob("ompi.*")]
        left = {p for top in tops
                for p in _files_named(top, lambda n: n == session)}
        assert not left - before, left - before
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        _cleanup(unique)


def test_killed_job_leaves_no_rank_nor_region(tmp_path):
    """2 ranks that never call MPI, over ivshmem in a private region:
    killed, no rank runs on past a few seconds (they would not notice
    mpirun gone), and the private region is removed."""
    before = {p.name for p in SHM.glob("ivcloud-mpi-*")}
    unique = str(tmp_path / "ready")
    proc = _launch(unique, NO_MPI)
    try:
        _ready(proc, unique)
        launcher = proc.pid
        made = [p for p in SHM.glob(f"ivcloud-mpi-{launcher}-*")]
        assert made, "no private region made for the job"
        _kill_group(proc)
        assert _until(lambda: not _ranks(unique)), _ranks(unique)
        assert _until(lambda: not any(p.exists() for p in made)), made
        assert {p.name for p in SHM.glob("ivcloud-mpi-*")} <= before
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        _cleanup(unique)
