"""One region per job on an emulated server (a region is one trust
domain): two jobs running at once on the same server each get their own
ivshmem-server and region, each region holds only its own job's ranks,
and everything of a job is gone when it ends, or at `cluster down` when
its launcher was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ivcloud import server as server_mod
from ivcloud.cluster import regions
from ivcloud.mpis.openmpi import parse_btl_counters

from test_cluster import cluster, ivcloud, wait_for  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="cluster tests need root")

# Each rank exchanges a message with the other, says which socket it was
# given, then waits for GO (a file) so that the two jobs overlap.
HOLD_PROGRAM = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    int rank, size, token = -1;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int peer = rank ^ 1;
    MPI_Sendrecv(&rank, 1, MPI_INT, peer, 7, &token, 1, MPI_INT, peer, 7,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    const char *sock = getenv("IVSHM_SOCKET");
    printf("rank %d socket %s token %d\n", rank, sock ? sock : "-", token);
    fflush(stdout);
    for (int i = 0; i < 600 && access(argv[1], F_OK) != 0; i++)
        usleep(100000);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return token == peer ? 0 : 1;
}
"""


@pytest.fixture(scope="module")
def hold_program(mpi_programs):
    return mpi_programs("hold", HOLD_PROGRAM).parent


def _start_job(name, program, go, *opts, output=subprocess.PIPE):
    return subprocess.Popen(
        [sys.executable, "-m", "ivcloud", "cluster", "mpirun", "--name",
         name, "--transport", "ivshmem", "--verbose-btl", "--timeout", "90",
         *opts, "-np", "2", "--", str(program), str(go)],
        stdin=subprocess.DEVNULL, stdout=output, stderr=output, text=True)


def _job_servers(name, state):
    return regions.job_dirs(Path(state["servers_dir"]),
                         state["servers"]["0"]["name"])


def _server_gone(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return True
    return comm != "ivshmem-server" or stat.rsplit(")", 1)[1].split()[0] == "Z"


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_two_jobs_on_one_server_get_separate_regions(cluster, hold_program):
    name, state = cluster(servers=1, instances=2, vcpus=1)
    go = hold_program / "go"
    go.unlink(missing_ok=True)
    a = _start_job(name, hold_program / "hold", go)
    b = _start_job(name, hold_program / "hold", go)
    try:
        dirs = wait_for(lambda: len(_job_servers(name, state)) == 2
                     and _job_servers(name, state), 60, "two job servers")

        def peers_of_each():
            out = []
            for d in dirs:
                info = server_mod.status(server_mod.paths_for(d.name,
                                                              str(d.parent)))
                out.append(info.get("peers") or [])
            return all(len(p) == 2 for p in out) and out

        # four ranks run on this server: each region has its own job's two
        # (a shared region would hold all four)
        wait_for(peers_of_each, 60, "both jobs' ranks to join")
        # the standing region of the server has none of them
        standing = server_mod.status(server_mod.paths_for(
            state["servers"]["0"]["name"], state["servers_dir"]))
        assert not (standing.get("peers") or []), standing
    finally:
        go.write_text("go")
        outs = [p.communicate(timeout=120) for p in (a, b)]
    sockets = []
    for (out, err), proc in zip(outs, (a, b)):
        assert proc.returncode == 0, err
        counters = parse_btl_counters(out + err)
        assert set(counters) == {0, 1}, out + err
        assert all(c["sent_msgs"] > 0 and c["recv_msgs"] > 0
                   for c in counters.values()), counters
        socks = {line.split()[3] for line in out.splitlines()
                 if line.startswith("rank ")}
        assert len(socks) == 1, out
        sockets.append(socks.pop())
    assert sockets[0] != sockets[1]
    servers_dir = state["servers_dir"]
    assert all(s.startswith(servers_dir + "/") for s in sockets), sockets
    # a job's servers end with it
    assert _job_servers(name, state) == []


def test_shared_region_is_the_servers_standing_one(cluster, hold_program):
    name, state = cluster(servers=1, instances=2, vcpus=1)
    go = hold_program / "go-shared"
    go.write_text("go")
    p = _start_job(name, hold_program / "hold", go, "--shared-region")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    socks = {line.split()[3] for line in out.splitlines()
             if line.startswith("rank ")}
    assert socks == {state["servers"]["0"]["socket"]}
    assert set(parse_btl_counters(out + err)) == {0, 1}


def test_down_removes_the_regions_of_a_killed_launcher(cluster,
                                                       hold_program):
    name, state = cluster(servers=1, instances=2, vcpus=1)
    go = hold_program / "go-killed"
    go.unlink(missing_ok=True)
    # its mpirun outlives it and would hold pipes open: no pipes
    p = _start_job(name, hold_program / "hold", go,
                   output=subprocess.DEVNULL)
    try:
        dirs = wait_for(lambda: _job_servers(name, state), 60, "a job server")
        job_state = wait_for(lambda: _read_json(dirs[0] / "state.json"), 30,
                          "the job server's state")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        go.write_text("go")   # let the orphaned ranks finish
    assert _job_servers(name, state), "the job's server went with -9?"
    proc = ivcloud("cluster", "down", "--name", name)
    assert proc.returncode == 0, proc.stderr
    assert not dirs[0].exists()
    pid = job_state.get("pid")
    if pid:
        # gone, a zombie waiting for its reaper, or a new process
        wait_for(lambda: _server_gone(pid), 10, f"job server {pid} to exit")
    region = job_state.get("region")
    if region:
        assert not os.path.lexists(region)


@pytest.mark.parametrize("quiet", [False, True])
def test_job_servers_without_leave_notices(tmp_path, quiet):
    """start_regions(leave_notices=False), as the Slurm hooks ask for a
    cluster of QEMU guests, runs the job's servers with
    --no-leave-notices (their clients are the guests' devices only: QEMU
    could not unplug them after a leave notice, docs/server-protocol.md,
    "Quiet leaves"); by default, for ranks that are libivshm clients,
    they tell leaves as usual. A state with nothing but what
    start_regions reads."""
    state = {"servers_dir": str(tmp_path),
             "servers": {"0": {"name": "s0", "size": 32 << 20,
                               "max_peers": 4}}}
    job = regions.slurm_job_key(7)
    sockets = regions.start_regions(state, job, [0], leave_notices=not quiet)
    try:
        assert list(sockets) == [0]
        paths = regions.job_server_paths(tmp_path, "s0", 0, job)
        pid = server_mod.running_pid(paths)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert (b"--no-leave-notices" in argv) == quiet, argv
    finally:
        assert regions.stop_regions(state, job, [0]) == []
    assert not regions.job_dirs(tmp_path, "s0")
