"""Results of a run: a table (OOMMF ODT-like text and CSV), VTU snapshots
for ParaView, a PNG of <m>(t), the effective configuration and a JSON
summary, plus a progress display.

Files are written into DIR/.incomplete while the run goes on and moved
into DIR only when it succeeded (``Results.commit``), so a failed or
interrupted run never leaves something that looks like a result: its
files stay in DIR/.incomplete next to an error.txt. Only rank 0 touches
the file system; the collective parts (gathering m for a snapshot) are
done by every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

STAGING = ".incomplete"
RESULT_NAMES = ("table.odt", "table.csv", "m_t.png", "effective.toml",
                "summary.json", "snapshots", "m_final.vtu")


class Progress:
    """One status line on stderr: rewritten in place on a terminal,
    printed every `interval` seconds otherwise (logs stay short)."""

    def __init__(self, enabled: bool = True, stream=None,
                 interval: float = 5.0):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") \
            and self.stream.isatty()
        self.interval = interval
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last < 0.1:
                return
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            if not force and now - self._last < self.interval:
                return
            self.stream.write(text + "\n")
        self.stream.flush()
        self._last = now

    def message(self, text: str) -> None:
        """A line of its own (kept on the terminal)."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


class Table:
    """Rows of named numeric columns, appended to table.odt and table.csv
    as they come (flushed, so a long run can be watched)."""

    def __init__(self, directory: Path, title: str, columns: Sequence[str],
                 units: Sequence[str]):
        self.columns = list(columns)
        self.rows: List[List[float]] = []
        self._odt = open(directory / "table.odt", "w")
        self._csv = open(directory / "table.csv", "w")
        self._odt.write("# ODT 1.0\n# Table Start\n")
        self._odt.write(f"# Title: {title}\n")
        self._odt.write("# Columns: " + " ".join(self.columns) + "\n")
        self._odt.write("# Units: " + " ".join(u or "{}" for u in units)
                        + "\n")
        self._csv.write(",".join(self.columns) + "\n")
        self._odt.flush()
        self._csv.flush()

    def append(self, values: Dict[str, float]) -> None:
        row = [float(values.get(c, 0.0)) for c in self.columns]
        self.rows.append(row)
        self._odt.write(" ".join(f"{v:.10g}" for v in row) + "\n")
        self._csv.write(",".join(f"{v:.10g}" for v in row) + "\n")
        self._odt.flush()
        self._csv.flush()

    def close(self) -> None:
        if not self._odt.closed:
            self._odt.write("# Table End\n")
            self._odt.close()
            self._csv.close()

    def array(self) -> np.ndarray:
        return np.array(self.rows) if self.rows else np.zeros(
            (0, len(self.columns)))


def write_vtu(path: Path, points: np.ndarray, tets: np.ndarray,
              point_data: Dict[str, np.ndarray]) -> None:
    """A .vtu snapshot through meshio, binary and uncompressed: its
    default zlib compression of the whole mesh cost 20-27 ms per
    snapshot of the bar (4,114 nodes) on rank 0 while the other ranks
    waited, uncompressed 3.5 ms (files ~5x larger)."""
    import meshio
    mesh = meshio.Mesh(points, [("tetra", tets)], point_data=point_data)
    meshio.write(str(path), mesh, file_format="vtu", compression=None)


def plot_m(path: Path, t: np.ndarray, m: np.ndarray, title: str = "",
           stage_starts: Sequence[float] = ()) -> None:
    """PNG of the three components of <m> against t (ns)."""
    # A Figure on the Agg canvas, without pyplot (its backend selection
    # and figure manager), and fixed margins: ~20 ms less of the ~0.23 s
    # the PNG costs at the end of every run while the other ranks wait
    # (bar, measured); the rest is matplotlib's import
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for k, (label, color) in enumerate((("<mx>", "tab:blue"),
                                        ("<my>", "tab:orange"),
                                        ("<mz>", "tab:green"))):
        ax.plot(t * 1e9, m[:, k], label=label, color=color)
    for ts in stage_starts:
        ax.axvline(ts * 1e9, color="0.7", lw=0.8, ls="--")
    ax.set_xlabel("t (ns)")
    ax.set_ylabel("reduced magnetization")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if title:
        ax.set_title(title)
    # fixed margins that fit these labels: tight_layout draws the figure
    # once more
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.12,
                        top=0.92 if title else 0.97)
    fig.savefig(path)


