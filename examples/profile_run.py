"""Where the time of a run goes: wall-clock timers around each part of a
field evaluation and of a step, per rank (docs/mag.md, "Where the time
goes").

    mpirun -np 2 python examples/profile_run.py examples/sp4.toml OUT

Runs the problem as `ivcloud mag run` does (simulation.run) with the
methods below wrapped in timers, then prints per rank each part's share
of the solve time, the counts behind it, and writes PETSc's event log
to OUT/petsc_log.txt and the figures to OUT/profile.rankN.json. Parts
called inside others are taken out of them; the relax stage's row
overlaps the field rows (its evaluations are counted there too). The
timers cost about a microsecond per call, against milliseconds per
field evaluation.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from micromag import checkpoint, llg, problem, simulation  # noqa: E402
from micromag import state as state_mod  # noqa: E402
from micromag.parallel import comm_world, petsc  # noqa: E402
from micromag.terms import demag_grid, exchange  # noqa: E402

TIME = defaultdict(float)
COUNT = defaultdict(int)
IN_STEPS = defaultdict(float)      # the part of TIME inside integrate()
IN_STACKS = defaultdict(float)     # ... inside Dynamics.stack_field
_depth = {"integrate": 0, "stacks": 0}

WRAPPED = [
    (exchange.Exchange, "h"), (demag_grid.GridDemag, "h"),
    (demag_grid.GridDemag, "E"), (demag_grid.GridDemag,
                                  "grid_magnetization"),
    (demag_grid._SlabConvolution, "apply"),
    (demag_grid._SerialConvolution, "apply"),
    (llg.Dynamics, "field"), (llg.Dynamics, "_field"), (llg.Dynamics, "rhs"),
    (llg.Dynamics, "stack_field"), (llg.Dynamics, "rhs_stacks"),
    (llg.Dynamics, "dmdt_local"), (simulation.Simulation, "record"),
    (simulation.Simulation, "snapshot"), (checkpoint.Writer, "write"),
    (checkpoint.Writer, "due"), (state_mod.State, "normalize"),
    (state_mod.State, "max_norm_deviation"), (llg, "integrate"),
    (llg, "minimize")]


def _wrap(owner, name: str) -> None:
    key = f"{getattr(owner, '__name__', owner)}.{name}".split(".")[-2:]
    key = ".".join(key)
    fn = getattr(owner, name)
    outer = key == "llg.integrate"
    stacks = key == "Dynamics.stack_field"

    def timed(*args, **kw):
        inside = _depth["integrate"] > 0
        in_stacks = _depth["stacks"] > 0
        _depth["integrate"] += outer
        _depth["stacks"] += stacks
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.perf_counter() - t0
            _depth["integrate"] -= outer
            _depth["stacks"] -= stacks
            TIME[key] += dt
            COUNT[key] += 1
            if inside:
                IN_STEPS[key] += dt
            if in_stacks:
                IN_STACKS[key] += dt
    setattr(owner, name, timed)


def shares(solve: float) -> list:
    """(part, seconds) with the nested parts taken out of their callers."""
    g = TIME.__getitem__
    n = COUNT.__getitem__
    per_field = g("Dynamics.field") / max(n("Dynamics.field"), 1)
    per_dmdt = g("Dynamics.dmdt_local") / max(n("Dynamics.dmdt_local"), 1)
    conv = g("_SlabConvolution.apply") + g("_SerialConvolution.apply")
    per_stacks = g("Dynamics.stack_field") / max(
        n("Dynamics.stack_field"), 1)
    post = sum(IN_STEPS[k] for k in (
        "Dynamics.rhs", "Dynamics.rhs_stacks", "Simulation.record", "Writer.write", "Writer.due",
        "Simulation.snapshot", "State.normalize",
        "State.max_norm_deviation"))
    return [
        ("exchange field", g("Exchange.h")),
        ("demag: nodes to grid", g("GridDemag.grid_magnetization")),
        ("demag: convolution (FFT, MPI)", conv),
        ("demag: grid to nodes, energies", g("GridDemag.h")
         + g("GridDemag.E") - g("GridDemag.grid_magnetization") - conv),
        ("field(): sum, zero, state swap", g("Dynamics.field")
         - g("Exchange.h") - g("GridDemag.h")),
        ("LLG m x H", g("Dynamics.dmdt_local")),
        ("rhs(): array views", g("Dynamics.rhs")
         - n("Dynamics.rhs") * (per_field + per_dmdt)),
        # m tied over stacks (State.stacks): the terms' stack fields
        # (exchange, the demag's transfers, Zeeman) and their sum, the
        # convolution and any nodal term (field()) taken out
        ("stack_field(): terms on the stacks, sum",
         g("Dynamics.stack_field") - IN_STACKS["_SlabConvolution.apply"]
         - IN_STACKS["_SerialConvolution.apply"]
         - IN_STACKS["Dynamics._field"]),
        ("rhs_stacks(): array views", g("Dynamics.rhs_stacks")
         - n("Dynamics.rhs_stacks") * (per_stacks + per_dmdt)),
        ("integrator's own work", g("llg.integrate") - post),
        ("table rows", g("Simulation.record")),
        ("|m| checks, renormalization", g("State.normalize")
         + g("State.max_norm_deviation")),
        ("checkpoints, snapshots", g("Writer.write") + g("Writer.due")
         + g("Simulation.snapshot")),
        ("relax stage (minimize)", g("llg.minimize"))]


def main(argv) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: profile_run.py PROBLEM.toml OUT\n")
        return 2
    for owner, name in WRAPPED:
        _wrap(owner, name)
    # simulation.py imported these by name before they were wrapped
    simulation.integrate, simulation.minimize = llg.integrate, llg.minimize
    comm = comm_world()
    PETSc = petsc()
    PETSc.Log.begin()
    prob = problem.load(argv[0])
    summary = simulation.run(prob, argv[1], comm=comm, progress=False)
    viewer = PETSc.Viewer().createASCII(str(Path(argv[1]) /
                                            "petsc_log.txt"),
                                        comm=PETSc.COMM_WORLD)
    PETSc.Log.view(viewer)
    solve = summary["solve_time_s"]
    rows = shares(solve)
    rank = comm.Get_rank()
    (Path(argv[1]) / f"profile.rank{rank}.json").write_text(json.dumps(
        {"solve_time_s": solve, "seconds": dict(rows),
         "timers": dict(TIME), "counts": dict(COUNT)}, indent=1))
    lines = [f"rank {rank}: solve {solve:.1f} s, "
             f"{summary['field_evals']} field evaluations, "
             f"{summary['rhs_evals']} right-hand sides, "
             f"{summary['steps']} steps ({summary['rejected_steps']} "
             f"rejected), {summary['relax_iterations']} relax iterations"]
    lines += [f"  {name:34s} {sec:9.2f} s {100 * sec / solve:5.1f} %"
              for name, sec in rows]
    for text in comm.gather("\n".join(lines), root=0) or []:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
