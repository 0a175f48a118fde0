"""`ivcloud cluster migrate`: a QEMU guest of a VM cluster moved to another
emulated server and back (docs/cluster.md, "Migration"; under TCG, as
here, paused for the copy).

One cluster (2 servers x 1 instance x 1 vCPU, TCG, uplinks shaped to
200mbit) is booted once for the module; the tests use it in order: bad
input, s1i0 moved to s0 (its address, ssh and agent still answer, its
device is a peer of s0's region, and a BTL job now runs between the two
guests through it, while nothing of its source is left), a 4-rank MPICH
job over the provider (two ranks in each guest) under which s1i0 moves
to s1 and a 4-rank Intel MPI job under which it moves back (its ranks
drain and take the destination's region, s0i0's pair stays on s0's; a
64 MiB message and an RMA epoch in flight as the drain begins), its move
back refused while a BTL job runs in it (and the move of the guest
running that job's launcher refused) and done once the job ended
(--wait-jobs), an ivshm.env that a killed migration left hidden put
back at the next job's launch, a provider
rank killed while its guest's migration waits for its drain (the job
fails, the migration finds the rank's process gone and is undone within
seconds, nothing is left over), a move whose destination QEMU fails to
start (undone: the guest runs on its source with its device), an
ivshmem job between the two servers (over TCP through the shaped
uplinks) and one whose launching guest is killed, a guest without its
share found out, and `down`, which leaves nothing.
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

from ivcloud.cluster.migrate import BTL_LIBRARY
from ivcloud.mpis import openmpi

# the same requirements as the image tests (root, QEMU, mmdebstrap)
from test_guest_image import pytestmark  # noqa: F401
from vm_support import qemus_naming
# the cluster tests' pingpong and the BTL's exit lines
from test_cluster_vm import PROGRAM as PINGPONG, _counters

RUN_DIR = Path("/var/tmp") / f"ivc-cmig-{os.getpid()}"
NAME = "cmig"

# an allreduce, then asleep for the time given in seconds or until
# RELEASE exists in the rank's guest, whichever comes first (a job that
# is still running when a migration is asked for, and ends when the test
# has seen the migration wait for it)
RELEASE = "/tmp/release"
PROGRAM = r"""
import os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
assert total == comm.size * (comm.size + 1) // 2, total
print("rank", comm.rank, "on", MPI.Get_processor_name(), "allreduce", total,
      flush=True)
end = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 0)
while time.monotonic() < end and not os.path.exists("%s"):
    time.sleep(0.2)
comm.Barrier()
""" % RELEASE
# a provider MPI's job: each turn 4 messages from every rank to every
# other, each checked (its sender, its sequence number in that pair's
# stream, every byte: 64 B, one in 3 64 KiB), an RMA epoch (one put into
# the right neighbour's window after the opening fence, one before the
# closing fence, both checked) around the turn's messages, and an
# allreduce, until /tmp/stop appears in rank 0's guest. Every pair goes
# through the provider, the two ranks of one guest too (MPICH's and
# Intel MPI's own shared memory would take them otherwise): such a pair
# is a pair of one region. While /tmp/big exists in a rank's guest, a
# turn adds a 64 MiB message to the right neighbour (every byte
# checked), and the first rank of that guest (the one whose guest is
# about to move) takes the message to it (having said so in
# /tmp/big.held) only once its guest's ivshm.env is hidden (the drain
# began: the drain request is written right after) and 1 s more, then
# removes both files: that message and the turn's epoch were in flight
# across the drain's start. Each rank counts its big messages and epochs
# and those across a change of (region mapped, ivshm.env hidden).
RING = r"""
import ctypes, faulthandler, os, sys, time
faulthandler.enable()   # a rank's crash says where, on the job's stderr
os.environ["MPIR_CVAR_NOLOCAL"] = "1"   # MPICH
os.environ["I_MPI_FABRICS"] = "ofi"     # Intel MPI
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
right, left = (rank + 1) % size, (rank - 1) % size
peers = [r for r in range(size) if r != rank]
names = comm.allgather(MPI.Get_processor_name())
first = names.index(names[rank]) == rank   # of the ranks of its guest
limit = time.monotonic() + float(sys.argv[1])
BIG, AWAY, HOLD, EACH = 64 << 20, "/run/ivshm/ivshm.env.away", 1.0, 4
def payload(src, seq):
    n = 65536 if seq % 3 == 0 else 64
    return (seq.to_bytes(8, "little") + src.to_bytes(4, "little") +
            bytes([(seq * 31 + src) & 0xff]) * (n - 12))
def where():
    with open("/proc/self/maps") as f:
        return "/resource2" in f.read(), os.path.exists(AWAY)
