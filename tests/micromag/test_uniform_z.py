"""m uniform through a film's thickness (`[mesh] uniform_z = true`,
State.tie_stacks): the stacks of a structured box, the problem file's
check, the same dynamics as the free layers to the discretization's
order with about a quarter fewer field evaluations (the stiffest exchange
mode gone), m equal along every stack, and the same <m>(t) on one and
two ranks (each stack on one rank). docs/mag.md, "Discretization" and
"Performance"."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("petsc4py")

from mag_helpers import mag_cli, table                          # noqa: E402
from micromag import llg, problem as problem_mod                  # noqa: E402
from micromag import mesh as meshmod                              # noqa: E402
from micromag.constants import NM                                 # noqa: E402
from micromag.errors import ProblemError                          # noqa: E402
from micromag.simulation import Simulation                        # noqa: E402

# a 100 x 25 x 3 nm Permalloy film of standard problem 4's cells,
# switched from its initial state for 10 ps
FILM = """
title = "film"
[mesh]
shape = "box"
size = [100.0, 25.0, 3.0]
h = [2.5, 2.5, 3.0]
structured = true
{uniform}
[material]
Ms = 8.0e5
A = 1.3e-11
alpha = 0.02
[initial]
m = [1.0, 0.1, 0.0]
[demag]
method = "grid"
[[stage]]
type = "llg"
duration = 10e-12
integrator = "rk3bs"
output_every = 1e-12
[[stage.field]]
H = [-24.6, 4.3, 0.0]
unit = "mT"
"""


def _film(tmp_path, uniform: bool):
    p = tmp_path / f"film{int(uniform)}.toml"
    p.write_text(FILM.format(uniform="uniform_z = true" if uniform else ""))
    return p


def test_stacks_of_a_structured_box():
    m = meshmod.box(10 * NM, 5 * NM, 3 * NM, (2.5 * NM, 2.5 * NM, 1 * NM),
                    structured=True)
    s = meshmod.stacks(m.points)
    assert s.max() + 1 == 5 * 3                     # (4 + 1) x (2 + 1)
    assert np.all(np.bincount(s) == 4)              # 3 layers, 4 nodes
    for k in range(s.max() + 1):
        xy = m.points[s == k, :2]
        assert np.ptp(xy, axis=0).max() == 0


@pytest.mark.parametrize("text,needle", [
    ("structured = true\nuniform_z = true", None),
    ("structured = false\nuniform_z = true",
     "mesh uniform_z needs a structured box"),
    ("structured = true\nuniform_z = 1",
     "'uniform_z' in \\[mesh\\] must be true/false"),
])
def test_uniform_z_is_checked(tmp_path, text, needle):
    p = tmp_path / "p.toml"
    p.write_text(FILM.format(uniform="").replace(
        "h = [2.5, 2.5, 3.0]\nstructured = true", "h = 2.5\n" + text))
    if needle is None:
        assert problem_mod.load(p).mesh.uniform_z is True
        return
    with pytest.raises(ProblemError, match=needle):
        problem_mod.load(p)


def test_same_dynamics_with_fewer_evaluations(tmp_path):
    runs = {}
    for uniform in (False, True):
        prob = problem_mod.load(_film(tmp_path, uniform))
        sim = Simulation(prob)
        stage = prob.stages[0]
        dyn = llg.Dynamics(sim.state, sim.terms_for(stage, 0.0))
        llg.integrate(dyn, stage.duration, method="rk3bs", rtol=1e-5,
                      atol=1e-5)
        m = sim.space.gather(sim.state.m, to_all=True)
        runs[uniform] = (sim.state.average_m(), dyn.n_rhs, m,
                         sim.space.stacks)
    free, tied = runs[False], runs[True]
    # m through the 3 nm is nearly uniform anyway (exchange length 5.7
    # nm): the restriction changes <m> by far less than the switching
    assert np.abs(tied[0] - free[0]).max() < 2e-4, (tied[0], free[0])
    assert np.abs(free[0] - [1, 0.1, 0] / np.hypot(1, 0.1)).max() > 3e-3
    assert tied[1] < 0.8 * free[1], (tied[1], free[1])
    print(f"<m> free {free[0]}, tied {tied[0]}; right-hand sides "
          f"{free[1]}, {tied[1]}")
    m, stacks = tied[2], tied[3]
    order = np.argsort(stacks, kind="stable")
    pairs = m[order].reshape(-1, 2, 3)              # two node layers
    # equal but for round-off: the average's sums in either order
    assert np.abs(pairs[:, 0] - pairs[:, 1]).max() < 1e-12
    fm = free[2]
    assert np.abs(fm[order].reshape(-1, 2, 3)[:, 0]
                  - fm[order].reshape(-1, 2, 3)[:, 1]).max() > 0


@pytest.mark.parametrize("extra", ["", "K1 = 5e4\naxis = [0.6, 0.8, 0.0]"])
def test_stacks_as_unknowns_are_the_tied_nodes(tmp_path, extra):
    # one m per stack (State.stacks, the explicit integrators' default)
    # against both node layers with the field averaged over each stack:
    # the same LLG, so the same steps and m to round-off, with the
    # right-hand side's vectors half as long. Exchange, grid demag and
    # Zeeman have their fields on the stacks (Term.stack_field); the
    # anisotropy has none and is computed on the nodes and restricted
    p = _film(tmp_path, True)
    p.write_text(p.read_text().replace("alpha = 0.02",
                                       "alpha = 0.02\n" + extra))
    runs = {}
    for on_stacks in (False, True):
        prob = problem_mod.load(p)
        sim = Simulation(prob)
        stage = prob.stages[0]
        dyn = llg.Dynamics(sim.state, sim.terms_for(stage, 0.0))
        rows = []
        res = llg.integrate(dyn, stage.duration, method="rk3bs", rtol=1e-5,
                            atol=1e-5, output_every=2e-12,
                            callback=lambda r: rows.append(
                                (r.t, sim.state.average_m(r.m))),
                            on_stacks=on_stacks)
        runs[on_stacks] = (sim.space.gather(sim.state.m, to_all=True),
                           res["steps"], res["rejected"], dyn.n_rhs, rows,
                           dyn.n_field)
        names = [t.name for t in dyn.terms]
    assert ("anisotropy" in " ".join(names)) == bool(extra), names
    nodes, stacks = runs[False], runs[True]
    assert stacks[1:4] == nodes[1:4], (stacks[1:4], nodes[1:4])
    # one field evaluation counted per right-hand side on either path,
    # the anisotropy's nodal field inside stack_field included
    assert stacks[5] == nodes[5] >= nodes[3], (stacks[5], nodes[5])
    assert np.abs(stacks[0] - nodes[0]).max() < 1e-10
    assert len(stacks[4]) == len(nodes[4]) == 5
    for (ta, ma), (tb, mb) in zip(stacks[4], nodes[4]):
        assert ta == tb and np.abs(ma - mb).max() < 1e-10
    # m left on the nodes is still one value per stack
    order = np.argsort(sim.space.stacks, kind="stable")
    pairs = stacks[0][order].reshape(-1, 2, 3)
    assert np.abs(pairs[:, 0] - pairs[:, 1]).max() == 0
    assert np.abs(np.linalg.norm(stacks[0], axis=1) - 1).max() < 1e-12


def test_one_and_two_ranks_agree(tmp_path):
    prob = _film(tmp_path, True)
    runs = {}
    for np_ in (1, 2):
        out = tmp_path / f"np{np_}"
        r = mag_cli("run", str(prob), "--out", str(out), "--np", str(np_),
                    "--quiet")
        assert r.returncode == 0, r.stderr
        assert json.loads((out / "summary.json").read_text())["ranks"] \
            == np_
        runs[np_] = table(out)
    a, b = runs[1], runs[2]
    assert len(a) == len(b) and len(a) >= 11
    for c in ("mx", "my", "mz"):
        assert np.abs(a[c] - b[c]).max() <= 1e-6


def test_a_convergence_study_frees_m_across_several_layers():
    from mag_helpers import EXAMPLES
    from micromag import convergence
    prob = problem_mod.load(EXAMPLES / "sp4.toml")
    assert prob.mesh.uniform_z is True
    for layers, tied in ((1, True), (3, False)):
        text = convergence.problem_toml(prob, cell=5.0, layers=layers)
        cfg = problem_mod.from_dict(convergence._parse(text))
        assert bool(cfg.mesh.uniform_z) is tied, layers
