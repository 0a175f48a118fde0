"""`ivcloud cluster`: real namespaces, bridges, ivshmem-servers and Open MPI
jobs (root only). Every test brings its own cluster up under a unique
name and always takes it down; cleanup is checked against a snapshot of
the state file (holders, namespaces, servers, regions)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ivcloud.cluster import holder
from ivcloud.cluster.launch import visible_inside

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="cluster tests need root")

RUN_DIR = Path(os.environ.get("IVCLOUD_RUN_DIR") or "/run/ivcloud")
HAVE_MPI = shutil.which("mpicc") is not None and shutil.which("mpirun")

# All pairs exchange a message (so every BTL endpoint gets created), then
# an allreduce; each rank prints its host and the region it was given.
# Given a file name, the ranks then wait for that file (at most 2 min),
# so that jobs overlap or a job runs while something is done to it.
MPI_PROGRAM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    int rank, size, token, sum = 0;
    char host[64] = "";
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    gethostname(host, sizeof host - 1);
    for (int peer = 0; peer < size; peer++) {
        if (peer == rank)
            continue;
        MPI_Sendrecv(&rank, 1, MPI_INT, peer, 7, &token, 1, MPI_INT, peer, 7,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (token != peer)
            MPI_Abort(MPI_COMM_WORLD, 3);
    }
    int mine = rank + 1;
    MPI_Allreduce(&mine, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    const char *sock = getenv("IVSHM_SOCKET");
    printf("rank %d of %d on %s sum %d socket %s\n", rank, size, host, sum,
           sock ? sock : "-");
    fflush(stdout);
    for (int i = 0; argc > 1 && i < 1200 && access(argv[1], F_OK); i++)
        usleep(100000);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return sum == size * (size + 1) / 2 ? 0 : 1;
}
"""
BML_RE = re.compile(r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send "
                    r"to \[\[\d+,\d+\],(\d+)\] on node (\S+)")


