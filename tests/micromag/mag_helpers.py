"""What the solver's tests share: paths, units, the slow marker, running
`ivcloud mag` and an mpirun script, reading a run's table, and the
demagnetizing factors (computed from a field term, and Aharoni's exact
ones for prisms)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from micromag.parallel import clean_mpi_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NM = 1e-9
MS = 8.0e5

slow = pytest.mark.skipif(os.environ.get("IVCLOUD_SLOW") != "1",
                          reason="slow validation (set IVCLOUD_SLOW=1)")
# longer than `make test` affords (its 30 minutes): `make test-mag-long`
long = pytest.mark.skipif(os.environ.get("IVCLOUD_LONG") != "1",
                          reason="long validation (make test-mag-long)")


def mag_cli(*args, timeout=300):
    """`ivcloud mag ARGS` in a child process. os.environ, not the C
    environment this process inherits to children by default: MPI_Init
    here (singleton) added launcher variables there."""
    return subprocess.run([sys.executable, "-m", "ivcloud", "mag", *args],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL,
                          env=clean_mpi_env(os.environ))


def mpirun_python(script: Path, ranks: int, *args, timeout=300):
    """`mpirun -np ranks python script args` (oversubscribed)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found (openmpi-bin)")
    cmd = [mpirun]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-np", str(ranks), sys.executable,
            str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, env=clean_mpi_env(os.environ))


def table(out: Path) -> np.ndarray:
    return np.genfromtxt(out / "table.csv", delimiter=",", names=True)


def demag_factors(space, field, direction=(1.0, 1.0, 1.0)):
    """(diagonal factors, energy, volume) from the volume-averaged field
    of a uniform magnetization along `direction` (no zero component)."""
    d = np.asarray(direction, dtype=float)
    d /= np.linalg.norm(d)
    state = SimpleNamespace(m=space.vector_vec(), t=0.0, space=space)
    space.set_global(state.m, np.tile(d, (space.n, 1)))
    out = space.vector_vec()
    field.h(state, out)
    H = space.gather(out, to_all=True)
    vol = space.gather(space.mass, to_all=True)
    H_avg = (vol[:, None] * H).sum(axis=0) / vol.sum()
    return -H_avg / (field.Ms[0] * d), field.E(state), vol.sum()


def prism_factor_z(lx, ly, lz):
    """N_z of a rectangular prism (Aharoni, J. Appl. Phys. 83, 3432, 1998)."""
    a, b, c = lx / 2, ly / 2, lz / 2
    r = math.sqrt(a * a + b * b + c * c)
    ab, bc, ac = math.hypot(a, b), math.hypot(b, c), math.hypot(a, c)
    s = ((b * b - c * c) / (2 * b * c) * math.log((r - a) / (r + a))
         + (a * a - c * c) / (2 * a * c) * math.log((r - b) / (r + b))
         + b / (2 * c) * math.log((ab + a) / (ab - a))
         + a / (2 * c) * math.log((ab + b) / (ab - b))
         + c / (2 * a) * math.log((bc - b) / (bc + b))
         + c / (2 * b) * math.log((ac - a) / (ac + a))
         + 2 * math.atan(a * b / (c * r))
         + (a ** 3 + b ** 3 - 2 * c ** 3) / (3 * a * b * c)
         + (a * a + b * b - 2 * c * c) / (3 * a * b * c) * r
         + c / (a * b) * (ac + bc)
         - (ab ** 3 + bc ** 3 + ac ** 3) / (3 * a * b * c))
    return s / math.pi


def prism_factors(lx, ly, lz) -> np.ndarray:
    """(N_x, N_y, N_z) of a rectangular prism (Aharoni)."""
    return np.array([prism_factor_z(ly, lz, lx), prism_factor_z(lz, lx, ly),
                     prism_factor_z(lx, ly, lz)])
