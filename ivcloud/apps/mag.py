"""Our micromagnetic solver (the micromag package) as jobs: what
`ivcloud mag run` and `ivcloud mag converge` do below the command line.

- :func:`run` runs a problem file on N ranks: on the ranks this process
  was started with (one, or those of an mpirun that started it), or by
  starting N ranks of `ivcloud mag run ... --mpi-child` under mpirun
  (:mod:`ivcloud.mpis.local`: Open MPI with our BTL on the component path; the
  transport is Open MPI's shared memory unless told otherwise).
- :func:`run_command` is the `ivcloud mag run` command line of one run
  as a user types it; the benchmark (ivcloud.bench.mag) and the
  convergence study start it, one process per run.
- :func:`converge` is the mesh-convergence study (micromag.study), each
  run through :func:`run_command`.

Bad input raises micromag's ProblemError before anything is launched
or written; a run that fails raises another MagError (on several ranks
the ranks print their error and mpirun's exit status is returned);
mpirun missing raises MpiSetupError.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import process

REPO = Path(__file__).resolve().parents[2]
TRANSPORTS = ("vader", "tcp", "ivshmem")
CHILD_FLAG = "--mpi-child"     # the ranks of a job launched by `run`
PROG = "ivcloud mag"           # prefixes a rank's error line


def run(problem, out, ranks: int = 1, transport: str = "vader",
        progress: bool = True, resume: bool = False,
        checkpoint_every: float = 60.0, on_ranks: bool = False,
        argv: Optional[Sequence[str]] = None) -> int:
    """Run problem file `problem` into directory `out` on `ranks` ranks;
    the exit status (0: done). `on_ranks`: this process is one of the
    ranks of a job already started (as under mpirun); `argv` is
    recorded in the run's summary. resume and checkpoint_every as for
    micromag.simulation.run."""
    from micromag.parallel import under_mpirun
    options = dict(progress=progress, resume=resume,
                   checkpoint_every=checkpoint_every)
    if on_ranks or under_mpirun():
        _run_here(Path(problem), Path(out), argv, **options)
        return 0
    if ranks == 1:
        _run_here(Path(problem), Path(out), argv, singleton=True, **options)
        return 0
    return _launch(Path(problem), Path(out), ranks, transport, **options)


def _run_here(problem: Path, out: Path, argv, progress: bool,
              singleton: bool = False, **run_options) -> None:
    """On the ranks this process belongs to; `singleton`: it is the only
    one, started by no launcher, so what its Open MPI leaves (an orted,
    a session directory) is put in a job scope that goes when this
    process does, also if it is killed (process.own_job_scope)."""
    from micromag.ranks import one_thread_per_rank, run_on_ranks
    one_thread_per_rank()
    from micromag.problem import load
    prob = load(problem)
    _check_out(out)
    if singleton:
        process.own_job_scope()
    run_on_ranks(prob, out, progress,
                 list(argv) if argv is not None else None, PROG,
                 **run_options)


def _check_out(out: Path) -> None:
    from micromag.errors import ProblemError
    if out.exists() and not out.is_dir():
        raise ProblemError(f"output directory {out} exists and is not a "
                           f"directory")


def rank_command(problem: Path, out: Path, progress: bool, resume: bool,
                 checkpoint_every: float) -> List[str]:
    """Every rank's argv of a job `run` launches."""
    cmd = [sys.executable, "-m", "ivcloud", "mag", "run",
           str(problem.resolve()), "--out", str(out.resolve()), CHILD_FLAG,
           "--checkpoint-every", repr(checkpoint_every)]
    if not progress:
        cmd.append("--quiet")
    if resume:
        cmd.append("--resume")
    return cmd


def rank_env(environ=os.environ) -> Dict[str, str]:
    """The ranks' environment: without the launcher variables of this
    process, importing the very ivcloud and micromag trees this process
    imported, one thread per rank (the ranks are the parallelism)."""
    import micromag
    from micromag.parallel import clean_mpi_env
    env = clean_mpi_env(environ)
    roots = [str(REPO), str(Path(micromag.__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _launch(problem: Path, out: Path, ranks: int, transport: str,
            progress: bool, resume: bool, checkpoint_every: float) -> int:
    """`ranks` ranks of the solver under mpirun; mpirun's exit status.
    The problem is validated and the output directory made first."""
    from micromag.problem import load

    from ..mpis import local
    load(problem)
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    return local.run(rank_command(problem, out, progress, resume,
                                checkpoint_every),
                   ranks, transport=transport, env=rank_env())


# ---------------------------------------------------------------- runs as
# processes (the benchmark, the convergence study)

def run_command(problem: Path, out: Path, ranks: int,
                transport: str = "vader", resume: bool = False,
                checkpoint_every: Optional[float] = None) -> List[str]:
    """`ivcloud mag run PROBLEM --out OUT --np N ...` (quiet)."""
    cmd = [sys.executable, "-m", "ivcloud", "mag", "run", str(problem),
           "--out", str(out), "--np", str(ranks), "--transport", transport,
           "--quiet"]
    if resume:
        cmd.append("--resume")
    if checkpoint_every is not None:
        cmd += ["--checkpoint-every", repr(checkpoint_every)]
    return cmd


def study_launcher(ranks: int, transport: str = "vader"
                   ) -> Callable[[Path, Path, float], int]:
    """A micromag.study launcher: each run through `ivcloud mag run`
    (resumed from its checkpoint), on `ranks` ranks over `transport`."""
    def launch(problem: Path, run_dir: Path, checkpoint_every: float) -> int:
        cmd = run_command(problem, run_dir, ranks, transport, resume=True,
                          checkpoint_every=checkpoint_every)
        return subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode
    return launch


def converge(problem, out, cells: Sequence[float], layers: Sequence[int],
             ranks: int = 1, transport: str = "vader",
             reference: str = "auto", log=None, **settings) -> dict:
    """The convergence study of problem file `problem` in `out`
    (micromag.study.run; its report): `cells` and `layers` per run,
    `reference` "auto" (the published solution where the problem is
    one that has it), "none" or a file of rows 't mx my mz'; the other
    `settings` are micromag.study.StudySettings' (method, edge_h,
    duration, times, tol, no_run, checkpoint_every)."""
    from micromag import convergence, study
    from micromag.problem import load
    prob = load(problem)
    s = study.StudySettings(prob, Path(out), list(cells), list(layers),
                            reference=convergence.choose_reference(
                                prob, reference), **settings)
    return study.run(s, study_launcher(ranks, transport), log=log)
