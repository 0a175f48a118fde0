"""`ivcloud` command line against the real daemon and benchmark programs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud import native
from ivcloud.native import Channel


def ivcloud(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.stderr
    return lines[0]


@pytest.fixture
def server(tmp_path, unique):
    """(name, run_dir) of a server this test may start; stopped (or its
    leftovers removed) afterwards whatever happens."""
    run_dir = tmp_path / "run"
    yield unique, run_dir
    ivcloud("server", "stop", "--name", unique, "--run-dir", run_dir)
    region = Path(f"/dev/shm/ivcloud-{unique}")
    if region.exists():
        region.unlink()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- server

def test_server_start_status_stop(server):
    name, run_dir = server
    common = ["--name", name, "--run-dir", run_dir]
    proc = ivcloud("server", "start", *common, "--size", "32M",
                   "--max-peers", "4")
    assert proc.returncode == 0, proc.stderr
    assert f"server '{name}' started" in proc.stdout

    d = run_dir / name
    files = [d / "ivshmem.sock", d / "server.pid", d / "state.json"]
    for f in files:
        assert f.exists(), f
        assert mode(f) == 0o600, (f, oct(mode(f)))
    assert stat.S_ISSOCK(os.lstat(files[0]).st_mode)
    assert mode(d) == 0o700
    # the region is a sealed memfd: no file anyone could open and truncate
    assert not Path(f"/dev/shm/ivcloud-{name}").exists()
    pid = int(files[1].read_text())

    proc = ivcloud("server", "status", *common, "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["running"] and st["pid"] == pid and st["peers"] == []
    assert st["size"] == 32 << 20 and st["socket"] == str(files[0])
    assert st["sealed"] and st["region"] == "memfd (sealed)"

    # a peer attached through the socket shows up in the state file
    with Channel.attach_server(files[0], job_id=1, rank=0, name="p") as ch:
        assert ch.self_slot >= 0
        assert isinstance(ch.server_peers(), list)
        deadline = time.monotonic() + 10
        while True:
            st = json.loads(ivcloud("server", "status", *common,
                                    "--json").stdout)
            if len(st["peers"]) == 1:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        text = ivcloud("server", "status", *common)
        assert text.returncode == 0
        assert f"running (pid {pid})" in text.stdout
        assert "peers   1" in text.stdout
        # the host asks the ranks of one server id (a guest's IVPosition)
        # to drain, through the server's memfd (docs/migration.md)
        region = next(f"/proc/{pid}/fd/{n}" for n in os.listdir(
            f"/proc/{pid}/fd") if os.readlink(
            f"/proc/{pid}/fd/{n}").startswith("/memfd:"))
        me = st["peers"][0]["id"]
        gen = ch.peer(ch.self_slot).generation
        assert native.drain_guest(region, me + 1, 9) == []
        assert ch.drain_requested() == 0
        assert native.drain_guest(region, me, 9) == [(ch.self_slot, gen)]
        assert ch.drain_requested() == 9
        assert native.drain_state(region, ch.self_slot, gen, 9) is None
        ch.drain_ack(9, 0)
        assert native.drain_state(region, ch.self_slot, gen, 9) == 0

    proc = ivcloud("server", "stop", *common)
    assert proc.returncode == 0, proc.stderr
    assert "stopped" in proc.stdout
    for f in files:
        assert not os.path.lexists(f), f
    assert not d.exists()
    # the daemon is really gone
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"


def test_group_shares_socket_and_region(server):
    import grp
    name, run_dir = server
    try:
        group = grp.getgrnam("daemon")
    except KeyError:
        group = grp.getgrgid(os.getgid())
    common = ["--name", name, "--run-dir", run_dir]
    # host-file mode: the region file gets the group too
    proc = ivcloud("server", "start", *common, "--size", "32M", "--group",
                   group.gr_name, "--host-file")
    assert proc.returncode == 0, proc.stderr
    d = run_dir / name
    for f, want in [(d / "ivshmem.sock", 0o660),
                    (Path(f"/dev/shm/ivcloud-{name}"), 0o660),
                    (d / "server.pid", 0o640), (d / "state.json", 0o640)]:
        assert mode(f) == want, (f, oct(mode(f)))
        assert os.lstat(f).st_gid == group.gr_gid, f
    assert ivcloud("server", "stop", *common).returncode == 0
    assert not d.exists()


def test_start_twice_and_stop_twice(server):
    name, run_dir = server
    common = ["--name", name, "--run-dir", run_dir]
    assert ivcloud("server", "start", *common).returncode == 0
    line = assert_one_line_error(ivcloud("server", "start", *common))
    assert "already running" in line
    assert ivcloud("server", "stop", *common).returncode == 0
    line = assert_one_line_error(ivcloud("server", "stop", *common))
    assert "not running" in line
    line = assert_one_line_error(ivcloud("server", "status", *common))
    assert "not running" in line


def test_crashed_server_leftovers_are_cleaned(server):
    name, run_dir = server
    common = ["--name", name, "--run-dir", run_dir]
    # host-file mode: the region file outlives the server (a sealed memfd
    # goes with its last user)
    assert ivcloud("server", "start", *common, "--size", "32M",
                   "--host-file").returncode == 0
    pid = int((run_dir / name / "server.pid").read_text())
    os.kill(pid, 9)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and \
            Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # the region may still be in use by peers: start refuses, stop cleans
    line = assert_one_line_error(ivcloud("server", "start", *common,
                                         "--host-file"))
    assert "exists" in line
    proc = ivcloud("server", "stop", *common)
    assert proc.returncode == 0 and "was not running" in proc.stdout
    assert not (run_dir / name).exists()
    assert not Path(f"/dev/shm/ivcloud-{name}").exists()
    assert ivcloud("server", "start", *common).returncode == 0


@pytest.mark.parametrize("args, words", [
    (["server", "start", "--bogus"], "unrecognized"),
    (["server", "start", "--size", "12Q"], "bad size"),
    (["server", "start", "--size", "48M"], "power of two"),
    (["server", "start", "--size", "4K"], "too small"),
    (["server", "start", "--vectors", "0"], "vectors"),
    (["server", "start", "--vectors", "x"], "invalid int"),
    (["server", "start", "--max-peers", "1025"], "max-peers"),
    (["server", "start", "--queue-slots", "48"], "power of two"),
    (["server", "start", "--fast-channels", "65"], "fast-channels"),
    (["server", "start", "--name", "../evil"], "bad server name"),
    (["server", "start", "--group", "no-such-group-xyz"], "unknown group"),
    (["server", "frobnicate"], "invalid choice"),
    (["server"], "required"),
    ([], "required"),
    (["nosuchcommand"], "invalid choice"),
    (["bench", "p2p", "--sizes", "8,x"], "bad size"),
    (["bench", "p2p", "--iters", "-3"], "positive"),
    (["bench", "apps", "--configs", "tcp,ivshmem"], "must include one"),
    (["bench", "apps", "--configs", "one,rdma"], "rdma"),
    (["bench", "migrate", "--mpi", "openmpi"], "invalid choice"),
    (["bench", "migrate", "--instance-kind", "namespace"], "QEMU guests"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, unique, args, words):
    if args[:2] == ["server", "start"] and "--name" not in args:
        args = args + ["--name", unique]
    if args[:1] == ["server"] and len(args) > 1:
        args = args + ["--run-dir", tmp_path]
    line = assert_one_line_error(ivcloud(*args))
    assert words in line
    assert not Path(f"/dev/shm/ivcloud-{unique}").exists()


def test_console_script_in_venv():
    if sys.prefix == sys.base_prefix:
        pytest.skip("not running from the project venv")
    script = Path(sys.executable).parent / "ivcloud"
    assert script.exists(), "`pip install -e .` did not install `ivcloud`"
    proc = subprocess.run([str(script), "--help"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and "server" in proc.stdout


# ---------------------------------------------------------------- bench

BENCH_FIELDS = {"transport": str, "mode": str, "size": int,
                "latency_us": (int, float), "bandwidth_MBps": (int, float)}


def check_records(records):
    for r in records:
        for key, typ in BENCH_FIELDS.items():
            assert isinstance(r.get(key), typ), (key, r)
        assert r["size"] > 0 and r["latency_us"] > 0, r
        assert r["bandwidth_MBps"] >= 0, r


def test_bench_p2p_quick(tmp_path):
    out = tmp_path / "p2p.json"
    t0 = time.monotonic()
    proc = ivcloud("bench", "p2p", "--quick", "--json", out, "--skip-netns",
                   timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    recs = doc["records"]
    check_records(recs)
    seen = {(r["transport"], r["mode"]) for r in recs}
    for want in [("ivshm", "spin"), ("ivshm", "spin-then-block"),
                 ("ivshm", "put"), ("memcpy", "memcpy"),
                 ("tcp-loopback", "nodelay"), ("mpi-vader", "vader"),
                 ("ivshm-oversub", "spin"), ("ivshm-oversub",
                                             "spin-then-block"),
                 ("ivshm-blocked", "spin-then-block")]:
        assert want in seen, (want, sorted(seen))
    sizes = {r["size"] for r in recs if r["transport"] == "ivshm"}
    assert {8, 1 << 20} <= sizes
    assert any(r["transport"] == "memcpy" and r["size"] >= 1 << 20
               for r in recs)
    for r in recs:
        if r["transport"] == "ivshm-oversub":
            assert r["wall_s"] > 0 and r["pairs"] == 2
        if r["transport"] == "ivshm-blocked":
            assert 0 <= r["cpu_fraction"] <= 1.5
    assert not any(r["transport"] == "tcp-bridge" for r in recs)
    assert len(doc["targets"]) == 6
    for t in doc["targets"]:
        assert t["status"] in ("PASS", "MISS", "N/A")
    # the bridge target has no data with --skip-netns; the others do
    assert [t["status"] == "N/A" for t in doc["targets"]].count(True) == 1
    assert "Targets" in proc.stdout
    assert "tcp-bridge skipped" in proc.stdout
    print(f"bench p2p --quick took {elapsed:.1f} s")
    assert elapsed < 60


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_bench_tcp_bridge_netns():
    from ivcloud import netns
    from ivcloud.bench import p2p

    reason = netns.available()
    assert reason is None, reason
    # a leftover from a run that died is swept by prefix
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netns.list_ours()
        assert stale in netns.cleanup_leftovers()
        assert stale not in netns.list_ours()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)

    settings = p2p.P2pSettings(sizes=[8, 65536], iters=200, budget=8 << 20,
                               pair_trips=10, split_trips=100, wait_ms=10,
                               timeout_s=60, netns=True)
    before = set(netns.list_ours())
    recs = p2p.run_tcp_bridge(settings)
    check_records(recs)
    assert [(r["transport"], r["size"]) for r in recs] == \
        [("tcp-bridge", 8), ("tcp-bridge", 65536)]
    mine = {n for n in netns.list_ours() if f"-{os.getpid()}-" in n}
    assert not mine and set(netns.list_ours()) <= before

    # a failure inside the block still removes everything
    with pytest.raises(RuntimeError):
        with netns.BridgedPair() as net:
            assert net.exists()
            raise RuntimeError("boom")
    assert not net.exists()
