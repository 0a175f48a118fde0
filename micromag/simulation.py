"""Running a problem: the Python API (behind `ivcloud mag run`).

    from micromag import problem, simulation
    prob = problem.load("examples/bar.toml")
    summary = simulation.run(prob, "out/bar")        # under mpirun: parallel

    sim = simulation.Simulation(prob)                # or step by step
    sim.run_stage(sim.stages[0])
    print(sim.state.average_m())

    simulation.run(prob, "out/bar", resume=True)     # continue a killed run

A run checkpoints its state (micromag.checkpoint) at the end of every
stage and every `checkpoint_every` wall seconds (and with every snapshot)
into its staging directory; with resume=True a run whose checkpoint
matches the problem continues from it.

Every rank calls the same functions (collective); rank 0 writes files and
the progress display. Results do not depend on the number of ranks
beyond solver tolerance (see fem.py).
"""

from __future__ import annotations

import math
import resource
import time
import traceback
from typing import Dict, List, Optional

import numpy as np

from . import checkpoint as ckpt_mod
from . import problem as problem_mod
from .constants import MU0, RAD_PER_S_TO_DEG_PER_NS
from .errors import IntegrationError, MagError, ProblemError, SimulationError
from .llg import Dynamics, integrate, minimize
from .output import Progress, Results, plot_m
from .parallel import comm_world, petsc
from .problem import StageSettings
from .state import State
from .terms import schur
from .terms import CubicAnisotropy, Exchange, UniaxialAnisotropy, Zeeman
from .terms.demag_grid import exchange_length
from .terms.demag_method import make_demag, resolve_for


# The u1 (Neumann) solve of the demagnetizing field, unless the problem
# file says otherwise: a Cholesky factorization of the whole (constant)
# stiffness matrix, done once and held on every rank (PETSc's "redundant"
# PC), applied once per solve (KSP "preonly"). The shift turns the one
# zero pivot of the singular Neumann matrix into a pinned node: for a
# right-hand side with zero sum (D m always has one) the factor then
# solves K u1 = D m up to round-off and a constant, which potential()
# removes.
# Block Jacobi/ICC(0), demag.py's own default, needed 24 CG iterations per
# solve on 1 rank of standard problem 4 and 42 on 2 (the blocks lose the
# coupling across the cut). CG around the factor took ~1 iteration but
# two applications of the factor (the initial residual and one step):
# 1.2 ms per solve on the bar against 0.42 ms with one application.
POISSON_DIRECT = {"demag_poisson_ksp_type": "preonly",
                  "demag_poisson_pc_type": "redundant",
                  "demag_poisson_redundant_pc_type": "cholesky",
                  "demag_poisson_redundant_pc_factor_shift_type": "nonzero",
                  "demag_poisson_redundant_pc_factor_mat_ordering_type":
                      "nd"}
# On more than one rank the same direct solve without replicating the
# whole factor: every rank factors its own block, a dense Schur
# complement on the interface between the blocks joins them
# (terms/schur.py). The bar, 2 ranks: 0.29 ms per solve
# against 0.42 ms for the replicated factor, the same field to round-off.
POISSON_SCHUR = {"demag_poisson_ksp_type": "preonly",
                 "demag_poisson_pc_type": "python",
                 "demag_poisson_pc_python_type":
                     "micromag.terms.schur.InterfaceSchurPC"}
