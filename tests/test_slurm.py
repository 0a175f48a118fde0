"""Slurm on the emulated cluster (`cluster up --scheduler slurm`, `cluster
srun|sbatch`): real munged, slurmctld and slurmd, Open MPI ranks started
by srun through PMIx, a region per job made by the controller's hooks.

One 2-server x 2-instance x 2-vCPU namespace cluster serves the module
(Slurm's start costs a few seconds); the tests run in file order, the
one that kills a slurmd near the end, and the last takes the cluster
down and checks that nothing of it is left. A second, small cluster is
killed while its Slurm starts, to check `down` after that."""

from __future__ import annotations

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

from ivcloud import procfs
from ivcloud import server as server_mod
from ivcloud.cluster import holder, regions
from ivcloud.cluster.slurm import client
from ivcloud.errors import ClusterFailure
from ivcloud.mpis.openmpi import parse_btl_counters

from test_cluster import (BML_RE, MPI_PROGRAM, RUN_DIR, assert_gone,
                          ivcloud, new_name, one_line_error, state_of,
                          wait_for)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="cluster tests need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None
                       or shutil.which("munged") is None,
                       reason="Slurm (slurmctld, slurmd, munge) not installed"),
]

RANK_RE = re.compile(r"^rank (\d+) of (\d+) on (\S+) sum (\d+) socket (\S+)$",
                     re.M)
JOB_TIMEOUT = 120


@pytest.fixture(scope="module")
def program(mpi_programs):
    """test_cluster's pairs program: its ranks' hosts and regions, then,
    given a file name, a wait for that file."""
    return mpi_programs("slurm-pairs", MPI_PROGRAM)


@pytest.fixture(scope="module")
def slurm_cluster():
    """(name, state) of the module's cluster; taken down at the end if a
    test has not (test_down_removes_everything does, and checks)."""
    name = new_name()
    t0 = time.monotonic()
    up = ivcloud("cluster", "up", "--name", name, "--servers", 2,
                 "--instances-per-server", 2, "--vcpus", 2,
                 "--oversubscribe", "--scheduler", "slurm")
    print(f"\nup --scheduler slurm (2 x 2 x 2): "
          f"{time.monotonic() - t0:.1f} s")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield name, state_of(name)
    finally:
        if (RUN_DIR / f"cluster-{name}").exists():
            ivcloud("cluster", "down", "--name", name)


def srun(name, *args, rankfile=None, timeout=JOB_TIMEOUT):
    opts = ["--rankfile", rankfile] if rankfile else []
    return ivcloud("cluster", "srun", "--name", name, *opts, "--", *args,
                   timeout=timeout)


def start_srun(name, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "srun", "--name", name,
         "--", *map(str, args)], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ranks(out):
    """{rank: (host, socket)} of the program's lines, each with the
    right allreduce sum."""
    found = {}
    for r, size, host, total, sock in RANK_RE.findall(out):
        assert int(total) == int(size) * (int(size) + 1) // 2, out
        found[int(r)] = (host, sock)
    return found


def job_dirs(state, server):
    return regions.job_dirs(Path(state["servers_dir"]),
                         state["servers"][str(server)]["name"])


def running_jobs(state):
    out = client.query(state, ["squeue", "--noheader", "--states=RUNNING",
                               "--format=%i %N"])
    return [line.split() for line in out.splitlines() if line.strip()]


def socket_of(state, host, job):
    server = state["instances"][host]["server"]
    return str(regions.job_server_paths(
        Path(state["servers_dir"]), state["servers"][str(server)]["name"],
        server, regions.slurm_job_key(job)).socket)


# ---------------------------------------------------------------- refusals

