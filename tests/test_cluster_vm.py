"""`ivcloud cluster up --instance-kind vm`: the emulated
cloud's instances as QEMU guests of the Debian image (TCG here), their
NICs on taps in the server's bridge, their ivshmem-doorbell devices on
the server's standing region, their vCPU threads pinned.

One cluster (1 server x 2 instances x 1 vCPU) is booted once for the
module; the tests use it in order: status and exec, an mpi4py job over
the region (BTL counters on both ranks), the same over virtio-net with
--transport tcp, the C suite both ways, MPICH's and Intel MPI's mpi4py
jobs from the shared build/mpi over the provider (its exit lines from
the guests' ranks), then a guest killed mid-job, then `down` and what
it leaves. Before that, without the shared cluster: bad input (exit 2,
one line) and `down` after `up` was killed with SIGKILL.
IVCLOUD_SKIP_GUEST_IMAGE=1 skips the module.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud.mpis import openmpi

# the same requirements as the image tests (root, QEMU, mmdebstrap)
from test_guest_image import pytestmark  # noqa: F401
from vm_support import qemus_naming

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = Path("/var/tmp") / f"ivc-cvm-{os.getpid()}"


PROGRAM = r"""
import sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.rank
total = comm.allreduce(rank + 1, op=MPI.SUM)
assert total == comm.size * (comm.size + 1) // 2, total
n = int(sys.argv[1])
buf = np.zeros(1 << 20, dtype=np.uint8)
for i in range(n):
    if rank == 0:
        buf[:] = i & 0xff
        comm.Send(buf, dest=1, tag=i)
        comm.Recv(buf, source=1, tag=i)
        assert (buf == ((i + 1) & 0xff)).all(), i
    elif rank == 1:
        comm.Recv(buf, source=0, tag=i)
        assert (buf == (i & 0xff)).all(), i
        buf += 1
        comm.Send(buf, dest=0, tag=i)
print("rank", rank, "on", MPI.Get_processor_name(), "allreduce", total,
      "pingpong ok", n, flush=True)
if len(sys.argv) > 2:
    import time
    time.sleep(float(sys.argv[2]))
