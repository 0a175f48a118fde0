"""Slurm on a VM cluster (`cluster up --instance-kind vm --scheduler
slurm`): munged and slurmctld in the head node, munged and slurmd in
each QEMU guest (TCG here) with the cluster's configuration and key,
Open MPI ranks in the guests started by `srun --mpi=pmix`, talking
through a region of the job's own over ivshmem devices that the
controller's hooks plug into the guests for the job's life
(docs/cluster.md, "Regions of VM clusters").

One 1-server x 2-instance x 1-vCPU cluster, used in order: up and
status, a 2-rank job across both guests (its own server and devices,
the BML's choice and the BTL's counters on both ranks, nothing of them
left after the job, and a second job in the same ports), 2-rank jobs
of MPICH, Intel MPI and Open MPI 5 over the provider, a job whose
slurmd in one guest is killed and a job one of whose guests is killed
(IVCLOUD_SLURM_VM_KILL=1: `make test-slurm-vm`), then `down` and what
it leaves. Then a 2-server x
1-instance cluster for `cluster migrate` (a move needs a second server;
IVCLOUD_SLURM_VM_MIGRATE=1, `make test-slurm-vm`):
an idle guest moved, whose slurmd serves on and whose next job's region
is its new server's; a guest under a running Open MPI (BTL) job refused,
naming the job, then moved once the job ended (--wait-jobs); a guest
moved there and back under a running MPICH job over the provider, whose
ranks drain off the job's region and take the job's region on the new
server, while every message arrives once, in order, intact; a move
killed after its drain under such a job, after which the job ends well
and nothing of it is left.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud import procfs
from ivcloud.cluster import regions
from ivcloud.cluster.slurm import guest_regions
from ivcloud.mpis.openmpi import parse_btl_counters
from ivcloud.vm import qemu

from test_cluster import BML_RE, wait_for
from test_cluster_migrate import RING
from test_cluster_vm import (OFI_LIBRARY, OFI_PROGRAM, PROGRAM, RUN_DIR,
                             assert_nothing_left, cluster, up_args)
# the same requirements as the image tests (root, QEMU, mmdebstrap)
from test_guest_image import pytestmark as _image_marks

pytestmark = [*_image_marks,
              pytest.mark.skipif(shutil.which("slurmctld") is None
                                 or shutil.which("munged") is None,
                                 reason="Slurm (slurmctld, munge) not "
                                        "installed")]

NAME = "svm"
JOB_TIMEOUT = 400


@pytest.fixture(scope="module", autouse=True)
def run_dir():
    """RUN_DIR, removed once the module's clusters are down."""
    yield RUN_DIR
    shutil.rmtree(RUN_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def svm(guest_deb):
    with slurm_cluster(NAME, up_args(guest_deb), ("s0i0", "s0i1")):
        yield NAME


@contextlib.contextmanager
def slurm_cluster(name, args, hosts):
    """A VM cluster with Slurm (`up` ARGS), /tmp/prog.py (mpi4py of the
    guests' Open MPI) and /tmp/ofi.py (of a PyPI MPI's prefix) in each
    of its guests `hosts`; taken down at the block's end."""
    t0 = time.monotonic()
    r = cluster("up", name, *args, "--scheduler", "slurm")
    print(f"\ncluster up --instance-kind vm --scheduler slurm "
          f"({len(hosts)} guests, tcg): {time.monotonic() - t0:.0f} s")
    try:
        assert r.returncode == 0, r.stderr + r.stdout
        code = base64.b64encode(PROGRAM.encode()).decode()
        ofi = base64.b64encode(OFI_PROGRAM.encode()).decode()
        for host in hosts:
            r = cluster("exec", name, host, "--", "sh", "-c",
                        f"echo {code} | base64 -d > /tmp/prog.py && "
                        f"echo {ofi} | base64 -d > /tmp/ofi.py", timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
        yield name
    finally:
        if (RUN_DIR / f"cluster-{name}").exists():
            cluster("down", name, timeout=120)


def state_of(name):
    return json.loads((RUN_DIR / f"cluster-{name}" / "state.json"
                       ).read_text())


def test_status_names_every_daemon(svm, tmp_path):
    r = cluster("status", svm, "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["healthy"], info
    sl = info["slurm"]
    assert sorted(sl["daemons"]) == ["munged", "munged-s0i0", "munged-s0i1",
                                     "slurmctld", "slurmd-s0i0",
                                     "slurmd-s0i1"], sl
    assert all(d["alive"] for d in sl["daemons"].values()), sl
    assert sl["nodes"] == {"s0i0": "idle", "s0i1": "idle"}, sl
    # the guests' own units of them stay masked: one munged, one slurmd
    for host in ("s0i0", "s0i1"):
        r = cluster("exec", svm, host, "--", "sh", "-c",
                    "pgrep -c -x munged; pgrep -c -x slurmd; "
                    "systemctl is-enabled munge.service slurmd.service",
                    timeout=60)
        assert r.stdout.split() == ["1", "1", "masked", "masked"], r.stdout
    # a batch job's sruns would look for its hostfile in a guest
    plan = tmp_path / "plan"
    plan.write_text("rank 0=s0i1 slot=0\nrank 1=s0i0 slot=0\n")
    r = cluster("sbatch", svm, "--rankfile", plan, "--", "--wrap", "true",
                timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, \
        r.stderr
    assert "namespace instances" in r.stderr


def guest_sh(name, host, script):
    r = cluster("exec", name, host, "--", "sh", "-c", script, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def ivshmem_devices(name, host):
    """The PCI addresses of guest `host`'s ivshmem devices (1af4:1110)."""
    return guest_sh(name, host, "for d in /sys/bus/pci/devices/*; do "
                                "[ $(cat $d/vendor) = 0x1af4 ] && "
                                "[ $(cat $d/device) = 0x1110 ] && "
                                "echo ${d##*/}; done; true").split()


def test_pmix_job_uses_a_region_of_its_own(svm):
    """Two ranks, one per guest: the prolog made the job's server and
    plugged a device on it into both guests, the task prolog named that
    device (not the standing one) to the BTL, the BML picks the ivshmem
    BTL between the guests and both ranks' counters show traffic; once
    the job ended, the epilog took the devices out of the guests and
    removed the job's server."""
    state = state_of(svm)
    srv = state["servers"]["0"]
    servers_dir = Path(state["servers_dir"])
    standing = {h: ivshmem_devices(svm, h) for h in ("s0i0", "s0i1")}
    assert all(len(d) == 1 for d in standing.values()), standing
    t0 = time.monotonic()
    job = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "srun", "--name", svm,
         "--run-dir", str(RUN_DIR), "--", "--mpi=pmix", "--nodes=2",
         "--ntasks-per-node=1",
         "--export=ALL,OMPI_MCA_btl_ivshmem_verbose=1,"
         "OMPI_MCA_btl_base_verbose=100", "sh", "-c",
         'echo "$SLURMD_NODENAME region $OMPI_MCA_btl_ivshmem_region"; '
         "exec python3 /tmp/prog.py 5"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        # the job's server, which the prolog makes before any rank runs
        seen = wait_for(lambda: regions.job_dirs(servers_dir, srv["name"])
                        or job.poll() is not None, JOB_TIMEOUT,
                        "the job's server")
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    print(f"srun --mpi=pmix, 2 ranks in 2 guests: "
          f"{time.monotonic() - t0:.1f} s")
    out = stdout + stderr
    assert job.returncode == 0, out
    assert seen is not True, "no server of the job's own while it ran"
    assert [d.name for d in seen] == [re.match(r"sj\d+s0", seen[0].name)[0]]
    job_id = int(seen[0].name[2:-2])
    assert "rank 0 on s0i0 allreduce 3 pingpong ok 5" in stdout, out
    assert "rank 1 on s0i1 allreduce 3 pingpong ok 5" in stdout, out
    hooks = Path(state["slurm"]["dir"], "log", "hooks.log")
    plugged = re.search(rf"prolog job {job_id}: regions on servers \[0\]; "
                        rf"devices s0i0 (\S+), s0i1 (\S+) \(",
                        hooks.read_text())
    assert plugged, hooks.read_text()
    for host, addr in zip(("s0i0", "s0i1"), plugged.groups()):
        assert addr not in standing[host], (addr, standing)
        # the rank in that guest was given the job's device
        assert (f"{host} region /sys/bus/pci/devices/{addr}/resource2"
                in stdout), out
    used = {(src, dst): btl for src, btl, _, dst in BML_RE.findall(out)
            if btl != "self"}
    assert used == {("s0i0", "s0i1"): "ivshmem",
                    ("s0i1", "s0i0"): "ivshmem"}, out
    counters = parse_btl_counters(out)
    assert sorted(counters) == [0, 1], out
    for c in counters.values():
        assert c["sent_msgs"] >= 5 and c["recv_msgs"] >= 5, counters
        assert c["sent_bytes"] >= 5 << 20, counters
    # slurmctld runs the epilog once the job has ended, after srun exits
    t1 = time.monotonic()
    # its line, whatever it says, so that a failed epilog names its cause
    line = epilog_line(hooks, job_id)
    assert re.search(r"devices and regions on servers \[0\] removed \(",
                     line), hooks.read_text()
    print(f"epilog done {time.monotonic() - t1:.1f} s after srun returned")
    assert not regions.job_dirs(servers_dir, srv["name"])
    for host, addr in zip(("s0i0", "s0i1"), plugged.groups()):
        assert ivshmem_devices(svm, host) == standing[host]
        left = guest_sh(svm, host,
                        f"ls /run/ivshm; ls /run/ivcloud/slurm-jobs; "
                        f"systemctl is-active ivshm-bind@{addr}.service; "
                        f"true").split()
        assert f"{addr}.env" not in left and f"{job_id}.env" not in left, left
        assert "inactive" in left, left
        with qemu.Qmp(Path(state["vms"][host]["dir"]) / "qmp.sock") as q:
            chardevs = [c["label"] for c in q.execute("query-chardev")]
        assert not [c for c in chardevs if c.startswith("ivj")], chardevs
    # the next job gets a device of its own in the same ports, and the
    # guests' QEMUs outlive the unplug (qemu.guard_eventfds: without it
    # both died at the next job's first agent command)
    r = cluster("srun", svm, "--", "--mpi=pmix", "--nodes=2",
                "--ntasks-per-node=1", "python3", "/tmp/prog.py", 1,
                timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("pingpong ok 1") == 2, r.stdout + r.stderr
    line = epilog_line(hooks, job_id + 1)
    assert re.search(r"devices and regions on servers \[0\] removed \(",
                     line), hooks.read_text()
    assert re.search(rf"prolog job {job_id + 1}: regions on servers \[0\]; "
                     rf"devices s0i0 {plugged[1]}, s0i1 {plugged[2]} \(",
                     hooks.read_text()), hooks.read_text()
    for host in ("s0i0", "s0i1"):
        assert ivshmem_devices(svm, host) == standing[host]


# the MPIs from PyPI under `cluster srun`: its options, srun's, the start
# of the library's version line, and a line the job must print (a
# regular expression). MPICH's variables come from the guests' task
# prolog, the job naming its PMI plugin; the others' from `cluster srun
# --mpi`, which gives srun their variables and PMI plugin. Intel MPI's
# startup report (I_MPI_DEBUG=5) says that it loaded Slurm's PMI-2
# library.
SRUN_MPIS = {
    "mpich": ((), ("--mpi=pmi2",), OFI_LIBRARY["mpich"], ""),
    "impi": (("--mpi", "impi"), ("--export=ALL,I_MPI_DEBUG=5",),
             OFI_LIBRARY["impi"], r"MPI startup\(\): PMI API: pmi2$"),
    "openmpi5": (("--mpi", "openmpi5"), (), "Open MPI v5", ""),
}


@pytest.mark.parametrize("mpi", list(SRUN_MPIS))
def test_srun_uses_the_jobs_region(svm, mpi):
    """An MPI from PyPI (its prefix shared with the guests) under srun,
    one rank per guest: the guests' task prolog names the job's device
    (not the standing one) to the provider, and each rank's provider
    report (srun's --report-transport) shows the pair's every message
    over that region, none delegated."""
    from ivcloud.mpis import flavor, provider
    ours, theirs, library, startup = SRUN_MPIS[mpi]
    python = str(flavor(mpi).prefix() / "bin" / "python")
    state = state_of(svm)
    hooks = Path(state["slurm"]["dir"], "log", "hooks.log")
    # none before the cluster's first job
    done = len(re.findall(r"prolog job", hooks.read_text())
               if hooks.exists() else [])
    n = 20
    t0 = time.monotonic()
    r = cluster("srun", svm, *ours, "--report-transport", "--", *theirs,
                "--nodes=2", "--ntasks-per-node=1", "sh", "-c",
                'echo "$SLURMD_NODENAME provider region $FI_IVSHM_REGION"; '
                'exec "$0" "$@"', python, "/tmp/ofi.py", n,
                timeout=JOB_TIMEOUT)
    print(f"srun, {mpi}, 2 ranks in 2 guests: {time.monotonic() - t0:.1f} s")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out + hooks.read_text()
    ranks = sorted((host, int(pid)) for pid, host in re.findall(
        rf"rank \d pid (\d+) on (s0i\d) allreduce 3 pingpong ok {n} "
        rf"{re.escape(library)}", r.stdout))
    assert [h for h, _ in ranks] == ["s0i0", "s0i1"], out
    assert re.search(startup, out, re.M), out
    plugged = re.findall(r"prolog job (\d+): regions on servers \[0\]; "
                         r"devices s0i0 (\S+), s0i1 (\S+) \(",
                         hooks.read_text())
    assert len(plugged) == done + 1, hooks.read_text()
    job_id, *addrs = plugged[-1]
    for host, addr in zip(("s0i0", "s0i1"), addrs):
        assert (f"{host} provider region /sys/bus/pci/devices/{addr}/"
                f"resource2" in r.stdout), out
    # line by line: the two guests' pids may be equal
    reports = [rep for line in r.stderr.splitlines()
               for rep in provider.parse_reports(line).items()]
    assert sorted(p for p, _ in reports) == sorted(p for _, p in ranks), out
    for _, counts in reports:
        assert counts["sent"] >= n and counts["received"] >= n, out
        assert counts["delegated"] == 0, out
    assert re.search(r"devices and regions on servers \[0\] removed \(",
                     epilog_line(hooks, job_id)), hooks.read_text()


def test_back_to_back_jobs_share_the_port(svm):
    """Three jobs in a row on both guests, none waiting for the last
    one's epilog: Slurm starts each prolog as soon as the last job
    ended, before that job's epilog has unplugged the only root port of
    the 1-vCPU guests; the prolog waits for the port
    (guest_regions.PORT_WAIT_S) and every job runs, each epilog
    removes what its prolog plugged."""
    hooks = Path(state_of(svm)["slurm"]["dir"], "log", "hooks.log")
    jobs = []
    for _ in range(3):
        r = cluster("srun", svm, "--", "--nodes=2", "--ntasks-per-node=1",
                    "sh", "-c", 'echo "job $SLURM_JOB_ID"',
                    timeout=JOB_TIMEOUT)
        assert r.returncode == 0, r.stdout + r.stderr + hooks.read_text()
        jobs.append(int(r.stdout.split()[1]))
    for job in jobs:
        assert re.search(r"regions on servers \[0\]; devices s0i0 ",
                         hooks_line(hooks, "prolog", job) or ""), \
            hooks.read_text()
        assert re.search(r"devices and regions on servers \[0\] removed \(",
                         epilog_line(hooks, job)), hooks.read_text()
    for host in ("s0i0", "s0i1"):   # the device of boot alone
        assert len(ivshmem_devices(svm, host)) == 1, host


def guest_ranks(name, host):
    r = cluster("exec", name, host, "--", "pgrep", "-f", "prog.py",
                timeout=60)
    return r.stdout.split() if r.returncode == 0 else []


@contextlib.contextmanager
def sleeping_job(name, seconds=300):
    """A 2-rank job, one rank per guest, that sleeps `seconds` after its
    pingpong (srun's Popen); killed if it still runs at the block's
    end."""
    job = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "srun", "--name", name,
         "--run-dir", str(RUN_DIR), "--", "--mpi=pmix", "--nodes=2",
         "--ntasks-per-node=1", "python3", "/tmp/prog.py", "1",
         str(seconds)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def ended_after(job, what, timeout):
    """srun `job`'s output once it ended, at most `timeout` s from now."""
    t0 = time.monotonic()
    out, err = job.communicate(timeout=timeout)
    print(f"job ended {time.monotonic() - t0:.1f} s after {what}")
    return out + err


# 45-65 s (the job ends 25-30 s after the kill: SlurmdTimeout, then
# Slurm's ping and message timeouts), more than `make test` has left for
# this module: `make test-slurm-vm` runs it
@pytest.mark.skipif(not os.environ.get("IVCLOUD_SLURM_VM_KILL"),
                    reason="IVCLOUD_SLURM_VM_KILL=1 (make test-slurm-vm)")
def test_killed_slurmd_ends_the_job(svm):
    """s0i1's slurmd killed under a running job: slurmctld sets the node
    down and ends the job, and its epilog kills, through s0i1's agent,
    the job's rank and slurmstepd there, which no slurmd would end, then
    unplugs the job's devices and removes its server."""
    hooks = Path(state_of(svm)["slurm"]["dir"], "log", "hooks.log")
    with sleeping_job(svm) as job:
        wait_for(lambda: guest_ranks(svm, "s0i1"), 120, "the rank on s0i1")
        r = cluster("exec", svm, "s0i1", "--", "pkill", "-KILL", "-x",
                    "slurmd", timeout=60)
        assert r.returncode == 0, r.stdout
        out = ended_after(job, "its slurmd was killed", 120)
    assert job.returncode != 0, out
    wait_for(lambda: re.search(r"ended the job's processes on s0i1",
                               hooks.read_text()), 60, "the epilog")
    assert not guest_ranks(svm, "s0i1")
    # and then took the job's devices out, rank or no rank
    for host in ("s0i0", "s0i1"):
        assert len(ivshmem_devices(svm, host)) == 1
    state = state_of(svm)
    assert not regions.job_dirs(Path(state["servers_dir"]),
                             state["servers"]["0"]["name"])


def slurm_nodes(name):
    """{node: Slurm's state}; `status` exits 1 for a degraded cluster
    (a restarted slurmd is not the one recorded) but says it all."""
    r = cluster("status", name, "--json", timeout=120)
    try:
        return json.loads(r.stdout)["slurm"]["nodes"]
    except (ValueError, KeyError):
        return {}


def hooks_line(hooks, what, job):
    """The hook's line of job `job` in hooks.log, once there."""
    m = re.search(rf"^.*{what} job {job}:.*$", hooks.read_text(), re.M)
    return m[0] if m else None


def epilog_line(hooks, job, timeout=120):
    """Job `job`'s epilog line, whatever it says; a test that waits in
    vain fails with all that hooks.log holds (a traceback goes there
    too)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = hooks_line(hooks, "epilog", job)
        if line:
            return line
        time.sleep(0.1)
    pytest.fail(f"no epilog of job {job} in {timeout} s; hooks.log:\n"
                f"{hooks.read_text()}")


# After the killed slurmd: a dead guest leaves the cluster degraded (its
# node stays down), so this runs last before `down`. 35-45 s: the job
# ends 27-32 s after the kill (SlurmdTimeout and Slurm's pings, as
# above). Without quiet leaves the survivor's QEMU aborted at the unplug.
@pytest.mark.skipif(not os.environ.get("IVCLOUD_SLURM_VM_KILL"),
                    reason="IVCLOUD_SLURM_VM_KILL=1 (make test-slurm-vm)")
def test_killed_guest_frees_the_survivors_device(svm):
    """s0i1's QEMU killed (-9) under a 2-rank job: the job ends, and its
    epilog takes the job's device out of the survivor s0i0, whose QEMU
    lives on (the job's server never told it that s0i1 left: QEMU 7.2
    aborts at the unplug of a device that was told; docs/server-protocol.md,
    "Quiet leaves"), so its root port is free for the next job, which
    gets a device there; the job's server is gone."""
    state = state_of(svm)
    slurm = state["slurm"]
    hooks = Path(slurm["dir"], "log", "hooks.log")
    servers_dir, srv_name = (Path(state["servers_dir"]),
                             state["servers"]["0"]["name"])
    # a slurmd killed by the case before: started again, and the node
    # comes back by itself (ReturnToService=2)
    if not guest_sh(svm, "s0i1", "pgrep -x slurmd; true").split():
        conf = slurm["conf"]
        guest_sh(svm, "s0i1", f"SLURM_CONF={conf} slurmd -f {conf} -N s0i1")
    wait_for(lambda: slurm_nodes(svm) == {"s0i0": "idle", "s0i1": "idle"},
             180, "both nodes idle")
    standing = ivshmem_devices(svm, "s0i0")
    with sleeping_job(svm) as job:
        seen = wait_for(lambda: regions.job_dirs(servers_dir, srv_name)
                        or job.poll() is not None, JOB_TIMEOUT,
                        "the job's server")
        assert seen is not True, "the job ended before it ran"
        job_id = int(seen[0].name[2:-2])
        wait_for(lambda: guest_ranks(svm, "s0i0")
                 and guest_ranks(svm, "s0i1"), 120, "both ranks")
        dev = guest_regions.device_id(job_id)
        with qemu.Qmp(Path(state["vms"]["s0i0"]["dir"]) / "qmp.sock") as q:
            assert qemu.find_device(q, dev) is not None
        victim = Path(state["vms"]["s0i1"]["dir"])
        pid = int((victim / "qemu.pid").read_text())
        os.kill(pid, 9)
        t0 = time.monotonic()
        out = ended_after(job, "its guest s0i1 was killed", 180)
    assert job.returncode != 0, out
    line = epilog_line(hooks, job_id)
    print(f"epilog done {time.monotonic() - t0:.1f} s after the kill")
    assert "devices and regions on servers [0] removed" in line, line
    assert not regions.job_dirs(servers_dir, srv_name)
    survivor = Path(state["vms"]["s0i0"]["dir"])
    spid = int((survivor / "qemu.pid").read_text())
    assert procfs.alive(spid), "the survivor's QEMU died"
    with qemu.Qmp(survivor / "qmp.sock") as q:
        assert qemu.find_device(q, dev) is None
        assert qemu.free_root_port(q) is not None
        chardevs = [c["label"] for c in q.execute("query-chardev")]
    assert dev not in chardevs, chardevs
    assert ivshmem_devices(svm, "s0i0") == standing
    # the next job on the survivor gets a device in the freed port
    r = cluster("srun", svm, "--", "--mpi=pmix", "--nodes=1",
                "--nodelist=s0i0", "--ntasks=1", "sh", "-c",
                'echo "region $OMPI_MCA_btl_ivshmem_region"; '
                "exec python3 /tmp/prog.py 0", timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pingpong ok 0" in r.stdout, r.stdout + r.stderr
    plugged = re.findall(r"prolog job (\d+): regions on servers \[0\]; "
                         r"devices s0i0 (\S+) \(", hooks.read_text())
    assert plugged and int(plugged[-1][0]) > job_id, hooks.read_text()
    assert f"region /sys/bus/pci/devices/{plugged[-1][1]}/resource2" \
        in r.stdout, r.stdout
    assert procfs.alive(spid)


def test_down_leaves_nothing(svm):
    state = state_of(svm)
    fabric = state["holders"]["fabric"]["pid"]
    head = [rec for rec in list(state["holders"].values())
            + [state["slurm"]["daemons"]["slurmctld"],
               state["slurm"]["daemons"]["munged"]]]
    r = cluster("down", svm, timeout=120)
    assert r.returncode == 0, r.stderr
    assert_nothing_left(svm, fabric)
    for rec in head:   # holders, and the head's daemons
        assert procfs.start_time(rec["pid"]) != rec["start"], rec


# ------------------------------------------------------------ migration

MIG = "svmm"
# a second cluster's boot and eight moves under TCG (8.5-14 minutes on
# the shared 2-core machine, its boot 1.5-6 of them): `make test-slurm-vm`,
# beside the kill tests, to keep `make test`'s time
moves = pytest.mark.skipif(not os.environ.get("IVCLOUD_SLURM_VM_MIGRATE"),
                           reason="IVCLOUD_SLURM_VM_MIGRATE unset (make "
                                  "test-slurm-vm)")


@pytest.fixture(scope="module")
def svmm(guest_deb):
    """2 servers x 1 instance (after the 1 x 2 cluster is down, when the
    whole module runs)."""
    args = list(up_args(guest_deb))
    args[1], args[3] = 2, 1
    with slurm_cluster(MIG, args, ("s0i0", "s1i0")):
        yield MIG


def slurmd_pid(name, host):
    return guest_sh(name, host, "pgrep -x slurmd; true").split()


def migrate(name, host, to, *extra, timeout=600):
    t0 = time.monotonic()
    r = cluster("migrate", name, host, "--to", to, *extra, timeout=timeout)
    print(f"migrate {host} --to {to} {' '.join(map(str, extra))}: "
          f"rc {r.returncode}, "
          f"{time.monotonic() - t0:.1f} s")
    return r


@moves
def test_migrate_idle_guest_serves_on(svmm):
    """s1i0 moved to s0 while no job runs: its slurmd (the same process)
    serves on at the same address, Slurm's node is resumed (the move
    drained it), and the next 2-node job gets one region of its own on
    s0 for both guests, over which the BTL carries their traffic."""
    before = slurmd_pid(svmm, "s1i0")
    assert len(before) == 1, before
    r = migrate(svmm, "s1i0", "s0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "s1i0 moved from s1 to s0" in r.stdout, r.stdout
    assert "migrate s1i0: switch (" in r.stderr, r.stderr
    assert slurmd_pid(svmm, "s1i0") == before
    wait_for(lambda: slurm_nodes(svmm) == {"s0i0": "idle", "s1i0": "idle"},
             120, "both nodes idle")
    state = state_of(svmm)
    assert state["instances"]["s1i0"]["server"] == 0
    hooks = Path(state["slurm"]["dir"], "log", "hooks.log")
    r = cluster("srun", svmm, "--", "--mpi=pmix", "--nodes=2",
                "--ntasks-per-node=1",
                "--export=ALL,OMPI_MCA_btl_base_verbose=100",
                "python3", "/tmp/prog.py", 2, timeout=JOB_TIMEOUT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "rank 1 on s1i0 allreduce 3 pingpong ok 2" in r.stdout, out
    assert re.search(r"prolog job \d+: regions on servers \[0\]; devices "
                     r"s0i0 \S+, s1i0 \S+ \(", hooks.read_text()), \
        hooks.read_text()
    used = {(src, dst): btl for src, btl, _, dst in BML_RE.findall(out)
            if btl != "self"}
    assert used == {("s0i0", "s1i0"): "ivshmem",
                    ("s1i0", "s0i0"): "ivshmem"}, out


@moves
def test_migrate_under_a_job_waits_for_it(svmm):
    """Under a running 2-node job of Open MPI over the ivshmem BTL, the
    move of s1i0 (back to s1) is refused in one line naming the job and
    the BTL (exit 2; the node is not left drained): ob1 cannot move a
    peer to another path; with --wait-jobs it waits for the job to end (the node
    drained meanwhile: no job starts there) and then moves it, slurmd
    and all."""
    before = slurmd_pid(svmm, "s1i0")
    with sleeping_job(svmm, 45) as job:
        # the rank has loaded the BTL (its pingpong is done)
        wait_for(lambda: guest_sh(svmm, "s1i0", "grep -l -F "
                                  "mca_btl_ivshmem.so /proc/[0-9]*/maps "
                                  "2>/dev/null; true").strip()
                 or job.poll() is not None, JOB_TIMEOUT, "the rank on s1i0")
        assert job.poll() is None, job.communicate()
        squeue = cluster("exec", svmm, "head", "--", "squeue", "--noheader",
                         "--format=%i", timeout=60).stdout.split()
        assert len(squeue) == 1, squeue
        r = migrate(svmm, "s1i0", "s1")
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"runs Slurm job {squeue[0]} " in r.stderr, r.stderr
        assert "the Open MPI BTL" in r.stderr, r.stderr
        assert slurm_nodes(svmm)["s1i0"] == "allocated"
        t0 = time.monotonic()
        mover = subprocess.Popen(
            [sys.executable, "-m", "ivcloud", "cluster", "migrate", "--name",
             svmm, "--run-dir", str(RUN_DIR), "s1i0", "--to", "s1",
             "--wait-jobs", "300"], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Slurm's word for a drained node that still runs a job
            seen = wait_for(lambda: ("exited" if mover.poll() is not None
                                     else slurm_nodes(svmm).get("s1i0")
                                     == "draining"), 60, "the node draining")
            out = ended_after(job, "the node was drained", 120)
            stdout, stderr = mover.communicate(timeout=300)
        finally:
            if mover.poll() is None:
                mover.kill()
                mover.wait()
    print(f"migrate --wait-jobs: {time.monotonic() - t0:.1f} s")
    assert job.returncode == 0, out
    assert mover.returncode == 0, stdout + stderr
    assert seen is True, stderr
    assert f"drain: waiting for Slurm job {squeue[0]} " in stderr, stderr
    assert "s1i0 moved from s0 to s1" in stdout, stdout
    assert slurmd_pid(svmm, "s1i0") == before
    wait_for(lambda: slurm_nodes(svmm) == {"s0i0": "idle", "s1i0": "idle"},
             120, "both nodes idle")
    r = cluster("srun", svmm, "--", "--mpi=pmix", "--nodes=2",
                "--ntasks-per-node=1", "python3", "/tmp/prog.py", 1,
                timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("pingpong ok 1") == 2, r.stdout + r.stderr


def start_ring_job(name, *options):
    """test_cluster_migrate's RING (900 turns, until /tmp/stop) as an
    MPICH job under `cluster srun` (srun --mpi=pmi2, `options` its
    own), one rank in each of s0i0 and s1i0; its Popen."""
    from ivcloud.mpis import flavor
    python = str(flavor("mpich").prefix() / "bin" / "python")
    ring = base64.b64encode(RING.encode()).decode()
    for host in ("s0i0", "s1i0"):
        guest_sh(name, host, f"echo {ring} | base64 -d > /tmp/ring.py && "
                             f"rm -f /tmp/stop")
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "srun", "--name", name,
         "--run-dir", str(RUN_DIR), *options, "--", "--mpi=pmi2",
         "--nodes=2", "--ntasks-per-node=1", python, "/tmp/ring.py", "900"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def job_leftovers(name, job):
    """What of Slurm job `job` is left: its servers' directories on the
    host, its devices and env files in the guests, an env file a move
    hid."""
    state = state_of(name)
    left = [str(d) for srv in state["servers"].values()
            for d in regions.job_dirs(Path(state["servers_dir"]),
                                      srv["name"])
            if d.name.startswith(regions.slurm_job_key(job) + "s")]
    for host, rec in state["vms"].items():
        devices = ivshmem_devices(name, host)
        if len(devices) != 1:
            left.append(f"{host}: devices {devices}")
        left += [f"{host}: {f}" for f in guest_sh(
            name, host, f"ls -d {guest_regions.JOB_DIR}/{job}.env* "
                        f"/run/ivshm/ivshm.env.away 2>/dev/null; "
                        f"true").split()]
        if (Path(rec["dir"]) / "env.hidden").exists():
            left.append(f"{host}: env.hidden")
    return left


@moves
def test_migrate_moves_a_provider_jobs_region(svmm, tmp_path):
    """An MPICH job over the provider (srun --mpi=pmi2), one rank in each
    guest, a ring of checked messages (test_cluster_migrate's RING: each
    message's sender, sequence number and every byte, an allreduce each
    turn): s1i0 moves to s0 and back under it, after a move to s0 whose
    destination QEMU does not start (rolled back: the job's device
    plugged into s1i0 again on the job's region on s1, the job's env
    file back, the rank back on it). Each move drains the
    rank in s1i0 off the job's region (not the guest's device of boot),
    gives the job a region on the destination (s0's, shared with s0i0's
    rank; s1's made anew) and the guest a device on it at the address
    it had, and stops the job's region left on the source when no guest
    of the job is there. The rank rejoins from the job's env file: over
    s0's region with its peer while co-resident, over the core
    otherwise. The job exits 0, every message once and in order; after
    it, nothing of the job is left on either server or in either
    guest."""
    assert state_of(svmm)["instances"]["s1i0"]["server"] == 1
    hooks = Path(state_of(svmm)["slurm"]["dir"], "log", "hooks.log")
    job = start_ring_job(svmm, "--report-transport")
    try:
        wait_for(lambda: guest_sh(svmm, "s1i0", "pgrep -f '[r]ing.py'; true"
                                  ).strip() or job.poll() is not None,
                 JOB_TIMEOUT, "the rank on s1i0")
        assert job.poll() is None, job.communicate()
        squeue = cluster("exec", svmm, "head", "--", "squeue", "--noheader",
                         "--format=%i", timeout=60).stdout.split()
        assert len(squeue) == 1, squeue
        job_id = int(squeue[0])
        key = regions.slurm_job_key(job_id)
        time.sleep(8)   # some turns over the core (two servers)
        fake = tmp_path / "qemu-system-x86_64"
        fake.write_text("#!/bin/sh\necho 'qemu-system-x86_64: cannot take "
                        "this guest' >&2\nexit 1\n")
        fake.chmod(0o755)
        r = cluster("migrate", svmm, "s1i0", "--to", "s0",
                    env={**os.environ, "IVCLOUD_QEMU": str(fake)})
        assert r.returncode == 1, r.stdout + r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert "step 'start'" in last and "rolled back, the guest runs " \
            "on s1" in last, r.stderr
        assert f"rolled back: Slurm job {job_id} " in r.stderr, r.stderr
        assert job.poll() is None, job.communicate()
        state = state_of(svmm)
        assert state["instances"]["s1i0"]["server"] == 1
        assert [d.name for d in regions.job_dirs(
            Path(state["servers_dir"]), state["servers"]["1"]["name"])] == \
            [f"{key}s1"]
        assert len(ivshmem_devices(svmm, "s1i0")) == 2
        assert guest_sh(svmm, "s1i0", f"ls {guest_regions.JOB_DIR}").split() \
            == [f"{job_id}.env"]
        time.sleep(5)   # the rank back on s1's job region
        said = [r.stderr]
        for dest, src, note in (("s0", "s1", "stopped"),
                                ("s1", "s0", "stays for s0i0")):
            r = migrate(svmm, "s1i0", dest)
            said.append(r.stderr)
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"s1i0 moved from {src} to {dest}" in r.stdout, r.stdout
            assert f"drain: Slurm job {job_id} " in r.stderr, r.stderr
            # the job's rank, then nothing on the device of boot
            assert re.findall(r"drain: (\d+) ranks moved to the core$",
                              r.stderr, re.M)[:1] == ["1"], r.stderr
            assert f"region on {src} {note}" in r.stderr, r.stderr
            assert job.poll() is None, job.communicate()
            state = state_of(svmm)
            dirs = {k: [d.name for d in regions.job_dirs(
                Path(state["servers_dir"]), srv["name"])]
                for k, srv in state["servers"].items()}
            # s0's region held by s0i0 throughout; s1's only while s1i0
            # is there
            assert dirs == {"0": [f"{key}s0"],
                            "1": [f"{key}s1"] if dest == "s1" else []}, dirs
            assert len(ivshmem_devices(svmm, "s1i0")) == 2
            time.sleep(10)   # turns on the new server
        for host in ("s0i0", "s1i0"):
            guest_sh(svmm, host, "touch /tmp/stop")
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            out, err = job.communicate()
            print(f"\njob killed:\n{out}\n{err}")
    print("\n".join(said))
    assert job.returncode == 0, out + err
    ranks = dict((host, int(pid)) for pid, host in re.findall(
        r"rank \d pid (\d+) on (s\di0) turns \d+ received \d+ in order",
        out))
    assert sorted(ranks) == ["s0i0", "s1i0"], out + err
    lines = [m.group(0) for m in re.finditer(r"fi_ivshm: pid (\d+) sent .*",
                                             err)
             if int(m.group(1)) in ranks.values()]
    print("\n".join(lines))
    assert len(lines) == 2, err
    moved = [re.search(r"drained (\d+) switched (\d+) rejoined (\d+)"
                       r"(?: phases (\S+))?", line) for line in lines]
    assert all(moved), lines
    mover = next(m for m in moved if m.group(1) == "3")
    peer = next(m for m in moved if m is not mover)
    # three drains (s1's job region twice, then s0's), a job region taken
    # after each
    assert int(mover.group(3)) == 3, lines
    # the peer moved the pair to the region when the mover came, and off
    # it when the mover left
    assert peer.group(1) == "0" and int(peer.group(2)) >= 2, lines
    phases = [tuple(map(int, p.split("/")))
              for p in mover.group(4).split(",")]
    # (region/core messages sent): the core on two servers, away (the
    # move rolled back), back on s1, away, the region beside s0i0, away,
    # the core on two servers
    assert len(phases) == 7, mover.group(0)
    assert phases[4][0] > 0, mover.group(0)
    assert all(s == 0 for k, (s, _) in enumerate(phases) if k != 4), \
        mover.group(0)
    # the epilog found the job's guests where they are now
    assert re.search(r"devices and regions on servers \[0, 1\] removed \(",
                     epilog_line(hooks, job_id)), hooks.read_text()
    assert job_leftovers(svmm, job_id) == []
    assert state_of(svmm)["instances"]["s1i0"]["server"] == 1


@moves
def test_killed_migration_leaves_nothing_of_the_job(svmm):
    """A migration of s1i0 under a running MPICH job killed (SIGKILL)
    once its drain took the job's rank off the job's region (its env
    file hidden, both devices still plugged): the job runs on over the
    core and exits 0; its epilog removes its devices, its regions and
    its files, the hidden one too; the next migration puts back what
    the killed one left on the host (its record of the hidden file, the
    node drained in Slurm) and moves the guest."""
    src = state_of(svmm)["instances"]["s1i0"]["server"]
    hooks = Path(state_of(svmm)["slurm"]["dir"], "log", "hooks.log")
    job = start_ring_job(svmm)
    mover = None
    try:
        wait_for(lambda: guest_sh(svmm, "s1i0", "pgrep -f '[r]ing.py'; true"
                                  ).strip() or job.poll() is not None,
                 JOB_TIMEOUT, "the rank on s1i0")
        assert job.poll() is None, job.communicate()
        job_id = int(cluster("exec", svmm, "head", "--", "squeue",
                             "--noheader", "--format=%i",
                             timeout=60).stdout.split()[0])
        time.sleep(5)
        mover = subprocess.Popen(
            [sys.executable, "-m", "ivcloud", "cluster", "migrate", "--name",
             svmm, "--run-dir", str(RUN_DIR), "s1i0", "--to",
             f"s{1 - src}"], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        said = []
        for line in mover.stderr:
            said.append(line)
            if "ranks moved to the core" in line:
                break
        mover.kill()
        mover.wait()
        assert any("ranks moved to the core" in w for w in said), said
        assert guest_sh(svmm, "s1i0", f"ls {guest_regions.JOB_DIR}"
                        ).split() == [f"{job_id}.env.away"]
        time.sleep(5)   # the job runs on over the core
        assert job.poll() is None, job.communicate()
        for host in ("s0i0", "s1i0"):
            guest_sh(svmm, host, "touch /tmp/stop")
        out, err = job.communicate(timeout=300)
    finally:
        for p in (mover, job):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert job.returncode == 0, out + err
    assert out.count(" in order") == 2, out + err
    assert re.search(r"devices and regions on servers \[0, 1\] removed \(",
                     epilog_line(hooks, job_id)), hooks.read_text()
    # on the host: the killed move's record of the file it hid
    assert job_leftovers(svmm, job_id) == ["s1i0: env.hidden"]
    assert slurm_nodes(svmm)["s1i0"] in ("drained", "idle"), \
        slurm_nodes(svmm)
    r = migrate(svmm, "s1i0", f"s{1 - src}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_leftovers(svmm, job_id) == []
    wait_for(lambda: slurm_nodes(svmm) == {"s0i0": "idle", "s1i0": "idle"},
             120, "both nodes idle")