def test_guest_task_prolog_names_the_jobs_device(tmp_path):
    """The VM guests' task prolog (run here by sh, as slurmd runs it):
    the job's device from its env file, to the BTL and to the provider
    (and that file, which the provider reads again when it rejoins after
    a move), a variable the task set wins, an unknown position is -1 (the
    provider is not given one); no env file: no ivshmem BTL at all and
    no region for the provider rather than the guest's device of
    boot."""
    from ivcloud.cluster.slurm.conf import guest_task_prolog_text
    script = tmp_path / "task-prolog"
    script.write_text(guest_task_prolog_text(
        {"OMPI_MCA_btl": "self,vader,ivshmem,tcp"}, str(tmp_path)))
    dev = "/sys/bus/pci/devices/0000:01:00.0"
    (tmp_path / "7.env").write_text(
        f"IVSHM_PCI=0000:01:00.0\nIVSHM_UIO=/dev/vfio/9\n"
        f"IVSHM_BAR0={dev}/resource0\nIVSHM_BAR2={dev}/resource2\n"
        f"IVSHM_DOORBELL=vfio\nIVSHM_POSITION=\n")

    def exports(job, **env):
        out = subprocess.run(["sh", str(script)], capture_output=True,
                             text=True, check=True,
                             env={"PATH": os.environ["PATH"],
                                  "SLURM_JOB_ID": str(job), **env}).stdout
        return dict(line[len("export "):].split("=", 1)
                    for line in out.splitlines())

    assert exports(7) == {
        "OMPI_MCA_btl": "self,vader,ivshmem,tcp",
        "OMPI_MCA_btl_ivshmem_region": f"{dev}/resource2",
        "OMPI_MCA_btl_ivshmem_uio_dev": "/dev/vfio/9",
        "OMPI_MCA_btl_ivshmem_bar0": f"{dev}/resource0",
        "OMPI_MCA_btl_ivshmem_position": "-1",
        "FI_IVSHM_REGION": f"{dev}/resource2",
        "FI_IVSHM_UIO_DEV": "/dev/vfio/9",
        "FI_IVSHM_BAR0": f"{dev}/resource0",
        "FI_IVSHM_DEVICE_ENV": str(tmp_path / "7.env")}
    mine = exports(7, OMPI_MCA_btl_ivshmem_region="/x", FI_IVSHM_BAR0="/y")
    assert "OMPI_MCA_btl_ivshmem_region" not in mine
    assert "FI_IVSHM_BAR0" not in mine and "FI_IVSHM_REGION" in mine
    assert exports(8) == {"OMPI_MCA_btl": "self,vader,tcp",
                          "FI_IVSHM_REGION": "/nonexistent"}
    assert exports(8, OMPI_MCA_btl="self,tcp", FI_IVSHM_REGION="/z") == {}


def test_migration_records_each_env_file_it_hides(tmp_path):
    """A migration of a guest under a Slurm job hides the job's env file
    as well as ivshm.env (docs/migration.md, "A Slurm job's ranks"): its
    VM directory's env.hidden lists each, so that healing after a killed
    migration finds the device of each (the device of boot for
    ivshm.env, the job's for its file); an empty one (as older moves
    left it) is ivshm.env's."""
    from ivcloud.cluster import migrate as mig
    from ivcloud.cluster.slurm import guest_regions
    job_env = guest_regions.job_env_path(7)
    assert mig._hidden(tmp_path) == []
    mig._mark_hidden(tmp_path, job_env, True)
    mig._mark_hidden(tmp_path, mig.GUEST_ENV, True)
    mig._mark_hidden(tmp_path, job_env, True)
    assert sorted(mig._hidden(tmp_path)) == sorted([job_env, mig.GUEST_ENV])
    assert {e: mig._device_of_env(e) for e in mig._hidden(tmp_path)} == \
        {job_env: guest_regions.device_id(7), mig.GUEST_ENV: "ivs"}
    mig._mark_hidden(tmp_path, job_env, False)
    assert mig._hidden(tmp_path) == [mig.GUEST_ENV]
    mig._mark_hidden(tmp_path, mig.GUEST_ENV, False)
    assert not (tmp_path / mig.HIDDEN).exists()
    (tmp_path / mig.HIDDEN).touch()
    assert mig._hidden(tmp_path) == [mig.GUEST_ENV]
    assert mig._device_of_env("/run/ivcloud/slurm-jobs/x.env") == ""


