"""The parts of one field evaluation and of one step, on one rank
(docs/mag.md, "Performance"): process CPU time, so that time spent
descheduled on a busy machine is left out.

    python examples/profile_eval.py examples/sp4.toml [--ps 5] [--reps 40]
        [--rounds 5]

Builds the problem as `ivcloud mag run` does, relaxes it (its relax
stages, if any), then times each part of an evaluation at that state
(medians of 5 blocks of `reps` calls, after 10 to warm up) and
integrates its first llg stage for `ps` picoseconds with a timer around
the right-hand side: the rest of the step is the integrator's own work
(PETSc's stage sums and error norm, the post-step |m| check). With the
grid demag on FFTW's plans, also the same convolution on scipy.fft, the
two alternating for `rounds` rounds. Prints one JSON object
(milliseconds)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# as `ivcloud mag run` has it: one BLAS thread (OpenBLAS's threaded
# daxpy made PETSc's VecAXPY of 30,753 values 5x slower here)
from micromag.ranks import one_thread_per_rank  # noqa: E402
one_thread_per_rank()

from micromag import llg, problem, simulation  # noqa: E402
from micromag.parallel import comm_world  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    blocks = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        blocks.append((time.process_time() - t0) / reps * 1e3)
    return statistics.median(blocks)


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--ps", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds of the FFT engines")
    a = ap.parse_args(argv)
    prob = problem.load(a.problem)
    sim = simulation.Simulation(prob, comm_world())
    st = sim.state
    for stage in prob.stages:
        if stage.type == "relax":
            llg.minimize(llg.Dynamics(st, sim.terms_for(stage, 0.0)),
                         tol=stage.tol)
    stage = next(s for s in prob.stages if s.type == "llg")
    terms = sim.terms_for(stage, 0.0)
    dyn = llg.Dynamics(st, terms)
    sp = sim.space
    work, F = sp.vector_vec(), sp.vector_vec()
    m = st.m.getArray(readonly=True).reshape(-1, 3)
    out = {"nodes": sp.n}
    for term in terms:
        out[f"{term.name}: h()"] = timed(lambda: term.h(st, work), a.reps)
    dm = sim.demag
    if getattr(dm, "grid", None) is not None:
        part = dm.grid_magnetization(m)
        H = dm.grid_field(m, part)
        conv = dm.conv
        out["demag: nodes to grid"] = timed(
            lambda: dm.grid_magnetization(m), a.reps)
        out["demag: convolution"] = timed(lambda: conv.apply(part), a.reps)
        if getattr(conv, "engine", None) == "fftw":
            # the same convolution on scipy.fft, in alternating rounds
            from micromag.terms import demag_grid
            from micromag.terms.newell import octant_tensor
            g = dm.grid
            other = demag_grid._SerialConvolution(
                g, octant_tensor(g.n, g.h), engine="scipy")
            rounds = {"fftw": [], "scipy": []}
            for _ in range(a.rounds):
                rounds["fftw"].append(timed(lambda: conv.apply(part),
                                            a.reps))
                rounds["scipy"].append(timed(lambda: other.apply(part),
                                             a.reps))
            for k, v in rounds.items():
                out[f"demag: convolution, {k} (median of rounds)"] = \
                    statistics.median(v)
            out["demag: convolution, fftw / scipy per round"] = [
                round(x / y, 2) for x, y in zip(rounds["fftw"],
                                                rounds["scipy"])]
        if hasattr(conv, "forward"):
            import numpy as np
            Mg = np.moveaxis(part.reshape(conv.n + (3,)), 3, 0)
            Mk = conv.forward(Mg)
            out["demag: forward FFT"] = timed(lambda: conv.forward(Mg),
                                              a.reps)
            out["demag: backward FFT"] = timed(
                lambda: conv.backward(conv._Hk), a.reps)
            if hasattr(conv, "kernel"):
                kp = lambda: conv.kernel.apply(Mk, conv._Hk)  # noqa: E731
            else:
                from micromag.terms.demag_grid import _apply_kernel
                kp = lambda: _apply_kernel(conv.Nk, Mk, conv._Hk,  # noqa
                                           conv._tmp)
            out["demag: kernel product"] = timed(kp, a.reps)
        out["demag: grid to nodes"] = timed(lambda: dm.T_back @ H, a.reps)
    if st.stack_average is not None:
        out["stack average"] = timed(lambda: st.average_stacks(work),
                                     a.reps)
    out["field()"] = timed(lambda: dyn.field(), a.reps)
    h = dyn.heff.getArray(readonly=True).reshape(-1, 3)
    out["m x H"] = timed(lambda: dyn.dmdt_local(m, h), a.reps)
    out["rhs()"] = timed(lambda: dyn.rhs(0.0, st.m, F), a.reps)
    out["VecAXPY"] = timed(lambda: F.axpy(0.5, work), a.reps)
    sk = st.stacks
    if sk is not None:
        # m stored once per stack (what the explicit integrators use)
        u, Fs, ws = sk.vector(), sk.vector(), sk.vector()
        with u as arr:
            sk.restrict(m, arr.reshape(-1, 3))
        for term in terms:
            f = term.stack_field(st)
            if f is not None:
                out[f"{term.name}: stack_field()"] = timed(
                    lambda: f(st, u, ws), a.reps)
        out["stacks: stack_field()"] = timed(
            lambda: dyn.stack_field(u, 0.0, ws), a.reps)
        hs = ws.getArray(readonly=True).reshape(-1, 3)
        us = u.getArray(readonly=True).reshape(-1, 3)
        out["stacks: m x H"] = timed(
            lambda: dyn.dmdt_local(us, hs, coef=dyn._stack_c), a.reps)
        out["stacks: rhs_stacks()"] = timed(
            lambda: dyn.rhs_stacks(0.0, u, Fs), a.reps)
        out["stacks: VecAXPY"] = timed(lambda: Fs.axpy(0.5, ws), a.reps)
    # one short integration: steps, right-hand sides, the integrator's
    # own work per step
    rhs_cpu = [0.0]
    name = "rhs" if sk is None or not stage.integrator.startswith("rk") \
        else "rhs_stacks"
    inner = getattr(dyn, name)

    def counted(t, u, f):
        t0 = time.process_time()
        inner(t, u, f)
        rhs_cpu[0] += time.process_time() - t0
    setattr(dyn, name, counted)
    dyn.n_rhs = 0
    t0 = time.process_time()
    res = llg.integrate(dyn, st.t + a.ps * 1e-12, method=stage.integrator,
                        rtol=stage.rtol, atol=stage.atol)
    total = time.process_time() - t0
    steps = max(res["steps"], 1)
    out.update({"integrator": stage.integrator, "steps": res["steps"],
                "rejected": res["rejected"], "rhs per step":
                dyn.n_rhs / steps, "dt ps": a.ps / steps,
                "step": total / steps * 1e3, "step less its rhs":
                (total - rhs_cpu[0]) / steps * 1e3})
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                      for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
