"""Landau-Lifshitz-Gilbert dynamics and energy minimisation.

LLG in Landau-Lifshitz form, with gamma0 = mu0 |gamma_e| in m/(A s):

    dm/dt = -gamma0/(1 + alpha^2) [ m x H + alpha m x (m x H) ]

integrated by PETSc TS on the distributed vector_vec of the FEM space
(with m tied through a film, State.tie_stacks, the explicit methods on
one m per stack: Dynamics.rhs_stacks):

    rk5dp   explicit Dormand-Prince 5(4), adaptive (default)
    rk3bs   explicit Bogacki-Shampine 3(2), adaptive
    rk4     classical Runge-Kutta, fixed step (dt)
    bdf     implicit BDF (order from the damping unless `order`, see
            auto_bdf_order), adaptive, Newton with a
            matrix-free Jacobian (MFFD) and GMRES preconditioned by the
            exchange part of the Jacobian (ExchangeJacobian; additive
            Schwarz + ILU(1)): the PVODE set-up of Magpar, for stiff (fine-mesh) runs
    beuler  implicit Euler, same nonlinear solver, fixed or adaptive

|m| = 1 is kept by rescaling after every accepted step (the error that
it corrects is the integrator's own truncation error, far below the
tolerance, so the RK first-same-as-last stage is kept). Outputs at fixed
times come from the integrators' dense output (TSInterpolate), so they
do not shorten the steps.

Energy minimisation (``minimize``) is steepest descent on the product of
spheres with Barzilai-Borwein step lengths (alternating BB1/BB2, as in
Exl et al., J. Appl. Phys. 115, 17D118, 2014): m <- normalize(m - tau g),
g = m x (m x H) the projected energy gradient, until max |m x H| is
below tol * max Ms.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

import numpy as np

from .errors import IntegrationError
from .parallel import global_max, global_min, global_sum
from .state import State
from .terms.exchange import Exchange

INTEGRATORS = ("rk5dp", "rk3bs", "rk4", "bdf", "beuler")
ADAPTIVE_DEFAULT = {"rk5dp": True, "rk3bs": True, "rk4": False,
                    "bdf": True, "beuler": False}


class Dynamics:
    """The effective field of a list of terms and the LLG right-hand side
    for a State. Counts field evaluations (`n_field`) and right-hand side
    evaluations (`n_rhs`)."""

    def __init__(self, state: State, terms: Sequence):
        self.state = state
        self.space = state.space
        self.terms = list(terms)
        self.heff = self.space.vector_vec()
        self._work = self.space.vector_vec()
        self.n_field = 0
        self.n_rhs = 0
        self.field_time = 0.0        # wall seconds spent in field()
        self._scratch = {}           # dmdt_local's work arrays, by size
        self._stack_plan = None      # stack_field's terms and vectors
        self._h_stacks = None        # rhs_stacks' field
        self.set_damping()

    def set_damping(self, alpha_local: Optional[np.ndarray] = None) -> None:
        st = self.state
        a = st.alpha_local if alpha_local is None else alpha_local
        c1 = -st.gamma_local / (1.0 + a * a)
        c1 = np.where(st.magnetic_local, c1, 0.0)
        self._c1 = c1[:, None]
        self._c2 = (c1 * a)[:, None]
        sk = st.stacks
        if sk is not None:
            # a stack's damping and gamma: its nodes', weighted by Ms V
            # (the same where the material is uniform through the film)
            a = sk.average(a)
            c1 = -sk.average(st.gamma_local) / (1.0 + a * a)
            c1 = np.where(sk.magnetic, c1, 0.0)
            self._stack_c = (c1[:, None], (c1 * a)[:, None])

    # ------------------------------------------------------------ fields

    @contextlib.contextmanager
    def _at(self, m_vec, t: Optional[float]):
        """The state, evaluated at (m_vec, t) where given, restored after
        (the terms read m and t from the state)."""
        st = self.state
        saved_m, saved_t = st.m, st.t
        if m_vec is not None:
            st.m = m_vec
        if t is not None:
            st.t = t
        try:
            yield st
        finally:
            st.m, st.t = saved_m, saved_t

    def field(self, m_vec=None, t: Optional[float] = None, out=None,
              average: bool = True, terms=None):
        """Effective field (A/m) at (m_vec, t), into `out` (default: the
        object's own heff vector, returned). average=False leaves out the
        stack average (State.tie_stacks) for a caller that restricts the
        field itself (stack_field), `terms` a subset of the terms."""
        t0 = time.perf_counter()
        out = self._field(m_vec, t, out, average, terms)
        self.field_time += time.perf_counter() - t0
        self.n_field += 1
        return out

    def _field(self, m_vec, t, out, average, terms):
        """field()'s work, not counted: for field() and for a caller that
        counts one evaluation of its own (stack_field)."""
        out = self.heff if out is None else out
        terms = self.terms if terms is None else terms
        with self._at(m_vec, t) as st:
            if not terms:
                out.set(0.0)
            for i, term in enumerate(terms):
                # the first term writes the sum's start (no zeroing)
                if i == 0:
                    term.h(st, out)
                    continue
                term.h(st, self._work)
                out.axpy(1.0, self._work)
            # m uniform over each stack (State.tie_stacks): the field of
            # the restricted energy
            if average:
                st.average_stacks(out)
        return out

    def energies(self, m_vec=None, t: Optional[float] = None):
        """{term name: energy (J)} at (m_vec, t); collective."""
        out = {}
        with self._at(m_vec, t) as st:
            for term in self.terms:
                out[term.name] = out.get(term.name, 0.0) + term.E(st)
        return out

    def dmdt_local(self, m: np.ndarray, h: np.ndarray,
                   out: Optional[np.ndarray] = None,
                   coef=None) -> np.ndarray:
        """dm/dt at the owned nodes, (nloc, 3), into `out` if given
        (coef: the stacks' (c1, c2) in place of the nodes')."""
        n = len(m)
        if n not in self._scratch:
            self._scratch[n] = (np.empty((n, 3)), np.empty((n, 3)),
                                np.empty(n))
        mxh, mxmxh, tmp = self._scratch[n]
        out = np.empty((n, 3)) if out is None else out
        c1, c2 = (self._c1, self._c2) if coef is None else coef
        _cross(m, h, mxh, tmp)
        _cross(m, mxh, mxmxh, tmp)
        np.multiply(c1, mxh, out=out)
        np.multiply(c2, mxmxh, out=mxmxh)
        out += mxmxh
        return out

    def rhs(self, t: float, u, F) -> None:
        h = self.field(u, t)
        m = u.getArray(readonly=True).reshape(-1, 3)
        hv = h.getArray(readonly=True).reshape(-1, 3)
        with F as f:
            self.dmdt_local(m, hv, out=f.reshape(-1, 3))
        self.n_rhs += 1

    def stack_field(self, u, t: Optional[float], out):
        """R H(P u) (State.stacks), the field of the energy restricted to
        m tied over the stacks, into the stack vector `out`: the terms
        that have one (Term.stack_field) on the stacks alone, the others
        on the nodes of P u, their sum restricted."""
        sk = self.state.stacks
        t0 = time.perf_counter()
        if self._stack_plan is None:
            fast, slow = [], []
            for term in self.terms:
                f = term.stack_field(self.state)
                (slow.append(term) if f is None else fast.append(f))
            self._stack_plan = (fast, slow, sk.vector(),
                                self.space.vector_vec())
        fast, slow, work, m_nodes = self._stack_plan
        with self._at(None, t) as st:
            for i, f in enumerate(fast):
                if i == 0:
                    f(st, u, out)
                    continue
                f(st, u, work)
                out.axpy(1.0, work)
            if slow or not fast:
                sk.prolong(u, m_nodes)
                h = self._field(m_nodes, t, None, False, slow)
                with work as w:
                    sk.restrict(h.getArray(readonly=True).reshape(-1, 3),
                                w.reshape(-1, 3))
                if fast:
                    out.axpy(1.0, work)
                else:
                    work.copy(out)
        self.field_time += time.perf_counter() - t0
        self.n_field += 1
        return out

    def rhs_stacks(self, t: float, u, F) -> None:
        """The right-hand side on the stacks (State.stacks): u holds one
        m per stack, the field is the restricted one (stack_field)."""
        if self._h_stacks is None:
            self._h_stacks = self.state.stacks.vector()
        h = self.stack_field(u, t, self._h_stacks)
        m = u.getArray(readonly=True).reshape(-1, 3)
        hs = h.getArray(readonly=True).reshape(-1, 3)
        with F as f:
            self.dmdt_local(m, hs, out=f.reshape(-1, 3),
                            coef=self._stack_c)
        self.n_rhs += 1

    def max_dmdt(self, m_vec=None, t: Optional[float] = None) -> float:
        """max over nodes of |dm/dt| (rad/s)."""
        m_vec = self.state.m if m_vec is None else m_vec
        h = self.field(m_vec, t)
        m = m_vec.getArray(readonly=True).reshape(-1, 3)
        d = self.dmdt_local(m, h.getArray(readonly=True).reshape(-1, 3))
        local = float(np.sqrt((d * d).sum(axis=1)).max()) if len(d) else 0.0
        return global_max(self.space.comm, local)

    def max_torque(self, m_vec=None, t: Optional[float] = None) -> float:
        """max over magnetic nodes of |m x H| (A/m)."""
        m_vec = self.state.m if m_vec is None else m_vec
        h = self.field(m_vec, t).getArray(readonly=True).reshape(-1, 3)
        m = m_vec.getArray(readonly=True).reshape(-1, 3)
        tq = np.cross(m, h)[self.state.magnetic_local]
        local = float(np.sqrt((tq * tq).sum(axis=1)).max()) if len(tq) else 0.0
        return global_max(self.space.comm, local)


def _cross(a: np.ndarray, b: np.ndarray, out: np.ndarray,
           tmp: np.ndarray) -> np.ndarray:
    """Row-wise a x b of (n, 3) arrays into `out` (tmp: (n,) scratch):
    np.cross's arithmetic (the same bits), without its axis handling,
    which cost ~2/3 of its time per right-hand side at a few thousand
    nodes, nor its temporaries."""
    a0, a1, a2 = a[:, 0], a[:, 1], a[:, 2]
    b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
    for o, (p, q, r, s) in zip(out.T, ((a1, b2, a2, b1), (a2, b0, a0, b2),
                                       (a0, b1, a1, b0))):
        np.multiply(p, q, out=o)
        np.multiply(r, s, out=tmp)
        o -= tmp
    return out


class ExchangeJacobian:
    """Sparse approximation of the LLG Jacobian d(dm/dt)/dm for the
    implicit integrators' preconditioner: the exchange part at frozen m,
    J = B(m) Kx with B_i = c1 [m_i]x + c2 [m_i]x [m_i]x per node ([m]x
    the cross-product matrix) and Kx the exchange field's matrix. The
    exchange field is what makes LLG stiff; demagnetization, anisotropy
    and Zeeman are left to the matrix-free Newton-Krylov operator."""

    def __init__(self, dyn: "Dynamics", Kx):
        PETSc = dyn.space.PETSc
        self.dyn = dyn
        sp = dyn.space
        nl = sp.nlocal
        indptr, indices, vals = Kx.getValuesCSR()
        counts = np.diff(indptr)
        rows = np.repeat(np.arange(len(counts)), counts)
        # Kx = diag(scale) (K (x) I3): the x-x entries carry k_ij
        sel = (rows % 3 == 0) & (indices % 3 == 0)
        self.block_row = rows[sel] // 3
        self.block_col = (indices[sel] // 3).astype(PETSc.IntType)
        self.k = vals[sel]
        self.rowptr = np.concatenate([[0], np.cumsum(np.bincount(
            self.block_row, minlength=nl))]).astype(PETSc.IntType)
        self.P = PETSc.Mat().createBAIJ(
            size=((3 * nl, 3 * sp.n), (3 * nl, 3 * sp.n)), bsize=3,
            csr=(self.rowptr, self.block_col,
                 np.zeros(9 * len(self.k))), comm=sp.pcomm)
        self.P.setOption(PETSc.Mat.Option.NEW_NONZERO_ALLOCATION_ERR, True)
        self.P.assemble()
        self.n_assembled = 0

    def assemble(self, u, P) -> None:
        m = u.getArray(readonly=True).reshape(-1, 3)
        X = np.zeros((len(m), 3, 3))
        X[:, 0, 1], X[:, 0, 2] = -m[:, 2], m[:, 1]
        X[:, 1, 0], X[:, 1, 2] = m[:, 2], -m[:, 0]
        X[:, 2, 0], X[:, 2, 1] = -m[:, 1], m[:, 0]
        c1 = self.dyn._c1[:, :, None]
        c2 = self.dyn._c2[:, :, None]
        B = c1 * X + c2 * (X @ X)
        V = B[self.block_row] * self.k[:, None, None]
        P.zeroEntries()
        P.setValuesBlockedCSR(self.rowptr, self.block_col, V.reshape(-1))
        P.assemble()
        self.n_assembled += 1


class Report:
    """What a callback is told at an output time."""

    def __init__(self, t, m_vec, step, dt, final=False):
        self.t = t
        self.m = m_vec
        self.step = step
        self.dt = dt
        self.final = final


def integrate(dyn: Dynamics, t_end: float, *, method: str = "rk5dp",
              rtol: float = 1e-5, atol: float = 1e-5,
              dt: Optional[float] = None, adaptive: Optional[bool] = None,
              order: Optional[int] = None, output_every: Optional[float] = None,
              callback: Optional[Callable[[Report], Optional[bool]]] = None,
              max_steps: int = 10_000_000,
              petsc_options: Optional[dict] = None,
              prefix: str = "mag_",
              renorm_tol: Optional[float] = None,
              precondition: bool = True,
              on_stacks: bool = True) -> dict:
    """Integrate LLG from state.t to t_end (s). `callback(report)` is
    called at every multiple of output_every (from interpolated states,
    |m| renormalized) and at the end; returning True stops the run there.
    |m| is reset to 1 when it drifts by more than renorm_tol (default
    rtol for RK, 10 rtol for the implicit methods). With m tied over
    stacks of nodes (State.tie_stacks) the explicit methods integrate
    one m per stack unless on_stacks is False (the nodes, their field
    averaged: the same solution, docs/mag.md "Discretization"). Returns
    statistics: steps, rejected, renormalizations, t."""
    PETSc = dyn.space.PETSc
    st = dyn.state
    if method not in INTEGRATORS:
        raise IntegrationError(f"unknown integrator '{method}' (choose from "
                               f"{', '.join(INTEGRATORS)})")
    if adaptive is None:
        adaptive = ADAPTIVE_DEFAULT[method]
    if method == "rk4" and adaptive:
        raise IntegrationError("rk4 has no error estimate: use a fixed dt")
    if not adaptive and not dt:
        raise IntegrationError(f"fixed-step {method} needs dt")
    t0 = st.t
    if not t_end > t0:
        return {"steps": 0, "rejected": 0, "rhs": 0, "t": t0}

    opts = PETSc.Options()
    own_opts = dict(petsc_options or {})
    ts = PETSc.TS().create(comm=dyn.space.pcomm)
    ts.setOptionsPrefix(prefix)
    ts.setProblemType(PETSc.TS.ProblemType.NONLINEAR)
    # m tied over stacks of nodes: the explicit methods integrate one m
    # per stack (State.stacks); the implicit ones keep the nodes, whose
    # exchange Jacobian preconditions them
    stacks = st.stacks if method.startswith("rk") and on_stacks else None
    if stacks is not None:
        F = stacks.vector()
        ts.setRHSFunction(lambda ts_, t, u, f: dyn.rhs_stacks(t, u, f), F)
    else:
        F = dyn.space.vector_vec()
        ts.setRHSFunction(lambda ts_, t, u, f: dyn.rhs(t, u, f), F)
    if method.startswith("rk"):
        ts.setType(PETSc.TS.Type.RK)
        ts.setRKType({"rk5dp": "5dp", "rk3bs": "3bs", "rk4": "4"}[method])
    else:
        ts.setType(PETSc.TS.Type.BDF if method == "bdf"
                   else PETSc.TS.Type.BEULER)
        if method == "bdf":
            own_opts.setdefault("ts_bdf_order", order or auto_bdf_order(dyn))
        snes = ts.getSNES()
        # Newton only has to beat the truncation error the step controller
        # accepts: tight nonlinear/linear tolerances cost right-hand sides
        # (each a demag solve) and buy nothing; the preconditioner is
        # reused over a few Newton iterations and steps
        snes.setTolerances(rtol=1e-3, max_it=20)
        ksp = snes.getKSP()
        ksp.setType("gmres")
        ksp.setTolerances(rtol=1e-2, max_it=200)
        own_opts.setdefault("snes_lag_jacobian", 3)
        own_opts.setdefault("snes_lag_jacobian_persists", 1)
        exch = [t for t in dyn.terms if isinstance(t, Exchange)]
        if exch and precondition:
            # Newton-Krylov with the operator applied matrix-free (finite
            # differences of the full right-hand side) and the exchange
            # Jacobian as preconditioner: ILU per rank, additive Schwarz
            # with two layers of overlap across ranks. Block Jacobi lost
            # 30 % more Krylov iterations on 2 ranks of the bar, 80 % on
            # standard problem 4; one layer still 11 % on standard
            # problem 4 (0.3 ns: 5,420 operator applications on 2 ranks,
            # 4,862 on 1) and the bar 11 %; two layers 0.6 % and 5 %
            # (4,890; the bar 676 against 643), four no fewer.
            # ILU(1), not ILU(0): with ILU(0) the
            # Krylov count depended on the node ordering, which changes
            # with the number of ranks (standard problem 4, 0.2 ns: 4,036
            # field evaluations on 1 rank, 5,386 on 2; with ILU(1) 4,035
            # and 4,071, at the same cost per step on 1 rank)
            jac = ExchangeJacobian(dyn, exch[0].matrix)
            ts.setRHSJacobian(lambda ts_, t, u, J, P: _jacobian(jac, u, J,
                                                                P),
                              jac.P, jac.P)
            own_opts.setdefault("snes_mf_operator", "")
            ksp.getPC().setType("asm")
            own_opts.setdefault("pc_asm_overlap", 2)
            own_opts.setdefault("sub_pc_type", "ilu")
            own_opts.setdefault("sub_pc_factor_levels", 1)
        else:
            snes.setUseMF(True)
            ksp.getPC().setType("none")
        ts.setMaxSNESFailures(-1)
    ts.setTime(t0)
    ts.setMaxTime(t_end)
    ts.setMaxSteps(max_steps)
    ts.setExactFinalTime(PETSc.TS.ExactFinalTime.MATCHSTEP)
    if dt is None:
        dt = _initial_dt(dyn)
    ts.setTimeStep(dt)
    ts.setTolerances(rtol=rtol, atol=atol)
    # A value the problem's [petsc] table set (the options database)
    # wins over our defaults, but not over what the method needs (a
    # fixed step has no adaptor); ours are set for this run only, and a
    # value of the user's we had to override comes back after it
    own_opts = {k: v for k, v in own_opts.items()
                if not opts.hasName(prefix + k)}
    needed = {} if adaptive else {"ts_adapt_type": "none"}
    saved = {k: opts.getString(prefix + k) for k in needed
             if opts.hasName(prefix + k)}
    own_opts.update(needed)
    for key, value in own_opts.items():
        opts[prefix + key] = value
    try:
        return _run_ts(ts, dyn, st, t0, t_end, adaptive, output_every,
                       callback, max_steps, renorm_tol, method, rtol,
                       stacks)
    finally:
        for key in own_opts:
            opts.delValue(prefix + key)
        for key, value in saved.items():
            opts[prefix + key] = value
        ts.destroy()
        F.destroy()


def _run_ts(ts, dyn, st, t0, t_end, adaptive, output_every, callback,
            max_steps, renorm_tol, method, rtol, stacks=None) -> dict:
    """integrate()'s time loop on its configured TS; its solution is
    st.m, or with `stacks` one m per stack, prolonged to st.m at the
    end and to the nodes for every report."""
    PETSc = dyn.space.PETSc
    ts.setFromOptions()
    if adaptive:
        # never above 1 ns per step (shapes the first steps of a relax)
        ts.setStepLimits(1e-18, 1e-9)
    ts.setMaxStepRejections(-1)
    if stacks is None:
        u = st.m
        interp = report_m = dyn.space.vector_vec()
    else:
        u = stacks.vector()
        with u as a:
            stacks.restrict(st.m.getArray(readonly=True).reshape(-1, 3),
                            a.reshape(-1, 3))
        interp, report_m = stacks.vector(), dyn.space.vector_vec()
    ts.setSolution(u)

    def report(t, step, dt, final=False):
        if stacks is not None:
            stacks.prolong(interp, report_m)
        return callback(Report(t, report_m, step, dt, final=final))
    state = {"next": (t0 + output_every) if output_every else None,
             "stopped": False, "renormalized": 0}
    if renorm_tol is None:
        # implicit methods lose their history on a reset: let them drift
        # further (the drift is their own truncation error)
        renorm_tol = 10 * rtol if method in ("bdf", "beuler") else rtol
        renorm_tol = max(renorm_tol, 1e-12)
    t_tol = 1e-9 * (t_end - t0)

    def poststep(ts_):
        # runs after every accepted step; also the place to stop, as the
        # TS loop checks its converged reason right after it
        x = ts_.getSolution()
        # Touching the solution makes TS restart (RK loses its
        # first-same-as-last stage, BDF falls back to order 1), so |m| is
        # only reset once the drift exceeds renorm_tol.
        if st.max_norm_deviation(x) > renorm_tol:
            st.normalize(x)
            state["renormalized"] += 1
        t = ts_.getTime()
        st.t = t
        if callback is None or state["stopped"]:
            return
        step = ts_.getStepNumber()
        nxt = state["next"]
        # outputs strictly inside the last step come from dense output
        while nxt is not None and nxt < t - t_tol:
            ts_.interpolate(nxt, interp)
            st.normalize(interp)
            if report(nxt, step, ts_.getTimeStep()):
                state["stopped"] = True
                interp.copy(x)
                ts_.setTime(nxt)
                st.t = nxt
                ts_.setConvergedReason(
                    PETSc.TS.ConvergedReason.CONVERGED_USER)
                return
            nxt += output_every
        final = t >= t_end - t_tol
        if final or (nxt is not None and nxt <= t + t_tol):
            x.copy(interp)
            st.normalize(interp)
            if report(t, step, ts_.getTimeStep(), final=final):
                state["stopped"] = True
                ts_.setConvergedReason(
                    PETSc.TS.ConvergedReason.CONVERGED_USER)
            if nxt is not None and nxt <= t + t_tol:
                nxt += output_every
        state["next"] = nxt

    ts.setPostStep(poststep)
    try:
        ts.solve(u)
    except PETSc.Error as e:
        raise IntegrationError(f"time integration failed at t = "
                               f"{ts.getTime():.4g} s ({e})") from None
    reason = ts.getConvergedReason()
    t_now = ts.getTime()
    if reason < 0:
        raise IntegrationError(f"time integration diverged at t = "
                               f"{t_now:.4g} s (TS reason {reason})")
    if (reason == PETSc.TS.ConvergedReason.CONVERGED_ITS
            and t_now < t_end - t_tol):
        raise IntegrationError(f"stopped after {max_steps} steps at "
                               f"t = {t_now:.4g} s")
    st.t = float(t_now)
    st.normalize(u)            # what the caller sees has |m| = 1
    if stacks is not None:
        stacks.prolong(u, st.m)
        u.destroy()
        report_m.destroy()
    stats = {"steps": int(ts.getStepNumber()),
             "rejected": int(ts.getStepRejections()),
             "t": float(st.t), "stopped": state["stopped"],
             "renormalized": state["renormalized"],
             "last_dt": float(ts.getTimeStep())}
    interp.destroy()
    return stats


def auto_bdf_order(dyn: Dynamics) -> int:
    """The highest BDF order whose stability wedge (A(alpha) angle: 90,
    90, 86, 73 degrees for orders 1-4) holds the LLG eigenvalues, which
    lie at atan(1/alpha) from the negative real axis for damping alpha:
    4 for alpha >= 0.35, 3 for alpha >= 0.08, else 2."""
    st = dyn.state
    a = st.alpha_local[st.magnetic_local]
    amin = global_min(dyn.space.comm, float(a.min()) if len(a) else 1.0)
    return 4 if amin >= 0.35 else 3 if amin >= 0.08 else 2


def _jacobian(jac: ExchangeJacobian, u, J, P) -> None:
    jac.assemble(u, P)
    if J.handle != P.handle:
        J.assemble()          # the matrix-free operator takes the new base


def _initial_dt(dyn: Dynamics) -> float:
    """A first step that turns m by ~1e-3 rad at the fastest node (the
    adaptive controller takes it from there)."""
    rate = dyn.max_dmdt()
    return 1e-3 / rate if rate > 0 else 1e-13


def minimize(dyn: Dynamics, tol: float = 1e-6, max_iter: int = 50_000,
             callback: Optional[Callable[[int, float], Optional[bool]]] = None,
             report_every: int = 100) -> dict:
    """Relax state.m to a local energy minimum (see module docstring).
    tol: stop when max |m x H| < tol * max(Ms). Returns iterations and
    the final torque (A/m)."""
    st = dyn.state
    sp = dyn.space
    comm = sp.comm
    ms_max = global_max(comm, st.Ms_local.max() if sp.nlocal else 0.0)
    target = tol * ms_max
    w = st.MsV_local[:, None] / max(st.MsV_local.max(), 1e-300)
    mag = st.magnetic_local[:, None]

    def gradient(m_vec):
        h = dyn.field(m_vec).getArray(readonly=True).reshape(-1, 3)
        m = m_vec.getArray(readonly=True).reshape(-1, 3)
        mh = np.einsum("ij,ij->i", m, h)[:, None]
        g = (mh * m - h) * mag            # m x (m x h)
        tq = np.sqrt((g * g).sum(axis=1))
        torque = global_max(comm, tq.max() if len(tq) else 0.0)
        return g, torque

    def wdot(a, b):
        return global_sum(comm, (w * a * b).sum())

    m_vec = st.m
    g, torque = gradient(m_vec)
    tau = 1e-2 / max(torque, 1e-300)
    tau_min, tau_max = 1e-12 * tau, 1e6 * tau
    it = 0
    while torque > target and it < max_iter:
        m_old = m_vec.getArray(readonly=True).reshape(-1, 3).copy()
        with m_vec as a:
            a3 = a.reshape(-1, 3)
            a3 -= tau * g
            a3 /= np.sqrt(np.einsum("ij,ij->i", a3, a3))[:, None]
            s = a3 - m_old
        g_new, torque = gradient(m_vec)
        y = g_new - g
        sy = wdot(s, y)
        if it % 2 == 0:
            ss = wdot(s, s)
            tau = ss / sy if sy > 0 else tau_max
        else:
            yy = wdot(y, y)
            tau = sy / yy if sy > 0 and yy > 0 else tau_max
        tau = min(max(tau, tau_min), tau_max)
        g = g_new
        it += 1
        if callback is not None and it % report_every == 0:
            if callback(it, torque):
                break
    return {"iterations": it, "torque": torque,
            "converged": bool(torque <= target), "target": target}
