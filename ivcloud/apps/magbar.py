"""Our micromagnetic solver (the micromag package, run as `ivcloud mag
run`) on the thesis's test problem: the Permalloy bar of
examples/bar.toml relaxing for 300 ps (seed 000, section 4.1).

Every rank runs `python -m ivcloud mag run PROBLEM --out DIR
--mpi-child` (or, where only the python3-micromag package is installed,
as in the guests of a VM cluster, `python3 -m micromag run PROBLEM --out
DIR`); rank 0 writes DIR/summary.json, whose wall time (setup and solve:
the thesis's time to solution) and solve time we read.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import InvalidRequest, OperationFailed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bar.toml"
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
CHILD_FLAG = "--mpi-child"     # the ranks of a job launched elsewhere
SUMMARY = "summary.json"       # rank 0 writes it into the output directory
PACKAGED_PYTHON = "/usr/bin/python3"   # Debian's, with python3-micromag
# Debian 12's petsc4py is found through /usr/lib/petsc, an alternative
# that only PETSc's development package makes, or through PETSC_DIR
PACKAGED_ENV = {"PETSC_DIR": "/usr/lib/petscdir/petsc3.18/"
                             "x86_64-linux-gnu-real"}


def prepare(workdir: Path, duration_s: Optional[float] = None,
            cell_nm: Optional[float] = None) -> Path:
    """The bar problem in `workdir` (its relaxation shortened to
    `duration_s`, its mesh coarsened to cells of `cell_nm`, for plumbing
    runs), without the <m>(t) plot; returns the problem file."""
    try:
        text = EXAMPLE.read_text()
    except OSError as e:
        raise OperationFailed(f"cannot read {EXAMPLE}: {e.strerror}")
    if cell_nm is not None:
        if cell_nm <= 0:
            raise InvalidRequest(f"cell size must be positive, not "
                                 f"{cell_nm}")
        text, n = re.subn(r"^h\s*=.*$", f"h = {cell_nm!r}", text,
                          flags=re.M)
        if n != 1:
            raise OperationFailed(f"{EXAMPLE} has no single mesh size h")
    if duration_s is not None:
        if duration_s <= 0:
            raise InvalidRequest(f"duration must be positive, not "
                                 f"{duration_s}")
        text, n = re.subn(r"^duration\s*=.*$", f"duration = {duration_s!r}",
                          text, flags=re.M)
        if n != 1:
            raise OperationFailed(f"{EXAMPLE} has no single duration")
    if re.search(r"^\[output\]", text, flags=re.M):
        raise OperationFailed(f"{EXAMPLE} has an [output] section of its "
                              f"own")
    # no <m>(t) plot: nobody reads it, and rank 0 draws it after the
    # timed part (matplotlib's import alone is seconds in a TCG guest)
    text += "\n[output]\npng = false\n"
    workdir.mkdir(parents=True, exist_ok=True)
    problem = workdir / "bar.toml"
    problem.write_text(text)
    return problem


def command(problem: Path, out: Path) -> List[str]:
    """Every rank's argv: the solver with one thread per rank."""
    return (["/usr/bin/env"] + [f"{k}={v}" for k, v in ENV.items()] +
            [sys.executable, "-m", "ivcloud", "mag", "run", str(problem),
             "--out", str(out), CHILD_FLAG, "--quiet"])


def packaged_command(problem: Path, out: Path) -> List[str]:
    """Every rank's argv on a machine with the python3-micromag package
    and without ivcloud (the guests of a VM cluster): the solver's own
    `python3 -m micromag run`, one thread per rank."""
    env = dict(ENV, **PACKAGED_ENV)
    return (["/usr/bin/env"] + [f"{k}={v}" for k, v in env.items()] +
            [PACKAGED_PYTHON, "-m", "micromag", "run", str(problem),
             "--out", str(out), "--quiet"])


def results(out: Path) -> Dict[str, float]:
    """time_s (setup + solve) and solve_s of a finished run."""
    try:
        text = (out / SUMMARY).read_text()
    except OSError as e:
        raise OperationFailed(f"no solver summary in {out}: {e}")
    return results_of(text, out)


def results_of(text: str, out: Path) -> Dict[str, float]:
    """time_s and solve_s from the text of OUT/summary.json (read
    wherever rank 0 wrote it)."""
    try:
        summary = json.loads(text)
    except ValueError as e:
        raise OperationFailed(f"no solver summary in {out}: {e}")
    try:
        return {"time_s": float(summary["wall_time_s"]),
                "solve_s": float(summary["solve_time_s"])}
    except (KeyError, TypeError, ValueError):
        raise OperationFailed(f"{out}/summary.json lacks the solver's "
                              f"times")
