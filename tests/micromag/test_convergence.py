"""Mesh convergence of standard problem 4 (`ivcloud mag converge`).

The fast check: field 1 for its first 0.1 ns at in-plane cells of 20 and
10 nm (two layers across the film), run end to end through the command;
<m> at 0.02, 0.05 and 0.1 ns may move by no more than a set amount
between the two meshes (measured: 0.016, 0.026, 0.064 in the worst
component). A broken term, integrator or mesh moves it by far more.
The full study (10, 5, 3.3 nm over the whole nanosecond) is
`make mag-study`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("petsc4py")

from micromag import convergence                                   # noqa: E402
from micromag.parallel import clean_mpi_env                        # noqa: E402
from micromag.problem import load                                  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMES = (0.02e-9, 0.05e-9, 0.1e-9)
BOUND = (0.03, 0.05, 0.1)


def test_sp4_curve_moves_little_from_20_to_10_nm(tmp_path):
    out = tmp_path / "study"
    r = subprocess.run(
        [sys.executable, "-m", "ivcloud", "mag", "converge",
         str(EXAMPLES / "sp4.toml"), "--out", str(out), "--cells", "20,10",
         "--layers", "2", "--duration", "0.1e-9", "--times",
         ",".join(repr(t) for t in TIMES)],
        capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL, env=clean_mpi_env(os.environ))
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "convergence.json").read_text())
    assert (out / "convergence.png").stat().st_size > 10_000
    assert report["complete"] == [20.0, 10.0]
    (diff,) = report["differences"]
    assert (diff["from"], diff["to"]) == (20.0, 10.0)
    for at, bound in zip(diff["at"], BOUND):
        assert at is not None and at["max"] < bound, (at, bound)
    # the s-state the dynamics start from, and the field turning m over
    m10 = report["values"][1]["m"]
    assert 0.5 < m10[-1][0] < 0.7 and m10[-1][1] > 0.5
    # every run's problem file is the example with only the mesh and
    # duration changed
    cfg = load(out / "h10" / "problem.toml").config
    assert cfg["mesh"]["h"] == [10.0, 10.0, 1.5]
    assert cfg["stage"][-1]["duration"] == pytest.approx(0.1e-9)
    assert cfg["material"] == load(EXAMPLES / "sp4.toml").config["material"]


def test_compare_tables_successive_refinements_and_partial_runs(tmp_path):
    import numpy as np
    t = np.linspace(0, 1e-9, 11)
    curves = {
        10.0: {"t": t, "m": np.stack([np.cos(t * 1e9), np.sin(t * 1e9),
                                      0 * t], axis=1)},
        5.0: {"t": t, "m": np.stack([np.cos(t * 1e9) + 0.02,
                                     np.sin(t * 1e9), 0 * t], axis=1)},
        3.3: {"t": t[:6], "m": np.stack([np.cos(t[:6] * 1e9) + 0.025,
                                         np.sin(t[:6] * 1e9), 0 * t[:6]],
                                        axis=1)},
    }
    rep = convergence.compare(curves, [0.25e-9, 1e-9])
    d1, d2 = rep["differences"]
    assert (d1["from"], d1["to"], d2["from"], d2["to"]) == (10, 5, 5, 3.3)
    assert d1["at"][0]["dm"][0] == pytest.approx(0.02)
    assert d2["at"][0]["max"] == pytest.approx(0.005)
    assert d2["at"][1] is None                  # 3.3 nm not there yet
    assert convergence.converged(rep, 0.01) == []
    assert "(not reached)" in convergence.format_table(rep)
