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
    # the published solution (OOMMF, docs/mag-sp4-references.md) is in
    # the report: the finer mesh is closer to it at every compared time
    # (measured at 0.1 ns: 0.088 for 20 nm, 0.024 for 10 nm)
    ref = report["reference"]
    assert ref["name"].startswith("OOMMF")
    assert ref["m"][2] == pytest.approx([0.52146, 0.66498, -0.08469])
    d20, d10 = ref["differences"]
    assert (d20["cell"], d10["cell"]) == (20.0, 10.0)
    for a20, a10 in zip(d20["at"], d10["at"]):
        assert a10["max"] < a20["max"]
    assert d10["at"][2]["max"] < 0.05
    assert "reference <m>" in r.stdout and "10 nm - ref" in r.stdout
    # the grid's demag (auto, a box): no note on the layers, which
    # matter for FEM/BEM only; every run in the directory summed up
    assert "layer film" not in r.stdout
    assert [(x["method"], x["cell"]) for x in report["methods"]] == \
        [(None, 20.0), (None, 10.0)]
    assert "every study in this directory" in r.stdout
    # every run's problem file is the example with only the mesh and
    # duration changed
    cfg = load(out / "h10" / "problem.toml").config
    assert cfg["mesh"]["h"] == [10.0, 10.0, 1.5]
    assert cfg["stage"][-1]["duration"] == pytest.approx(0.1e-9)
    assert cfg["material"] == load(EXAMPLES / "sp4.toml").config["material"]
    # the finished runs are not taken for a study of other layers
    r = subprocess.run(
        [sys.executable, "-m", "ivcloud", "mag", "converge",
         str(EXAMPLES / "sp4.toml"), "--out", str(out), "--cells", "20,10",
         "--layers", "3", "--duration", "0.1e-9", "--no-run"],
        capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, env=clean_mpi_env(os.environ))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "h20" in lines[0], r.stderr
    assert load(out / "h20" / "problem.toml").config["mesh"]["h"][2] == 1.5


def test_layers_one_for_all_or_one_per_cell_size():
    assert convergence.parse_layers("3", 2) == [3, 3]
    assert convergence.parse_layers("3,6", 2) == [3, 6]
    for bad in ("3,6,9", "0", "x", ""):
        with pytest.raises(convergence.ProblemError):
            convergence.parse_layers(bad, 2)
    # Richardson over the cell size only where one parameter is refined
    assert convergence.refined_alike([10, 5, 3.3], [3, 3, 3])
    assert convergence.refined_alike([10, 5, 3.3], [3, 6, 9])
    assert not convergence.refined_alike([5, 3.3, 2.5], [3, 6, 6])


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


def test_richardson_recovers_order_and_limit():
    import numpy as np
    t = np.linspace(0, 1e-9, 11)
    m0 = np.stack([np.cos(t * 1e9), np.sin(t * 1e9), 0.1 + 0 * t], axis=1)

    def at(h, p, c):   # <m>(h) = m0 + c h^p, per component
        return {"t": t, "m": m0 + np.outer(np.ones_like(t),
                                           np.asarray(c) * h ** p)}
    curves = {h: at(h, 2.0, [1e-3, -2e-3, 0.0]) for h in (10.0, 5.0, 2.5)}
    rep = convergence.compare(curves, [0.5e-9])
    rich = rep["richardson"]
    assert rich["cells"] == [10.0, 5.0, 2.5]
    mx, my, mz = rich["at"][0]
    assert mx["p"] == pytest.approx(2.0, rel=1e-6)
    assert mx["error"] == pytest.approx(1e-3 * 2.5 ** 2, rel=1e-6)
    assert my["m0"] == pytest.approx(np.sin(0.5), rel=1e-6)
    assert mz is None            # no change at all: nothing to estimate
    assert "Richardson from 10, 5, 2.5 nm" in convergence.format_table(rep)
    # uneven sizes: a second change larger than the first still fits
    # (5, 4, 3 nm at p = 0.5: ratio 1.135)
    uneven = {h: at(h, 0.5, [1e-3, 0.0, 0.0]) for h in (5.0, 4.0, 3.0)}
    x = convergence.compare(uneven, [0.5e-9])["richardson"]["at"][0][0]
    assert x["p"] == pytest.approx(0.5, rel=1e-6)
    # changes that grow (not yet asymptotic) give no estimate
    curves[2.5] = at(2.5, 2.0, [1e-3, -2e-3, 0.0])
    curves[2.5]["m"][:, 0] += 0.5
    assert convergence.compare(curves, [0.5e-9])["richardson"]["at"][0][0] \
        is None
    # two sizes: none
    del curves[2.5]
    assert convergence.compare(curves, [0.5e-9])["richardson"] is None


