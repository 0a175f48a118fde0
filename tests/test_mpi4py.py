"""mpi4py programs over the ivshmem BTL (Debian's python3-mpi4py).

This file is also the MPI program: pytest runs it under mpirun as
`python test_mpi4py.py SECTION`, with `--mca btl self,ivshmem` (no tcp
fallback) and the component's counters on, and checks every rank moved
traffic through it. The script is an ordinary mpi4py program: nothing in
it knows about ivshmem.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SECTIONS = ["p2p", "coll", "rma", "comm"]


# ---------------------------------------------------------------- program
# (runs in every rank; imports mpi4py only here so that collecting the
# tests never initialises MPI in the pytest process)

def _p2p(MPI, np, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    # numpy buffers, small and 8 MiB, both directions between 0 and 1
    for n in (1, 1000, 1 << 20):
        data = np.arange(n, dtype=np.float64) * (n % 7 + 1)
        if rank == 0:
            comm.Send(data, dest=1, tag=n % 1000)
            back = np.empty(n, dtype=np.float64)
            comm.Recv(back, source=1, tag=n % 1000 + 1)
            assert np.array_equal(back, data + 1), f"echo of {n} doubles"
        elif rank == 1:
            got = np.empty(n, dtype=np.float64)
            st = MPI.Status()
            comm.Recv(got, source=0, tag=n % 1000, status=st)
            assert st.Get_count(MPI.DOUBLE) == n
            assert np.array_equal(got, data), f"{n} doubles"
            comm.Send(got + 1, dest=0, tag=n % 1000 + 1)
    comm.Barrier()

    # ANY_SOURCE / ANY_TAG: everybody but 0 sends 20 arrays
    per = 20
    if rank == 0:
        seen = {}
        buf = np.empty(5000, dtype=np.int32)
        for _ in range((size - 1) * per):
            st = MPI.Status()
            comm.Recv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
            src, tag = st.Get_source(), st.Get_tag()
            k = tag - 100 * src
            assert k == seen.get(src, 0), f"order from {src}: {k}"
            seen[src] = k + 1
            n = st.Get_count(MPI.INT)
            assert n == 100 * k + src
            assert np.all(buf[:n] == src * 1000 + k), f"content {src}/{k}"
        assert seen == {s: per for s in range(1, size)}, seen
    else:
        for k in range(per):
            n = 100 * k + rank
            comm.Send(np.full(n, rank * 1000 + k, dtype=np.int32), dest=0,
                      tag=100 * rank + k)
    # rank 0's ANY_TAG receives would also match the next phase's tag 7
    # from rank size-1 once that rank's 20 arrays are in (a truncation)
    comm.Barrier()

    # pickled objects, non-blocking, and probe
    right, left = (rank + 1) % size, (rank - 1) % size
    req = comm.isend({"from": rank, "blob": b"x" * (rank * 10000)}, dest=right,
                     tag=7)
    obj = comm.recv(source=left, tag=7)
    req.wait()
    assert obj["from"] == left and len(obj["blob"]) == left * 10000

    out = np.full(300000, rank, dtype=np.int64)
    inn = np.empty(300000, dtype=np.int64)
    reqs = [comm.Irecv(inn, source=left, tag=8),
            comm.Isend(out, dest=right, tag=8)]
    MPI.Request.Waitall(reqs)
    assert np.all(inn == left)

    if rank == 1:
        comm.Send(np.arange(777, dtype=np.int16), dest=0, tag=9)
    elif rank == 0:
        st = MPI.Status()
        comm.Probe(source=MPI.ANY_SOURCE, tag=9, status=st)
        n = st.Get_count(MPI.SHORT)
        assert n == 777 and st.Get_source() == 1
        got = np.empty(n, dtype=np.int16)
        comm.Recv(got, source=1, tag=9)
        assert np.array_equal(got, np.arange(777, dtype=np.int16))


def _coll(MPI, np, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    for root in range(size):
        obj = comm.bcast({"root": root, "v": list(range(root + 3))}
                         if rank == root else None, root=root)
        assert obj == {"root": root, "v": list(range(root + 3))}
        arr = np.arange(100000, dtype=np.float64) if rank == root \
            else np.zeros(100000)
        comm.Bcast(arr, root=root)
        assert np.array_equal(arr, np.arange(100000, dtype=np.float64))

    for n in (1, 1000, 250000):
        mine = np.arange(n, dtype=np.int64) + rank
        total = np.empty(n, dtype=np.int64)
        comm.Allreduce(mine, total, op=MPI.SUM)
        want = np.arange(n, dtype=np.int64) * size + size * (size - 1) // 2
        assert np.array_equal(total, want), f"Allreduce {n}"
        red = np.empty(n, dtype=np.int64) if rank == 0 else None
        comm.Reduce(mine, red, op=MPI.MAX, root=0)
        if rank == 0:
            assert np.array_equal(red, np.arange(n, dtype=np.int64) + size - 1)
    assert comm.allreduce(rank, op=MPI.SUM) == size * (size - 1) // 2

    block = 5000
    send = np.array([[rank * 100 + d] * block for d in range(size)],
                    dtype=np.int32)
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    for s in range(size):
        assert np.all(recv[s] == s * 100 + rank), f"Alltoall from {s}"
    got = comm.alltoall([(rank, d) for d in range(size)])
    assert got == [(s, rank) for s in range(size)]

    gathered = np.empty((size, 3), dtype=np.int32)
    comm.Allgather(np.array([rank, rank * 2, rank * 3], dtype=np.int32),
                   gathered)
    assert np.array_equal(gathered[:, 1], np.arange(size) * 2)
    assert comm.allgather(rank * rank) == [r * r for r in range(size)]
    comm.Barrier()


def _rma(MPI, np, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    n = 1 << 16
    win = MPI.Win.Allocate(n * 8, disp_unit=8, comm=comm)
    mem = np.frombuffer(win.tomemory(), dtype=np.int64)
    mem[:] = 0
    win.Fence()
    # fence: put a block into the right neighbour, accumulate into 0.
    # Origin buffers are named: they must live until the epoch closes.
    block = np.full(n, rank + 1, dtype=np.int64)
    win.Put(block, right)
    win.Fence()
    assert np.all(mem == left + 1), "Put under fence"
    win.Fence()
    inc = np.array([rank + 1], dtype=np.int64)
    win.Accumulate(inc, 0, target=[0, 1], op=MPI.SUM)
    win.Fence()
    if rank == 0:
        assert mem[0] == size + size * (size + 1) // 2, mem[0]
    got = np.empty(n, dtype=np.int64)
    win.Fence()
    win.Get(got, right)
    win.Fence()
    assert np.array_equal(got[1:], np.full(n - 1, rank + 1)), "Get under fence"

    # passive target: exclusive lock as a mutex around get + put, and
    # fetch_and_op tickets
    comm.Barrier()
    win.Lock(rank, MPI.LOCK_EXCLUSIVE)
    mem[:4] = 0
    win.Unlock(rank)
    comm.Barrier()
    rounds = 15
    for _ in range(rounds):
        win.Lock(0, MPI.LOCK_EXCLUSIVE)
        cur = np.empty(1, dtype=np.int64)
        win.Get(cur, 0, target=[1, 1])
        win.Flush(0)
        nxt = cur + 1
        win.Put(nxt, 0, target=[1, 1])
        win.Unlock(0)
        ticket, one = np.empty(1, dtype=np.int64), np.ones(1, dtype=np.int64)
        win.Lock(0, MPI.LOCK_SHARED)
        win.Fetch_and_op(one, ticket, 0, 2, MPI.SUM)
        win.Unlock(0)
        assert 0 <= ticket[0] < rounds * size
    comm.Barrier()
    if rank == 0:
        win.Lock(0, MPI.LOCK_EXCLUSIVE)
        assert mem[1] == rounds * size, f"lost updates: {mem[1]}"
        assert mem[2] == rounds * size, f"fetch_and_op: {mem[2]}"
        win.Unlock(0)
    comm.Barrier()
    win.Free()

    # a window over an existing numpy array, shared lock + flush
    base = np.full(1000, -1, dtype=np.int32)
    win = MPI.Win.Create(base, disp_unit=4, comm=comm)
    win.Lock(right, MPI.LOCK_SHARED)
    me = np.array([rank], dtype=np.int32)
    win.Put(me, right, target=[rank, 1])
    win.Flush(right)
    back = np.empty(1, dtype=np.int32)
    win.Get(back, right, target=[rank, 1])
    win.Flush(right)
    assert back[0] == rank
    win.Unlock(right)
    comm.Barrier()
    win.Lock(rank, MPI.LOCK_EXCLUSIVE)
    assert base[left] == left
    win.Unlock(rank)
    comm.Barrier()
    win.Free()


def _comm(MPI, np, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    half = comm.Split(color=rank % 2, key=-rank)
    members = half.allgather(rank)
    assert members == sorted((r for r in range(size) if r % 2 == rank % 2),
                             reverse=True), members
    s = np.empty(1, dtype=np.int64)
    half.Allreduce(np.array([rank], dtype=np.int64), s)
    assert s[0] == sum(members)

    dup = comm.Dup()
    right, left = (rank + 1) % size, (rank - 1) % size
    a, b = np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64)
    on_world = np.array([rank], dtype=np.int64)
    on_dup = np.array([rank + 1000], dtype=np.int64)
    reqs = [dup.Irecv(b, source=left, tag=1),
            comm.Irecv(a, source=left, tag=1),
            comm.Isend(on_world, right, 1),
            dup.Isend(on_dup, right, 1)]
    MPI.Request.Waitall(reqs)
    assert a[0] == left and b[0] == left + 1000, (a, b)
    assert dup.allreduce(1) == size
    dup.Free()
    half.Free()


def _main(section: str) -> int:
    from mpi4py import MPI
    import numpy as np

    comm = MPI.COMM_WORLD
    try:
        {"p2p": _p2p, "coll": _coll, "rma": _rma, "comm": _comm}[section](
            MPI, np, comm)
        comm.Barrier()
    except Exception as e:  # one line, then the whole job goes down
        sys.stderr.write(f"FAIL rank {comm.Get_rank()}: mpi4py {section}: "
                         f"{type(e).__name__}: {e}\n")
        sys.stderr.flush()
        comm.Abort(1)
    if comm.Get_rank() == 0:
        print(f"PASS mpi4py {section} ({comm.Get_size()} ranks, thread "
              f"level {MPI.Query_thread()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))


# ---------------------------------------------------------------- tests

import pytest  # noqa: E402  (not needed by the MPI program above)

NP = 3


def _mpi4py_python() -> str:
    """The interpreter that has mpi4py and numpy: this one (the venv sees
    the system packages), else Debian's."""
    for py in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run([py, "-c", "import mpi4py, numpy"],
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            return py
    pytest.fail("no python with mpi4py and numpy (apt-get install "
                "python3-mpi4py)")


@pytest.fixture(scope="module")
def python() -> str:
    return _mpi4py_python()


@pytest.fixture(scope="module")
def component():
    from ivcloud.mpis import local, openmpi
    from ivcloud.errors import IvcloudError
    try:
        return openmpi.component_dir()
    except IvcloudError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("section", SECTIONS)
def test_mpi4py_over_ivshmem(python, component, shm_path, section):
    from ivcloud.mpis import local, openmpi
    from test_mpi_btl import assert_passed_over_ivshmem, make_region, run_job

    make_region(shm_path)
    cmd = local.mpirun_command([python, str(Path(__file__).resolve()), section],
                             NP, transport="ivshmem", region=shm_path,
                             verbose_btl=True, tcp_fallback=False)
    env = {k: v for k, v in os.environ.items()
           if k not in ("IVSHM_REGION", "IVSHM_SOCKET")}
    job = run_job(cmd, timeout=180, env=env)
    assert_passed_over_ivshmem(job, f"mpi4py {section}", NP)