class Results:
    """The output directory of one run (rank 0 only)."""

    def __init__(self, out_dir: os.PathLike, keep: bool = False):
        """`keep`: leave the files of an interrupted run in the staging
        directory (to resume it: see `restore`, `reset`)."""
        self.out_dir = Path(out_dir)
        self.stage_dir = self.out_dir / STAGING
        self.table: Optional[Table] = None
        self.snapshots = 0
        if keep and self.stage_dir.is_dir():
            (self.stage_dir / "snapshots").mkdir(exist_ok=True)
        else:
            self.reset()

    def reset(self) -> None:
        """Start with an empty staging directory."""
        if self.table is not None:
            self.table.close()
            self.table = None
        if self.stage_dir.exists():
            shutil.rmtree(self.stage_dir)
        self.stage_dir.mkdir(parents=True)
        (self.stage_dir / "snapshots").mkdir()
        self.snapshots = 0

    def restore(self, snapshots: int) -> None:
        """Continue an interrupted run whose checkpoint had written
        `snapshots` numbered snapshots: later ones (written after the
        checkpoint) and the old error report go."""
        snap_dir = self.stage_dir / "snapshots"
        times = snap_dir / "times.txt"
        lines = times.read_text().splitlines() if times.is_file() else []
        numbered = [ln for ln in lines if ln.startswith("snapshots/m_")]
        keep = set(ln.split()[0] for ln in numbered[:snapshots])
        for f in snap_dir.glob("m_*.vtu"):
            if f"snapshots/{f.name}" not in keep:
                f.unlink()
        # m_final.vtu is written after the last stage: never kept
        lines = [ln for ln in lines if ln.split()[0] in keep]
        if lines:
            times.write_text("\n".join(lines) + "\n")
        elif times.exists():
            times.unlink()
        for name in ("error.txt", "m_final.vtu", "summary.json"):
            p = self.stage_dir / name
            if p.exists():
                p.unlink()
        self.snapshots = snapshots

    def open_table(self, title, columns, units) -> Table:
        self.table = Table(self.stage_dir, title, columns, units)
        return self.table

    def snapshot(self, points, tets, m: np.ndarray, t: float,
                 extra: Optional[Dict[str, np.ndarray]] = None,
                 name: Optional[str] = None) -> Path:
        if name is None:
            name = f"snapshots/m_{self.snapshots:05d}.vtu"
            self.snapshots += 1
        path = self.stage_dir / name
        data = {"m": np.ascontiguousarray(m)}
        data.update(extra or {})
        write_vtu(path, points, tets, data)
        with open(self.stage_dir / "snapshots" / "times.txt", "a") as f:
            f.write(f"{name} {t:.10g}\n")
        return path

    def write_text(self, name: str, text: str) -> None:
        (self.stage_dir / name).write_text(text)

    def write_json(self, name: str, data: dict) -> None:
        (self.stage_dir / name).write_text(json.dumps(data, indent=2,
                                                      sort_keys=True) + "\n")

    def commit(self) -> None:
        """Move the finished results into place (replacing those of an
        earlier run in the same directory)."""
        if self.table is not None:
            self.table.close()
        # a finished run is not resumed: its checkpoint goes
        for p in self.stage_dir.glob("*checkpoint.npz*"):
            p.unlink()
        for name in RESULT_NAMES:
            old = self.out_dir / name
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        for item in sorted(self.stage_dir.iterdir()):
            item.rename(self.out_dir / item.name)
        self.stage_dir.rmdir()

    def fail(self, message: str) -> None:
        """Leave the partial files where they are, with the reason."""
        if self.table is not None:
            self.table.close()
        try:
            (self.stage_dir / "error.txt").write_text(message + "\n")
        except OSError:
            pass