def _sp4_variant(tmp_path, old, new):
    text = (EXAMPLES / "sp4.toml").read_text()
    assert old in text
    p = tmp_path / "variant.toml"
    p.write_text(text.replace(old, new))
    return load(p)


def test_reference_only_for_standard_problem_4(tmp_path):
    ref = convergence.reference_for(load(EXAMPLES / "sp4.toml"))
    assert ref is not None and ref["first_crossing_s"] == 0.1385e-9
    assert ref["field"] == 1 and "crossing_tol_s" not in ref
    assert len(ref["t"]) == len(ref["m"]) == 12
    # another material, field or film: no reference
    for old, new in (("alpha = 0.02", "alpha = 0.03"),
                     ("H = [-24.6, 4.3, 0.0]", "H = [-35.5, -6.3, 1.0]"),
                     ("size = [500.0, 125.0, 3.0]",
                      "size = [500.0, 125.0, 5.0]")):
        assert convergence.reference_for(
            _sp4_variant(tmp_path, old, new)) is None, new
    # the same field in other units is still field 1
    same = _sp4_variant(tmp_path, 'H = [-24.6, 4.3, 0.0]\nunit = "mT"',
                        'H = [-0.0246, 0.0043, 0.0]\nunit = "T"')
    assert convergence.reference_for(same)["field"] == 1
    # field 2: the example, and field 1's file with field 2's field
    for prob in (load(EXAMPLES / "sp4_field2.toml"),
                 _sp4_variant(tmp_path, "H = [-24.6, 4.3, 0.0]",
                              "H = [-35.5, -6.3, 0.0]")):
        ref2 = convergence.reference_for(prob)
        assert ref2["field"] == 2 and ref2["crossing_tol_s"] == 2e-12
        assert 0.13e-9 < ref2["first_crossing_s"] < 0.145e-9
        assert len(ref2["t"]) == len(ref2["m"]) == 12
        spread = ref2["spread"]
        published = list(convergence.SP4_FIELD2_PUBLISHED_1NS.values())
        for k in range(3):
            assert spread["min"][k] == min(m[k] for m in published)
            assert spread["max"][k] == max(m[k] for m in published)


def _crossing_curve(t_cross, m_end):
    """<mx> falling through zero at t_cross, ending at m_end at 1 ns."""
    import numpy as np
    t = np.linspace(0, 1e-9, 1001)      # 1 ps rows
    mx = np.where(t < 0.3e-9, -np.tanh((t - t_cross) / 20e-12),
                  m_end[0])
    m = np.stack([mx, 0 * t + m_end[1], 0 * t + m_end[2]], axis=1)
    return {"t": t, "m": m}