# beyond this many nodes the replicated factor is left to the user
POISSON_DIRECT_MAX_NODES = 200_000


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Simulation:
    """Mesh, space, state and terms of a problem, ready to run stages."""

    def __init__(self, prob: problem_mod.Problem, comm=None,
                 progress: Optional[Progress] = None):
        self.comm = comm if comm is not None else comm_world()
        self.rank = self.comm.Get_rank()
        self.problem = prob
        self.progress = progress or Progress(enabled=False)
        self.notes: List[str] = []
        t0 = time.perf_counter()
        if prob.petsc:
            opts = petsc().Options()
            for key, value in prob.petsc:
                opts[key.lstrip("-")] = ("" if value is True else value)

        # the mesh is built once (gmsh is not MPI-aware) and broadcast
        mesh = err = None
        if self.rank == 0:
            try:
                mesh = problem_mod.build_mesh(prob.mesh)
            except Exception as e:  # reported on every rank below
                err = f"{type(e).__name__}: {e}" if not isinstance(
                    e, ValueError) else str(e)
        mesh, err = self.comm.bcast((mesh, err), root=0)
        if err:
            raise ProblemError(f"mesh: {err}")
        from .fem import FEMSpace
        from .mesh import stacks
        self.space = FEMSpace(mesh, self.comm, stacks=stacks(mesh.points)
                              if prob.mesh.uniform_z else None)
        sp = self.space
        mats = problem_mod.material_arrays(prob.materials, sp.mesh.regions)
        self.mats = mats
        self.state = State(sp, mats["Ms"], mats["alpha"], mats["gamma"])
        if prob.mesh.uniform_z:
            self.state.tie_stacks()
        self._set_initial()

        self.terms = []
        if np.any(mats["A"] > 0):
            self.terms.append(Exchange(self.state, mats["A"]))
        if np.any(mats["K1"] != 0):
            self.terms.append(UniaxialAnisotropy(self.state, mats["K1"],
                                                 mats["axis"]))
        if np.any(mats["Kc1"] != 0) or np.any(mats["Kc2"] != 0):
            self.terms.append(CubicAnisotropy(self.state, mats["Kc1"],
                                              mats["Kc2"], mats["c1"],
                                              mats["c2"]))
        self.demag = None
        if prob.demag.enabled:
            td = time.perf_counter()
            self.demag = self._make_demag()
            self.demag_setup_time = time.perf_counter() - td
            self.terms.append(self.demag)
        self.stages = prob.stages
        self.setup_time = time.perf_counter() - t0
        self.stats: Dict[str, float] = {"steps": 0, "rejected": 0,
                                        "relax_iterations": 0,
                                        "field_time": 0.0}
        # set up by `run`: its account so far and its checkpoints (the
        # same on every rank: None when they are off)
        self.log: Optional[ckpt_mod.RunLog] = None
        self.checkpoints: Optional[ckpt_mod.Writer] = None

    # ------------------------------------------------------------ setup

    def _make_demag(self):
        """The demagnetizing-field term the problem asks for; FEM/BEM
        with the direct u1 solve (POISSON_DIRECT / POISSON_SCHUR) unless
        the problem file sets its own solver."""
        sp, d = self.space, self.problem.demag
        grid_h = None if d.grid_h is None else \
            np.asarray(d.grid_h, dtype=float) * self.problem.mesh.metres
        method = resolve_for(sp, d.method)
        opts = petsc().Options()
        added = []
        if method != "grid" and \
                sp.n <= POISSON_DIRECT_MAX_NODES and not any(
                    opts.hasName(k) for k in ("demag_poisson_pc_type",
                                              "demag_poisson_ksp_type")):
            direct = POISSON_DIRECT
            if self.comm.Get_size() > 1 and schur.fits(sp.K):
                direct = POISSON_SCHUR
            for key, value in direct.items():
                if not opts.hasName(key):
                    opts[key] = value
                    added.append(key)
        mats = self.problem.materials
        try:
            return make_demag(
                sp, self.state.Ms_nodes, method, rtol=d.rtol, tol=d.tol,
                grid_tol=d.grid_tol, grid_h=grid_h,
                length=exchange_length([m.Ms for m in mats],
                                       [m.A for m in mats]))
        finally:
            for key in added:      # later solvers of this process
                opts.delValue(key)

    def _set_initial(self) -> None:
        init = self.problem.initial
        sp = self.space
        if init.type == "uniform":
            self.state.set_m(init.m)
        elif init.type == "random":
            # drawn in the input mesh's node order: same field for any
            # number of ranks
            rng = np.random.default_rng(init.seed)
            orig = rng.normal(size=(sp.n, 3))
            arr = np.empty_like(orig)
            arr[sp.perm] = orig
            self.state.set_m(arr)
        else:
            import meshio
            from scipy.spatial import cKDTree
            try:
                src = meshio.read(init.file)
                m = np.asarray(src.point_data["m"], dtype=float)
            except Exception as e:
                raise ProblemError(
                    f"initial file {init.file}: cannot read 'm' ({e})")
            tree = cKDTree(np.asarray(src.points, dtype=float)[:, :3])
            _, idx = tree.query(sp.mesh.points)
            self.state.set_m(m[idx])

    def demag_summary(self) -> str:
        """The demag method in words (progress line, summary)."""
        d = self.demag
        if d is None:
            return "off"
        if getattr(d, "grid", None) is not None:
            return f"grid, {d.grid}"
        return d.method

    def terms_for(self, stage: StageSettings,
                  t_stage0: Optional[float] = None) -> List:
        """The terms of a stage that started (or starts now) at t_stage0."""
        fields = self.problem.fields + stage.field
        terms = list(self.terms)
        if fields:
            H = problem_mod.field_function(
                fields, self.state.t if t_stage0 is None else t_stage0)
            terms.append(Zeeman(self.state, H))
        return terms

    # ------------------------------------------------------------ records

    def columns(self):
        names = [t.name for t in self.terms]
        if self.problem.fields or any(s.field for s in self.stages):
            names.append("zeeman")
        names = list(dict.fromkeys(names))
        cols = (["stage", "t", "mx", "my", "mz", "E_total"]
                + [f"E_{n}" for n in names]
                + ["Hx", "Hy", "Hz", "max_dmdt", "steps", "field_evals"])
        units = (["", "s", "", "", "", "J"] + ["J"] * len(names)
                 + ["mT", "mT", "mT", "deg/ns", "", ""])
        return cols, units

    def record(self, dyn: Dynamics, stage_index: int, m_vec=None,
               t: Optional[float] = None, steps: int = 0) -> Dict[str, float]:
        """One table row at (m_vec, t); collective."""
        st = self.state
        m_vec = st.m if m_vec is None else m_vec
        t = st.t if t is None else t
        row: Dict[str, float] = {"stage": stage_index, "t": t}
        mavg = st.average_m(m_vec)
        row.update(mx=mavg[0], my=mavg[1], mz=mavg[2])
        row["max_dmdt"] = dyn.max_dmdt(m_vec, t) * RAD_PER_S_TO_DEG_PER_NS
        energies = dyn.energies(m_vec, t)
        for name, e in energies.items():
            row[f"E_{name}"] = e
        row["E_total"] = sum(energies.values())
        for term in dyn.terms:
            if isinstance(term, Zeeman):
                H = term.value(t) * MU0 * 1e3
                row.update(Hx=H[0], Hy=H[1], Hz=H[2])
        row["steps"] = self.stats["steps"] + steps
        row["field_evals"] = self.n_field_total(dyn)
        return row

    def n_field_total(self, dyn: Optional[Dynamics] = None) -> int:
        return int(self.stats.get("field_evals", 0)
                   + (dyn.n_field if dyn is not None else 0))

    # ------------------------------------------------------------ mesh

    def mesh_original(self):
        """(points, tets) of the mesh in the input numbering."""
        sp = self.space
        order = np.argsort(sp.perm)          # new id -> old id
        return sp.to_original(sp.mesh.points), order[sp.mesh.tets]

    # ------------------------------------------------------------ stages

    def run_stage(self, stage: StageSettings, index: int = 1, results=None,
                  table=None, start: Optional[ckpt_mod.Resume] = None
                  ) -> dict:
        """Run one stage; rows go to `table` and snapshots to `results`
        (rank 0) when given. When `start` says the stage was going, it
        continues from the current state (its time st.t, its rows up to
        st.t already recorded)."""
        st = self.state
        going = start is not None and start.going(index)
        t_stage0 = start.t_stage0 if going else st.t
        terms = self.terms_for(stage, t_stage0)
        if stage.alpha is not None:
            st.set_alpha(stage.alpha)
        else:
            st.set_alpha(self.mats["alpha"])
        dyn = Dynamics(st, terms)
        rank0 = self.rank == 0
        t_run0 = st.t
        prog = self.progress
        label = f"stage {index}/{len(self.stages)} {stage.name}"

        def add_row(row):
            if rank0 and table is not None:
                table.append(row)

        if not going:
            add_row(self.record(dyn, index))
        t_wall = time.perf_counter()
        out: dict = {"name": stage.name, "type": stage.type}
        if stage.minimizes:
            def cb(it, torque):
                if rank0:
                    prog.update(f"{label}: iteration {it}, max |m x H| = "
                                f"{torque:.3g} A/m")
                return False
            res = minimize(dyn, tol=stage.tol, max_iter=stage.max_iter,
                           callback=cb)
            self.stats["relax_iterations"] += res["iterations"]
            out.update(res)
            if not res["converged"] and rank0:
                prog.message(f"{label}: not converged after "
                             f"{res['iterations']} iterations (max |m x H| "
                             f"= {res['torque']:.3g} A/m)")
        else:
            duration = stage.duration
            t_end = t_stage0 + duration
            snap_every = stage.snapshot_every or 0.0
            next_snap = [t_stage0 + snap_every if snap_every else math.inf]
            if going and start.next_snap is not None:
                next_snap[0] = start.next_snap
            stop = stage.stop_dmdt or 0.0

            def cb(report):
                row = self.record(dyn, index, report.m, report.t,
                                  steps=report.step)
                add_row(row)
                snapped = report.t >= next_snap[0] - 1e-9 * duration
                if snapped:
                    self.snapshot(results, report.m, report.t)
                    while next_snap[0] <= report.t + 1e-9 * duration:
                        next_snap[0] += snap_every
                ck = self.checkpoints
                if ck is not None and not report.final and ck.due(snapped):
                    ck.write(
                        index, False, report.m, report.t, t_stage0,
                        next_snap[0], dyn, report.step, table,
                        results.snapshots if results is not None else 0)
                if rank0:
                    frac = (report.t - t_stage0) / duration
                    el = time.perf_counter() - t_wall
                    rate = (report.t - t_run0) / el if el > 0 else 0.0
                    prog.update(
                        f"{label}: t = {report.t * 1e9:.4g} ns "
                        f"({100 * frac:.0f} %), step {report.step}, "
                        f"dt = {report.dt:.3g} s, <m> = ({row['mx']:.4f}, "
                        f"{row['my']:.4f}, {row['mz']:.4f}), "
                        f"{el:.1f} s, {rate * 1e12:.3g} ps/s")
                return bool(stop) and row["max_dmdt"] < stop
            try:
                res = integrate(dyn, t_end, method=stage.integrator,
                                rtol=stage.rtol, atol=stage.atol,
                                dt=stage.dt or None,
                                adaptive=stage.adaptive,
                                order=stage.order,
                                output_every=stage.output_every,
                                callback=cb)
            except IntegrationError as e:
                raise SimulationError(f"{label}: {e}") from None
            self.stats["steps"] += res["steps"]
            self.stats["rejected"] += res["rejected"]
            out.update(res)
        if stage.type == "relax":
            add_row(self.record(dyn, index))
        out["wall_time"] = time.perf_counter() - t_wall
        out["rhs_evals"] = dyn.n_rhs
        out["field_evals"] = dyn.n_field
        out["field_time_s"] = dyn.field_time
        self.stats["field_time"] += dyn.field_time
        self.stats["field_evals"] = self.stats.get("field_evals", 0) \
            + dyn.n_field
        self.stats["rhs_evals"] = self.stats.get("rhs_evals", 0) + dyn.n_rhs
        out["m"] = st.average_m().tolist()
        out["t_end"] = st.t
        if rank0:
            prog.finish()
            prog.message(f"{label}: done in {out['wall_time']:.2f} s, "
                         f"<m> = ({out['m'][0]:.4f}, {out['m'][1]:.4f}, "
                         f"{out['m'][2]:.4f})")
        return out

    def snapshot(self, results: Optional[Results], m_vec, t: float,
                 name: Optional[str] = None) -> None:
        """VTU of m at time t (collective gather, rank 0 writes)."""
        m = self.space.gather(m_vec)
        if self.rank == 0 and results is not None:
            sp = self.space
            results.snapshot(sp.mesh.points, sp.mesh.tets, m, t,
                             extra={"Ms": self.state.Ms_nodes}, name=name)


