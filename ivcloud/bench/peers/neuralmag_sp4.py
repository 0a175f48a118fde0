"""µMAG standard problem 4, field 1, in NeuralMag (nodal finite
differences, the JAX backend on the CPU), as its own guide sets it up:
relaxation by damping-only integration from m = (1, 0.1, 0) normalized,
then 1 ns in the field (-24.6, 4.3, 0) mT with damping 0.02, in 10 ps
steps of its adaptive Dormand-Prince integrator.

Run by ivcloud.bench.mag_peer with the peer's own Python (build/peers/
neuralmag): `python neuralmag_sp4.py CELL_NM`. Prints one JSON line:
the cell size, <m> at 1 ns (NeuralMag's own average over the film), the
seconds from the start to the end of the relaxation (imports and JAX's
compilations included) and of the whole run. Not imported by
ivcloud (NeuralMag lives only in the peer's environment).
"""

import json
import math
import sys
import time

t0 = time.perf_counter()
import neuralmag as nm  # noqa: E402
from scipy import constants  # noqa: E402

cell = float(sys.argv[1]) * 1e-9
nx, ny = round(500e-9 / cell), round(125e-9 / cell)
# a single-layer film: NeuralMag's 2-d nodal mesh, the 3 nm thickness as
# the third spacing (its guide's advice for thin films)
state = nm.State(nm.Mesh([nx, ny], [cell, cell, 3e-9], [0.0, 0.0, 0.0]))
state.material.Ms = 8e5
state.material.A = 1.3e-11
state.material.alpha = 0.02
norm = math.hypot(1.0, 0.1)
state.m = nm.VectorFunction(state).fill((1.0 / norm, 0.1 / norm, 0.0))
nm.ExchangeField().register(state, "exchange")
nm.DemagField().register(state, "demag")
nm.TotalField("exchange", "demag").register(state)
llg = nm.LLGSolver(state)
llg.relax()
relaxed = time.perf_counter()
h = nm.VectorFunction(state).fill([-24.6e-3 / constants.mu_0,
                                   4.3e-3 / constants.mu_0, 0.0])
nm.ExternalField(h).register(state, "external")
nm.TotalField("exchange", "demag", "external").register(state)
llg.reset()
start = state.t                 # the relaxation advanced the clock
for _ in range(100):
    llg.step(1e-11)
m = [float(v) for v in state.m.avg()]
print(json.dumps({"cell_nm": cell * 1e9, "cells": [nx, ny],
                  "t_s": float(state.t - start), "m": m,
                  "start_and_relax_s": relaxed - t0,
                  "wall_s": time.perf_counter() - t0}))