def test_epilog_follows_a_guest_that_moved(tmp_path):
    """The epilog's lock of a guest's ports (guest_regions.ports_now)
    waits for a migration that holds them and then follows the guest to
    the QEMU directory state.json names now, holding that one's lock
    (the move holds it until the job's device is bound there)."""
    import threading
    from ivcloud.cluster.slurm import guest_regions
    from ivcloud.cluster.state import StateDir, save
    sd = StateDir.of(tmp_path / "cluster-t")
    sd.dir.mkdir()
    old, new = sd.dir / "vm" / "s1i0", sd.dir / "vm" / "s1i0.s0"
    old.mkdir(parents=True)
    new.mkdir()
    state = {"dir": str(sd.dir), "vms": {"s1i0": {"dir": str(old)}}}
    save(sd, state)
    moved = threading.Event()

    def move():
        with guest_regions.port_lock(old), guest_regions.port_lock(new):
            moved.set()
            time.sleep(0.5)
            save(sd, {**state, "vms": {"s1i0": {"dir": str(new)}}})
            time.sleep(0.5)
    mover = threading.Thread(target=move)
    mover.start()
    moved.wait(10)
    t0 = time.monotonic()
    with guest_regions.ports_now(state, "s1i0", 10) as d:
        waited = time.monotonic() - t0
        assert d == new
        # held: another taker waits
        with pytest.raises(ClusterFailure):
            with guest_regions.port_lock(new, 0.2):
                pass
    mover.join()
    assert waited >= 0.8, waited


def test_bad_requests_are_one_line_exit_2():
    name = new_name()
    base = ["cluster", "up", "--name", name, "--servers", 1,
            "--instances-per-server", 2]
    line = one_line_error(ivcloud(*base, "--scheduler", "slurm",
                                  "--instance-kind", "vm", "--guest-deb",
                                  "/nonexistent/guest.deb"))
    assert "guest.deb does not exist" in line
    line = one_line_error(ivcloud(*base, "--scheduler", "slurm",
                                  "--slurm-time-slice", 3))
    assert "time slice" in line
    line = one_line_error(ivcloud(*base, "--slurm-time-slice", 10))
    assert "--scheduler slurm" in line
    line = one_line_error(ivcloud(*base, "--scheduler", "pbs"))
    assert "invalid choice" in line
    assert not (RUN_DIR / f"cluster-{name}").exists()
    assert "not up" in one_line_error(srun(name, "hostname"))
    assert "no sbatch arguments" in one_line_error(
        ivcloud("cluster", "sbatch", "--name", name))


def test_a_cluster_without_slurm_refuses_srun():
    name = new_name()
    up = ivcloud("cluster", "up", "--name", name, "--servers", 1,
                 "--instances-per-server", 1)
    assert up.returncode == 0, up.stderr
    try:
        assert "runs no Slurm" in one_line_error(srun(name, "hostname"))
    finally:
        assert ivcloud("cluster", "down", "--name", name).returncode == 0


# ---------------------------------------------------------------- jobs

def test_status_files_and_plain_srun(slurm_cluster):
    name, state = slurm_cluster
    st = ivcloud("cluster", "status", "--name", name, "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    info = json.loads(st.stdout)
    sl = info["slurm"]
    assert info["healthy"] and info["scheduler"] == "slurm"
    assert sorted(sl["daemons"]) == ["munged", "slurmctld", "slurmd-s0i0",
                                     "slurmd-s0i1", "slurmd-s1i0",
                                     "slurmd-s1i1"]
    assert all(d["alive"] for d in sl["daemons"].values())
    assert sl["nodes"] == {h: "idle" for h in ("s0i0", "s0i1", "s1i0",
                                                "s1i1")}
    # config, key, socket, logs: all under the cluster's directory
    conf = Path(sl["conf"])
    assert conf.parent == Path(state["dir"]) / "slurm"
    assert f"AuthInfo=socket={conf.parent}/munge/munge.socket" in \
        conf.read_text()
    # an instance's vCPUs are its node's CPUs
    nodes = client.query(state, ["scontrol", "show", "nodes"])
    assert nodes.count("CPUTot=2") == 4, nodes
    # plain srun, in the head node (the login node) with its SLURM_CONF
    p = ivcloud("cluster", "exec", "--name", name, "head", "--", "srun",
                "--nodes=2", "--ntasks-per-node=1", "hostname")
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.split()) == 2


