"""A mesh-convergence study as one call (behind `ivcloud mag converge`).

    from micromag import problem, study
    s = study.StudySettings(problem.load("examples/sp4.toml"), "out/sp4",
                            cells=[5.0, 2.5], layers=[1, 1], method="grid")
    report = study.run(s)                  # runs what is missing, compares
    print(study.format_report(report))

Every cell size is one run of the problem (convergence.problem_toml) in
OUT[/LABEL]/h<cell>/run, started by `launch` (default: the solver's own
command, under mpirun for several ranks). A finished run is reused, an
interrupted one continues from its checkpoint, a run of another problem
text in the same place is refused (ProblemError) before anything runs.
LABEL is the demag method the study forces (grid, dense, fmm, auto, or
graded: dense FEM/BEM on a mesh graded towards the lateral faces); none
keeps the problem's own in OUT/h<cell>. The report compares successive
refinements and the reference (convergence.compare), and sums up every
labelled study found in OUT at the last compared time, so one call with
no runs left shows all the methods against the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from . import convergence as cv
from .checkpoint import peek
from .errors import ProblemError
from .parallel import clean_mpi_env
from .problem import Problem

# what --method may name: a demag method, or "graded"
LABELS = ("grid", "dense", "fmm", "auto", "graded")
# graded: cells at the film's lateral faces (in the mesh's unit)
GRADED_EDGE_H = 0.5

# launch(problem_file, run_dir, checkpoint_every) -> exit status
Launcher = Callable[[Path, Path, float], int]


@dataclass
class StudySettings:
    """One study: `problem` at in-plane `cells` (mesh unit) with
    `layers[i]` element layers across z for cells[i]; `method` forces a
    demag method (LABELS) or None; `duration` (s) shortens the last llg
    stage, `times` (stage times, s) are compared (default 0.1, 0.2, 0.5
    and 1 of the duration); `reference`: a curve (convergence.
    reference_for / read_reference) or None."""

    problem: Problem
    out: Path
    cells: Sequence[float]
    layers: Sequence[int]
    method: Optional[str] = None
    edge_h: float = GRADED_EDGE_H
    duration: Optional[float] = None
    times: Optional[Sequence[float]] = None
    tol: float = 0.01
    reference: Optional[dict] = None
    no_run: bool = False
    checkpoint_every: float = 60.0

    def __post_init__(self):
        self.out = Path(self.out)
        if self.method is not None and self.method not in LABELS:
            raise ProblemError(f"study method '{self.method}' unknown "
                               f"({', '.join(LABELS)})")
        if len(self.layers) != len(self.cells):
            raise ProblemError("one number of layers per cell size")
        if not self.edge_h > 0:
            raise ProblemError("graded edge cell size must be positive")
        if self.out.exists() and not self.out.is_dir():
            raise ProblemError(f"{self.out} exists and is not a directory")

    @property
    def label_dir(self) -> Path:
        return self.out if self.method is None else self.out / self.method

    def llg_duration(self) -> float:
        llg = [s for s in self.problem.stages if s.type == "llg"]
        if not llg:
            raise ProblemError("a convergence study needs an llg stage")
        return self.duration or llg[-1].duration

    def compare_times(self) -> List[float]:
        if self.times:
            return list(self.times)
        return [f * self.llg_duration() for f in (0.1, 0.2, 0.5, 1.0)]

    def fem_bem(self) -> bool:
        """Whether the runs use FEM/BEM (whose thin-film accuracy
        depends on the layers), not the grid (which auto is on the
        structured boxes a study refines)."""
        method = self.method or self.problem.demag.method
        return method in ("dense", "fmm", "graded")

    def text(self, cell: float, layers: int) -> str:
        demag, edge = self.method, None
        if self.method == "graded":
            demag, edge = "dense", self.edge_h
        return cv.problem_toml(self.problem, cell, layers, self.duration,
                               method=demag, edge_h=edge)


def own_command(ranks: int) -> Launcher:
    """Runs with the solver's own command (python3 -m micromag run),
    under mpirun when ranks > 1."""
    def launch(problem_file: Path, run_dir: Path,
               checkpoint_every: float) -> int:
        cmd = [sys.executable, "-m", "micromag", "run", str(problem_file),
               "--out", str(run_dir), "--quiet", "--resume",
               "--checkpoint-every", repr(checkpoint_every)]
        if ranks > 1:
            cmd = ["mpirun", "-np", str(ranks)] + cmd
        env = clean_mpi_env(os.environ)
        return subprocess.run(cmd, stdin=subprocess.DEVNULL,
                              env=env).returncode
    return launch


def run(s: StudySettings, launch: Optional[Launcher] = None,
        log: Callable[[str], None] = lambda line: None) -> dict:
    """Run the study's missing runs (unless s.no_run), compare, write
    convergence.json and convergence.png into the label's directory and
    return the report (its "failed" lists the cell sizes whose run
    failed)."""
    launch = launch or own_command(1)
    cells = list(s.cells)
    texts = {c: s.text(c, n) for c, n in zip(cells, s.layers)}
    base = s.label_dir
    dirs = {c: base / f"h{c:g}" for c in cells}
    _refuse_other_problems(dirs, texts)
    base.mkdir(parents=True, exist_ok=True)
    failed = []
    for (c, d), n in zip(dirs.items(), s.layers):
        d.mkdir(exist_ok=True)
        (d / "problem.toml").write_text(texts[c])
        if s.no_run or (d / "summary.json").is_file():
            continue
        ck = peek(d / "run")
        how = "" if ck is None else (
            f" (continuing from the checkpoint at stage {ck['stage']}, "
            f"t = {ck['t']:.4g} s, if it fits the problem)")
        log(f"converge: cells of {c:g} {s.problem.mesh.unit}, "
            f"{n} layer(s){how} ...")
        if launch(d / "problem.toml", d / "run", s.checkpoint_every) != 0:
            failed.append(c)
            continue
        (d / "summary.json").write_text((d / "run" / "summary.json")
                                        .read_text())
    curves = {c: cv.read_curve(d / "run") for c, d in dirs.items()
              if cv.table_path(d / "run") is not None}
    if not curves:
        raise ProblemError(f"no results in {base}")
    times = s.compare_times()
    report = cv.compare(curves, times, reference=s.reference)
    if not cv.refined_alike(cells, s.layers):
        # Richardson needs one refinement parameter: cells and layers
        # refined in different ratios have none
        report["richardson"] = None
    report.update(problem=str(s.problem.path) if s.problem.path else None,
                  method=s.method, cells=cells, layers=list(s.layers),
                  duration_s=s.llg_duration(), tol=s.tol, failed=failed,
                  converged_cells=cv.converged(report, s.tol),
                  complete=[c for c in cells
                            if (dirs[c] / "summary.json").is_file()],
                  fem_bem=s.fem_bem(),
                  methods=summary(s.out, times[-1], s.reference))
    (base / "convergence.json").write_text(json.dumps(report, indent=2)
                                           + "\n")
    unit = s.problem.mesh.unit
    cv.plot(curves, base / "convergence.png",
            title=f"{s.problem.title} ({s.method or 'demag as given'}): "
                  f"in-plane cells {', '.join(f'{c:g}' for c in cells)} "
                  f"{unit}, layers {', '.join(str(n) for n in s.layers)}",
            reference=s.reference)
    return report


def _refuse_other_problems(dirs, texts) -> None:
    """A finished or interrupted run of another text (other layers,
    duration or method) must not be taken for this one; all looked at
    before any run starts, so a refusal costs no compute."""
    for c, d in dirs.items():
        old = d / "problem.toml"
        if (old.is_file() and old.read_text() != texts[c]
                and ((d / "summary.json").is_file()
                     or cv.table_path(d / "run") is not None)):
            raise ProblemError(f"{d} holds a run of another problem (other "
                               f"layers, duration or method?): use "
                               f"another output directory")


def summary(out: Path, t: float, reference: Optional[dict]) -> list:
    """Every run under out/h* and out/<label>/h* at stage time t: label,
    cell, layers, nodes, wall seconds and ranks of the run, <m>(t), its
    difference to the reference and to the next coarser cell size of
    the same label."""
    rows = []
    for label in [None] + sorted(LABELS):
        base = out if label is None else out / label
        if not base.is_dir():
            continue
        found = []
        for d in base.glob("h*"):
            if cv.table_path(d / "run") is None:
                continue
            try:
                cell = float(d.name[1:])
            except ValueError:
                continue
            found.append((cell, d))
        prev = None
        for cell, d in sorted(found, reverse=True):
            m = cv.value_at(cv.read_curve(d / "run"), t)
            row = {"method": label, "cell": cell, "m": None if m is None
                   else [float(x) for x in m]}
            row.update(_run_facts(d))
            ref = None if reference is None else cv.value_at(reference, t)
            row["to_reference"] = (None if m is None or ref is None
                                   else [float(a - b) for a, b in
                                         zip(m, ref)])
            row["change"] = (None if m is None or prev is None
                             else [float(a - b) for a, b in zip(m, prev)])
            prev = m
            rows.append(row)
    return rows


def _run_facts(d: Path) -> dict:
    """nodes, layers, wall time and ranks of the run in d (None where
    the run has not finished)."""
    facts = {"nodes": None, "layers": None, "wall_time_s": None,
             "ranks": None}
    try:
        from .problem import load
        mesh = load(d / "problem.toml").mesh
        h, size = mesh.h, mesh.size
        facts["layers"] = round(size[2] / h[2])
    except (ProblemError, KeyError, TypeError):
        pass
    summ = d / "summary.json"
    if summ.is_file():
        s = json.loads(summ.read_text())
        facts.update(nodes=s.get("nodes"), ranks=s.get("ranks"),
                     wall_time_s=s.get("wall_time_s"))
    return facts


def format_report(report: dict) -> str:
    """The report as text: the refinement table (convergence.
    format_table), then every method found at the last compared time."""
    lines = [cv.format_table(report)]
    layers = report.get("layers") or []
    cells = report.get("cells") or []
    if len(cells) > 1 and len(set(layers)) == 1 and \
            report.get("fem_bem"):
        n = layers[0]
        lines.append(
            f"\nlayers: {n} at every size, so the FEM/BEM study converges "
            f"to the {n}-layer film (for a thin film not the limit: "
            f"docs/mag-demag.md, 'Thin films need layers'); refine them "
            f"in proportion, e.g. --layers "
            f"{','.join(str(round(n * cells[0] / c)) for c in cells)}")
    rows = report.get("methods") or []
    if rows:
        t = report["times"][-1]
        lines.append("")
        lines.append(f"at {t * 1e9:g} ns, every study in this directory:")
        lines.append(f"{'method':<8} {'cell':>6} {'layers':>6} {'nodes':>7} "
                     f"{'wall s':>8}   {'<m>':<26} {'minus reference':<26} "
                     f"change from coarser")
        for r in rows:
            def vec(v):
                return "-" if v is None else \
                    "(" + ", ".join(f"{x:+.4f}" for x in v) + ")"
            wall = "-" if r["wall_time_s"] is None else \
                f"{r['wall_time_s']:.0f}"
            lines.append(
                f"{r['method'] or '(own)':<8} {r['cell']:>6g} "
                f"{'-' if r['layers'] is None else r['layers']:>6} "
                f"{'-' if r['nodes'] is None else r['nodes']:>7} "
                f"{wall:>8}   {vec(r['m']):<26} {vec(r['to_reference']):<26} "
                f"{vec(r['change'])}")
    return "\n".join(lines)