def _start(sim: Simulation, results: Optional[Results], resume: bool,
           every: Optional[float]) -> ckpt_mod.Resume:
    """Where the run starts (the same on every rank): from the
    checkpoint in the staging directory if `resume` and it was written
    for this very run, else from the beginning (the staging directory
    emptied). Sets up the run's log and its checkpoints (none when
    `every` is None). Collective."""
    ck = key = path = None
    if sim.rank == 0:
        points, tets = sim.mesh_original()
        key = ckpt_mod.key(sim.problem, points, tets)
        path = results.stage_dir / ckpt_mod.NAME
        if resume:
            ck, why = ckpt_mod.load_matching(path, key, sim.space.n,
                                             sim.columns()[0])
            if ck is None:
                sim.progress.message(f"note: {why}: starting from the "
                                     f"beginning")
                results.reset()
    ck = sim.comm.bcast(ck, root=0)
    start = ckpt_mod.Resume() if ck is None else ckpt_mod.Resume.of(ck)
    sim.log = start.log(sim.columns()[0])
    if every is not None:
        sim.checkpoints = ckpt_mod.Writer(sim, path, key, every, sim.log)
    return start


def _open_table(sim: Simulation, results: Optional[Results],
                start: ckpt_mod.Resume):
    """The run's table (rank 0; None elsewhere) with the rows of the run
    so far; the run's first lines of progress."""
    if sim.rank != 0:
        return None
    prog, sp = sim.progress, sim.space
    prog.message(f"mesh: {sp.mesh.summary()}, {len(sp.boundary_nodes)} "
                 f"boundary nodes; demag: {sim.demag_summary()}; "
                 f"{sim.comm.Get_size()} rank(s); setup "
                 f"{sim.setup_time:.2f} s")
    if start.resumes:
        results.restore(start.snapshots)
        prog.message(f"resuming stage {start.stage} "
                     f"({'finished' if start.done else 'going'}) at t = "
                     f"{start.t:.6g} s from "
                     f"{results.stage_dir / ckpt_mod.NAME}")
    results.write_text("effective.toml",
                       problem_mod.to_toml(sim.problem.config))
    cols, units = sim.columns()
    table = results.open_table(sim.problem.title or "micromag", cols, units)
    for row in start.rows:
        table.append(dict(zip(cols, row)))
    return table