def test_pmix_job_uses_the_region_between_coresident_instances(
        slurm_cluster, program):
    """4 ranks, one per instance: each pair of a server talks through the
    job's region on it (counters), the pairs across servers over TCP."""
    name, state = slurm_cluster
    p = srun(name, "--mpi=pmix", "--nodes=4", "--ntasks-per-node=1",
             "--export=ALL,OMPI_MCA_btl_ivshmem_verbose=1,"
             "OMPI_MCA_btl_base_verbose=100", program)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    found = ranks(p.stdout)
    assert sorted(h for h, _ in found.values()) == ["s0i0", "s0i1", "s1i0",
                                                    "s1i1"], out
    job = int(re.search(r"/sj(\d+)s\d+/", p.stdout).group(1))
    for host, sock in found.values():
        assert sock == socket_of(state, host, job), (host, sock)
    counters = parse_btl_counters(out)
    assert set(counters) == {0, 1, 2, 3}, out
    assert all(c["sent_msgs"] > 0 and c["recv_msgs"] > 0
               for c in counters.values()), counters
    server_of = {h: state["instances"][h]["server"] for h, _ in
                 found.values()}
    host_of = {r: h for r, (h, _) in found.items()}
    pairs = {}
    for src, btl, dst_rank, dst in BML_RE.findall(out):
        assert host_of[int(dst_rank)] == dst
        if btl != "self":
            pairs.setdefault((src, dst), set()).add(btl)
    assert len(pairs) == 12, pairs
    for (src, dst), btls in pairs.items():
        want = "ivshmem" if server_of[src] == server_of[dst] else "tcp"
        assert btls == {want}, (src, dst, btls)
    # the epilog removed the job's regions
    wait_for(lambda: not job_dirs(state, 0) and not job_dirs(state, 1), 30,
             "the job's regions to go")


def test_two_jobs_at_once_get_separate_regions(slurm_cluster, program):
    name, state = slurm_cluster
    go = Path(program).parent / "go-two"
    go.unlink(missing_ok=True)
    # both on server 0's two instances, one CPU of each per job
    a, b = (start_srun(name, "--nodelist=s0i0,s0i1", "--ntasks=2",
                       "--ntasks-per-node=1",
                       "--export=ALL,OMPI_MCA_btl_ivshmem_verbose=1",
                       program, go) for _ in range(2))
    try:
        dirs = wait_for(lambda: len(job_dirs(state, 0)) == 2
                        and job_dirs(state, 0), 60, "two jobs' regions")

        def peers_of_each():
            peers = [server_mod.status(server_mod.paths_for(
                d.name, str(d.parent))).get("peers") or [] for d in dirs]
            return all(len(p) == 2 for p in peers)

        # four ranks on this server: each region holds its own job's two
        wait_for(peers_of_each, 60, "both jobs' ranks in their regions")
        standing = server_mod.status(server_mod.paths_for(
            state["servers"]["0"]["name"], state["servers_dir"]))
        assert not standing.get("peers"), standing
    finally:
        go.write_text("go")
        outs = [p.communicate(timeout=JOB_TIMEOUT) for p in (a, b)]
    sockets = set()
    for (out, err), p in zip(outs, (a, b)):
        assert p.returncode == 0, out + err
        socks = {s for _, s in ranks(out).values()}
        assert len(socks) == 1 and len(ranks(out)) == 2, out
        sockets |= socks
        counters = parse_btl_counters(out + err)
        assert all(c["sent_msgs"] > 0 for c in counters.values()), counters
    assert len(sockets) == 2, sockets
    wait_for(lambda: not job_dirs(state, 0), 30, "the jobs' regions to go")


