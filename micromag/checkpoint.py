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

A resumed stage restarts its integrator from the checkpointed state:
step size and history (BDF order, Runge-Kutta stages) start afresh, so
<m>(t) continues with the integrator's tolerance, not bit for bit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
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
