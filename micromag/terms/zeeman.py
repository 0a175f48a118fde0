"""Zeeman energy of an applied field: static (uniform or per node) or
time-dependent (uniform): E = -mu0 int Ms m.H_ext."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np

from ..errors import ProblemError
from .base import Term


FieldValue = Union[Sequence[float], np.ndarray,
                   Callable[[float], Sequence[float]]]


class Zeeman(Term):
    """Applied field H (A/m): a constant 3-vector, or a callable of time
    t (s) returning one (time-dependent, uniform), or an (n, 3) array in
    the space's numbering (static, non-uniform)."""

    name = "zeeman"
    quadratic = False

    def __init__(self, state, H: FieldValue, name: Optional[str] = None):
        super().__init__()
        self.state_space = state.space
        if name:
            self.name = name
        self._func = H if callable(H) else None
        self._static = None
        if self._func is None:
            arr = np.asarray(H, dtype=float)
            sp = state.space
            if arr.shape == (3,):
                self._static = np.broadcast_to(arr, (sp.nlocal, 3))
            elif arr.shape == (sp.n, 3):
                self._static = arr[sp.rstart:sp.rend]
            else:
                raise ProblemError("Zeeman field must be a 3-vector, an "
                                 "(n, 3) array or a function of t")
        self._mask = state.magnetic_local[:, None]
        # the nodal field, masked, is kept and copied in h() until the
        # applied field changes (a broadcast assignment and the mask at
        # every call cost 15 times the copy: standard problem 4, a
        # constant field, 0.28 against 0.02 ms per evaluation)
        self._flat = None if self._static is None else np.ascontiguousarray(
            self._static * self._mask).reshape(-1)
        self._value = None           # the uniform value _flat holds

    def value(self, t: float) -> np.ndarray:
        """The uniform applied field at time t (A/m), or the mean of a
        non-uniform one."""
        if self._func is not None:
            return np.asarray(self._func(t), dtype=float)
        return np.asarray(self._static).mean(axis=0) if len(self._static) \
            else np.zeros(3)

    def _nodal(self, t: float) -> np.ndarray:
        """The masked nodal field at t, flat (kept until it changes)."""
        if self._func is not None:
            v = np.asarray(self._func(t), dtype=float)
            if self._value is None or not np.array_equal(v, self._value):
                self._value = v
                self._flat = np.ascontiguousarray(np.broadcast_to(
                    v, self._mask.shape[:1] + (3,)) * self._mask).reshape(-1)
        return self._flat

    def h(self, state, out_vec) -> None:
        flat = self._nodal(state.t)
        with out_vec as o:
            o[:] = flat

    def stack_field(self, state):
        R = state.stacks.R
        kept = [None, None]          # the nodal field and its restriction

        def f(st, u_vec, out_vec):
            flat = self._nodal(st.t)
            if kept[0] is not flat:
                kept[0] = flat
                kept[1] = np.ascontiguousarray(
                    R @ flat.reshape(-1, 3)).reshape(-1)
            with out_vec as o:
                o[:] = kept[1]
        return f