def test_tree_topology_packs_a_job_onto_one_server(slurm_cluster, program,
                                                   tmp_path):
    """With s0i0 busy, a 2-node job gets s1i0 and s1i1 (the tree plugin
    keeps it on one leaf switch: one server), where a topology-blind
    Slurm takes the first free nodes, s0i1 and s1i0. The planner's
    rankfile, and a round-robin one, place tasks as they say."""
    name, state = slurm_cluster
    client.wait_idle(state, 60)   # the last test's nodes may be completing
    busy = start_srun(name, "--nodelist=s0i0", "--ntasks=2", "sleep", 60)
    try:
        wait_for(lambda: running_jobs(state), 30, "s0i0 to be busy")

        def two_nodes():
            p = srun(name, "--nodes=2", "--ntasks-per-node=1", "hostname")
            assert p.returncode == 0, p.stderr
            return sorted(p.stdout.split())

        assert two_nodes() == ["s1i0", "s1i1"]
        client.set_topology(state, "flat")
        try:
            assert two_nodes() == ["s0i1", "s1i0"]
        finally:
            client.set_topology(state, "tree")
        assert two_nodes() == ["s1i0", "s1i1"]
    finally:
        busy.terminate()
        busy.communicate(timeout=60)

    rankfile = tmp_path / "rankfile"
    plan = ivcloud("place", "--cluster", name, "--pattern", "ring",
                   "--ranks", 4, "--partitioner", "spectral",
                   "--out", rankfile)
    assert plan.returncode == 0, plan.stderr
    want = dict(re.findall(r"^rank (\d+)=(\S+) ", rankfile.read_text(), re.M))
    p = srun(name, program, rankfile=rankfile)
    assert p.returncode == 0, p.stdout + p.stderr
    assert {r: h for r, (h, _) in ranks(p.stdout).items()} == \
        {int(r): h for r, h in want.items()}
    # round-robin over servers: the same program spans both
    rankfile.write_text("rank 0=s0i0 slot=0\nrank 1=s1i0 slot=0\n"
                        "rank 2=s0i1 slot=0\nrank 3=s1i1 slot=0\n")
    p = srun(name, program, rankfile=rankfile)
    assert p.returncode == 0, p.stdout + p.stderr
    assert {r: h for r, (h, _) in ranks(p.stdout).items()} == \
        {0: "s0i0", 1: "s1i0", 2: "s0i1", 3: "s1i1"}
    rankfile.write_text("rank 0=s9i9 slot=0\n")
    assert "not an instance" in one_line_error(srun(name, program,
                                                    rankfile=rankfile))


def test_sbatch_job_with_a_rankfile(slurm_cluster, program):
    """A batch job placed by a rankfile: its srun step runs each rank
    where the file says, in the job's regions, which end with it."""
    name, state = slurm_cluster
    rankfile = Path(program).parent / "rankfile-batch"
    rankfile.write_text("rank 0=s1i1 slot=0\nrank 1=s0i0 slot=0\n"
                        "rank 2=s1i0 slot=0\n")
    out = Path(program).parent / "batch.out"
    p = ivcloud("cluster", "sbatch", "--name", name, "--rankfile", rankfile,
                "--", f"--output={out}", "--wrap", f"srun {program}")
    assert p.returncode == 0, p.stderr
    job = int(re.search(r"Submitted batch job (\d+)", p.stdout).group(1))
    found = wait_for(lambda: out.exists() and len(ranks(out.read_text())) == 3
                     and ranks(out.read_text()), 60, "the batch job's ranks")
    assert {r: h for r, (h, _) in found.items()} == {0: "s1i1", 1: "s0i0",
                                                     2: "s1i0"}
    assert {s for _, s in found.values()} == {socket_of(state, "s1i1", job),
                                              socket_of(state, "s0i0", job)}
    wait_for(lambda: not job_dirs(state, 0) and not job_dirs(state, 1), 30,
             "the batch job's regions to go")


