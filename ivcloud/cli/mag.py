"""`ivcloud mag run|check|bench|converge`: the command line of the
`micromag` solver (which never imports ivcloud), of ivcloud.apps.mag (a
run on N ranks, the convergence study) and of ivcloud.bench.mag.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import List, Optional

from ..apps.mag import CHILD_FLAG, TRANSPORTS
from . import CliError, action, comma_list, number, positive_int

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BENCH_PROBLEMS = ("bar", "sp4")
STUDY_METHODS = ("grid", "dense", "fmm", "auto", "graded")


def _not_empty(values: List[int]) -> List[int]:
    if not values:
        raise ValueError("no rank count given")
    return values


_np_list = comma_list(positive_int, _not_empty, "rank list")
_NOT_SECONDS = "'{}' is not a number of seconds >= 0"
_seconds = number(float, _NOT_SECONDS, lambda value: None
                  if 0 <= value < float("inf") else _NOT_SECONDS)
_times = comma_list(number(float, "'{}' is not a number"),
                    what="list of times")


def register(sub) -> None:
    p = sub.add_parser("mag", help="micromagnetic FEM solver (LLG, PETSc)",
                       description="Finite-element micromagnetics: "
                                   "exchange, demagnetization (FEM/BEM), "
                                   "anisotropy, Zeeman; LLG dynamics and "
                                   "energy minimisation on MPI ranks.")
    # sub-parsers inherit the top parser's class: one-line usage errors
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    run = action(acts, "run", cmd_run, help="run a problem file")
    run.add_argument("problem", help="problem file (TOML)")
    run.add_argument("--out", required=True, help="output directory")
    run.add_argument("--np", type=positive_int, default=1,
                     help="MPI ranks (re-launches under mpirun)")
    run.add_argument("--transport", choices=TRANSPORTS, default="vader",
                     help="MPI transport for --np > 1 (default: vader)")
    run.add_argument("--quiet", action="store_true",
                     help="no progress display")
    run.add_argument("--resume", action="store_true",
                     help="continue an interrupted run in --out from its "
                          "checkpoint (if it was written for this problem, "
                          "mesh and solver; else start from the beginning)")
    run.add_argument("--checkpoint-every", type=_seconds, default=60.0,
                     metavar="SECONDS",
                     help="checkpoint the state every this many wall "
                          "seconds (and at every snapshot and stage end; "
                          "0: at every table row; default 60)")
    run.add_argument(CHILD_FLAG, action="store_true",
                     help=argparse.SUPPRESS)

    chk = action(acts, "check", cmd_check, help="validate a problem file "
                 "and print its effective configuration")
    chk.add_argument("problem")

    b = action(acts, "bench", cmd_bench, help="time the solver on the "
               "thesis bar and standard problem 4")
    b.add_argument("--json", help="write the results to this file")
    b.add_argument("--np", type=_np_list, default=[1, 2],
                   help="rank counts, comma-separated (default 1,2)")
    b.add_argument("--problems", default=",".join(BENCH_PROBLEMS),
                   help="comma-separated example names (default bar,sp4;"
                        " sp4_field2: standard problem 4, field 2; "
                        "ellipsoid: the curved body at several mesh "
                        "sizes, docs/mag.md)")
    b.add_argument("--examples", default=str(EXAMPLES),
                   help="directory of the example problem files")
    b.add_argument("--transport", choices=TRANSPORTS, default="vader")
    b.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds, the runs alternating in each (default 3)")
    b.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds per run before it is stopped")
    b.add_argument("--peer", choices=("neuralmag",),
                   help="also run each standard problem 4 of the "
                        "problems (sp4, sp4_field2) and the ellipsoid in "
                        "this finite-difference code (make peer-neuralmag "
                        "installs it), in the same rounds")

    c = action(acts, "converge", cmd_converge, help="mesh-convergence "
               "study of a structured-box problem (e.g. standard problem 4)")
    c.add_argument("problem", help="problem file (TOML)")
    c.add_argument("--out", required=True, help="study directory (one "
                   "run per cell size in it; finished runs are reused)")
    c.add_argument("--cells", default="10,5,3.3",
                   help="in-plane cell sizes in the mesh's unit, "
                        "comma-separated (default 10,5,3.3)")
    c.add_argument("--layers", default="3",
                   help="element layers across the thickness: one number "
                        "for every cell size, or one per cell size, "
                        "comma-separated (default 3)")
    c.add_argument("--duration", type=float, default=None,
                   help="shorten the last llg stage to this many seconds")
    c.add_argument("--times", type=_times, default=None,
                   help="stage times (s) to compare, comma-separated "
                        "(default 0.1, 0.2, 0.5 and 1 of 1 ns, scaled "
                        "to the duration)")
    c.add_argument("--tol", type=float, default=0.01,
                   help="largest change of a component under refinement "
                        "called converged (default 0.01)")
    c.add_argument("--method", choices=STUDY_METHODS, default=None,
                   help="demag method of every run (graded: FEM/BEM with "
                        "the dense matrix on a mesh graded towards the "
                        "lateral faces); the runs go into OUT/METHOD "
                        "(default: the problem's own, into OUT)")
    c.add_argument("--edge-h", type=float, default=0.5,
                   help="graded: cell size at the lateral faces, in the "
                        "mesh's unit (default 0.5)")
    c.add_argument("--np", type=positive_int, default=1)
    c.add_argument("--checkpoint-every", type=_seconds, default=60.0,
                   metavar="SECONDS",
                   help="checkpoint each run every this many wall seconds "
                        "(default 60); an interrupted run continues from "
                        "its checkpoint when the study is started again")
    c.add_argument("--transport", choices=TRANSPORTS, default="vader")
    c.add_argument("--reference", default="auto", metavar="auto|none|FILE",
                   help="reference <m>(t) for the table and plot: auto "
                        "(for standard problem 4 when the problem is that "
                        "one: field 1's published solution; field 2's "
                        "finite-difference run at 1.25 nm, its crossing "
                        "check and the published spread of <m>(1 ns)), "
                        "none, or a file of rows 't mx my mz' (t in s)")
    c.add_argument("--no-run", action="store_true",
                   help="only compare what the runs in --out have so far")


def cmd_check(args) -> int:
    from micromag.problem import load, to_toml
    with _mag_errors():
        prob = load(args.problem)
    sys.stdout.write(to_toml(prob.config))
    return 0


def cmd_run(args) -> int:
    from ..apps import mag
    with _mag_errors():
        return mag.run(args.problem, args.out, ranks=args.np,
                       transport=args.transport, progress=not args.quiet,
                       resume=args.resume,
                       checkpoint_every=args.checkpoint_every,
                       on_ranks=args.mpi_child, argv=sys.argv[1:])


# ---------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    from ..bench import mag as bench
    settings = bench.MagBenchSettings(
        problems=[n.strip() for n in args.problems.split(",") if n.strip()],
        ranks=args.np, rounds=args.rounds, examples=Path(args.examples),
        transport=args.transport, timeout_s=args.timeout, peer=args.peer)
    return bench.run(settings, json_path=args.json)


# ---------------------------------------------------------------- converge

def cmd_converge(args) -> int:
    from micromag import convergence as cv
    from micromag import study

    from ..apps import mag
    with _mag_errors():
        cells = cv.parse_cells(args.cells)
        report = mag.converge(
            args.problem, Path(args.out), cells,
            cv.parse_layers(args.layers, len(cells)), ranks=args.np,
            transport=args.transport, reference=args.reference,
            log=lambda line: print(line, file=sys.stderr, flush=True),
            method=args.method, edge_h=args.edge_h,
            duration=args.duration, times=args.times or None, tol=args.tol,
            no_run=args.no_run, checkpoint_every=args.checkpoint_every)
    sys.stdout.write(study.format_report(report) + "\n")
    return 1 if report["failed"] else 0



@contextlib.contextmanager
def _mag_errors():
    """micromag's errors as the command's: bad input exit 2, a failed
    run exit 1."""
    from micromag.errors import MagError, ProblemError

    from ..errors import OperationFailed
    try:
        yield
    except ProblemError as e:
        raise CliError(str(e)) from None
    except MagError as e:
        raise OperationFailed(str(e)) from None


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m ivcloud.cli.mag ...` == `ivcloud mag ...`."""
    from . import main as top
    return top(["mag"] + list(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