def test_field_2_checks_the_crossing_and_the_published_spread():
    """Field 2's checks on made-up curves: the crossing within 2 ps of
    the reference's, <m>(1 ns) inside the published spread."""
    ref = convergence.reference_for(load(EXAMPLES / "sp4_field2.toml"))
    x0 = ref["first_crossing_s"]
    spread = ref["spread"]
    mid = [0.5 * (a + b) for a, b in zip(spread["min"], spread["max"])]
    off = list(mid)
    off[1] = spread["max"][1] + 0.01
    curves = {5.0: _crossing_curve(x0 + 3e-12, off),      # both miss
              2.5: _crossing_curve(x0 - 1.5e-12, mid)}    # both pass
    rep = convergence.compare(curves, [0.1e-9, 1e-9], reference=ref)
    r = rep["reference"]
    assert r["crossing_tol_s"] == 2e-12 and r["spread"] == spread
    coarse, fine = r["differences"]
    assert coarse["crossing_diff_s"] == pytest.approx(3e-12, abs=0.05e-12)
    assert coarse["crossing_ok"] is False and fine["crossing_ok"] is True
    assert coarse["inside_spread"] is False and fine["inside_spread"] is True
    text = convergence.format_table(rep)
    assert "crossing within 2 ps of the reference: 5 nm NO (+3.00 ps), " \
           "2.5 nm yes (-1.50 ps)" in text, text
    assert "published first crossings: 0.1362..0.1382 ns" in text
    assert "inside the published spread" in text and \
           "5 nm NO, 2.5 nm yes" in text, text
    # a run that has not reached 1 ns: no verdict yet
    short = {k: v[:200] for k, v in curves[2.5].items()}
    c = convergence.checks(short, ref)
    assert c["crossing_ok"] is True and c["inside_spread"] is None


def test_compare_against_a_reference(tmp_path):
    import numpy as np
    t = np.linspace(0, 1e-9, 101)
    mx = np.cos(t * 1e10)                 # first zero at pi/2 * 0.1 ns
    curve = {"t": t, "m": np.stack([mx, np.sin(t * 1e10), 0 * t], axis=1)}
    tab = {"name": "tab", "source": "test", "interpolate": False,
           "t": [0.1e-9, 0.5e-9], "m": [[0.5, 0.5, 0.0], [0.1, 0.2, 0.3]]}
    rep = convergence.compare({5.0: curve}, [0.1e-9, 0.3e-9], reference=tab)
    r = rep["reference"]
    assert r["m"][0] == [0.5, 0.5, 0.0] and r["m"][1] is None  # not tabulated
    (d,) = r["differences"]
    assert d["at"][0]["dm"][0] == pytest.approx(np.cos(1.0) - 0.5, abs=1e-3)
    assert d["at"][1] is None
    assert rep["values"][0]["first_crossing_s"] == pytest.approx(
        np.pi / 2 * 1e-10, rel=1e-3)
    text = convergence.format_table(rep)
    assert "5 nm - ref" in text and "(none)" in text
    # a full curve from a file is interpolated
    f = tmp_path / "ref.txt"
    f.write_text("# t mx my mz\n" + "\n".join(
        f"{x:.6e} {np.cos(x * 1e10):.8f} {np.sin(x * 1e10):.8f} 0"
        for x in t[::5]) + "\n")
    full = convergence.read_reference(f)
    rep = convergence.compare({5.0: curve}, [0.3e-9], reference=full)
    assert rep["reference"]["differences"][0]["at"][0]["max"] < 0.02
    assert rep["reference"]["differences"][0]["crossing_diff_s"] == \
        pytest.approx(0, abs=2e-12)
    convergence.plot({5.0: curve}, tmp_path / "p.png", reference=full)
    convergence.plot({5.0: curve}, tmp_path / "q.png", reference=tab)
    assert (tmp_path / "q.png").stat().st_size > 10_000


def test_bad_reference_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\n3 4\n")
    r = subprocess.run(
        [sys.executable, "-m", "ivcloud", "mag", "converge",
         str(EXAMPLES / "sp4.toml"), "--out", str(tmp_path / "s"),
         "--reference", str(bad), "--no-run"],
        capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, env=clean_mpi_env(os.environ))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.txt" in lines[0], r.stderr
    assert not (tmp_path / "s").exists()
