"""The Debian guest image (docs/vm.md): Debian 12 from Debian packages
(mmdebstrap) with openmpi-bin, python3-mpi4py, python3-numpy, hpcc and
our ivcloud-guest package installed by dpkg, booted under QEMU (TCG here)
with its ivshmem-doorbell device on an ivshmem-server.

Checked inside the booted guest: the udev rule started ivshm-bind, which
gave the device to vfio-pci with group ivshm and mode 0660; Open MPI
lists the ivshmem component and its defaults name the device; a plain
`mpirun`, run by an unprivileged member of group ivshm, picks the BTL,
which attaches to the region with the doorbell.

The image is built (about 3-4 min here: mmdebstrap, dpkg, mke2fs) once
per input hash and cached in /var/cache/ivcloud (`make test` builds it
ahead, while the C tests run: tests/vm_support.py's prebuild); the boot
takes about a minute under TCG. IVCLOUD_SKIP_GUEST_IMAGE=1 skips the
module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ivcloud.server import paths_for, start as server_start
from vm_support import HOST_DEB, vm_down
from ivcloud.vm import agent, debian, qemu


pytestmark = [
    pytest.mark.skipif(os.environ.get("IVCLOUD_SKIP_GUEST_IMAGE") == "1",
                       reason="IVCLOUD_SKIP_GUEST_IMAGE=1"),
    pytest.mark.skipif(qemu.qemu_binary() is None, reason="no QEMU"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mmdebstrap") is None
                       or shutil.which("dpkg-deb") is None,
                       reason="needs root, mmdebstrap and dpkg-deb"),
]


def ivcloud(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def guest(guest_packages_dir):
    # the session's packages (conftest.py)
    guest_deb = guest_packages_dir / "ivcloud-guest_0.1.0_amd64.deb"
    host_deb = guest_packages_dir / HOST_DEB
    t0 = time.monotonic()
    # ivcloud-host too: its hardened unit is started under the guest's
    # systemd (this host has none)
    img = debian.build(deb=guest_deb, log=print, extra=[host_deb])
    print(f"\nDebian image: {time.monotonic() - t0:.0f} s "
          f"(cached if ~0), disk {img.disk.stat().st_blocks * 512 >> 20} MiB")
    run_dir = Path(tempfile.mkdtemp(prefix="ivc-dg-", dir="/tmp"))
    paths = paths_for(f"dg{os.getpid()}", str(run_dir))
    server_start(paths, 32 << 20)
    try:
        t0 = time.monotonic()
        r = ivcloud("vm", "up", "--kind", "debian", "--guest-deb", guest_deb,
                    "--extra-deb", host_deb,
                    "--count", 2, "--network", "--server", paths.socket,
                    "--run-dir", run_dir, "--memory", "512M", "--accel",
                    "tcg", "--boot-timeout", 400, "--name", "deb")
        assert r.returncode == 0, r.stderr + r.stdout
        print(f"vm up (debian, tcg): {time.monotonic() - t0:.0f} s; "
              f"{r.stdout.strip()}")
        yield run_dir / "vm" / "deb0" / "agent.sock"
    finally:
        vm_down(run_dir, paths)


def peer(sock: Path) -> Path:
    return sock.parent.parent / "deb1" / "agent.sock"


def sh(sock: Path, command: str, timeout=120) -> str:
    r = agent.run(sock, command, timeout)
    assert r.status == 0, f"{command}: {r.status}\n{r.output}"
    return r.output


def env_of(sock: Path) -> dict:
    return dict(line.split("=", 1) for line in
                sh(sock, "cat /run/ivshm/ivshm.env").split() if "=" in line)


def test_udev_rule_bound_the_device(guest):
    r = ivcloud("vm", "status", "--json", "--run-dir",
                guest.parent.parent.parent, timeout=60)
    import json
    vms = {v["name"]: v for v in json.loads(r.stdout)}
    assert sorted(vms) == ["deb0", "deb1"] and all(
        v["running"] for v in vms.values())
    # each guest's id at the server (the banner's, which ivshm-bind read
    # from BAR0), the one libivshm registers when it attaches there
    ids = {vms[n]["ivposition"] for n in vms}
    assert None not in ids and len(ids) == 2, vms
    for n, sock in (("deb0", guest), ("deb1", peer(guest))):
        info = json.loads(sh(sock, "set -a; . /run/ivshm/ivshm.env; "
                             "ivshm-guest info --job 1").splitlines()[-1])
        assert info["doorbell_id"] == vms[n]["ivposition"], (n, info)
    env = env_of(guest)
    assert env["IVSHM_DOORBELL"] == "vfio"
    assert env["IVSHM_UIO"].startswith("/dev/vfio/")
    pci = env["IVSHM_PCI"]
    assert sh(guest, f"readlink /sys/bus/pci/devices/{pci}/driver"
              ).strip().endswith("/vfio-pci")
    assert sh(guest, f"systemctl is-active ivshm-bind@{pci}.service"
              ).strip() == "active"
    for f in (env["IVSHM_UIO"], env["IVSHM_BAR2"], env["IVSHM_BAR0"]):
        assert sh(guest, f"stat -c '%G %a' {f}").strip() == "ivshm 660", f
    # the package's files came from dpkg, not from the image builder
    assert "ivcloud-guest" in sh(guest, "dpkg -S /usr/bin/ivshm-guest")


def test_vm_exec_runs_numpy(guest):
    """numpy's BLAS as `vm exec` runs it in the TCG guest: OpenBLAS took
    qemu64 (AMD family 15) for an Opteron and died on 3DNow! (SIGILL)
    until the command got qemu.guest_env's setting."""
    r = ivcloud("vm", "exec", "--run-dir", guest.parent.parent.parent,
                "deb0", "--", "python3 -c 'import numpy; "
                "a = numpy.ones((64, 64)); print(float((a @ a).sum()))'",
                timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[-1] == "262144.0", r.stdout


def test_open_mpi_lists_the_component_and_defaults(guest):
    env = env_of(guest)
    out = sh(guest, "ompi_info | grep ivshmem")
    assert "MCA btl: ivshmem" in out
    conf = sh(guest, "cat /etc/openmpi/openmpi-mca-params.conf")
    assert f"btl_ivshmem_region = {env['IVSHM_BAR2']}" in conf
    assert f"btl_ivshmem_uio_dev = {env['IVSHM_UIO']}" in conf
    assert "btl = self,vader,ivshmem,tcp" in conf
    assert "\nosc = ^ucx,pt2pt\n# BEGIN ivcloud-guest" in conf  # Debian's line intact
    for pkg in ("openmpi-bin", "python3-mpi4py", "python3-numpy", "hpcc"):
        assert "ii" in sh(guest, f"dpkg -l {pkg} | tail -n 1")


def test_plain_mpirun_picks_the_btl(guest):
    # an unprivileged member of group ivshm, no --mca option: the BTL
    # comes from the defaults block, the device from ivshm-bind
    prog = ("from mpi4py import MPI; import numpy as np; "
            "a = np.arange(4); MPI.COMM_WORLD.Barrier(); "
            "print('rank', MPI.COMM_WORLD.rank, 'of', MPI.COMM_WORLD.size, a.sum())")
    out = sh(guest, "cd /tmp && OMPI_MCA_btl_ivshmem_verbose=1 "
             "OMPI_MCA_btl_base_verbose=10 "
             f"runuser -u mpi -- mpirun -np 1 python3 -c \"{prog}\" 2>&1",
             timeout=300)
    assert "rank 0 of 1 6" in out, out
    assert "cannot attach" not in out, out
    # the component attached to the region and reported its counters
    assert "btl_ivshmem: rank 0 sent" in out, out


PINGPONG = r"""
import sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, n = comm.rank, int(sys.argv[1])
buf = np.zeros(4096, dtype=np.uint8)
for i in range(n):
    if rank == 0:
        buf[:] = i & 0xff
        comm.Send(buf, dest=1, tag=i)
        comm.Recv(buf, source=1, tag=i)
        assert (buf == ((i + 1) & 0xff)).all(), i
    else:
        comm.Recv(buf, source=0, tag=i)
        assert (buf == (i & 0xff)).all(), i
        buf += 1
        comm.Send(buf, dest=0, tag=i)
print("pingpong rank", rank, "on", MPI.Get_processor_name(), "ok", n, flush=True)
"""


def test_plain_mpirun_between_two_guests_uses_ivshmem(guest):
    """Two guests on one ivshmem-server: mpirun in deb0 starts rank 1 in
    deb1 over ssh (their own network), and the 2-rank ping-pong goes
    through the shared region, as the BTL's counters show."""
    import base64
    code = base64.b64encode(PINGPONG.encode()).decode()
    for s in (guest, peer(guest)):
        sh(s, f"echo {code} | base64 -d > /tmp/pp.py && chmod 644 /tmp/pp.py")
        sh(s, "printf 'deb0 slots=1\\ndeb1 slots=1\\n' > /tmp/hosts")
    out = sh(guest, "cd /tmp && OMPI_MCA_btl_ivshmem_verbose=1 "
             "runuser -u mpi -- mpirun -np 2 --hostfile /tmp/hosts "
             "python3 /tmp/pp.py 200 2>&1", timeout=400)
    print(out)
    assert "pingpong rank 0 on deb0 ok 200" in out, out
    assert "pingpong rank 1 on deb1 ok 200" in out, out
    assert "cannot attach" not in out, out
    import re
    sent = {int(r): (int(m), int(b)) for r, m, b in re.findall(
        r"btl_ivshmem: rank (\d) sent (\d+) msgs (\d+) bytes", out)}
    # 200 messages of 4 KiB each way went through the region: had tcp
    # carried them, these counters would be zero
    for rank in (0, 1):
        msgs, nbytes = sent.get(rank, (0, 0))
        assert msgs >= 200 and nbytes >= 200 * 4096, out


def test_debian_kind_bad_input_exits_2(tmp_path):
    import socket
    sock = tmp_path / "s"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    try:
        for extra, flag in ((["--network"], "--network"),
                            (["--kind", "debian", "--doorbell", "uio"],
                             "--doorbell"),
                            (["--kind", "debian", "--network", "--count", 3],
                             "--network"),
                            (["--kind", "debian", "--kernel", "/bin/true"],
                             "--kernel")):
            r = ivcloud("vm", "up", "--server", sock, "--run-dir", tmp_path,
                        *extra, timeout=60)
            assert r.returncode == 2, (extra, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr
        assert not (tmp_path / "vm").exists()
    finally:
        s.close()


def test_host_package_unit_serves_under_its_hardening(guest):
    """ivshmem-server@t.service of ivcloud-host, started by systemd in
    deb1: it serves its socket, a client attaches through it, the
    hardening is in force, its region is a sealed memfd (no file), and
    stopping it removes the socket."""
    g = peer(guest)
    sh(g, "mkdir -p /etc/ivshmem-server && echo 'IVSHMEM_SERVER_OPTS=\"--size"
          " 32M --max-peers 4 --group ivshm\"' > /etc/ivshmem-server/t.conf && "
          "systemctl start ivshmem-server@t")
    sock = "/run/ivshmem-server/t/ivshmem.sock"
    sh(g, f"i=0; while [ ! -S {sock} ] && [ $i -lt 100 ]; do sleep 0.1; "
          f"i=$((i+1)); done; test -S {sock}")
    assert sh(g, "systemctl is-active ivshmem-server@t").strip() == "active"
    info = sh(g, f"ivshm-guest info --server {sock} --job 1")
    assert '"cmd":"info"' in info, info
    pid = sh(g, "systemctl show -p MainPID --value ivshmem-server@t").strip()
    status = sh(g, f"cat /proc/{pid}/status")
    assert "NoNewPrivs:\t1" in status
    assert "CapEff:\t0000000000000009" in status  # CAP_CHOWN, CAP_FOWNER
    # ProtectSystem=strict: the server's root is read-only, /dev/shm not
    mounts = sh(g, f"cat /proc/{pid}/mountinfo")
    root_line = [ln for ln in mounts.splitlines() if ln.split()[4] == "/"]
    assert root_line[-1].split()[5].split(",")[0] == "ro", root_line
    # --group: the socket for group ivshm, 0660; the region a sealed
    # memfd that only the socket hands out
    assert sh(g, f"stat -c '%G %a' {sock}").split() == ["ivshm", "660"]
    assert '"sealed":true' in sh(g, "cat /run/ivshmem-server/t/state.json")
    assert "ivshmem-server-t" not in sh(g, "ls /dev/shm")
    sh(g, "systemctl stop ivshmem-server@t")
    left = sh(g, f"ls /dev/shm; test ! -e {sock} && echo gone")
    assert "gone" in left and "ivshmem-server-t" not in left


def test_reconfigure_and_remove_in_a_running_guest(guest):
    """In deb1, with its device bound: postinst run again (what an
    upgrade does) keeps one defaults block and the device's group; then
    dpkg -r takes out exactly what the package added, and Open MPI still
    works without it. Last user of deb1 in this module."""
    g = peer(guest)
    env = env_of(g)
    sh(g, "/var/lib/dpkg/info/ivcloud-guest.postinst configure 0.1.0")
    conf = sh(g, "cat /etc/openmpi/openmpi-mca-params.conf")
    assert conf.count("# BEGIN ivcloud-guest") == 1
    assert f"btl_ivshmem_region = {env['IVSHM_BAR2']}" in conf
    assert sh(g, f"stat -c '%G %a' {env['IVSHM_UIO']}").strip() == "ivshm 660"
    sh(g, "dpkg -r ivcloud-host ivcloud-guest")
    conf = sh(g, "cat /etc/openmpi/openmpi-mca-params.conf")
    assert "ivcloud" not in conf and "ivshmem" not in conf
    assert conf.endswith("osc = ^ucx,pt2pt")  # no final newline, as shipped
    assert "ivshmem" not in sh(g, "ompi_info | grep 'MCA btl'")
    assert sh(g, "ls /run/ivshm 2>&1 || true").find("No such file") >= 0
    out = sh(g, "cd /tmp && runuser -u mpi -- mpirun -np 1 hostname")
    assert out.strip() == "deb1", out