"""


def ivcloud(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          **kw)


def cluster(action, name, *args, timeout=600, **kw):
    return ivcloud("cluster", action, "--name", name, "--run-dir", RUN_DIR,
                   *args, timeout=timeout, **kw)


def assert_nothing_left(name: str, fabric_pid=None):
    assert not qemus_naming(RUN_DIR / f"cluster-{name}")
    assert not (RUN_DIR / f"cluster-{name}").exists()
    assert not Path(f"/dev/shm/ivcloud-{name}-s0").exists()
    if fabric_pid is not None:
        # the taps and bridges lived in the fabric's namespace
        try:
            st = Path(f"/proc/{fabric_pid}/stat").read_text()
        except OSError:
            st = ") Z"  # gone
        # a zombie (its parent, the killed `up`, was not there to reap
        # it) holds no namespace
        assert st[st.rindex(")") + 2:].split()[0] in ("Z", "X"), st
    out = subprocess.run(["ip", "-o", "link"], capture_output=True,
                         text=True).stdout
    assert "t-s0i" not in out  # nothing leaked into the host's namespace


@pytest.fixture(scope="module", autouse=True)
def run_dir():
    # guest_deb (conftest.py) is the session's
    try:
        yield RUN_DIR
    finally:
        shutil.rmtree(RUN_DIR, ignore_errors=True)


def up_args(deb):
    return ("--servers", 1, "--instances-per-server", 2, "--vcpus", 1,
            "--instance-kind", "vm", "--guest-deb", deb, "--accel", "tcg",
            "--oversubscribe")


def test_bad_input_exits_2(guest_deb, tmp_path):
    cases = [
        (["--guest-deb", tmp_path / "none.deb"], {}, "none.deb"),
        ([], {"IVCLOUD_QEMU": "/nonexistent/qemu"}, "QEMU"),
        (["--vm-memory", 16], {}, "MiB"),
    ]
    for extra, env, word in cases:
        args = list(up_args(guest_deb))
        for flag in ("--guest-deb", "--vm-memory"):
            if flag in extra and flag in args:
                i = args.index(flag)
                del args[i:i + 2]
        r = cluster("up", "cvmbad", *args, *extra, timeout=60,
                    env={**os.environ, **env})
        assert r.returncode == 2, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr
    # more vCPUs than the host has, without --oversubscribe
    r = cluster("up", "cvmbad", "--servers", 1, "--instances-per-server", 2,
                "--vcpus", os.cpu_count() or 1, "--instance-kind", "vm",
                "--guest-deb", guest_deb, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    # VM options without VM instances
    r = cluster("up", "cvmbad", "--servers", 1, "--instances-per-server", 1,
                "--accel", "tcg", timeout=60)
    assert r.returncode == 2 and "--instance-kind" in r.stderr
    assert not (RUN_DIR / "cluster-cvmbad").exists()
    # the benchmark on a VM cluster refuses the same way, before any
    # cluster exists
    for extra, env, word in (
            (["--instance-kind", "vm"], {"IVCLOUD_QEMU": "/nonexistent/qemu"},
             "QEMU"),
            (["--vm-memory", 300], {}, "--instance-kind")):
        r = ivcloud("bench", "hierarchy", "--quick", "--out",
                    tmp_path / "bench", "--guest-deb", guest_deb, *extra,
                    timeout=60, env={**os.environ, **env})
        assert r.returncode == 2, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr
    assert not (tmp_path / "bench").exists()


def test_pypi_mpi_refused_where_the_guests_lack_it():
    """A VM cluster that booted without the MPIs' share (none was built
    when it came up) refuses their jobs in one ClusterError."""
    from ivcloud import mpis
    from ivcloud.cluster import kinds
    from ivcloud.cluster.vm_instance import VmConfig
    from ivcloud.errors import ClusterError
    kind = kinds.VmInstances(VmConfig("qemu", "deb", (), 512, "tcg"))
    for state in ({"vm_boot": {}}, {"vm_boot": {"shared": ["/elsewhere"]}}):
        with pytest.raises(ClusterError, match="not shared with them"):
            kind.job_program(state, mpis.flavor("mpich"), ["/bin/true"],
                             "ivshmem")
    assert kind.job_program({}, mpis.flavor("openmpi"), ["/bin/true"],
                            "ivshmem") == ["/bin/true"]


def test_down_after_up_killed_with_sigkill(guest_deb):
    name = "cvmkill"
    proc = subprocess.Popen([sys.executable, "-m", "ivcloud", "cluster", "up",
                             "--name", name, "--run-dir", str(RUN_DIR),
                             *map(str, up_args(guest_deb))],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    state = RUN_DIR / f"cluster-{name}" / "state.json"
    deadline = time.monotonic() + 120
    # killed once both QEMUs run and the guests boot
    while time.monotonic() < deadline:
        try:
            vms = json.loads(state.read_text()).get("vms", {})
        except (OSError, ValueError):
            vms = {}
        if len(vms) == 2 and all(v.get("pid") for v in vms.values()):
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("up recorded no QEMU within 120 s")
    fabric = json.loads(state.read_text())["holders"]["fabric"]["pid"]
    proc.kill()
    proc.wait()
    assert len(qemus_naming(RUN_DIR / f"cluster-{name}")) == 2
    r = cluster("down", name, timeout=120)
    assert r.returncode == 0, r.stderr
    assert_nothing_left(name, fabric)


@pytest.fixture(scope="module")
def vmc(guest_deb):
    name = "cvm"
    t0 = time.monotonic()
    r = cluster("up", name, *up_args(guest_deb))
    assert r.returncode == 0, r.stderr + r.stdout
    print(f"\ncluster up --instance-kind vm (1x2x1, tcg): "
          f"{time.monotonic() - t0:.0f} s; {r.stdout.strip()}")
    code = base64.b64encode(PROGRAM.encode()).decode()
    for host in ("s0i0", "s0i1"):
        r = cluster("exec", name, host, "--", "sh", "-c",
                    f"echo {code} | base64 -d > /tmp/prog.py && "
                    f"chmod 644 /tmp/prog.py", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    try:
        yield name
    finally:
        if (RUN_DIR / f"cluster-{name}").exists():
            cluster("down", name, timeout=120)
        for pid in qemus_naming(RUN_DIR):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(RUN_DIR, ignore_errors=True)


def test_status_and_exec(vmc):
    r = cluster("status", vmc, "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "vm" and info["healthy"]
    insts = {i["hostname"]: i for i in info["instances"]}
    assert sorted(insts) == ["s0i0", "s0i1"]
    for inst in insts.values():
        assert inst["alive"] and inst["pid"] in qemus_naming(RUN_DIR)
        # the vCPU thread runs where the cluster's vCPU map says
        assert inst["cpus"] == inst["planned_cpus"], inst
    # both guests' devices are peers of the server's standing region
    assert len(info["servers"][0]["peers"]) == 2
    r = cluster("exec", vmc, "s0i1", "--", "sh", "-c",
                "hostname; ip -4 -o addr; timeout 10 bash -c "
                "'echo > /dev/tcp/s0i0/22' && echo reached", timeout=60)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith("s0i1\n") and "10.251.0.2/16" in r.stdout
    assert "reached" in r.stdout
    # from the head node (a namespace on the core bridge) through the
    # uplink and the server's bridge to the guest's sshd
    r = cluster("exec", vmc, "head", "--", "timeout", "10", "bash", "-c",
                "echo > /dev/tcp/10.251.0.1/22 && echo reached", timeout=60)
    assert r.returncode == 0 and "reached" in r.stdout, r.stdout + r.stderr
    r = cluster("mpirun", vmc, "--dry-run", "-np", 2, "--", "python3",
                "/tmp/prog.py", timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("# in guest s0i0: ")
    assert "runuser -u mpi -- mpirun -np 2" in r.stdout
    assert "standing region" in r.stderr
    r = cluster("exec", vmc, "s0i0", "--", "false", timeout=60)
    assert r.returncode == 1
    r = cluster("exec", vmc, "nosuch", "--", "true", timeout=60)
    assert r.returncode == 2 and "nosuch" in r.stderr


def wait_for_rank(name, host):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = cluster("exec", name, host, "--", "pgrep", "-u", "mpi",
                    "python3", timeout=60)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"the job's rank on {host} never started")


def _counters(out):
    return {int(r): (int(m), int(b)) for r, m, b in re.findall(
        r"btl_ivshmem: rank (\d) sent (\d+) msgs (\d+) bytes", out)}


def test_mpi4py_over_the_region(vmc):
    t0 = time.monotonic()
    r = cluster("mpirun", vmc, "--transport", "ivshmem", "--btl",
                "self,ivshmem", "--verbose-btl", "-np", 2, "--",
                "python3", "/tmp/prog.py", 20, timeout=400)
    print(f"ivshmem job: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 on s0i0 allreduce 3 pingpong ok 20" in r.stdout, r.stdout
    assert "rank 1 on s0i1 allreduce 3 pingpong ok 20" in r.stdout, r.stdout
    sent = _counters(r.stdout + r.stderr)
    for rank in (0, 1):
        msgs, nbytes = sent.get(rank, (0, 0))
        assert msgs >= 20 and nbytes >= 20 << 20, (r.stdout + r.stderr)


def test_mpi4py_over_virtio_net(vmc):
    r = cluster("mpirun", vmc, "--transport", "tcp", "-np", 2, "--",
                "python3", "/tmp/prog.py", 20, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 on s0i0 allreduce 3 pingpong ok 20" in r.stdout, r.stdout
    assert "rank 1 on s0i1 allreduce 3 pingpong ok 20" in r.stdout, r.stdout
    assert "btl_ivshmem" not in (r.stdout + r.stderr)


# The C MPI correctness suite (native/tests/mpi, as tests/test_mpi_btl.py
# runs it on the host): built on the host with mpicc against Debian's Open
# MPI, the same libmpi.so.40 the image's openmpi-bin brings, and copied
# into the guests with `cluster put`, as a user brings a program in.
# p2p: messages up to 8 MiB; coll: 2 iterations
C_SUITE = {"p2p": ["8"], "coll": ["2"], "rma": [], "comm": []}
GUEST_BIN = "/opt/ivcloud-tests"


@pytest.fixture(scope="module")
def c_suite(vmc, tmp_path_factory):
    mpicc = shutil.which("mpicc")
    assert mpicc, "mpicc not found (install libopenmpi-dev)"
    out = tmp_path_factory.mktemp("mpi-c")
    for name in C_SUITE:
        r = subprocess.run([mpicc, "-O2", "-Wall", "-Wextra", "-Werror",
                            "-o", str(out / name),
                            str(REPO / "native" / "tests" / "mpi" /
                                f"{name}.c")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    r = cluster("put", vmc, *(out / n for n in C_SUITE), GUEST_BIN,
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\ncluster put of {len(C_SUITE)} programs into 2 guests: "
          f"{time.monotonic() - t0:.1f} s")
    assert sorted(r.stdout.split()) == sorted(
        f"{h}:{GUEST_BIN}/{n}" for h in ("s0i0", "s0i1") for n in C_SUITE)
    # the copies are the files, executable by the MPI user
    want = subprocess.run(["sha256sum", *(str(out / n) for n in C_SUITE)],
                          capture_output=True, text=True).stdout.split()[::2]
    r = cluster("exec", vmc, "s0i1", "--", "sh", "-c",
                f"cd {GUEST_BIN} && sha256sum {' '.join(C_SUITE)} && "
                f"runuser -u mpi -- test -x p2p && ls {GUEST_BIN}",
                timeout=60)
    assert r.returncode == 0, r.stdout
    assert r.stdout.split()[:2 * len(C_SUITE):2] == want, r.stdout
    assert ".part" not in r.stdout
    return {n: [f"{GUEST_BIN}/{n}", *a] for n, a in C_SUITE.items()}


def test_cluster_put_bad_input(vmc, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    for args, word in (([f, "relative/dir"], "absolute"),
                       ([tmp_path / "none", "/tmp"], "none"),
                       ([f], "directory"),
                       (["--host", "nosuch", f, "/tmp"], "nosuch")):
        r = cluster("put", vmc, *args, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr


@pytest.mark.parametrize("name", sorted(C_SUITE))
def test_c_suite_over_the_region(vmc, c_suite, name):
    """--btl self,ivshmem: no other BTL could carry a byte between the
    guests, and both ranks' counters show traffic both ways."""
    t0 = time.monotonic()
    r = cluster("mpirun", vmc, "--transport", "ivshmem", "--btl",
                "self,ivshmem", "--verbose-btl", "-np", 2, "--",
                *c_suite[name], timeout=600)
    print(f"{name} over the region: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"PASS {name}" in r.stdout, r.stdout
    # no region of the job's own (a namespace job's default): said once
    assert r.stderr.count("standing region") == 1, r.stderr
    counters = openmpi.parse_btl_counters(r.stdout + r.stderr)
    assert sorted(counters) == [0, 1], (r.stdout + r.stderr)
    for rank, c in counters.items():
        assert c["sent_msgs"] > 0 and c["recv_msgs"] > 0, (rank, c)
        assert c["sent_bytes"] > 0 and c["recv_bytes"] > 0, (rank, c)
    if name == "p2p":
        # the 8 MiB messages each way went through the region
        assert min(c["sent_bytes"] for c in counters.values()) > 8 << 20


@pytest.mark.parametrize("name", sorted(C_SUITE))
def test_c_suite_over_virtio_net(vmc, c_suite, name):
    # osc pt2pt: one-sided operations as messages, over tcp here (the
    # ivshmem transport picks it by itself)
    r = cluster("mpirun", vmc, "--transport", "tcp", "--mca", "osc",
                "pt2pt", "-np", 2, "--", *c_suite[name], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"PASS {name}" in r.stdout, r.stdout
    # self,vader,tcp: the component was not even loaded
    assert "btl_ivshmem" not in (r.stdout + r.stderr), (r.stdout + r.stderr)


BML_RE = re.compile(r"\[(s0i\d):\d+\] mca: bml: Using (\w+) btl for send "
                    r"to \[\[\d+,\d+\],(\d)\]")


def test_two_ranks_per_guest(vmc, c_suite, tmp_path):
    """-np 4, ranks 0-1 in s0i0 and 2-3 in s0i1: the first rank of a
    guest holds its device's vfio group, the second shares the region
    without a doorbell of its own (it registers the guest's IVPosition,
    which ivshm-bind put into Open MPI's defaults). Between the guests
    every rank uses the ivshmem BTL, inside a guest Open MPI's vader."""
    for host in ("s0i0", "s0i1"):
        r = cluster("exec", vmc, host, "--", "sh", "-c",
                    ". /run/ivshm/ivshm.env && grep -x \"btl_ivshmem_position"
                    " = $IVSHM_POSITION\" /etc/openmpi/openmpi-mca-params.conf",
                    timeout=60)
        assert r.returncode == 0, (host, r.stdout)
        # the device sits in a root port of its own (a guest that can
        # migrate), where vfio-pci would reset it at each open, and the
        # region would vanish under the guest's other ranks: ivshm-bind
        # turned its resets off
        r = cluster("exec", vmc, host, "--", "sh", "-c",
                    ". /run/ivshm/ivshm.env && m=/sys/bus/pci/devices/"
                    "$IVSHM_PCI/reset_method && [ -e $m ] && "
                    "[ -z \"$(cat $m)\" ]", timeout=60)
        assert r.returncode == 0, (host, r.stdout, r.stderr)
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("".join(f"rank {r}=s0i{r // 2} slot=0\n"
                                for r in range(4)))
    t0 = time.monotonic()
    r = cluster("mpirun", vmc, "--transport", "ivshmem", "--verbose-btl",
                "--shared-region", "--oversubscribe", "--rankfile", rankfile,
                "--mca",
                "btl_base_verbose", "10", "-np", 4, "--", c_suite["coll"][0],
                "1", timeout=600)
    print(f"coll, 2 ranks in each of 2 guests: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS coll (4 ranks" in r.stdout, r.stdout
    assert "cannot attach" not in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert "standing region" not in r.stderr  # asked for it
    counters = openmpi.parse_btl_counters(r.stdout + r.stderr)
    assert sorted(counters) == [0, 1, 2, 3], (r.stdout + r.stderr)
    for rank, c in counters.items():
        assert c["sent_msgs"] > 0 and c["recv_msgs"] > 0, (rank, c)
    used = {}
    for host, btl, peer in BML_RE.findall(r.stdout + r.stderr):
        if btl != "self":
            used.setdefault((host, int(peer)), set()).add(btl)
    for rank in range(4):
        for peer in range(4):
            if peer == rank:
                continue
            want = "vader" if rank // 2 == peer // 2 else "ivshmem"
            assert used.get((f"s0i{rank // 2}", peer)) == {want}, \
                (rank, peer, used)


# The PyPI MPIs in the guests: their prefixes are shared with the guests
# at their host paths (ivcloud/vm/share.py), their ranks use the guest
# package's provider. mpi4py from each prefix, no numpy (the prefixes'
# venvs do not see the system's packages).
OFI_PROGRAM = r"""
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.rank
total = comm.allreduce(rank + 1, op=MPI.SUM)
assert total == comm.size * (comm.size + 1) // 2, total
n = int(sys.argv[1])
buf = bytearray(4096)
for i in range(n):
    if rank == 0:
        buf[:8] = i.to_bytes(8, "little")
        comm.Send(buf, dest=1, tag=i)
        comm.Recv(buf, source=1, tag=i)
        assert int.from_bytes(buf[:8], "little") == i + 1, i
    elif rank == 1:
        comm.Recv(buf, source=0, tag=i)
        buf[:8] = (int.from_bytes(buf[:8], "little") + 1).to_bytes(8, "little")
        comm.Send(buf, dest=0, tag=i)
print("rank", rank, "pid", os.getpid(), "on", MPI.Get_processor_name(),
      "allreduce", total, "pingpong ok", n,
      MPI.Get_library_version().splitlines()[0], flush=True)
"""
OFI_LIBRARY = {"mpich": "MPICH Version:", "impi": "Intel(R) MPI Library"}


@pytest.fixture(scope="module")
def ofi_program(vmc):
    code = base64.b64encode(OFI_PROGRAM.encode()).decode()
    for host in ("s0i0", "s0i1"):
        r = cluster("exec", vmc, host, "--", "sh", "-c",
                    f"echo {code} | base64 -d > /tmp/ofi.py && "
                    f"chmod 644 /tmp/ofi.py", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    return "/tmp/ofi.py"


@pytest.mark.parametrize("mpi", sorted(OFI_LIBRARY))
def test_pypi_mpi_over_the_region(vmc, ofi_program, mpi):
    """MPICH and Intel MPI from build/mpi between the two guests: each
    rank prints its pid and guest, and the provider's exit line of the
    same pid shows every message of the pair over the region."""
    from ivcloud.mpis import flavor, provider
    python = str(flavor(mpi).prefix() / "bin" / "python")
    r = cluster("mpirun", vmc, "--mpi", mpi, "--transport", "ivshmem",
                "--report-transport", "--dry-run", "-np", 2, "--", python,
                ofi_program, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # the guest package's provider, not this checkout's build
    assert f"{provider.INSTALLED.parent}" in r.stdout, r.stdout
    assert "build/native" not in r.stdout, r.stdout
    n = 50
    t0 = time.monotonic()
    r = cluster("mpirun", vmc, "--mpi", mpi, "--transport", "ivshmem",
                "--report-transport", "-np", 2, "--", python, ofi_program,
                n, timeout=400)
    print(f"{mpi} job over the region: {time.monotonic() - t0:.1f} s")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    ranks = sorted((host, int(pid)) for pid, host in re.findall(
        rf"rank \d pid (\d+) on (s0i\d) allreduce 3 pingpong ok {n} "
        rf"{re.escape(OFI_LIBRARY[mpi])}", r.stdout))
    assert [h for h, _ in ranks] == ["s0i0", "s0i1"], out
    # line by line: the two guests' pids may be equal
    reports = [rep for line in r.stderr.splitlines()
               for rep in provider.parse_reports(line).items()]
    assert sorted(p for p, _ in reports) == sorted(p for _, p in ranks), out
    for _, counts in reports:
        assert counts["sent"] >= n and counts["received"] >= n, out
        assert counts["delegated"] == 0, out


def test_killed_guest_ends_the_job(vmc):
    state = json.loads((RUN_DIR / f"cluster-{vmc}" / "state.json"
                        ).read_text())
    victim = state["vms"]["s0i1"]["pid"]
    job = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name", vmc,
         "--run-dir", str(RUN_DIR), "-np", "2", "--", "python3",
         "/tmp/prog.py", "2", "600"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rank(vmc, "s0i1")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    print(f"job ended {took:.1f} s after its guest was killed")
    assert job.returncode != 0
    assert "s0i1 died" in out + err, out + err
    # nothing of the job is left in the surviving guest
    r = cluster("exec", vmc, "s0i0", "--", "pgrep", "-u", "mpi", timeout=60)
    assert r.returncode == 1, r.stdout
    r = cluster("status", vmc, "--json", timeout=60)
    assert r.returncode == 1  # degraded
    assert not {i["hostname"]: i["alive"] for i in json.loads(r.stdout)[
        "instances"]}["s0i1"]
    # no new job on a degraded cluster: one line, exit 1
    r = cluster("mpirun", vmc, "-np", 1, "--", "true", timeout=60)
    assert r.returncode == 1 and "s0i1" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_down_leaves_nothing(vmc):
    state = json.loads((RUN_DIR / f"cluster-{vmc}" / "state.json"
                        ).read_text())
    fabric = state["holders"]["fabric"]["pid"]
    r = cluster("down", vmc, timeout=120)
    assert r.returncode == 0, r.stderr
    assert_nothing_left(vmc, fabric)
