"""`ivcloud mag`: run micromagnetic problems and benchmark the solver.

    ivcloud mag run PROBLEM.toml --out DIR [--np N] [--transport T] [--quiet]
                    [--resume] [--checkpoint-every SECONDS]
    ivcloud mag check PROBLEM.toml          validate, print the effective TOML
    ivcloud mag bench [--json FILE] [--np 1,2] [--problems bar,sp4]
    ivcloud mag converge PROBLEM.toml --out DIR [--cells 10,5,3.3] [--layers 3]
                    [--reference auto|none|FILE]

The solver is the `micromag` package (its own package in this
repository; it never imports ivcloud). This module is the command on top:
argument parsing, launching, and turning micromag's errors into one line
on stderr (ProblemError and MeshError: bad input, exit status 2; any
other MagError: a failed run, exit status 1).

With --np > 1 `run` re-launches itself under mpirun (ivcloud.mpi builds
the command line; the transport is Open MPI's shared memory unless
--transport says otherwise); started under mpirun by the user it runs
on the ranks it was given. The problem is validated before anything is
launched or written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from micromag.parallel import clean_mpi_env, under_mpirun

from . import CliError, positive_int

CHILD_FLAG = "--mpi-child"
TRANSPORTS = ("vader", "tcp", "ivshmem")
REPO = Path(__file__).resolve().parents[2]
BENCH_PROBLEMS = ("bar", "sp4")


def _np_list(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of "
                                         f"integers")
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"'{text}': rank counts must be "
                                         f"positive")
    return out


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v >= 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of "
                                         f"seconds >= 0")
    return v


def register(sub) -> None:
    p = sub.add_parser("mag", help="micromagnetic FEM solver (LLG, PETSc)",
                       description="Finite-element micromagnetics: "
                                   "exchange, demagnetization (FEM/BEM), "
                                   "anisotropy, Zeeman; LLG dynamics and "
                                   "energy minimisation on MPI ranks.")
    # sub-parsers inherit the top parser's class: one-line usage errors
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    run = acts.add_parser("run", help="run a problem file")
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
    run.set_defaults(func=cmd_run)

    chk = acts.add_parser("check", help="validate a problem file and print "
                                        "its effective configuration")
    chk.add_argument("problem")
    chk.set_defaults(func=cmd_check)

    b = acts.add_parser("bench", help="time the solver on the thesis bar "
                                      "and standard problem 4")
    b.add_argument("--json", help="write the results to this file")
    b.add_argument("--np", type=_np_list, default=[1, 2],
                   help="rank counts, comma-separated (default 1,2)")
    b.add_argument("--problems", default=",".join(BENCH_PROBLEMS),
                   help="comma-separated example names (default bar,sp4)")
    b.add_argument("--examples", default=str(REPO / "examples"),
                   help="directory of the example problem files")
    b.add_argument("--transport", choices=TRANSPORTS, default="vader")
    b.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds per run before it is stopped")
    b.set_defaults(func=cmd_bench)

    c = acts.add_parser("converge", help="mesh-convergence study of a "
                                         "structured-box problem (e.g. "
                                         "standard problem 4)")
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
    c.add_argument("--times", default=None,
                   help="stage times (s) to compare, comma-separated "
                        "(default 0.1, 0.2, 0.5 and 1 of 1 ns, scaled "
                        "to the duration)")
    c.add_argument("--tol", type=float, default=0.01,
                   help="largest change of a component under refinement "
                        "called converged (default 0.01)")
    c.add_argument("--np", type=positive_int, default=1)
    c.add_argument("--checkpoint-every", type=_seconds, default=60.0,
                   metavar="SECONDS",
                   help="checkpoint each run every this many wall seconds "
                        "(default 60); an interrupted run continues from "
                        "its checkpoint when the study is started again")
    c.add_argument("--transport", choices=TRANSPORTS, default="vader")
    c.add_argument("--reference", default="auto", metavar="auto|none|FILE",
                   help="reference <m>(t) for the table and plot: auto "
                        "(the published solution for standard problem 4, "
                        "field 1, when the problem is that one), none, or "
                        "a file of rows 't mx my mz' (t in s)")
    c.add_argument("--no-run", action="store_true",
                   help="only compare what the runs in --out have so far")
    c.set_defaults(func=cmd_converge)


def _load(path: str):
    from micromag.errors import ProblemError
    from micromag.problem import load
    try:
        return load(path)
    except ProblemError as e:
        raise CliError(str(e)) from None


def _check_out(out: str) -> Path:
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise CliError(f"--out {p} exists and is not a directory")
    return p


def cmd_check(args) -> int:
    from micromag.problem import to_toml
    prob = _load(args.problem)
    sys.stdout.write(to_toml(prob.config))
    return 0


def cmd_run(args) -> int:
    if getattr(args, "mpi_child", False) or under_mpirun() \
            or args.np == 1:
        return _run_here(args)
    prob = _load(args.problem)     # refuse bad input before launching
    del prob
    out = _check_out(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from .. import mpi
    program = [sys.executable, "-m", "ivcloud", "mag", "run",
               str(Path(args.problem).resolve()), "--out",
               str(out.resolve()), CHILD_FLAG]
    if args.quiet:
        program.append("--quiet")
    if args.resume:
        program.append("--resume")
    program += ["--checkpoint-every", repr(args.checkpoint_every)]
    env = clean_mpi_env(os.environ)
    # the ranks import these very trees (ivcloud and micromag), wherever
    # the parent found them
    import micromag
    roots = [str(REPO), str(Path(micromag.__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p]))
    # one thread per rank: the ranks are the parallelism
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        return mpi.run(program, args.np, transport=args.transport, env=env)
    except mpi.MpiSetupError as e:
        raise CliError(str(e)) from None


def _run_here(args) -> int:
    from micromag.ranks import one_thread_per_rank, run_on_ranks
    one_thread_per_rank()
    from micromag.errors import MagError, ProblemError
    prob = _load(args.problem)
    out = _check_out(args.out)
    try:
        run_on_ranks(prob, out, not args.quiet, sys.argv[1:], "ivcloud mag",
                     resume=args.resume,
                     checkpoint_every=args.checkpoint_every)
    except MagError as e:
        err = CliError(str(e))
        if not isinstance(e, ProblemError):
            err.exit_code = 1        # a valid problem that failed to run
        raise err from None
    return 0


# ---------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    examples = Path(args.examples)
    names = [n.strip() for n in args.problems.split(",") if n.strip()]
    files = {}
    for name in names:
        f = examples / f"{name}.toml"
        if not f.is_file():
            raise CliError(f"example problem {f} not found")
        _load(str(f))
        files[name] = f
    runs = []
    with tempfile.TemporaryDirectory(prefix="ivcloud-mag-bench-") as tmp:
        for name in names:
            for np_ in args.np:
                out = Path(tmp) / f"{name}-{np_}"
                cmd = [sys.executable, "-m", "ivcloud", "mag", "run",
                       str(files[name]), "--out", str(out), "--np",
                       str(np_), "--transport", args.transport, "--quiet"]
                sys.stderr.write(f"bench: {name} on {np_} rank(s) ...\n")
                sys.stderr.flush()
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, capture_output=True,
                                          text=True, timeout=args.timeout,
                                          stdin=subprocess.DEVNULL)
                except subprocess.TimeoutExpired:
                    runs.append({"problem": name, "ranks": np_,
                                 "error": f"timeout after {args.timeout} s"})
                    continue
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    runs.append({"problem": name, "ranks": np_,
                                 "error": f"exit {proc.returncode}: {tail}"})
                    sys.stderr.write(f"bench: {name} failed: {tail}\n")
                    continue
                s = json.loads((out / "summary.json").read_text())
                entry = {
                    "problem": name, "ranks": np_,
                    "nodes": s["nodes"], "boundary_nodes":
                        s["boundary_nodes"], "demag": s["demag"],
                    "time_to_solution_s": round(wall, 3),
                    "solve_time_s": round(s["solve_time_s"], 3),
                    "setup_time_s": round(s["setup_time_s"], 3),
                    "solve_cpu_s_max_rank": round(
                        s.get("solve_cpu_s", {}).get("max", 0.0), 3),
                    "steps": s["steps"], "rejected_steps":
                        s["rejected_steps"],
                    "relax_iterations": s["relax_iterations"],
                    "rhs_evals": s["rhs_evals"],
                    "field_evals": s["field_evals"],
                    "peak_rss_mb_per_rank": round(
                        s["peak_rss_mb"]["max"], 1),
                    "peak_rss_mb_total": round(s["peak_rss_mb"]["sum"], 1),
                    "peak_rss_mb_ranks": [round(v, 1) for v in
                                          s["peak_rss_mb"]["per_rank"]],
                    "field_time_s": round(s.get("field_time_s", 0.0), 3),
                    "ms_per_field_eval": round(
                        1e3 * s.get("field_time_s", 0.0)
                        / max(1, s["field_evals"]), 4),
                    "m_final": [round(v, 5) for v in s["m_final"]],
                }
                runs.append(entry)
                sys.stderr.write(
                    f"bench: {name} np={np_}: {wall:.2f} s to solution "
                    f"(solve {s['solve_time_s']:.2f} s), {s['steps']} steps, "
                    f"{s['field_evals']} field evaluations "
                    f"({entry['ms_per_field_eval']:.3g} ms each), peak "
                    f"{entry['peak_rss_mb_ranks']} MB per rank\n")
    for name in names:
        base = [r for r in runs if r["problem"] == name and r["ranks"] == 1
                and "error" not in r]
        for r in runs:
            if r["problem"] == name and base and "error" not in r:
                # speedup/efficiency: of the solve (the stages), as
                # before; *_time_to_solution: of the wall time of the
                # whole command as a user sees it (start-up, set-up and
                # outputs included), the figure the goal is for
                t1 = base[0]["solve_time_s"]
                r["speedup"] = round(t1 / r["solve_time_s"], 3)
                r["efficiency"] = round(t1 / r["solve_time_s"] / r["ranks"],
                                        3)
                w1 = base[0]["time_to_solution_s"]
                w = r["time_to_solution_s"]
                r["speedup_time_to_solution"] = round(w1 / w, 3)
                r["efficiency_time_to_solution"] = round(
                    w1 / w / r["ranks"], 3)
                if r["ranks"] > 1:
                    sys.stderr.write(
                        f"bench: {name} on {r['ranks']} ranks: efficiency "
                        f"{r['efficiency_time_to_solution']:.2f} (time to "
                        f"solution), {r['efficiency']:.2f} (solve)\n")
    report = {"benchmark": "ivcloud mag bench", "host": platform.node(),
              "cpus": os.cpu_count(), "transport": args.transport,
              "anchors": {"magpar_bar_1_vcpu_s": 114, "magpar_bar_4_vcpu_s":
                          65, "target_bar_1_core_s": 10,
                          "target_efficiency_2_ranks": 0.8},
              "runs": runs}
    text = json.dumps(report, indent=2) + "\n"
    if args.json:
        Path(args.json).write_text(text)
    sys.stdout.write(text)
    return 0 if all("error" not in r for r in runs) else 1


# ---------------------------------------------------------------- converge

def cmd_converge(args) -> int:
    from micromag import convergence as cv
    from micromag.checkpoint import peek
    from micromag.errors import ProblemError
    prob = _load(args.problem)
    try:
        cells = cv.parse_cells(args.cells)
        layers = dict(zip(cells, cv.parse_layers(args.layers, len(cells))))
        texts = {c: cv.problem_toml(prob, c, layers[c], args.duration)
                 for c in cells}
    except ProblemError as e:
        raise CliError(f"{args.problem}: {e}") from None
    try:
        if args.reference == "none":
            reference = None
        elif args.reference == "auto":
            reference = cv.reference_for(prob)
        else:
            reference = cv.read_reference(args.reference)
    except ProblemError as e:
        raise CliError(str(e)) from None
    llg = [s for s in prob.config["stage"] if s["type"] == "llg"][-1]
    duration = args.duration or llg["duration"]
    if args.times:
        try:
            times = [float(x) for x in args.times.split(",") if x.strip()]
        except ValueError:
            raise CliError(f"--times '{args.times}' is not a list of "
                           f"numbers") from None
    else:
        times = [f * duration for f in (0.1, 0.2, 0.5, 1.0)]
    out = _check_out(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dirs = {c: out / f"h{c:g}" for c in cells}
    # a finished or interrupted run of another text (other layers, another
    # duration) must not be taken for this one; all looked at before any
    # run starts, so a refusal costs no compute
    for c, d in dirs.items():
        old = d / "problem.toml"
        if (old.is_file() and old.read_text() != texts[c]
                and ((d / "summary.json").is_file()
                     or cv.table_path(d / "run") is not None)):
            raise CliError(f"{d} holds a run of another problem (other "
                           f"layers or duration?): use another --out")
    failed = []
    for c, d in dirs.items():
        d.mkdir(exist_ok=True)
        (d / "problem.toml").write_text(texts[c])
        if args.no_run or (d / "summary.json").is_file():
            continue
        unit = prob.config["mesh"]["unit"]
        ck = peek(d / "run")
        how = "" if ck is None else (
            f" (continuing from the checkpoint at stage {ck['stage']}, "
            f"t = {ck['t']:.4g} s, if it fits the problem)")
        sys.stderr.write(f"converge: cells of {c:g} {unit}, "
                         f"{layers[c]} layer(s){how} ...\n")
        sys.stderr.flush()
        # an interrupted run continues: its checkpoint is tied to the
        # problem text, mesh and solver, so a changed study starts over
        cmd = [sys.executable, "-m", "ivcloud", "mag", "run",
               str(d / "problem.toml"), "--out", str(d / "run"), "--np",
               str(args.np), "--transport", args.transport, "--quiet",
               "--resume", "--checkpoint-every",
               repr(args.checkpoint_every)]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            failed.append(c)
            continue
        (d / "summary.json").write_text((d / "run" / "summary.json")
                                        .read_text())
    curves = {}
    for c, d in dirs.items():
        if cv.table_path(d / "run") is not None:
            curves[c] = cv.read_curve(d / "run")
    if not curves:
        raise CliError(f"no results in {out}")
    report = cv.compare(curves, times, reference=reference)
    if not cv.refined_alike(cells, [layers[c] for c in cells]):
        # Richardson needs one refinement parameter: cells and layers
        # refined in different ratios have none
        report["richardson"] = None
    report.update(problem=str(Path(args.problem).resolve()),
                  cells=cells, layers=[layers[c] for c in cells],
                  duration_s=duration,
                  tol=args.tol, failed=failed,
                  converged_cells=cv.converged(report, args.tol),
                  complete=[c for c in cells
                            if (dirs[c] / "summary.json").is_file()])
    (out / "convergence.json").write_text(json.dumps(report, indent=2)
                                          + "\n")
    cv.plot(curves, out / "convergence.png",
            title=f"{prob.title}: in-plane cells "
                  f"{', '.join(f'{c:g}' for c in cells)} "
                  f"{prob.config['mesh']['unit']}, layers "
                  f"{', '.join(str(layers[c]) for c in cells)}",
            reference=reference)
    sys.stdout.write(cv.format_table(report) + "\n")
    if len(cells) > 1 and len(set(layers.values())) == 1:
        n = layers[cells[0]]
        sys.stdout.write(f"\nlayers: {n} at every size, so the study "
                         f"converges to the {n}-layer film (for a thin "
                         f"film not the limit: docs/mag.md, 'sixth "
                         f"session'); refine them in proportion, e.g. "
                         f"--layers {','.join(str(round(n * cells[0] / c)) for c in cells)}\n")
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m ivcloud.cli.mag ...` == `ivcloud mag ...`."""
    from . import main as top
    return top(["mag"] + list(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
