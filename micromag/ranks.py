"""Running a problem on the MPI ranks this process was started with:
the rank side of `ivcloud mag run` and of `python3 -m micromag run`.

Rank 0 makes the output directory, every rank runs the problem. On a
single rank an error is raised to the caller; on several, a MagError is
printed once per failing rank as one line and the job is aborted (a rank
that raised cannot leave the others waiting in a collective): exit
status 2 for a problem that cannot be run, 1 for one that failed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional


def one_thread_per_rank() -> None:
    """The ranks are the parallelism: BLAS and OpenMP get one thread.
    Must run before numpy or PETSc load their BLAS."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def run_on_ranks(prob, out: Path, progress: bool,
                 argv: Optional[List[str]], prog: str, **run_options) -> None:
    """Run loaded problem `prob` on MPI.COMM_WORLD into `out`; `prog`
    prefixes the error line of a multi-rank failure; `run_options` go to
    simulation.run (resume, checkpoint_every)."""
    from mpi4py import MPI

    from .errors import MagError, ProblemError
    from .simulation import run
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    try:
        run(prob, out, comm, progress=progress, argv=argv, **run_options)
    except MagError as e:
        if comm.Get_size() > 1:
            sys.stderr.write(f"{prog}: error: {' '.join(str(e).split())}\n")
            sys.stderr.flush()
            comm.Abort(2 if isinstance(e, ProblemError) else 1)
        raise
    except Exception:
        if comm.Get_size() > 1:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            comm.Abort(1)
        raise