def run(prob: problem_mod.Problem, out_dir, comm=None,
        progress: bool = True, argv: Optional[List[str]] = None,
        resume: bool = False,
        checkpoint_every: Optional[float] = 60.0) -> dict:
    """Run all stages of `prob`, writing results into out_dir; returns
    the summary (also written as summary.json). Collective.

    The state is checkpointed at the end of every stage, with every
    snapshot and every `checkpoint_every` wall seconds (0: at every table
    row; None: never). `resume`: continue from the checkpoint an
    interrupted run left in out_dir if it was written for this very
    problem, mesh and solver (else start from the beginning); on any
    number of ranks."""
    comm = comm if comm is not None else comm_world()
    t_start = time.perf_counter()
    rank0 = comm.Get_rank() == 0
    prog = Progress(enabled=progress and rank0)
    results = Results(out_dir, keep=resume) if rank0 else None
    try:
        sim = Simulation(prob, comm, prog)
        for note in sim.notes:
            prog.message(f"note: {note}")
        start = _start(sim, results, resume, checkpoint_every)
        table = _open_table(sim, results, start)
        sim.stats = start.restore(sim.state, sim.space.perm) or sim.stats
        cpu_solve = time.process_time()
        sim.log.t_solve = time.perf_counter()
        for i, stage in enumerate(sim.stages, start=1):
            if start.finished(i):
                continue
            if not start.going(i):
                sim.log.stage_starts.append(sim.state.t)
            sim.log.stage_out.append(sim.run_stage(stage, i, results, table,
                                                   start))
            if sim.checkpoints is not None:
                sim.checkpoints.write(i, True, table=table,
                                      snapshots=results.snapshots
                                      if results is not None else 0)
        solve_time = sim.log.solve_time()
        # CPU seconds of the solve per rank: on a shared machine a
        # steadier figure than the wall time (MPI waits spin, so a rank
        # that waits is still counted while it runs)
        solve_cpu = comm.gather(time.process_time() - cpu_solve, root=0)
        if prob.output.vtu:
            sim.snapshot(results, sim.state.m, sim.state.t,
                         name="m_final.vtu")
        summary = _summary(sim, argv, solve_time)
        rss = comm.gather(_peak_rss_mb(), root=0)
        if rank0:
            summary["solve_cpu_s"] = {"max": max(solve_cpu),
                                      "per_rank": solve_cpu}
            summary["peak_rss_mb"] = {"max": max(rss), "sum": sum(rss),
                                      "per_rank": rss}
            summary["wall_time_s"] = time.perf_counter() - t_start
            _finish(sim, results, table, summary)
        return summary
    except BaseException as e:
        if results is not None:
            prog.finish()
            msg = str(e) if isinstance(e, MagError) else \
                "".join(traceback.format_exception(e))
            results.fail(msg)
        raise


