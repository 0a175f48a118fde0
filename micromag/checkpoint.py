"""Checkpoints of a running problem, so that an interrupted run continues
where it stopped instead of starting again from zero.

A checkpoint is one file, ``checkpoint.npz`` in the run's staging
directory (output.STAGING), replaced atomically (written to a temporary
file in the same directory, flushed to disk, renamed over the old one),
so that a run killed at any moment leaves either the previous checkpoint
or the new one, never a torn file. It holds:

* ``m``: the magnetization on the mesh nodes in the *input* mesh's
  numbering (not the solver's partitioned one), so that a run can be
  resumed on any number of ranks;
* ``meta`` (JSON): the stage being run (1-based) and whether it is
  finished, the simulated time and the time the stage started at, the
  next snapshot time and the number of snapshots written, the counters
  (steps, field evaluations, ...), the outputs of the finished stages;
* ``rows``: the table (<m>(t), energies, ...) written so far, up to and
  including the checkpoint's time; a resumed run rewrites its table from
  them, dropping rows a killed run wrote after its last checkpoint.

The end of every stage is checkpointed, so the relaxed state (e.g. the
s-state of standard problem 4) survives an interruption of the stage
after it.

Every checkpoint carries a key: a hash of the effective problem (which
includes the mesh and its cell sizes), the bytes of the problem file and
of an initial-state file, the mesh actually built (nodes and elements)
and the solver's own source code. A checkpoint whose key differs from
the run's (a changed problem, mesh or solver) is never resumed from.

A run starts from a :class:`Resume`: empty for a fresh run, else built
from the checkpoint; it restores the state, tells the run which stages
are finished and the interrupted stage where it stood, and carries the
run's account so far (:class:`RunLog`) on into the next checkpoints,
which a :class:`Writer` writes. A resumed stage restarts its integrator
from the checkpointed state: step size and history (BDF order,
Runge-Kutta stages) start afresh, so <m>(t) continues with the
integrator's tolerance, not bit for bit.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from . import problem as problem_mod

FORMAT = 1
NAME = "checkpoint.npz"
_PACKAGE = Path(__file__).resolve().parent


def solver_hash() -> str:
    """sha256 of the solver's source (every .py file of the package):
    the solver version a checkpoint is tied to."""
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(p.relative_to(_PACKAGE)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def _file_hash(path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def key(prob: problem_mod.Problem, points: np.ndarray,
        tets: np.ndarray) -> str:
    """The key of a run: `points` (n, 3) and `tets` of the mesh in the
    input numbering."""
    h = hashlib.sha256()
    h.update(f"format {FORMAT}\n".encode())
    h.update(solver_hash().encode())
    h.update(problem_mod.to_toml(prob.config).encode())
    if prob.path is not None:
        h.update(b"problem file " + _file_hash(prob.path).encode())
    if prob.initial.type == "file":
        h.update(b"initial file " + _file_hash(prob.initial.file).encode())
    h.update(np.ascontiguousarray(points, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(tets, dtype=np.int64).tobytes())
    return h.hexdigest()


def _plain(obj):
    """numpy scalars and arrays in the meta data as JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} in checkpoint meta data")


def save(path, m: np.ndarray, rows: np.ndarray, meta: dict) -> None:
    """Write the checkpoint atomically (temp file, fsync, rename)."""
    path = Path(path)
    buf = io.BytesIO()
    np.savez(buf, m=np.asarray(m, dtype=np.float64),
             rows=np.asarray(rows, dtype=np.float64),
             meta=np.frombuffer(json.dumps(
                 dict(meta, format=FORMAT), default=_plain).encode(),
                 dtype=np.uint8))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path) -> Tuple[Optional[dict], str]:
    """(checkpoint, "") or (None, why not): {"m", "rows", "meta"}."""
    path = Path(path)
    if not path.is_file():
        return None, f"no checkpoint in {path.parent}"
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            m = np.array(z["m"], dtype=np.float64)
            rows = np.array(z["rows"], dtype=np.float64)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile,
            UnicodeDecodeError) as e:
        return None, f"checkpoint {path} unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None, f"checkpoint {path} has another format"
    if m.ndim != 2 or m.shape[1] != 3 or not np.all(np.isfinite(m)):
        return None, f"checkpoint {path} has no valid magnetization"
    return {"m": m, "rows": rows, "meta": meta}, ""


def load_matching(path, run_key: str, n_nodes: int,
                  columns) -> Tuple[Optional[dict], str]:
    """The checkpoint at `path` if it belongs to this run (same key, node
    count and table columns), else (None, why not)."""
    ck, why = load(path)
    if ck is None:
        return None, why
    meta = ck["meta"]
    if meta.get("key") != run_key:
        return None, (f"checkpoint {path} belongs to another problem, mesh "
                      f"or solver version")
    if len(ck["m"]) != n_nodes or list(meta.get("columns", [])) != \
            list(columns):
        return None, f"checkpoint {path} does not fit this mesh or table"
    rows = ck["rows"]
    if rows.size and (rows.ndim != 2 or rows.shape[1] != len(columns)):
        return None, f"checkpoint {path} has a malformed table"
    return ck, ""


def peek(run_dir) -> Optional[dict]:
    """The meta data of the checkpoint of an unfinished run in run_dir
    (no key check), or None."""
    from .output import STAGING
    ck, _ = load(Path(run_dir) / STAGING / NAME)
    return None if ck is None else ck["meta"]


