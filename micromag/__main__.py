"""`python3 -m micromag run PROBLEM.toml --out DIR [--quiet]`: the
solver's own command, for machines that have the python3-micromag
package but not ivcloud (the guests of a VM cluster). It runs on the
ranks it was started with (`mpirun -np N python3 -m micromag run ...`);
`ivcloud mag` is the full command (launching on N ranks, checks,
benchmarks). `--resume` and `--checkpoint-every` as for `ivcloud mag
run` (simulation.run). Bad input: one line on stderr, exit status 2; a run that
failed: exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "micromag"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        sys.stderr.write(f"{PROG}: error: {' '.join(message.split())}\n")
        sys.exit(2)


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description="Run a micromagnetic problem file "
                                       "on this process's MPI ranks.")
    acts = p.add_subparsers(dest="action", metavar="ACTION",
                            parser_class=_Parser)
    acts.required = True
    run = acts.add_parser("run", help="run a problem file")
    run.add_argument("problem", help="problem file (TOML)")
    run.add_argument("--out", required=True, help="output directory")
    run.add_argument("--quiet", action="store_true",
                     help="no progress display")
    run.add_argument("--resume", action="store_true",
                     help="continue an interrupted run in --out from its "
                          "checkpoint")
    run.add_argument("--checkpoint-every", type=float, default=60.0,
                     metavar="SECONDS",
                     help="checkpoint every this many wall seconds "
                          "(default 60)")
    args = p.parse_args(argv)
    if not args.checkpoint_every >= 0:
        p.error("--checkpoint-every must be a number of seconds >= 0")

    from .ranks import one_thread_per_rank, run_on_ranks
    one_thread_per_rank()
    from .errors import MagError, ProblemError
    from .problem import load
    out = Path(args.out)
    try:
        prob = load(args.problem)
        if out.exists() and not out.is_dir():
            raise ProblemError(f"{out} exists and is not a directory")
        run_on_ranks(prob, out, not args.quiet, sys.argv[1:], PROG,
                     resume=args.resume,
                     checkpoint_every=args.checkpoint_every)
    except MagError as e:
        sys.stderr.write(f"{PROG}: error: {' '.join(str(e).split())}\n")
        return 2 if isinstance(e, ProblemError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
