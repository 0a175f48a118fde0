"""What the tests of the libfabric MPIs (MPICH, Intel MPI, Open MPI 5
from PyPI: ivcloud.mpis) share: one cluster per test module, programs
built by each MPI's compiler, the `cluster mpirun --mpi` call and the
lines the programs and the provider print.

Import the fixtures into a test module by name (`from mpis_support
import ofi_cluster, ofi_programs`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Dict, List

import pytest

from ivcloud import mpis
from ivcloud.mpis import provider
from test_cluster import RUN_DIR, assert_gone, ivcloud, new_name

REPO = Path(__file__).resolve().parent.parent
OFI = list(mpis.OFI_NAMES)
CORRECTNESS = ("p2p", "coll", "rma")
# what each correctness program is given: p2p's largest size in MiB,
# coll's rounds (small, to keep the suite bounded)
CORRECTNESS_ARGS = {"p2p": ["16"], "coll": ["1"], "rma": []}
JOB_TIMEOUT_S = 80    # the launcher tears a job down 20 s before this

# Every rank says who it is (so that the provider's per-process lines can
# be matched to ranks), then an allreduce and a 1 MiB ping-pong between
# ranks 0 and 1 with its content checked in both directions.
MPI4PY_SCRIPT = r'''
import os, socket, sys
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
print(f"rank {rank} pid {os.getpid()} host {socket.gethostname()}",
      flush=True)
total = comm.allreduce(rank + 1)
if total != size * (size + 1) // 2:
    sys.exit(f"rank {rank}: allreduce gave {total}")
n, rounds = 1 << 20, int(sys.argv[1])
buf = bytearray(n)
for i in range(rounds if rank < 2 else 0):
    msg = bytes((i + k) & 0xff for k in range(256)) * (n // 256)
    if rank == 0:
        comm.Send([msg, MPI.BYTE], dest=1, tag=i)
        comm.Recv([buf, MPI.BYTE], source=1, tag=i)
    else:
        comm.Recv([buf, MPI.BYTE], source=0, tag=i)
        comm.Send([buf, MPI.BYTE], dest=0, tag=i)
    if buf != msg:
        sys.exit(f"rank {rank}: 1 MiB message {i} arrived changed")
comm.Barrier()
if rank == 0:
    print(f"mpi4py ok: allreduce {total}, {rounds} x 1 MiB ping-pong",
          flush=True)
'''

# Every pair of ranks exchanges a message, then an allreduce; each rank
# says who it is.
PAIRS_C = r'''
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    int rank, size, token, sum = 0, mine;
    char host[64] = "";
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gethostname(host, sizeof host - 1);
    printf("rank %d pid %d host %s\n", rank, (int)getpid(), host);
    fflush(stdout);
    for (int round = 0; round < 100; round++)
        for (int peer = 0; peer < size; peer++) {
            if (peer == rank)
                continue;
            MPI_Sendrecv(&rank, 1, MPI_INT, peer, 7, &token, 1, MPI_INT,
                         peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            if (token != peer)
                MPI_Abort(MPI_COMM_WORLD, 3);
        }
    mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("pairs ok: sum %d\n", sum);
    MPI_Finalize();
    return sum == size * (size + 1) / 2 ? 0 : 1;
}
'''

_RANK_RE = re.compile(r"^rank (\d+) pid (\d+) host (\S+)$", re.M)


@pytest.fixture(scope="module")
def ofi_cluster():
    """A cluster of 2 servers x 2 instances x 1 vCPU for the whole test
    module: (name, state). Taken down at the end and checked gone."""
    name = new_name()
    proc = ivcloud("cluster", "up", "--name", name, "--servers", 2,
                   "--instances-per-server", 2, "--vcpus", 1,
                   "--oversubscribe")
    try:
        assert proc.returncode == 0, proc.stderr
        state = json.loads((RUN_DIR / f"cluster-{name}" /
                            "state.json").read_text())
        yield name, state
    finally:
        d = RUN_DIR / f"cluster-{name}"
        snapshot = json.loads((d / "state.json").read_text()) \
            if (d / "state.json").exists() else {}
        if d.exists():
            down = ivcloud("cluster", "down", "--name", name)
            assert down.returncode == 0, down.stderr
        assert_gone(name, snapshot)


@pytest.fixture(scope="session")
def ofi_programs():
    """build(mpi, name) -> a program for that MPI, outside /tmp (the
    instances have their own): the C correctness programs of
    native/tests/mpi, `pairs` (PAIRS_C), or `mpi4py` (a script and the
    MPI's own Python: the argv prefix). Removed at the end."""
    d = Path(f"/var/tmp/ivcloud-test-ofi-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    d.mkdir()
    (d / "pairs.c").write_text(PAIRS_C)
    (d / "mpi4py_check.py").write_text(MPI4PY_SCRIPT)
    built: Dict = {}

    def build(mpi: str, name: str) -> List[str]:
        flavor = mpis.flavor(mpi)
        if name == "mpi4py":
            return [str(flavor.python()), str(d / "mpi4py_check.py")]
        if (mpi, name) not in built:
            src = d / "pairs.c" if name == "pairs" else \
                REPO / "native" / "tests" / "mpi" / f"{name}.c"
            out = d / f"{name}-{mpi}"
            proc = subprocess.run(
                flavor.compile_command(src, out, ["-O2", "-Wall", "-Wextra",
                                                  "-Werror"]),
                capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            built[(mpi, name)] = [str(out)]
        return list(built[(mpi, name)])

    try:
        yield build
    finally:
        shutil.rmtree(d, ignore_errors=True)


def mpirun(cluster: str, mpi: str, transport: str, np: int,
           program: List[str], *opts, timeout=JOB_TIMEOUT_S):
    """`ivcloud cluster mpirun --mpi MPI` (block placement: one rank per
    instance, s0i0, s0i1, s1i0, ...)."""
    return ivcloud("cluster", "mpirun", "--name", cluster, "--mpi", mpi,
                   "--transport", transport, "--timeout", timeout - 20,
                   *opts, "-np", np, "--", *program, timeout=timeout)


def ranks(text: str) -> Dict[int, Dict]:
    """{rank: {pid, host}} from the programs' 'rank R pid P host H'."""
    return {int(r): {"pid": int(p), "host": h}
            for r, p, h in _RANK_RE.findall(text)}


def reports_by_rank(proc) -> Dict[int, Dict[str, int]]:
    """The provider's exit line of every rank, matched by pid; a rank
    without one fails the test."""
    text = proc.stdout + proc.stderr
    who = ranks(proc.stdout)
    lines = provider.parse_reports(text)
    missing = [r for r, w in who.items() if w["pid"] not in lines]
    assert who and not missing, (f"ranks without a fi_ivshm line: "
                                 f"{missing}\n{text}")
    return {r: lines[w["pid"]] for r, w in who.items()}
