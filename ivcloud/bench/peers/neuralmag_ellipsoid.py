"""The single-domain ellipsoid of examples/ellipsoid.toml in NeuralMag
(nodal finite differences, the JAX backend on the CPU): cubic cells of
the given size over the body's bounding box, the cells whose
centres lie inside the ellipsoid magnetic (NeuralMag's domains, its
density rho elsewhere), relaxed from the initial m in the static field
by its LLG integrator with damping 1, in steps of STEP_S until <m> moves
by less than TOL in a step. Not its own relax(): that stops on max
|dm/dt| over every node of the box, and the nodes outside the body
never settle (it stalls near 8e7 rad/s at 2 nm cells).

Run by ivcloud.bench.mag_peer with the peer's own Python (build/peers/
neuralmag): `python neuralmag_ellipsoid.py CELL_NM SPEC_JSON`, SPEC_JSON
{"semi_axes_nm": [a, b, c], "Ms": .., "A": .., "H": [.., .., ..] (A/m),
"m0": [.., .., ..]}. Prints one JSON line: the cell size and counts, <m>
(NeuralMag's own average over the magnetic domain) and the seconds from
the start to the end. Not imported by ivcloud.
"""

import json
import math
import sys
import time

t0 = time.perf_counter()
import neuralmag as nm  # noqa: E402

# With damping 1 the uniform mode decays with a time constant near 50 ps:
# a step moves <m> by about a fifth of its distance to equilibrium, so
# <m> stops within about 5e-5 of it: 1e-6 is below the float32 noise of
# <m> (its default dtype) from 0.7 nm cells on, where it never stopped
STEP_S = 1e-11
TOL = 1e-5
MAX_STEPS = 2000

cell = float(sys.argv[1]) * 1e-9
spec = json.loads(sys.argv[2])
axes = [v * 1e-9 for v in spec["semi_axes_nm"]]
# the fewest cells that cover the body, centred on it
n = [max(1, math.ceil(2 * a / cell - 1e-9)) for a in axes]
state = nm.State(nm.Mesh(n, [cell] * 3, [-k * cell / 2 for k in n]))
x, y, z = state.coordinates("ccc")
state.add_domain(1, (x / axes[0]) ** 2 + (y / axes[1]) ** 2
                 + (z / axes[2]) ** 2 <= 1.0)
state.material.Ms = spec["Ms"]
state.material.A = spec["A"]
state.material.alpha = 1.0
norm = math.sqrt(sum(v * v for v in spec["m0"]))
state.m = nm.VectorFunction(state).fill([v / norm for v in spec["m0"]])
nm.ExchangeField().register(state, "exchange")
nm.DemagField().register(state, "demag")
nm.ExternalField(nm.VectorFunction(state).fill(spec["H"])).register(
    state, "external")
nm.TotalField("exchange", "demag", "external").register(state)
llg = nm.LLGSolver(state)
m = [float(v) for v in state.m.avg()]
for steps in range(1, MAX_STEPS + 1):
    llg.step(STEP_S)
    last, m = m, [float(v) for v in state.m.avg()]
    if max(abs(a - b) for a, b in zip(m, last)) < TOL:
        break
inside = int(state.domains.tensor.sum())
print(json.dumps({"cell_nm": cell * 1e9, "cells": n, "cells_inside": inside,
                  "m": m, "steps": steps, "t_s": float(state.t), "wall_s": time.perf_counter() - t0}))