def _summary(sim: Simulation, argv, solve_time: float) -> dict:
    """The run's summary (the same on every rank)."""
    sp, prob, stats, demag = sim.space, sim.problem, sim.stats, sim.demag
    grid = getattr(demag, "grid", None)
    return {
        "title": prob.title,
        "problem": str(prob.path) if prob.path else None,
        "ranks": sim.comm.Get_size(),
        "nodes": sp.n, "tets": int(len(sp.mesh.tets)),
        "boundary_nodes": int(len(sp.boundary_nodes)),
        "demag": demag is not None,
        "demag_method": getattr(demag, "method", None),
        "demag_grid": None if grid is None
        else {"cells": list(grid.n), "h_m": grid.h.tolist()},
        "terms": [t.name for t in sim.terms],
        "setup_time_s": sim.setup_time,
        "solve_time_s": solve_time,
        "steps": int(stats["steps"]),
        "rejected_steps": int(stats["rejected"]),
        "relax_iterations": int(stats["relax_iterations"]),
        "rhs_evals": int(stats.get("rhs_evals", 0)),
        "field_evals": int(stats.get("field_evals", 0)),
        "field_time_s": stats["field_time"],
        "t_end_s": sim.state.t,
        "m_final": sim.state.average_m().tolist(),
        "stages": sim.log.stage_out,
        "notes": sim.notes,
        "argv": argv,
        "resumed": sim.log.resumed,
    }


def _finish(sim: Simulation, results: Results, table, summary: dict
            ) -> None:
    """Rank 0: the plot of <m>(t), summary.json, the results in place."""
    prob = sim.problem
    if prob.output.png and table is not None:
        arr = table.array()
        c = table.columns
        keep = arr[:, c.index("stage")] > 0
        plot_m(results.stage_dir / "m_t.png", arr[keep, c.index("t")],
               arr[keep][:, [c.index("mx"), c.index("my"), c.index("mz")]],
               prob.title, sim.log.stage_starts[1:])
    results.write_json("summary.json", summary)
    results.commit()
