"""µMAG standard problem 4 (examples/sp4.toml: field 1, examples/
sp4_field2.toml: field 2) against the published solutions and, for
field 2, a converged finite-difference run (docs/mag-sp4-references.md).

Field 1. Quick: a 10 nm mesh for 0.2 ns, the s-state and the first <mx>
zero crossing. Slow (IVCLOUD_SLOW=1, which `make test-python` sets): the
example as it is, relaxation and the whole nanosecond on two ranks,
<m>(1 ns) within 0.01 of mumax3's certified value in every component
(and of OOMMF's within 0.012; the two differ by 1e-3; measured:
docs/mag.md, "Standard problem 4"); about 3-4 minutes on the two cores
of a quiet machine.

Field 2. Its check is the first <mx> zero crossing (at 0.137 ns), which
converges, where <m>(1 ns) scatter. Quick: the example's own mesh, two
ranks, only to 0.16 ns, past the crossing: the crossing within 2 ps of
the finite-difference run at 1.25 nm cells, which is the check itself,
at a fifth of the run. Long (`make test-mag-long`, beyond `make test`'s
time): the whole nanosecond, the crossing again and <m>(1 ns) against
the published spread (docs/mag.md, "Standard
problem 4, field 2", says where it falls).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("petsc4py")

from mag_helpers import EXAMPLES, long, mag_cli, slow, table      # noqa: E402
from micromag import convergence                                  # noqa: E402
from micromag.problem import load                                 # noqa: E402

DEFAULT_H = "h = [2.5, 2.5, 3.0]"


def _run(tmp_path, h=None, duration=None, ranks=1, timeout=900,
         example="sp4.toml"):
    text = (EXAMPLES / example).read_text()
    assert DEFAULT_H in text
    if h is not None:
        text = text.replace(DEFAULT_H, f"h = {h}")
    if duration is not None:
        text = text.replace("duration = 1e-9", f"duration = {duration}")
    prob = tmp_path / example
    prob.write_text(text)
    out = tmp_path / example.replace(".toml", "")
    r = mag_cli("run", str(prob), "--out", str(out), "--np", str(ranks),
                "--quiet", timeout=timeout)
    assert r.returncode == 0, r.stderr
    return prob, out


def _crossing(dyn):
    i = int(np.argmax(dyn["mx"] < 0))
    assert i > 0, "mx never crossed zero"
    t0, t1 = dyn["t"][i - 1], dyn["t"][i]
    m0, m1 = dyn["mx"][i - 1], dyn["mx"][i]
    return t0 - m0 * (t1 - t0) / (m1 - m0) - dyn["t"][0]


def test_coarse_s_state_and_first_crossing(tmp_path):
    """10 nm in the plane, two layers, 0.2 ns: s-state (0.967, 0.125, 0),
    first <mx> zero crossing at 0.14 ns."""
    _, out = _run(tmp_path, "[10.0, 10.0, 1.5]", 0.2e-9)
    t = table(out)
    relaxed = t[t["stage"] == 1][-1]
    assert relaxed["mx"] == pytest.approx(0.967, abs=0.008)
    assert relaxed["my"] == pytest.approx(0.125, abs=0.012)
    assert abs(relaxed["mz"]) < 1e-3
    assert _crossing(t[t["stage"] == 2]) == pytest.approx(0.14e-9,
                                                          abs=0.005e-9)


@slow
def test_default_within_0_01_of_the_published_solution(tmp_path):
    t0 = time.monotonic()
    prob, out = _run(tmp_path, ranks=2, timeout=1800)
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["demag_method"] == "grid" and summary["ranks"] == 2
    ref = convergence.reference_for(load(prob))
    curve = convergence.read_curve(out)
    m = convergence.value_at(curve, 1e-9)
    certified = m - np.array(convergence.SP4_FIELD1_CERTIFIED_1NS)
    assert np.abs(certified).max() < 0.01, (m, certified)
    diff = m - convergence.value_at(ref, 1e-9)         # OOMMF, 2.5 nm
    assert np.abs(diff).max() < 0.012, (m, diff)
    # the curve on the way: within 0.02 at the tabulated times (the
    # published curves themselves differ by ~0.01 late in the ns)
    for t in ref["t"]:
        d = convergence.value_at(curve, t) - convergence.value_at(ref, t)
        assert np.abs(d).max() < 0.03, (t, d)
    assert convergence.first_crossing(curve) == pytest.approx(
        ref["first_crossing_s"], abs=1e-12)
    print(f"standard problem 4 at the default on 2 ranks: {wall:.0f} s, "
          f"<m>(1 ns) - certified = {np.round(certified, 4)}, - OOMMF = "
          f"{np.round(diff, 4)}")


# ---------------------------------------------------------------- field 2

def test_field_2_first_crossing_within_2_ps_at_the_default_mesh(tmp_path):
    """Field 2 at the example's mesh on two ranks, to 0.16 ns: <mx>
    crosses zero within 2 ps of the finite-difference reference."""
    prob, out = _run(tmp_path, duration=0.16e-9, ranks=2,
                     example="sp4_field2.toml")
    ref = convergence.reference_for(load(prob))
    assert ref["field"] == 2
    t = table(out)
    relaxed = t[t["stage"] == 1][-1]                   # field 1's s-state
    assert relaxed["mx"] == pytest.approx(0.967, abs=0.002)
    assert relaxed["my"] == pytest.approx(0.125, abs=0.002)
    x = _crossing(t[t["stage"] == 2])
    assert convergence.first_crossing(convergence.read_curve(out)) == \
        pytest.approx(x, abs=1e-15)
    assert x == pytest.approx(ref["first_crossing_s"],
                              abs=convergence.SP4_FIELD2_CROSSING_TOL_S)


@long
def test_field_2_whole_nanosecond(tmp_path):
    t0 = time.monotonic()
    prob, out = _run(tmp_path, ranks=2, timeout=1800,
                     example="sp4_field2.toml")
    wall = time.monotonic() - t0
    ref = convergence.reference_for(load(prob))
    curve = convergence.read_curve(out)
    c = convergence.checks(curve, ref)
    assert c["crossing_ok"], convergence.first_crossing(curve)
    m = np.array(c["m_at_spread"])
    lo, hi = np.array(ref["spread"]["min"]), np.array(ref["spread"]["max"])
    outside = np.maximum(lo - m, m - hi).clip(min=0)
    # The published band (three solutions) is narrower than the scatter
    # it stands for: the converged finite-difference run itself lies
    # 0.0024 outside it (<mx>), the example 0.0038 (<mz>); measured in
    # docs/mag.md, "Standard problem 4, field 2". Beyond 0.005 is a change.
    assert outside.max() <= 0.005, (m, outside)
    print(f"standard problem 4, field 2 on 2 ranks: {wall:.0f} s, first "
          f"crossing {convergence.first_crossing(curve) * 1e9:.5f} ns "
          f"(reference {ref['first_crossing_s'] * 1e9:.5f}), <m>(1 ns) "
          f"{np.round(m, 4)}, outside the published spread by "
          f"{np.round(outside, 4)}")