def stamp(turn, src, k):
    return (turn * 2 + k).to_bytes(8, "little") + src.to_bytes(8, "little")
out, got = dict.fromkeys(peers, 0), dict.fromkeys(peers, 0)
turns = 0
buf = bytearray(65536)
big_in, big_out = bytearray(BIG), bytearray(BIG)
nbig = big_across = epochs = epochs_across = took = 0
mem = bytearray(32)
win = MPI.Win.Create(mem, 1, comm=comm)
big = False
while True:
    win.Fence()
    e0 = where()
    put0 = stamp(turns, rank, 0)   # alive until the fence
    win.Put(put0, right, target=(0, 16, MPI.BYTE))
    if big:
        fill = (nbig * 37 + rank) & 0xff
        ctypes.memset((ctypes.c_char * BIG).from_buffer(big_out), fill, BIG)
        big_out[:16] = nbig.to_bytes(8, "little") + rank.to_bytes(8, "little")
        b0 = where()
        sreq = comm.Isend(big_out, dest=right, tag=9)
        if first and os.path.exists("/tmp/big"):
            open("/tmp/big.held", "w").close()   # the test moves it now
            end = time.monotonic() + 120
            while not os.path.exists(AWAY) and time.monotonic() < end:
                comm.Iprobe(source=MPI.ANY_SOURCE, tag=9)
                time.sleep(0.01)
            end = min(end, time.monotonic() + HOLD)
            while time.monotonic() < end:
                comm.Iprobe(source=MPI.ANY_SOURCE, tag=9)
                time.sleep(0.01)
            for f in ("/tmp/big", "/tmp/big.held"):
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
        st = MPI.Status()
        t0 = time.monotonic()
        comm.Recv(big_in, source=left, tag=9, status=st)
        took = max(took, time.monotonic() - t0)
        sreq.Wait()
        want = (nbig * 37 + left) & 0xff
        assert st.Get_count(MPI.BYTE) == BIG and \
            big_in[:16] == nbig.to_bytes(8, "little") + \
            left.to_bytes(8, "little") and \
            big_in.count(bytes([want]), 16) == BIG - 16, (rank, nbig)
        big_across += where() != b0
        nbig += 1
    msgs = [(p, payload(rank, out[p] + k)) for p in peers
            for k in range(EACH)]
    reqs = [comm.Isend(m, dest=p, tag=7) for p, m in msgs]
    for p in peers:
        out[p] += EACH
    for p in peers:
        for k in range(EACH):
            st = MPI.Status()
            comm.Recv(buf, source=p, tag=7, status=st)
            assert bytes(buf[:st.Get_count(MPI.BYTE)]) == \
                payload(p, got[p]), (rank, p, got[p])
            got[p] += 1
    MPI.Request.Waitall(reqs)
    put1 = stamp(turns, rank, 1)   # alive until the fence
    win.Put(put1, right, target=(16, 16, MPI.BYTE))
    win.Fence()
    assert bytes(mem) == stamp(turns, left, 0) + stamp(turns, left, 1), \
        (rank, turns, bytes(mem))
    epochs_across += where() != e0
    epochs += 1
    stop = rank == 0 and (os.path.exists("/tmp/stop") or
                          time.monotonic() > limit)
    x = comm.allreduce((rank + 1) | int(stop) << 20 |
                       int(os.path.exists("/tmp/big")) << 24)
    assert x & 0xfffff == size * (size + 1) // 2, x
    turns += 1
    big = x >> 24 > 0
    if x >> 20 & 0xf:
        break
win.Free()
print("rank", rank, "pid", os.getpid(), "on", MPI.Get_processor_name(),
      "turns", turns, "received", sum(got.values()), "in order", "big", nbig,
      "across", big_across, "epochs", epochs, "across", epochs_across,
      "longest big receive %.1f s" % took, flush=True)