@dataclass(frozen=True, eq=False)
class Resume:
    """Where a run starts: at the beginning (``Resume()``) or where a
    checkpoint left it (``Resume.of(checkpoint)``). The run restores the
    state from it (restore), skips the stages it finished (finished) and
    continues the one it interrupted (going: from t_stage0, the next
    snapshot at next_snap, its rows up to t already in the table)."""

    stage: int = 0                 # the checkpoint's stage (1-based)
    done: bool = True              # ... finished at the checkpoint
    t: float = 0.0
    t_stage0: Optional[float] = None
    next_snap: Optional[float] = None
    m: Optional[np.ndarray] = None     # input mesh's numbering
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    stats: Optional[dict] = None
    snapshots: int = 0
    ranks: int = 0
    meta: dict = field(default_factory=dict)

    @classmethod
    def of(cls, ck: dict) -> "Resume":
        """From a checkpoint as load_matching returns it."""
        meta = ck["meta"]
        return cls(stage=meta["stage"], done=meta["done"], t=meta["t"],
                   t_stage0=meta["t_stage0"], next_snap=meta["next_snap"],
                   m=ck["m"], rows=ck["rows"], stats=meta["stats"],
                   snapshots=meta["snapshots"], ranks=meta["ranks"],
                   meta=meta)

    @property
    def resumes(self) -> bool:
        return self.m is not None

    def finished(self, index: int) -> bool:
        """Whether stage `index` was finished before."""
        return index < self.stage + (1 if self.done else 0)

    def going(self, index: int) -> bool:
        """Whether stage `index` was interrupted: it continues."""
        return index == self.stage and not self.done

    def restore(self, state, perm: np.ndarray) -> Optional[dict]:
        """Put m and t into `state` (perm: the solver's node numbering);
        the counters so far (None when starting afresh)."""
        if not self.resumes:
            return None
        arr = np.empty_like(self.m)
        arr[perm] = self.m
        state.set_m(arr)
        state.t = float(self.t)
        return dict(self.stats)

    def log(self, columns) -> "RunLog":
        """The account of the run so far, this resumption added."""
        m = self.meta
        resumed = list(m.get("resumed", []))
        if self.resumes:
            resumed.append({"stage": self.stage, "t": self.t,
                            "ranks_before": self.ranks})
        return RunLog(list(columns), list(m.get("stage_out", [])),
                      list(m.get("stage_starts", [])), resumed,
                      float(m.get("solve_time_s", 0.0)))


@dataclass
class RunLog:
    """What a run has done: the outputs of its finished stages, their
    start times, its resumptions and its solve time. Every checkpoint
    carries it, so that a resumed run reports the whole run."""

    columns: list
    stage_out: list
    stage_starts: list
    resumed: list
    solve_before: float = 0.0
    t_solve: float = field(default_factory=time.perf_counter)

    def solve_time(self) -> float:
        return self.solve_before + time.perf_counter() - self.t_solve

    def meta(self) -> dict:
        return {"stage_out": self.stage_out,
                "stage_starts": self.stage_starts, "resumed": self.resumed,
                "columns": self.columns, "solve_time_s": self.solve_time()}


class Writer:
    """Checkpoints a running Simulation: at the end of every stage, with
    every snapshot and every `every` wall seconds (0: at every table
    row). Collective; rank 0 writes `path` (None on the other ranks)."""

    def __init__(self, sim, path, run_key: str, every: float, log: RunLog):
        self.sim, self.path, self.key = sim, path, run_key
        self.every, self.log = every, log
        self._last = time.perf_counter()

    def due(self, forced: bool = False) -> bool:
        """Whether to checkpoint now (rank 0 decides: wall clocks differ
        between ranks, and the gather is collective)."""
        due = forced or time.perf_counter() - self._last >= self.every
        return bool(self.sim.comm.bcast(due, root=0))

    def write(self, index: int, done: bool, m_vec=None,
              t: Optional[float] = None, t_stage0: Optional[float] = None,
              next_snap: Optional[float] = None, dyn=None, steps: int = 0,
              table=None, snapshots: int = 0) -> None:
        """Checkpoint stage `index` at (m_vec, t): finished (done) or
        going, `dyn`/`steps` its integrator's counts so far."""
        sim = self.sim
        m_vec = sim.state.m if m_vec is None else m_vec
        m = sim.space.gather(m_vec)
        self._last = time.perf_counter()
        if sim.rank != 0:
            return
        stats = dict(sim.stats)
        if dyn is not None:
            stats["steps"] += steps
            for k, v in (("field_evals", dyn.n_field),
                         ("rhs_evals", dyn.n_rhs),
                         ("field_time", dyn.field_time)):
                stats[k] = stats.get(k, 0) + v
        t = sim.state.t if t is None else t
        meta = dict(self.log.meta(), key=self.key, stage=index, done=done,
                    t=float(t), t_stage0=None if t_stage0 is None
                    else float(t_stage0),
                    next_snap=None if next_snap is None or
                    not math.isfinite(next_snap) else float(next_snap),
                    snapshots=snapshots, stats=stats,
                    ranks=sim.comm.Get_size())
        rows = table.array() if table is not None else np.zeros((0, 0))
        save(self.path, sim.space.to_original(m), rows, meta)