def ivcloud(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.stderr
    return lines[0]


def wait_for(cond, timeout, what):
    """cond()'s first true value, polled every 0.1 s; fails the test
    after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out ({timeout} s) waiting for {what}")


def new_name() -> str:
    return f"t{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"


def state_of(name: str) -> dict:
    return json.loads((RUN_DIR / f"cluster-{name}" / "state.json").read_text())


def assert_gone(name: str, snapshot: dict) -> None:
    """Nothing of the cluster is left: holders, processes in its
    namespaces, servers, regions, links in the host, state directory."""
    assert not (RUN_DIR / f"cluster-{name}").exists()
    for rec in snapshot.get("holders", {}).values():
        if rec.get("start") is not None:
            assert holder.start_time(rec["pid"]) != rec["start"], rec
    assert holder.find_by_marker(name) == []
    ns = {"net": set(), "mnt": set()}
    for rec in snapshot.get("namespaces", {}).values():
        for kind in ns:
            if rec.get(kind):
                ns[kind].add(rec[kind])
    for kind in ns:  # never the host's own (as a guard for this check)
        assert holder.ns_inode(os.getpid(), kind) not in ns[kind]
    # (namespace inode numbers get reused: also match the cluster's env)
    assert holder.processes_in(ns, cluster=name) == []
    for srv in snapshot.get("servers", {}).values():
        if srv.get("pid"):
            assert holder.start_time(srv["pid"]) is None or \
                Path(f"/proc/{srv['pid']}/comm").read_text().strip() \
                != "ivshmem-server", srv
        assert not os.path.lexists(srv["region"])
    links = subprocess.run(["ip", "-o", "link"], capture_output=True,
                           text=True).stdout
    assert not re.search(r"\d+: (i-s\d+i\d+|br-s\d+|up-s\d+|cp-s\d+|"
                         r"i-head)[@:]", links), links


@pytest.fixture
def cluster():
    """up(**options) -> (name, state); every cluster made is taken down
    afterwards and checked to be gone."""
    made = []

    def up(servers=2, instances=2, vcpus=1, extra=()):
        name = new_name()
        made.append(name)
        proc = ivcloud("cluster", "up", "--name", name, "--servers", servers,
                       "--instances-per-server", instances, "--vcpus", vcpus,
                       "--oversubscribe", *extra)
        assert proc.returncode == 0, proc.stderr
        return name, state_of(name)

    yield up
    for name in made:
        d = RUN_DIR / f"cluster-{name}"
        snapshot = json.loads((d / "state.json").read_text()) \
            if (d / "state.json").exists() else {}
        if d.exists():
            proc = ivcloud("cluster", "down", "--name", name)
            assert proc.returncode == 0, proc.stderr
        assert_gone(name, snapshot)


@pytest.fixture(scope="module")
def mpi_program(mpi_programs):
    """The MPI test program, outside /tmp (instances have their own)."""
    return mpi_programs("pairs", MPI_PROGRAM)


def in_instance(name, host, *cmd, timeout=30):
    return ivcloud("cluster", "exec", "--name", name, host, "--", *cmd,
                   timeout=timeout)


def mpirun(name, program, np, *opts, timeout=120):
    return ivcloud("cluster", "mpirun", "--name", name, "--timeout", 90,
                   *opts, "-np", np, "--", program, timeout=timeout)


def bml_matrix(output: str, hosts_by_rank: dict) -> dict:
    """{(from host, to host): {btl, ...}} from btl_base_verbose lines."""
    pairs: dict = {}
    for src, btl, dst_rank, dst_host in BML_RE.findall(output):
        assert hosts_by_rank[int(dst_rank)] == dst_host
        if btl != "self":
            pairs.setdefault((src, dst_host), set()).add(btl)
    return pairs


def ranks_hosts(stdout: str) -> dict:
    found = re.findall(r"rank (\d+) of \d+ on (\S+) sum", stdout)
    return {int(r): h for r, h in found}


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("args,words", [
    (["--servers", "0", "--instances-per-server", "1"], "--servers"),
    (["--servers", "1", "--instances-per-server", "0"],
     "--instances-per-server"),
    (["--servers", "1", "--instances-per-server", "1", "--vcpus", "0"],
     "--vcpus"),
    (["--servers", "2", "--instances-per-server", "65", "--vcpus", "16",
      "--oversubscribe"], "peers"),
    (["--servers", "2", "--instances-per-server", "4", "--vcpus", "4"],
     "--oversubscribe"),
    (["--servers", "1", "--instances-per-server", "1", "--uplink-rate",
      "fast"], "bad uplink rate"),
    (["--servers", "x", "--instances-per-server", "1"], "invalid int"),
    (["--servers", "1", "--instances-per-server", "1", "--name", "../x"],
     "bad cluster name"),
    (["--servers", "1", "--instances-per-server", "1", "--run-dir",
      "/tmp/ivcloud-x"], "privately"),
])
def test_bad_input_is_one_line_exit_2(args, words):
    if "--name" not in args:
        args = args + ["--name", new_name()]
    name = args[args.index("--name") + 1]
    line = one_line_error(ivcloud("cluster", "up", *args))
    assert words in line
    assert not (RUN_DIR / f"cluster-{name}").exists()
    assert not Path(f"/tmp/ivcloud-x/cluster-{name}").exists()


def test_non_root_is_refused():
    name = new_name()
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-m", "ivcloud", "cluster", "up", "--name", name,
         "--servers", "1", "--instances-per-server", "1"],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert "needs root" in one_line_error(proc)
    assert not (RUN_DIR / f"cluster-{name}").exists()


def test_other_actions_without_cluster():
    name = new_name()
    for action in (["status"], ["down"], ["mpirun", "-np", "1", "--", "true"],
                   ["exec", "s0i0", "--", "true"]):
        line = one_line_error(ivcloud("cluster", action[0], "--name", name,
                                      *action[1:]))
        assert "not up" in line


def test_isolation_and_status(cluster):
    name, state = cluster(servers=2, instances=2)
    st = ivcloud("cluster", "status", "--name", name, "--json")
    assert st.returncode == 0, st.stderr
    info = json.loads(st.stdout)
    assert info["healthy"] and info["phase"] == "up"
    hosts = {i["hostname"]: i for i in info["instances"]}
    assert sorted(hosts) == ["s0i0", "s0i1", "s1i0", "s1i1"]
    assert all(i["alive"] and i["cpus"] == i["planned_cpus"]
               for i in hosts.values())
    assert [len(s["peers"]) for s in info["servers"]] == [0, 0]
    assert ivcloud("cluster", "status", "--name", name).returncode == 0

    # own hostname, own address on eth0
    for h, rec in hosts.items():
        p = in_instance(name, h, "sh", "-c", "hostname; ip -o -4 addr show "
                        "dev eth0; cat /proc/self/status | grep "
                        "Cpus_allowed_list")
        assert p.returncode == 0, p.stderr
        out = p.stdout.split()
        assert out[0] == h and f"{rec['address']}/16" in out
        assert out[-1] == ",".join(map(str, rec["planned_cpus"]))

    # /dev/shm, /tmp and SysV IPC of s0i0 are not those of s0i1 (same
    # server) nor of the host
    mark = f"ivcloud-{name}"
    p = in_instance(name, "s0i0", "sh", "-c",
                    f"touch /dev/shm/{mark} /tmp/{mark} && ipcmk -M 4096 "
                    f"&& ipcs -m | grep -c 4096")
    assert p.returncode == 0 and p.stdout.strip().endswith("1"), p
    assert in_instance(name, "s0i0", "test", "-e",
                       f"/dev/shm/{mark}").returncode == 0
    for h in ("s0i1", "s1i0"):
        p = in_instance(name, h, "sh", "-c",
                        f"ls /dev/shm /tmp; ipcs -m | grep -c 4096; true")
        assert mark not in p.stdout and p.stdout.split()[-1] == "0", p
    assert not Path(f"/dev/shm/{mark}").exists()
    assert not Path(f"/tmp/{mark}").exists()

    # each instance sees its own server's socket, not the other's, and
    # nothing else of the run dir (state files, other clusters)
    servers_dir = state["servers_dir"]
    for h, rec in hosts.items():
        p = in_instance(name, h, "sh", "-c",
                        f"ls {RUN_DIR}; ls {state['dir']}; ls {servers_dir};"
                        f" echo $IVSHM_SOCKET; "
                        f"test -S $IVSHM_SOCKET && echo socket-ok")
        own = state["servers"][str(rec["server"])]
        assert p.stdout.split() == [f"cluster-{name}", "agent", "servers",
                                    own["name"], own["socket"],
                                    "socket-ok"], p
    p = in_instance(name, "head", "ls", state["dir"])
    assert "agent" in p.stdout.split() and "state.json" in p.stdout.split()

    # instances resolve each other by name and reach each other over TCP
    server = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "exec", "--name", name,
         "s1i1", "--", "python3", "-c",
         "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET,"
         " socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5999)); s.listen(1);"
         " c, a = s.accept(); c.sendall(socket.gethostname().encode());"
         " c.close(); print(a[0])"],
        stdout=subprocess.PIPE, text=True)
    try:
        p = in_instance(name, "s0i0", "python3", "-c",
                        "import socket, time\n"
                        "for _ in range(100):\n"
                        "    try:\n"
                        "        c = socket.create_connection(('s1i1', 5999));"
                        " break\n"
                        "    except OSError: time.sleep(0.05)\n"
                        "print(c.recv(64).decode())")
        assert p.stdout.strip() == "s1i1", p
        assert server.communicate(timeout=30)[0].strip() == "10.251.0.1"
    finally:
        server.kill()
        server.wait()


def test_up_twice_is_refused(cluster):
    name, _ = cluster(servers=1, instances=1)
    line = one_line_error(ivcloud("cluster", "up", "--name", name,
                                  "--servers", "1",
                                  "--instances-per-server", "1"))
    assert "already up" in line
    assert json.loads(ivcloud("cluster", "status", "--name", name,
                              "--json").stdout)["healthy"]


def test_failure_midway_rolls_back():
    """Server s1 cannot start (its region name is taken): the instances
    and server s0 made so far are removed, someone else's file stays."""
    name = new_name()
    squatter = Path(f"/dev/shm/ivcloud-{name}-s1")
    squatter.write_bytes(b"not ours")
    try:
        proc = ivcloud("cluster", "up", "--name", name, "--servers", "2",
                       "--instances-per-server", "1", "--oversubscribe")
        line = one_line_error(proc)
        assert "server s1" in line and "rolled back" in line
        assert squatter.read_bytes() == b"not ours"
        assert not Path(f"/dev/shm/ivcloud-{name}-s0").exists()
        assert_gone(name, {})
    finally:
        squatter.unlink()


def test_down_after_up_killed_halfway():
    name = new_name()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "up", "--name", name,
         "--servers", "3", "--instances-per-server", "4",
         "--oversubscribe"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    path = RUN_DIR / f"cluster-{name}" / "state.json"
    snapshot: dict = {}
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            try:
                snapshot = json.loads(path.read_text())
            except (OSError, ValueError):
                snapshot = {}
            if len([r for r in snapshot.get("holders", {})
                    if r.startswith("s")]) >= 3:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(snapshot.get("holders", {})) >= 3, "up was too quick"
        snapshot = json.loads(path.read_text())
        assert snapshot["phase"] == "building"
        live = [r for r in snapshot["holders"].values()
                if holder.start_time(r["pid"]) == r["start"]]
        assert live, "the killed up left no holders to clean up?"
        assert json.loads(ivcloud("cluster", "status", "--name", name,
                                  "--json").stdout)["healthy"] is False
        down = ivcloud("cluster", "down", "--name", name)
        assert down.returncode == 0, down.stderr
        assert_gone(name, snapshot)
    finally:
        if proc.poll() is None:
            proc.kill()
        if path.parent.exists():
            ivcloud("cluster", "down", "--name", name)


def test_uplink_rate_limits_cross_server_traffic(cluster):
    name, state = cluster(servers=2, instances=2,
                          extra=["--uplink-rate", "20mbit"])
    fabric = state["holders"]["fabric"]["pid"]
    qd = subprocess.run(holder.enter_argv(fabric, ("net",))
                        + ["tc", "qdisc", "show"], capture_output=True,
                        text=True).stdout
    assert qd.count("qdisc tbf") == 4, qd  # both ends of both uplinks

    total = 2_500_000  # 1 s at 20 Mbit/s

    def transfer(src, dst, port):
        rx = subprocess.Popen(
            [sys.executable, "-m", "ivcloud", "cluster", "exec", "--name",
             name, dst, "--", "python3", "-c",
             "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', "
             f"{port})); s.listen(1); c, _ = s.accept(); n = 0; t0 = None\n"
             "while True:\n"
             "    d = c.recv(1 << 16)\n"
             "    if t0 is None: t0 = time.monotonic()\n"
             "    if not d: break\n"
             "    n += len(d)\n"
             "print(n, time.monotonic() - t0)"],
            stdout=subprocess.PIPE, text=True)
        try:
            tx = in_instance(
                name, src, "python3", "-c",
                "import socket, time\n"
                "for _ in range(200):\n"
                "    try:\n"
                f"        c = socket.create_connection(('{dst}', {port}));"
                " break\n"
                "    except OSError: time.sleep(0.02)\n"
                f"c.sendall(bytes({total})); c.close()")
            assert tx.returncode == 0, tx.stderr
            n, secs = rx.communicate(timeout=60)[0].split()
        finally:
            rx.kill()
            rx.wait()
        assert int(n) == total
        return float(secs)

    cross = transfer("s0i0", "s1i0", 6001)
    local = transfer("s0i0", "s0i1", 6002)
    print(f"uplink 20mbit: cross-server {cross:.3f} s, same server {local:.3f} s")
    assert cross > 0.6, cross   # shaped: ~1 s
    assert local < cross / 3, (local, cross)


@pytest.mark.skipif(not HAVE_MPI, reason="Open MPI not installed")
def test_mpi_tcp_across_servers_and_no_vader_between_instances(
        cluster, mpi_program):
    name, _ = cluster(servers=2, instances=2)
    # hello + allreduce, one rank per instance, over tcp
    p = mpirun(name, mpi_program, 4, "--mca", "btl_base_verbose", "100")
    assert p.returncode == 0, p.stdout + p.stderr
    hosts = ranks_hosts(p.stdout)
    assert hosts == {0: "s0i0", 1: "s0i1", 2: "s1i0", 3: "s1i1"}
    assert all(s == "10" for s in re.findall(r"sum (\d+)", p.stdout))
    pairs = bml_matrix(p.stderr + p.stdout, hosts)
    assert len(pairs) == 12 and all(b == {"tcp"} for b in pairs.values())

    # refusals: more ranks than vCPUs, a program instances cannot see
    line = one_line_error(mpirun(name, mpi_program, 5))
    assert "--oversubscribe" in line
    line = one_line_error(mpirun(name, "/tmp", 1))
    assert "does not exist" in line
    hidden = Path(f"/tmp/ivcloud-{name}-prog")
    shutil.copy(mpi_program, hidden)
    try:
        assert "privately" in one_line_error(mpirun(name, hidden, 1))
    finally:
        hidden.unlink()

    # round-robin placement spreads consecutive ranks across servers
    p = mpirun(name, mpi_program, 4, "--placement", "round-robin")
    assert p.returncode == 0, p.stderr
    assert ranks_hosts(p.stdout) == {0: "s0i0", 1: "s1i0", 2: "s0i1",
                                     3: "s1i1"}

    # a rankfile from the placement planner, read from the caller's /tmp
    rankfile = Path(f"/tmp/ivcloud-{name}-rankfile")
    try:
        plan = ivcloud("place", "--cluster", name, "--pattern", "ring",
                       "--ranks", 4, "--partitioner", "spectral",
                       "--out", rankfile)
        assert plan.returncode == 0, plan.stderr
        want = re.findall(r"^rank (\d+)=(\S+) ", rankfile.read_text(), re.M)
        p = mpirun(name, mpi_program, 4, "--rankfile", rankfile)
        assert p.returncode == 0, p.stdout + p.stderr
        assert ranks_hosts(p.stdout) == {int(r): h for r, h in want}
        # hand-written, against the placement's order
        rankfile.write_text("rank 0=s1i1 slot=0\nrank 1=s0i1 slot=0\n"
                            "rank 2=s1i0 slot=0\nrank 3=s0i0 slot=0\n")
        p = mpirun(name, mpi_program, 4, "--rankfile", rankfile)
        assert p.returncode == 0, p.stdout + p.stderr
        assert ranks_hosts(p.stdout) == {0: "s1i1", 1: "s0i1", 2: "s1i0",
                                         3: "s0i0"}
    finally:
        rankfile.unlink(missing_ok=True)

    # shared memory (vader) cannot reach from one instance to another...
    p = mpirun(name, mpi_program, 2, "--btl", "self,vader")
    assert p.returncode != 0 and p.returncode != 124, p.stdout
    assert "unable to reach each other" in p.stdout + p.stderr
    # ...but does inside one: 2 ranks per instance when oversubscribed
    p = mpirun(name, mpi_program, 8, "--oversubscribe", "--mca",
               "btl_base_verbose", "100")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout + p.stderr
    per_host = {}
    for src, btl, _, dst in BML_RE.findall(out):
        if btl != "self":
            per_host.setdefault(src == dst, set()).add(btl)
    assert per_host == {True: {"vader"}, False: {"tcp"}}, per_host


@pytest.mark.skipif(not HAVE_MPI, reason="Open MPI not installed")
def test_ivshmem_reachability_matrix(cluster, mpi_program, native_dir):
    """2 servers x 2 instances, 2 ranks per instance: vader inside an
    instance, ivshmem between instances of one server, tcp across."""
    component = native_dir / "btl" / "mca_btl_ivshmem.so"
    assert component.exists(), f"{component} not built"
    # a build under /tmp (a CI clone) is kept visible inside instances
    assert visible_inside(str(component)), component
    name, state = cluster(servers=2, instances=2)
    p = mpirun(name, mpi_program, 8, "--transport", "ivshmem",
               "--oversubscribe", "--mca", "btl_base_verbose", "100")
    assert p.returncode == 0, p.stdout + p.stderr
    hosts = ranks_hosts(p.stdout)
    assert len(hosts) == 8
    assert sorted(set(hosts.values())) == ["s0i0", "s0i1", "s1i0", "s1i1"]
    server_of = {i["hostname"]: i["server"]
                 for i in state["instances"].values()}
    pairs = bml_matrix(p.stdout + p.stderr, hosts)
    assert len(pairs) == 16, pairs
    for (src, dst), btls in pairs.items():
        want = ("vader" if src == dst else
                "ivshmem" if server_of[src] == server_of[dst] else "tcp")
        assert btls == {want}, (src, dst, btls)
    # the ranks have left their servers again
    info = json.loads(ivcloud("cluster", "status", "--name", name,
                              "--json").stdout)
    assert [len(s["peers"]) for s in info["servers"]] == [0, 0]


def test_down_finds_processes_of_a_dead_instance(cluster):
    """An instance's holder killed from outside: what still runs inside
    (found by namespace and the agent's IVCLOUD_CLUSTER) is stopped."""
    name, state = cluster(servers=1, instances=2)
    job = subprocess.Popen([sys.executable, "-m", "ivcloud", "cluster",
                            "exec", "--name", name, "s0i1", "--", "sleep",
                            "300"])
    try:
        victim = state["holders"]["s0i1"]
        ns = {"net": {state["namespaces"]["s0i1"]["net"]}}
        deadline = time.monotonic() + 20
        while not holder.processes_in(ns, cluster=name):
            assert time.monotonic() < deadline, "sleep never started"
            time.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        st = ivcloud("cluster", "status", "--name", name, "--json")
        assert st.returncode == 1
        dead = [i for i in json.loads(st.stdout)["instances"]
                if not i["alive"]]
        assert [i["hostname"] for i in dead] == ["s0i1"]
        down = ivcloud("cluster", "down", "--name", name)
        assert down.returncode == 0, down.stderr
        assert job.wait(timeout=20) != 0  # its sleep was killed
        assert holder.processes_in(ns, cluster=name) == []
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_down_stops_what_a_dying_process_starts(cluster):
    """A process that starts another while `down` stops it (an orphaned
    mpirun's launch agent did, in CI): the newcomer, unseen by the first
    look, is stopped too, and down succeeds."""
    name, state = cluster(servers=1, instances=2)
    script = "trap 'sleep 300 & exit 0' TERM; while :; do sleep 0.1; done"
    job = subprocess.Popen([sys.executable, "-m", "ivcloud", "cluster",
                            "exec", "--name", name, "s0i1", "--", "sh", "-c",
                            script])
    try:
        ns = {"net": {state["namespaces"]["s0i1"]["net"]}}
        deadline = time.monotonic() + 20
        # its loop's first sleep runs: the trap is set
        while len(holder.processes_in(ns, cluster=name)) < 2:
            assert time.monotonic() < deadline, "the script never started"
            time.sleep(0.05)
        down = ivcloud("cluster", "down", "--name", name)
        assert down.returncode == 0, down.stderr
        assert holder.processes_in(ns, cluster=name) == []
        assert not [p for p in holder.find_by_marker(name)]
    finally:
        if job.poll() is None:
            job.kill()
        job.wait()