def test_killed_slurmd_ends_the_job_and_frees_its_region(slurm_cluster,
                                                         program):
    name, state = slurm_cluster
    go = Path(program).parent / "go-never"
    go.unlink(missing_ok=True)
    job = start_srun(name, "--nodelist=s1i0,s1i1", "--ntasks-per-node=1",
                     program, go)
    try:
        [(job_id, _)] = wait_for(lambda: running_jobs(state), 60,
                                 "the job to run")
        job_id = int(job_id)
        wait_for(lambda: job_dirs(state, 1), 30, "the job's region")
        slurmd = state["slurm"]["daemons"]["slurmd-s1i1"]
        t0 = time.monotonic()
        os.kill(slurmd["pid"], signal.SIGKILL)
        job.communicate(timeout=120)
        ended = time.monotonic() - t0
        assert job.returncode != 0
        wait_for(lambda: not job_dirs(state, 1), 60, "the region to go")
        freed = time.monotonic() - t0
        print(f"\nslurmd killed: job ended after {ended:.1f} s, region "
              f"removed after {freed:.1f} s")
        # slurmctld notices within SlurmdTimeout (10 s) and a few pings
        assert ended < 90, ended
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        go.write_text("go")
    # nothing of the job is left on the node whose slurmd died
    ns = {"net": {state["namespaces"]["s1i1"]["net"]}}

    def of_job(pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return (f"SLURM_JOB_ID={job_id}".encode() in env
                or any(a.startswith(f"slurmstepd: [{job_id}.")
                       for a in procfs.cmdline(pid)))

    wait_for(lambda: not [p for p in holder.processes_in(ns) if of_job(p)],
             20, "the job's processes on s1i1 to end")
    st = json.loads(ivcloud("cluster", "status", "--name", name,
                            "--json").stdout)
    assert not st["healthy"]
    assert not st["slurm"]["daemons"]["slurmd-s1i1"]["alive"]


def test_down_removes_everything(slurm_cluster):
    name, _ = slurm_cluster
    snapshot = state_of(name)
    daemons = snapshot["slurm"]["daemons"]
    p = ivcloud("cluster", "down", "--name", name)
    assert p.returncode == 0, p.stderr
    assert_gone(name, snapshot)
    # gone when down returns, every thread of them (a daemon's leader
    # turns zombie while its threads still exit), so that `up` of the
    # same name can follow at once
    assert not [d for d in daemons.values()
                if procfs.exiting(d["pid"], d["start"])], daemons
    # no process of ours names the cluster's directory
    d = snapshot["dir"]
    assert not [pid for pid in procfs.pids()
                if any(d in a for a in procfs.cmdline(pid))]


def test_down_after_up_killed_while_slurm_starts():
    name = new_name()
    path = RUN_DIR / f"cluster-{name}" / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "up", "--name", name,
         "--servers", "1", "--instances-per-server", "2", "--scheduler",
         "slurm"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    snapshot: dict = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                snapshot = json.loads(path.read_text())
            except (OSError, ValueError):
                snapshot = {}
            if snapshot.get("step", "").startswith("slurm slurmd"):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert snapshot.get("step", "").startswith("slurm slurmd"), \
            "up was too quick"
        snapshot = json.loads(path.read_text())
        daemons = snapshot["slurm"]["daemons"]
        assert "slurmctld" in daemons
        assert any(procfs.start_time(d["pid"]) == d["start"]
                   for d in daemons.values())
        down = ivcloud("cluster", "down", "--name", name)
        assert down.returncode == 0, down.stderr
        assert_gone(name, snapshot)
        assert not [d for d in daemons.values()
                    if procfs.start_time(d["pid"]) == d["start"]]
    finally:
        if proc.poll() is None:
            proc.kill()
        if path.parent.exists():
            ivcloud("cluster", "down", "--name", name)
