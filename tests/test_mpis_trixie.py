"""Debian 13's own Open MPI 5 between two Debian 13 guests, through the
ivshm provider of our guest package, unmodified.

Two QEMU guests of the `--release trixie` image (Open MPI 5.0.7,
libfabric 2.1, python3-mpi4py from Debian, our ivcloud-guest package)
on one ivshmem-server: ivshm-bind bound each guest's device and turned
on mtl ofi in Open MPI's parameter file (Debian turns it off); a plain
`mpirun` in the first guest, as the unprivileged user, starts the second
rank over ssh, and pml cm + mtl ofi carry a 4 KiB ping-pong over the
provider, as its exit lines (FI_IVSHM_REPORT=1) show.

Slow (building the Debian 13 image takes minutes, the TCG boot about
one): `make test-trixie` runs it (IVCLOUD_TRIXIE=1); `make test` does
not, to stay within its 30 minutes.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ivcloud.mpis import provider
from ivcloud.server import paths_for, start as server_start
from ivcloud.vm import debian, qemu
from test_guest_image import ivcloud, sh
from vm_support import vm_down

REPO = Path(__file__).resolve().parents[1]
NATIVE = Path(os.environ.get("IVCLOUD_NATIVE_DIR") or REPO / "build" / "native")

pytestmark = [
    pytest.mark.skipif(os.environ.get("IVCLOUD_TRIXIE") != "1",
                       reason="slow: make test-trixie (IVCLOUD_TRIXIE=1)"),
    pytest.mark.skipif(qemu.qemu_binary() is None, reason="no QEMU"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mmdebstrap") is None
                       or shutil.which("dpkg-deb") is None,
                       reason="needs root, mmdebstrap and dpkg-deb"),
]

PINGPONG = r"""
import sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
n = int(sys.argv[1])
buf = bytearray(4096)
for i in range(n):
    if rank == 0:
        buf[:8] = i.to_bytes(8, "little")
        comm.Send(buf, dest=1, tag=i)
        comm.Recv(buf, source=1, tag=i)
        if int.from_bytes(buf[:8], "little") != i + 1:
            sys.exit("rank 0: bad echo")
    else:
        comm.Recv(buf, source=0, tag=i)
        buf[:8] = (int.from_bytes(buf[:8], "little") + 1).to_bytes(8, "little")
        comm.Send(buf, dest=0, tag=i)
print("pingpong rank", rank, "on", MPI.Get_processor_name(), "ok", n,
      MPI.Get_library_version().split(",")[0], flush=True)
"""


@pytest.fixture(scope="module")
def guests(tmp_path_factory):
    out = tmp_path_factory.mktemp("deb")
    subprocess.run(["sh", str(REPO / "packaging" / "mkdeb.sh"), str(NATIVE),
                    str(out), "0.1.0"], check=True, capture_output=True,
                   timeout=300)
    deb = out / "ivcloud-guest_0.1.0_amd64.deb"
    t0 = time.monotonic()
    img = debian.build(deb=deb, log=print, release_name="trixie")
    print(f"\nDebian 13 image: {time.monotonic() - t0:.0f} s (cached if "
          f"~0), disk {img.disk.stat().st_blocks * 512 >> 20} MiB")
    run_dir = Path(tempfile.mkdtemp(prefix="ivc-d13-", dir="/tmp"))
    paths = paths_for(f"d13{os.getpid()}", str(run_dir))
    server_start(paths, 32 << 20)
    try:
        t0 = time.monotonic()
        r = ivcloud("vm", "up", "--kind", "debian", "--release", "trixie",
                    "--guest-deb", deb, "--count", 2, "--network",
                    "--server", paths.socket, "--run-dir", run_dir,
                    "--memory", "512M", "--accel", "tcg", "--boot-timeout",
                    400, "--name", "tx")
        assert r.returncode == 0, r.stderr + r.stdout
        print(f"vm up (Debian 13, tcg): {time.monotonic() - t0:.0f} s")
        yield [run_dir / "vm" / f"tx{i}" / "agent.sock" for i in (0, 1)]
    finally:
        vm_down(run_dir, paths)


def test_debian13_open_mpi_5_uses_the_provider_between_guests(guests):
    first, second = guests
    # what the package set up: the provider where libfabric looks, mtl
    # ofi turned on by ivshm-bind, no BTL block (Open MPI 5 has none)
    assert "ivshm" in sh(first, "ls /usr/lib/x86_64-linux-gnu/libfabric/")
    mca = sh(first, "cat /etc/openmpi/openmpi-mca-params.conf")
    block = mca[mca.index("# BEGIN ivcloud-guest"):]
    assert "mtl = ofi" in block and "btl" not in block.split("\n", 1)[1], mca
    code = base64.b64encode(PINGPONG.encode()).decode()
    for s in guests:
        sh(s, f"echo {code} | base64 -d > /tmp/pp.py && chmod 644 /tmp/pp.py")
        sh(s, "printf 'tx0 slots=1\\ntx1 slots=1\\n' > /tmp/hosts")
    out = sh(first, "cd /tmp && runuser -u mpi -- mpirun -x "
             f"{provider.REPORT_ENV}=1 -np 2 --hostfile /tmp/hosts "
             "python3 /tmp/pp.py 200 2>&1", timeout=600)
    print(out)
    assert "pingpong rank 0 on tx0 ok 200 Open MPI v5.0.7" in out, out
    assert "pingpong rank 1 on tx1 ok 200 Open MPI v5.0.7" in out, out
    lines = provider.parse_reports(out)
    assert len(lines) == 2, out
    # 200 round trips over the region, none handed to tcp
    for counts in lines.values():
        assert counts["sent"] >= 200 and counts["received"] >= 200, out
        assert counts["delegated"] == 0, out
