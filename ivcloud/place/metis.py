"""ctypes binding to METIS 5 (Debian's libmetis5): just the two
partitioning calls the planner needs.

The library's idx_t width is a build-time choice of whoever packaged it, so
it is probed at load time rather than assumed from a header we do not
ship: METIS_SetDefaultOptions writes METIS_NOPTIONS idx_t values of -1,
which fill either half or all of a buffer of 64-bit slots. real_t is never
passed (tpwgts and ubvec stay NULL; balance goes through the UFACTOR
option), so its width does not matter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Dict, List, Optional, Sequence

from ..errors import OperationFailed

METIS_NOPTIONS = 40
# enum moptions_et (metis.h, 5.1)
OPTION_NCUTS = 7
OPTION_SEED = 8
OPTION_UFACTOR = 16
OPTION_NUMBERING = 17

METIS_OK = 1
_ERRORS = {-2: "METIS_ERROR_INPUT", -3: "METIS_ERROR_MEMORY",
           -4: "METIS_ERROR"}

LIBRARY_NAMES = ("libmetis.so.5", "libmetis.so")


class MetisError(OperationFailed):
    """libmetis refused or failed a partitioning call."""


class Metis:
    """One loaded libmetis. `partition` is the only entry point."""

    METHODS = ("recursive", "kway")

    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path)
        probe = (ctypes.c_int64 * METIS_NOPTIONS)()
        self._lib.METIS_SetDefaultOptions(probe)
        if probe[0] != -1:
            raise MetisError(f"{path}: METIS_SetDefaultOptions did not set "
                             f"the defaults; not METIS 5?")
        self.idx_t = (ctypes.c_int64 if probe[METIS_NOPTIONS - 1] == -1
                      else ctypes.c_int32)
        self.idx_max = (1 << (8 * ctypes.sizeof(self.idx_t) - 1)) - 1
        for name in ("METIS_PartGraphKway", "METIS_PartGraphRecursive"):
            fn = getattr(self._lib, name)
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls) -> Optional["Metis"]:
        """The system's METIS, or None if it is not installed."""
        candidates = list(LIBRARY_NAMES)
        found = ctypes.util.find_library("metis")
        if found:
            candidates.append(found)
        for name in candidates:
            try:
                return cls(name)
            except OSError:
                continue
        return None

    def partition(self, adj: Sequence[Dict[int, int]], nparts: int,
                  method: str, ufactor: int, seed: int,
                  ncuts: int = 4) -> List[int]:
        """Part index (0..nparts-1) of every vertex of the graph `adj`
        (local indices, symmetric, positive integer weights, unit vertex
        weights: one rank takes one share of slots). Minimizes the edge
        cut with at most (1 + ufactor/1000) times the average part size."""
        n = len(adj)
        if not 1 < nparts <= n:
            raise MetisError(f"cannot split {n} vertices into {nparts} parts")
        idx = self.idx_t
        xadj = (idx * (n + 1))()
        m = sum(len(a) for a in adj)
        adjncy = (idx * max(m, 1))()
        adjwgt = (idx * max(m, 1))()
        pos = 0
        for v, nbrs in enumerate(adj):
            xadj[v] = pos
            for u in sorted(nbrs):   # a fixed order: same input, same cut
                adjncy[pos] = u
                adjwgt[pos] = nbrs[u]
                pos += 1
        xadj[n] = pos
        vwgt = (idx * n)(*([1] * n))

        options = (idx * METIS_NOPTIONS)()
        self._lib.METIS_SetDefaultOptions(options)
        options[OPTION_NUMBERING] = 0
        options[OPTION_SEED] = seed
        options[OPTION_UFACTOR] = max(1, ufactor)
        options[OPTION_NCUTS] = max(1, ncuts)

        nvtxs, ncon = idx(n), idx(1)
        nparts_c, objval = idx(nparts), idx(0)
        part = (idx * n)()
        name = ("METIS_PartGraphKway" if method == "kway"
                else "METIS_PartGraphRecursive")
        fn = getattr(self._lib, name)
        rc = fn(ctypes.byref(nvtxs), ctypes.byref(ncon), xadj, adjncy, vwgt,
                None, adjwgt, ctypes.byref(nparts_c), None, None, options,
                ctypes.byref(objval), part)
        if rc != METIS_OK:
            raise MetisError(f"{name} failed: {_ERRORS.get(rc, rc)}")
        out = list(part)
        if any(not 0 <= p < nparts for p in out):
            raise MetisError("METIS returned a part index out of range")
        return out
