"""A rank that crashes makes the job fail, under every MPI: the launcher
exits non-zero and says which rank died of which signal, also with the
library Debian's libfabric links for psm loaded in the rank (its
handlers would turn the crash into an ordinary exit:
ivcloud.mpis.base.CRASH_ENV). native/tests/mpi/crash.c is the program:
rank 1, with that library loaded from its start, dies of SIGSEGV; the
others wait in a barrier it never reaches."""

from __future__ import annotations

import re
import time

import pytest

from mpis_support import mpirun, ofi_cluster, ofi_programs  # noqa: F401

# The launcher's own line (not the rank's, nor a handler's): Open MPI
# and PRRTE "... rank 1 with PID P on node H exited on signal 11"; hydra
# (MPICH, Intel MPI), whose proxies reach the instances through the
# launch agent, "PID P RUNNING AT s0i1" (rank 1's instance) and then
# "EXIT CODE: 11", the signal's number (a handled crash: EXIT CODE: 1)
NAMED = re.compile(r"rank 1 with PID \d+ on node \S+ exited on\s+signal 11"
                   r"|RUNNING AT s0i1\s*\n=\s+(EXIT CODE|KILLED BY SIGNAL): "
                   r"11\b")


@pytest.mark.parametrize("mpi", ["openmpi", "mpich", "impi", "openmpi5"])
def test_a_crashed_rank_fails_the_job(mpi, ofi_cluster, ofi_programs):
    name, _ = ofi_cluster
    t0 = time.monotonic()
    proc = mpirun(name, mpi, "ivshmem", 2, ofi_programs(mpi, "crash") + ["1"],
                  timeout=180)
    out = proc.stdout + proc.stderr
    assert "crash: rank 1 dies of SIGSEGV" in out, out
    assert proc.returncode != 0, out
    assert NAMED.search(out), out
    # the survivors were torn down, not left waiting out the timeout
    assert time.monotonic() - t0 < 120, out
