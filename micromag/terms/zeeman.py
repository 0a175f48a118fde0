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

    def value(self, t: float) -> np.ndarray:
        """The uniform applied field at time t (A/m), or the mean of a
        non-uniform one."""
        if self._func is not None:
            return np.asarray(self._func(t), dtype=float)
        return np.asarray(self._static).mean(axis=0) if len(self._static) \
            else np.zeros(3)

    def h(self, state, out_vec) -> None:
        with out_vec as o:
            o3 = o.reshape(-1, 3)
            if self._func is not None:
                o3[:] = np.asarray(self._func(state.t), dtype=float)
            else:
                o3[:] = self._static
            o3 *= self._mask
