"""µMAG standard problem 4 in NeuralMag (nodal finite differences, the
JAX backend on the CPU), as its own guide sets it up: relaxation by
damping-only integration from m = (1, 0.1, 0) normalized, then 1 ns in
field 1, (-24.6, 4.3, 0) mT, or field 2, (-35.5, -6.3, 0) mT, with
damping 0.02, in steps of SAMPLE_S (default 10 ps) of its adaptive
Dormand-Prince integrator, <m> after each.

Run by ivcloud.bench.mag_peer with the peer's own Python (build/peers/
neuralmag): `python neuralmag_sp4.py CELL_NM [FIELD [SAMPLE_S]]`.
Prints one JSON line: the cell size, the field, <m> at 1 ns (NeuralMag's
own average over the film), the curve <m>(t) at every sample (t from
the field's start), the seconds from the start to the end of the
relaxation (imports and JAX's compilations included) and of the whole
run. Not imported by ivcloud (NeuralMag lives only in the peer's
environment).
"""

import json
import math
import sys
import time

t0 = time.perf_counter()
import neuralmag as nm  # noqa: E402
from scipy import constants  # noqa: E402

FIELDS_MT = {1: (-24.6, 4.3, 0.0), 2: (-35.5, -6.3, 0.0)}
cell = float(sys.argv[1]) * 1e-9
field = int(sys.argv[2]) if len(sys.argv) > 2 else 1
sample = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-11
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
h = nm.VectorFunction(state).fill([v * 1e-3 / constants.mu_0
                                   for v in FIELDS_MT[field]])
nm.ExternalField(h).register(state, "external")
nm.TotalField("exchange", "demag", "external").register(state)
llg.reset()
# each row at its nominal time k * sample: the solver's own clock sums
# the steps and ends 1e-14 s short of 1 ns, which would leave the curve
# without a value there
curve = [[0.0] + [float(v) for v in state.m.avg()]]
for k in range(1, round(1e-9 / sample) + 1):
    llg.step(sample)
    curve.append([k * sample] + [float(v) for v in state.m.avg()])
print(json.dumps({"cell_nm": cell * 1e9, "cells": [nx, ny],
                  "field": field, "t_s": curve[-1][0], "m": curve[-1][1:],
                  "curve": curve,
                  "start_and_relax_s": relaxed - t0,
                  "wall_s": time.perf_counter() - t0}))
