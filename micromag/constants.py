"""Physical constants and unit factors of the solver (SI units)."""

from __future__ import annotations

import math

MU0 = 4e-7 * math.pi      # vacuum permeability (T m/A)
GAMMA0 = 2.211e5          # m/(A s): mu0 times the electron gyromagnetic ratio
FOUR_PI = 4.0 * math.pi
NM = 1e-9                 # one nanometre in metres
RAD_PER_S_TO_DEG_PER_NS = 180.0 / math.pi * 1e-9