"""
PHASES = ("unplug", "tap", "start", "migrate", "plug", "switch", "bind",
          "attach", "record")


def ivcloud(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          **kw)


def cluster(action, *args, name=NAME, timeout=600, **kw):
    return ivcloud("cluster", action, "--name", name, "--run-dir", RUN_DIR,
                   *args, timeout=timeout, **kw)


def state():
    return json.loads((RUN_DIR / f"cluster-{NAME}" / "state.json"
                       ).read_text())


def status():
    r = cluster("status", "--json", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def fabric_links():
    pid = state()["holders"]["fabric"]["pid"]
    return subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-o",
                           "link"], capture_output=True, text=True,
                          check=True).stdout


def guest_sh(host, script, timeout=60):
    r = cluster("exec", host, "--", "sh", "-c", script, timeout=timeout)
    assert r.returncode == 0, (host, r.stdout + r.stderr)
    return r.stdout


def position(host):
    """The IVPosition of the guest's default device (ivshm-bind's)."""
    out = guest_sh(host, ". /run/ivshm/ivshm.env && echo pos=$IVSHM_POSITION"
                         " && systemctl is-active ivshm-bind@$IVSHM_PCI")
    m = re.search(r"pos=(\d+)\nactive", out)
    assert m, out
    return int(m.group(1))


def assert_on(host, server, other):
    """`host` runs on server `server` with its device on that server's
    region, and nothing of it is left on server `other`."""
    info = status()
    assert info["healthy"], info
    inst = {i["hostname"]: i for i in info["instances"]}[host]
    assert inst["server"] == server and inst["alive"], inst
    # pinned to its own planned CPUs, as before the move
    assert inst["cpus"] == inst["planned_cpus"], inst
    peers = {s["index"]: [p["id"] for p in s["peers"]]
             for s in info["servers"]}
    assert position(host) in peers[server], (peers, host)
    # one peer per guest on the server: the other guest's, if it is there
    here = [i for i in info["instances"] if i["server"] == server]
    assert len(peers[server]) == len(here), (peers, here)
    assert len(peers[other]) == len([i for i in info["instances"]
                                     if i["server"] == other]), peers
    # one QEMU per guest; the guest's tap and directory, no other
    qemus = qemus_naming(RUN_DIR / f"cluster-{NAME}")
    assert sorted(qemus) == sorted(i["pid"] for i in info["instances"])
    rec = state()["vms"][host]
    vm_root = RUN_DIR / f"cluster-{NAME}" / "vm"
    dirs = sorted(p.name for p in vm_root.iterdir() if p.is_dir())
    assert dirs == sorted(Path(v["dir"]).name
                          for v in state()["vms"].values()), dirs
    taps = re.findall(r"\d+: (t-[a-z0-9]+)[@:]", fabric_links())
    assert sorted(taps) == sorted(v["tap"] for v in state()["vms"].values())
    assert rec["tap"] in state()["links"]
    # the guest keeps its address on the shared segment, answers its
    # agent and ssh both ways
    out = guest_sh(host, "hostname; ip -4 -o addr show scope global; "
                         "runuser -u mpi -- ssh -o BatchMode=yes s0i0 "
                         "hostname")
    assert out.startswith(f"{host}\n") and "10.251.1.1/16" in out, out
    assert out.rstrip().endswith("s0i0"), out
    out = guest_sh("s0i0", f"runuser -u mpi -- ssh -o BatchMode=yes {host} "
                           f"hostname")
    assert out.strip() == host, out


@pytest.fixture(scope="module")
def vmc(guest_deb):
    t0 = time.monotonic()
    # shaped uplinks: test_two_servers_go_over_the_uplinks
    r = cluster("up", "--servers", 2, "--instances-per-server", 1,
                "--vcpus", 1, "--instance-kind", "vm", "--guest-deb",
                guest_deb, "--accel", "tcg", "--oversubscribe",
                # two ring ranks in a guest, each holding 2 x 64 MiB
                # and its MPI's copies
                "--vm-memory", 1280,
                "--uplink-rate", "200mbit")
    assert r.returncode == 0, r.stderr + r.stdout
    print(f"\ncluster up --instance-kind vm (2x1x1, tcg): "
          f"{time.monotonic() - t0:.0f} s")
    for name, text in (("prog", PROGRAM), ("ring", RING)):
        code = base64.b64encode(text.encode()).decode()
        for host in ("s0i0", "s1i0"):
            guest_sh(host, f"echo {code} | base64 -d > /tmp/{name}.py && "
                           f"chmod 644 /tmp/{name}.py")
    try:
        yield NAME
    finally:
        if (RUN_DIR / f"cluster-{NAME}").exists():
            cluster("down", timeout=180)
        for pid in qemus_naming(RUN_DIR):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(RUN_DIR, ignore_errors=True)


def one_line(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_bad_input(vmc):
    for args, word in ((["nosuch", "--to", "s0"], "nosuch"),
                       (["s1i0", "--to", "s7"], "s7"),
                       (["s1i0", "--to", "1"], "on server s1 already"),
                       (["s1i0", "--to", "m1-s1"], "no server"),
                       (["s1i0"], "--to")):
        r = cluster("migrate", *args, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert word in one_line(r), (args, r.stderr)
    r = cluster("migrate", "s1i0", "--to", "s0", name="nosuchcluster",
                timeout=60)
    assert r.returncode == 2 and "not up" in one_line(r)
    # a cluster of namespace instances
    r = cluster("up", "--servers", 2, "--instances-per-server", 1,
                name="cmigns", timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        r = cluster("migrate", "s1i0", "--to", "s0", name="cmigns",
                    timeout=60)
        assert r.returncode == 2 and "namespace" in one_line(r), r.stderr
    finally:
        r = cluster("down", name="cmigns", timeout=120)
    assert r.returncode == 0, r.stderr
    # nothing was touched
    assert_untouched()


def assert_untouched():
    info = status()
    assert [(i["hostname"], i["server"]) for i in info["instances"]] == \
        [("s0i0", 0), ("s1i0", 1)]
    assert [len(s["peers"]) for s in info["servers"]] == [1, 1]


def _migrate(*args, timeout=600, **kw):
    t0 = time.monotonic()
    r = cluster("migrate", *args, timeout=timeout, **kw)
    # each step's time (its line says when it began, from the start)
    steps = re.findall(r"^migrate \S+: (\w+) \(([\d.]+) s\)$", r.stderr,
                       re.M)
    print(f"\nmigrate {' '.join(map(str, args))}: rc {r.returncode}, "
          f"{time.monotonic() - t0:.1f} s; {r.stdout.strip()}" +
          ("\n  steps at " + " ".join(f"{name} {at}" for name, at in steps)
           if steps else ""))
    return r


def _btl_job(*args, timeout=600):
    return cluster("mpirun", "--transport", "ivshmem", "--btl",
                   "self,ivshmem", "--verbose-btl", "-np", 2, "--",
                   "python3", "/tmp/prog.py", *args, timeout=timeout)


def test_there(vmc):
    before = state()["vms"]["s1i0"]
    r = _migrate("s1i0", "--to", "s0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.match(r"s1i0 moved from s1 to s0 in [\d.]+ s \(QEMU: "
                    r"downtime \d+ ms, total \d+ ms\)$", r.stdout.strip()), \
        r.stdout
    for phase in PHASES:
        assert re.search(rf"^migrate s1i0: {phase} \([\d.]+ s\)$", r.stderr,
                         re.M), (phase, r.stderr)
    assert re.search(r"downtime \d+ ms", r.stderr), r.stderr
    # under TCG the copy is not live (docs/cluster.md, "Migration", step
    # 6): the guest's downtime is the migration's whole time
    assert re.search(r"downtime \d+ ms \(paused for the copy: TCG\)",
                     r.stderr), r.stderr
    down, total = re.search(r"downtime (\d+) ms, total (\d+) ms",
                            r.stdout).groups()
    assert down == total, r.stdout
    # the source's QEMU is gone, its directory and tap with it
    assert not Path(f"/proc/{before['pid']}").exists() or \
        before["pid"] not in qemus_naming(RUN_DIR)
    assert not Path(before["dir"]).exists()
    assert_on("s1i0", 0, 1)
    # both guests on s0 now: a BTL job between them goes through its
    # region, both ways
    r = _btl_job(timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1 on s1i0 allreduce 3" in r.stdout, r.stdout
    counters = openmpi.parse_btl_counters(r.stdout + r.stderr)
    assert sorted(counters) == [0, 1], r.stdout + r.stderr
    for rank, c in counters.items():
        assert c["sent_msgs"] > 0 and c["recv_msgs"] > 0, (rank, c)


def _wait_rank(host, job, what="python"):
    deadline = time.monotonic() + 180
    while cluster("exec", host, "--", "pgrep", "-u", "mpi", what,
                  timeout=60).returncode != 0:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, \
            f"the job's rank in {host} never started"
        time.sleep(1)


def _guest_evidence():
    """What the guests' kernels (an oops, a rank's segfault or OOM kill
    line) and their QEMUs said, printed before the module's `down`
    removes the consoles and logs; a guest that died answers nothing,
    its console still there."""
    for host in ("s0i0", "s1i0"):
        try:
            r = cluster("exec", host, "--", "sh", "-c",
                        "dmesg | tail -n 80; free -m", timeout=60)
            said = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            said = "(its agent did not answer within 60 s)"
        print(f"\n--- {host}: dmesg\n{said}")
    for d in sorted((RUN_DIR / f"cluster-{NAME}" / "vm").glob("*/")):
        for name in ("console.log", "qemu.log"):
            try:
                lines = (d / name).read_text(errors="replace").splitlines()
            except OSError:
                continue
            print(f"\n--- {d.name}/{name}\n" + "\n".join(lines[-80:]))


def _ring_job(mpi, *args, np=2):
    from ivcloud.mpis import flavor
    python = str(flavor(mpi).prefix() / "bin" / "python")
    guest_sh("s0i0", "rm -f /tmp/stop")
    guest_sh("s1i0", "rm -f /tmp/big /tmp/big.held")
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
         NAME, "--run-dir", str(RUN_DIR), "--mpi", mpi, "--transport",
         "ivshmem", *args, "-np", str(np), "--", python, "/tmp/ring.py",
         "900"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


RING_END = (r"rank (\d) pid (\d+) on (s\di0) turns \d+ received \d+ in order "
            r"big (\d+) across (\d+) epochs (\d+) across (\d+) ")


@pytest.mark.parametrize("mpi", ["mpich", "impi"])
def test_provider_job_moves_along(vmc, mpi):
    """A 4-rank job of a provider MPI over the provider, two ranks in
    each guest (s0i0: ranks 0 and 2, s1i0: 1 and 3): s1i0 moves to the
    other server under it, under the MPICH job from s0 to s1 (its ranks
    leave the region of all four for s1's, where they are a pair of one
    region again), under the Intel MPI job back (from a region of their
    own to the one of s0i0's ranks, all four pairs across the guests
    taking the region). The mover's ranks let go of their region
    (drain), talk over the core while away, and take the destination's
    region; s0i0's pair stays on s0's region throughout, and the pairs
    across the guests change path once each. Every message of every
    pair, 64 MiB ones included, and every put of the RMA epochs arrives
    once, in order, intact, and the job exits 0 (docs/migration.md).
    The drain begins while a 64 MiB message to the mover and an RMA
    epoch are in flight (RING)."""
    try:
        _moves_along(mpi)
    except BaseException:
        _guest_evidence()
        raise


def _moves_along(mpi):
    from ivcloud.mpis import provider
    src = {i["hostname"]: i["server"] for i in status()["instances"]}["s1i0"]
    dest = 1 - src
    # one rank per vCPU would put both ranks in s0i0: two in each guest,
    # alternating (the ranks' own lines say where each runs)
    job = _ring_job(mpi, "--report-transport", "--oversubscribe", np=4)
    try:
        _wait_rank("s1i0", job)
        time.sleep(3)   # some turns on the regions
        # the next turn's 64 MiB message held by s1i0's first rank until
        # the drain began
        guest_sh("s1i0", "runuser -u mpi -- touch /tmp/big && "
                         "for i in $(seq 300); do [ -e /tmp/big.held ] "
                         "&& exit 0; sleep 0.2; done; exit 1",
                 timeout=120)
        r = _migrate("s1i0", "--to", f"s{dest}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"drain: 2 ranks moved to the core$", r.stderr,
                         re.M), r.stderr
        if job.poll() is not None:
            out, err = job.communicate()
            pytest.fail(f"the job ended ({job.returncode}) under the "
                        f"migration:\n{out}\n{err}")
        # the mover's ranks take the destination's region on their own
        # (docs/migration.md, "Core back to region"): both mapped, then
        # some turns there
        guest_sh("s1i0", "for i in $(seq 600); do n=0; for p in $(pgrep "
                         "-u mpi -f /tmp/ring.py); do grep -qs /resource2 "
                         "/proc/$p/maps && n=$((n+1)); done; [ $n -ge 2 ] "
                         "&& exit 0; sleep 0.1; done; exit 1", timeout=120)
        time.sleep(5)
        guest_sh("s0i0", "touch /tmp/stop")
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            # what the job said until then (a hang's last words)
            out, err = job.communicate()
            print(f"\njob killed:\n{out}\n{err}")
    assert job.returncode == 0, out + err
    ends = re.findall(RING_END, out)
    print("\n" + "\n".join(re.findall(r"rank \d pid .*", out)))
    where = {int(rank): host for rank, _, host, *_ in ends}
    assert where == {0: "s0i0", 1: "s1i0", 2: "s0i0", 3: "s1i0"}, out + err
    # one 64 MiB message each way round the ring; the one to the mover's
    # first rank (1) and the epoch around it in flight when the drain
    # began (or the region went)
    for rank, _, host, big, big_across, epochs, epochs_across in ends:
        assert int(big) == 1 and int(epochs) > 2, (rank, out)
        if rank == "1":
            assert int(big_across) == 1 and int(epochs_across) >= 1, \
                (rank, out)
    # the report lines of the ranks (pids in the two guests may be
    # equal, never in one): the mover's ranks drained once and took the
    # destination's region; s0i0's each switched the pairs with the two
    # movers, and only those: its pair stayed on s0's region
    pids = {int(pid) for _, pid, *_ in ends}
    lines = [m.group(0) for m in re.finditer(r"fi_ivshm: pid (\d+) sent .*",
                                             err)
             if int(m.group(1)) in pids]
    print("\n".join(lines))
    assert len(lines) == 4, err
    moved = [re.search(r"drained (\d+) switched (\d+) rejoined (\d+)"
                       r"(?: phases (\S+))?", line) for line in lines]
    assert all(moved), lines
    movers = [(line, m) for line, m in zip(lines, moved) if m.group(1) != "0"]
    stayers = [(line, m) for line, m in zip(lines, moved) if m.group(1) == "0"]
    assert len(movers) == 2 and len(stayers) == 2, lines
    for line, m in stayers:
        assert m.group(2) == "2" and m.group(3) == "0" and not m.group(4), \
            line
        counts = next(iter(provider.parse_reports(line).values()))
        assert counts["sent"] > 0 and counts["delegated"] > 0, line
    for line, m in movers:
        assert m.group(1) == "1" and m.group(3) == "1", line
        phases = [tuple(map(int, p.split("/")))
                  for p in m.group(4).split(",")]
        # (region messages sent/core messages sent): over the region
        # before the drain (to the guest's other rank at least), over the
        # core only while away, over the destination's region after (to
        # the other rank again, there)
        assert len(phases) == 3, line
        assert phases[0][0] > 0 and phases[2][0] > 0, line
        assert phases[1][0] == 0 and phases[1][1] > 0, line
    assert_on("s1i0", dest, src)


def test_back_refused_for_a_btl_job_then_waited_for(vmc):
    for host in ("s0i0", "s1i0"):
        guest_sh(host, f"rm -f {RELEASE}")
    job = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
         NAME, "--run-dir", str(RUN_DIR), "--transport", "ivshmem", "-np",
         "2", "--", "python3", "/tmp/prog.py", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mig = None
    try:
        deadline = time.monotonic() + 180
        # until its rank in s1i0 has loaded the BTL (what the drain
        # looks for), not a guess of how long that takes
        while True:
            r = cluster("exec", "s1i0", "--", "sh", "-c",
                        f"grep -qsF {BTL_LIBRARY} /proc/[0-9]*/maps",
                        timeout=60)
            if r.returncode == 0:
                break
            assert job.poll() is None and time.monotonic() < deadline, \
                "the job's rank in s1i0 never loaded the BTL"
            time.sleep(0.5)
        r = _migrate("s1i0", "--to", "s1", timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        line = one_line(r)
        assert "ivshmem BTL" in line and "/tmp/prog.py 60" in line, line
        assert re.search(r"job \[\d+,\d+\] rank 1 \(pid \d+", line), line
        assert job.poll() is None   # the job was left alone
        # the guest that runs the job's launcher (the first) stays too:
        # the job is followed through its QEMU
        r = _migrate("s0i0", "--to", "s1", timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        line = one_line(r)
        assert "s0i0' runs a job's launcher" in line, line
        assert f"`ivcloud` pid {job.pid} (pid " in line, line
        assert "/tmp/prog.py 60" in line, line
        assert job.poll() is None
        # the migration waits for the job, which ends (released, not
        # its 60 s waited out) once the migration said it waits
        t0 = time.monotonic()
        mig = subprocess.Popen(
            [sys.executable, "-m", "ivcloud", "cluster", "migrate", "--name",
             NAME, "--run-dir", str(RUN_DIR), "s1i0", "--to", "s1",
             "--wait-jobs", "300"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = []
        for line in mig.stderr:
            said.append(line)
            if "drain: waiting for job [" in line:
                break
        assert "drain: waiting for job [" in "".join(said), "".join(said)
        assert job.poll() is None   # it was waited for, not ended
        for host in ("s0i0", "s1i0"):
            guest_sh(host, f"touch {RELEASE}")
        mout, merr = mig.communicate(timeout=600)
        merr = "".join(said) + merr
        print(f"\nmigrate s1i0 --to s1 --wait-jobs 300: rc "
              f"{mig.returncode}, {time.monotonic() - t0:.1f} s; "
              f"{mout.strip()}")
        assert mig.returncode == 0, mout + merr
        out, err = job.communicate(timeout=60)
    finally:
        for p in (job, mig):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert job.returncode == 0, out + err
    assert "rank 1 on s1i0 allreduce 3" in out, out
    assert_on("s1i0", 1, 0)
    assert_untouched()


def guest_env(host):
    """(whether the guest's ivshm.env is there, hidden, and hidden by the
    host's record)."""
    from ivcloud.cluster import migrate as mig
    out = guest_sh(host, f"ls {mig.GUEST_ENV} {mig.AWAY_ENV} 2>/dev/null;"
                         f" true").split()
    d = Path(state()["vms"][host]["dir"])
    return (mig.GUEST_ENV in out, mig.AWAY_ENV in out,
            (d / mig.HIDDEN).exists())


def test_hidden_env_is_put_back(vmc):
    """A migration killed after its drain hid the guest's ivshm.env (so
    that no rank attached the device again) and before its unplug leaves
    it hidden: the drain, run here as the migration runs it (no rank is
    there to ask), then nothing. The next job's launch puts it back."""
    from ivcloud.cluster import migrate as mig
    st = state()
    rec = st["vms"]["s1i0"]
    mig.drain_ranks(st, "s1i0", Path(rec["dir"]) / "agent.sock",
                    rec["device"], print)
    assert guest_env("s1i0") == (False, True, True)
    r = cluster("mpirun", "-np", 1, "--", "hostname", timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "s0i0", \
        r.stdout + r.stderr
    assert guest_env("s1i0") == (True, False, False)
    assert_untouched()


def test_hidden_env_never_replaces_a_fresh_one(vmc):
    """A hidden ivshm.env that a bind has written anew since (a rollback
    that plugged the device again) is stale: healing drops it and keeps
    the fresh one."""
    from ivcloud.cluster import migrate as mig
    st = state()
    rec = st["vms"]["s1i0"]
    mig.drain_ranks(st, "s1i0", Path(rec["dir"]) / "agent.sock",
                    rec["device"], print)
    guest_sh("s1i0", f"cp {mig.AWAY_ENV} {mig.GUEST_ENV} && "
                     f"echo '# fresh' >> {mig.GUEST_ENV}")
    mig.heal(state())
    assert guest_env("s1i0") == (True, False, False)
    assert "# fresh" in guest_sh("s1i0", f"cat {mig.GUEST_ENV}")
    assert_untouched()


def test_rank_killed_during_the_drain(vmc):
    """An MPICH job over the provider; its rank in s1i0, stopped so that
    it cannot answer, is killed once the migration of s1i0 asked it to
    drain. The job fails within a bound; the migration completes or is
    undone, and says which: undone within 20 s of the kill once its
    drain's look at the guest's processes finds the rank gone; nothing
    of the job or the migration is left (assert_on: QEMUs, taps,
    directories, peers, the guest's ivshm.env; no process of the job, no
    chardev of a device that is gone)."""
    from ivcloud.cluster import migrate as mig
    from ivcloud.vm import qemu
    job = _ring_job("mpich")
    mig_p = None
    try:
        _wait_rank("s1i0", job)
        time.sleep(5)   # attached to s1's region
        guest_sh("s1i0", "pkill -STOP -u mpi -f /tmp/ring.py")
        mig_p = subprocess.Popen(
            [sys.executable, "-m", "ivcloud", "cluster", "migrate", "--name",
             NAME, "--run-dir", str(RUN_DIR), "s1i0", "--to", "s0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not guest_env("s1i0")[1]:   # the drain began
            assert mig_p.poll() is None and time.monotonic() < deadline, \
                mig_p.communicate()
            time.sleep(0.5)
        time.sleep(2)   # the request is written right after
        guest_sh("s1i0", "pkill -KILL -u mpi -f /tmp/ring.py")
        t0 = time.monotonic()
        out, err = job.communicate(timeout=180)
        print(f"\njob ended {time.monotonic() - t0:.1f} s after the kill")
        mout, merr = mig_p.communicate(timeout=600)
        ended = time.monotonic() - t0
        print(f"migrate ended {ended:.1f} s after the kill")
    finally:
        for p in (job, mig_p):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert job.returncode not in (0, None), out + err
    last = merr.strip().splitlines()[-1]
    print(f"migrate: rc {mig_p.returncode}: {last}")
    if mig_p.returncode == 0:
        assert "s1i0 moved from s1 to s0" in mout, mout + merr
        assert_on("s1i0", 0, 1)
        r = _migrate("s1i0", "--to", "s1")   # back, for what follows
        assert r.returncode == 0, r.stdout + r.stderr
    else:
        # found dead at the drain's look at its processes (every
        # DRAIN_LIVENESS_S), not at its DRAIN_ACK_S bound
        assert mig_p.returncode == 1 and "step 'drain'" in last and \
            "of the device died in the guest" in last and \
            "nothing was changed" in last, merr
        assert ended < 20, ended
    assert_on("s1i0", 1, 0)
    assert_untouched()
    for host in ("s0i0", "s1i0"):
        r = cluster("exec", host, "--", "pgrep", "-u", "mpi", timeout=60)
        assert r.returncode == 1, (host, r.stdout)
        with qemu.Qmp(Path(state()["vms"][host]["dir"]) / "qmp.sock",
                      30) as q:
            chardevs = [c["label"] for c in q.execute("query-chardev")]
        assert chardevs.count(qemu.BOOT_DEVICE) == 1, chardevs
    assert guest_env("s1i0") == (True, False, False)


def test_failed_destination_is_rolled_back(vmc, tmp_path):
    """A destination QEMU that does not start: the step is named, every
    step before it undone, and the guest runs on its source with its
    device (bound again: a BTL job through it would need a peer on
    s1)."""
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text("#!/bin/sh\necho 'qemu-system-x86_64: cannot take this "
                    "guest' >&2\nexit 1\n")
    fake.chmod(0o755)
    before = state()["vms"]["s1i0"]
    r = _migrate("s1i0", "--to", "s0",
                 env={**os.environ, "IVCLOUD_QEMU": str(fake)})
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "step 'start'" in last and "cannot take this guest" in last, last
    assert "rolled back, the guest runs on s1" in last, last
    for what in ("the destination QEMU stopped", "the source resumed",
                 "the destination's tap deleted",
                 "the source's device plugged again"):
        assert f"rolled back: {what}" in r.stderr, (what, r.stderr)
    after = state()["vms"]["s1i0"]
    assert (after["pid"], after["dir"], after["tap"]) == \
        (before["pid"], before["dir"], before["tap"])
    assert not (Path(before["dir"]).parent / "s1i0.s0").exists()
    assert_on("s1i0", 1, 0)
    assert_untouched()


def test_two_servers_go_over_the_uplinks(vmc):
    """One guest per server, shaped uplinks: the ranks are in different
    regions, so an ivshmem job's traffic goes over TCP through the
    servers' bridges, uplinks and the core bridge (its BTL counters stay
    at zero). Then the guest running mpirun itself dies: the launcher
    loses its agent, ends with one line, and the rank in the other guest
    goes. Last before `down`, which must clean up after the dead guest."""
    assert_untouched()
    code = base64.b64encode(PINGPONG.encode()).decode()
    for host in ("s0i0", "s1i0"):
        guest_sh(host, f"echo {code} | base64 -d > /tmp/pingpong.py && "
                       f"chmod 644 /tmp/pingpong.py")
    r = cluster("mpirun", "--transport", "ivshmem", "--verbose-btl",
                "-np", 2, "--", "python3", "/tmp/pingpong.py", 5,
                timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1 on s1i0 allreduce 3 pingpong ok 5" in r.stdout
    assert _counters(r.stdout + r.stderr) == {0: (0, 0), 1: (0, 0)}, \
        (r.stdout + r.stderr)
    job = subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
         NAME, "--run-dir", str(RUN_DIR), "-np", "2", "--", "python3",
         "/tmp/pingpong.py", "1", "600"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while cluster("exec", "s1i0", "--", "pgrep", "-u", "mpi", "python3",
                      timeout=60).returncode != 0:
            assert time.monotonic() < deadline, \
                "the job's rank on s1i0 never started"
            time.sleep(0.5)
        os.kill(state()["vms"]["s0i0"]["pid"], signal.SIGKILL)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 1, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    r = cluster("exec", "s1i0", "--", "pgrep", "-u", "mpi", timeout=60)
    assert r.returncode == 1, r.stdout


def test_guest_without_its_share_is_found_out(vmc):
    """The host's MPIs, which the guests mount at boot (their ready
    script only prints a line when the mount fails): the check that
    makes a guest without them an error at cluster start names the
    share."""
    from ivcloud.vm.share import Share
    share = Share.from_dict(state()["vm_boot"]["share"])
    assert share, "the guests have no share of the host's MPIs"
    d = Path(state()["vms"]["s1i0"]["dir"])
    assert share.unmounted(d) is None
    guest_sh("s1i0", f"umount -l {share.path}")
    why = share.unmounted(d)
    assert why and why.startswith(f"the share {share.path} is not "
                                  f"mounted ("), why


def test_down_leaves_nothing(vmc):
    fabric = state()["holders"]["fabric"]["pid"]
    r = cluster("down", timeout=180)
    assert r.returncode == 0, r.stderr
    assert not qemus_naming(RUN_DIR / f"cluster-{NAME}")
    assert not (RUN_DIR / f"cluster-{NAME}").exists()
    try:
        st = Path(f"/proc/{fabric}/stat").read_text()
    except OSError:
        st = ") X"
    assert st[st.rindex(")") + 2:].split()[0] in ("Z", "X"), st
    assert not Path(f"/dev/shm/ivcloud-{NAME}-s0").exists()
    out = subprocess.run(["ip", "-o", "link"], capture_output=True,
                         text=True).stdout
    assert "t-s0i" not in out and "t-s1i0" not in out
