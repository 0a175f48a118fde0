"""Node partition (micromag/partition.py: PT-Scotch through PETSc) on
real MPI ranks: balanced parts, a small edge cut, the same array on
every rank, and the same partition on every run of the same job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("petsc4py")
pytest.importorskip("mpi4py")

from micromag.parallel import clean_mpi_env                    # noqa: E402

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from mpi4py import MPI
    from micromag import mesh
    from micromag.fem import node_graph
    from micromag.partition import partition_nodes

    comm = MPI.COMM_WORLD
    box = mesh.box(30e-9, 30e-9, 100e-9, 3e-9, structured=True)
    graph = node_graph(len(box.points), box.tets)
    part = partition_nodes(graph, comm)
    coo = graph.tocoo()
    cut = int((part[coo.row] != part[coo.col]).sum() // 2)
    # every rank got the same array
    same = comm.allgather(hashlib.sha256(part.tobytes()).hexdigest())
    if comm.rank == 0:
        print(json.dumps({"n": len(part), "sizes":
                          np.bincount(part).tolist(), "cut": cut,
                          "first": int(part[0]), "hash": same[0],
                          "same": len(set(same)) == 1}))
""")


def _run(tmp_path, np_):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found (openmpi-bin)")
    script = tmp_path / "partition.py"
    script.write_text(SCRIPT)
    cmd = [mpirun]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-np", str(np_), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=clean_mpi_env(os.environ),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("np_", [2, 4])
def test_partition_is_balanced_small_and_reproducible(tmp_path, np_):
    first = _run(tmp_path, np_)
    n = first["n"]
    assert n == 11 * 11 * 34 and first["same"]
    assert len(first["sizes"]) == np_ and first["first"] == 0
    # parts within 1 % of the mean
    assert max(first["sizes"]) - min(first["sizes"]) <= 0.01 * n / np_
    # planar cuts across the long axis: 441 edges per cut (METIS k-way
    # found the same); allow 15 % more
    assert first["cut"] <= 1.15 * 441 * (np_ - 1)
    again = _run(tmp_path, np_)
    assert again["hash"] == first["hash"]
