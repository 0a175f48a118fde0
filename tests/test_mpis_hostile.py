"""A foreign co-tenant writing garbage into a job's region, with each
libfabric MPI over the ivshm provider.

The co-tenant does what a compromised VM on the same server could: it
connects to the job's ivshmem-server as a QEMU would (docs/server-
protocol.md: version, id, the region's fd) and, while two ranks on two
instances of that server ping-pong through the region, writes random
bytes over random places of it (registry and receive areas included)
for two seconds. A message the garbage destroys or garbles must end the
job with an error, as a failed network would (docs/provider.md,
"Failures": the provider fails what waits on a broken path within about
2 s while the ranks are in MPI calls), never leave both ranks waiting:
the job ends with a non-zero status within a bound (30 s from the first
garbage, generous for a loaded machine), and leaves nothing behind (the
cluster's teardown checks that no process of it remains)."""

from __future__ import annotations

import array
import mmap
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from ivcloud import server as server_mod
from ivcloud.cluster import regions
from mpis_support import OFI, ofi_cluster  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="cluster tests need root")

# Ranks 0 and 1 ping-pong 4 KiB messages whose content names the round
# (each side checks what it got) until rank 0 has run for argv[1]
# seconds; rank 0 says when the first 100 rounds went through.
VICTIM = r'''
import sys, time
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.rank
stop_at = time.monotonic() + float(sys.argv[1])
buf = bytearray(4096)
i = 0
while True:
    if rank == 0:
        last = time.monotonic() > stop_at
        msg = (i if not last else -1).to_bytes(8, "little",
                                               signed=True) * 512
        comm.Send([msg, MPI.BYTE], dest=1, tag=1)
        comm.Recv([buf, MPI.BYTE], source=1, tag=2)
        if buf != msg:
            sys.exit(f"rank 0: round {i} came back changed")
        if i == 100:
            print("victim running", flush=True)
        if last:
            break
    else:
        comm.Recv([buf, MPI.BYTE], source=0, tag=1)
        n = int.from_bytes(buf[:8], "little", signed=True)
        if buf != n.to_bytes(8, "little", signed=True) * 512:
            sys.exit(f"rank 1: round {i} arrived changed")
        comm.Send([buf, MPI.BYTE], dest=0, tag=2)
        if n < 0:
            break
    i += 1
print(f"rank {rank} done after {i} rounds", flush=True)
'''
RUN_S = 10          # the victims' own length
SCRIBBLE_S = 2.0
BOUND_S = 30        # from the first garbage to the job's end, at most


def _recv_msg(sock: socket.socket):
    """One server message: (value, fd or None)."""
    fds = array.array("i")
    data, anc, _, _ = sock.recvmsg(8, socket.CMSG_SPACE(fds.itemsize))
    if len(data) != 8:
        raise EOFError("server closed the connection")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) %
                                  fds.itemsize])
    return struct.unpack("<q", data)[0], (fds[0] if fds else None)


def scribble(sock_path: Path, seconds: float, seed: int) -> int:
    """Join the job's server as a QEMU would, map the region and write
    random bytes over it for `seconds`; the bytes written."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock_path))
    region_fd = None
    try:
        while region_fd is None:
            value, fd = _recv_msg(s)
            if value == -1 and fd is not None:
                region_fd = fd
            elif fd is not None:
                os.close(fd)
        size = os.fstat(region_fd).st_size
        mm = mmap.mmap(region_fd, size, mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
        rng = random.Random(seed)
        written = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            # one write in four into the first MiB: header, registry and
            # the first receive areas; the rest anywhere
            top = (1 << 20) if rng.random() < 0.25 else size
            n = rng.choice((8, 64, 4096))
            off = rng.randrange(0, top - n) & ~7
            mm[off:off + n] = rng.randbytes(n)
            written += n
        mm.close()
        return written
    finally:
        if region_fd is not None:
            os.close(region_fd)
        s.close()


def _job_socket(state, timeout: float = 60) -> Path:
    srv = state["servers"]["0"]
    servers_dir = Path(state["servers_dir"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = regions.job_dirs(servers_dir, srv["name"])
        if found:
            return server_mod.paths_for(found[0].name,
                                        str(found[0].parent)).socket
        time.sleep(0.1)
    raise AssertionError("the job's region never appeared")


@pytest.mark.parametrize("mpi", OFI)
def test_garbage_in_the_region_ends_the_job_within_a_bound(mpi,
                                                          ofi_cluster):
    from ivcloud import mpis
    name, state = ofi_cluster
    script = Path(f"/var/tmp/ivcloud-test-victim-{os.getpid()}.py")
    script.write_text(VICTIM)
    cmd = [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
           name, "--mpi", mpi, "--transport", "ivshmem", "--timeout",
           RUN_S + BOUND_S + 60, "-np", "2", "--",
           mpis.flavor(mpi).python(), script, RUN_S]
    out: list = []
    running = threading.Event()
    proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def read():
        for line in proc.stdout:
            out.append(line)
            if "victim running" in line:
                running.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sock = _job_socket(state)
        running.wait(60)
        assert running.is_set(), "".join(out)
        t0 = time.monotonic()
        written = scribble(sock, SCRIBBLE_S, seed=zlib.crc32(mpi.encode()))
        assert written > 0
        try:
            status = proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{mpi}: the job still ran {BOUND_S} s after the "
                        f"garbage:\n{''.join(out)}")
        took = time.monotonic() - t0
        reader.join(10)
        text = "".join(out)
        print(f"\n{mpi}: exit status {status} {took:.1f} s after "
              f"{written} bytes of garbage; last lines:\n"
              + "".join(out[-5:]))
        # an error, not the launcher's own timeout (124: a hang it cut)
        assert status not in (0, 124), text
        assert took <= BOUND_S, text
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        script.unlink(missing_ok=True)
