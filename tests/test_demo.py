"""`make demo`'s benchmarks end to end, quick: `ivcloud bench hierarchy
--quick` and `ivcloud bench halo --quick` on real emulated clusters (root
only), their JSON, plots and report, and that no cluster is left."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ivcloud.cluster import holder

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="clusters need root"),
    pytest.mark.skipif(not (shutil.which("mpicc") and shutil.which("mpirun")),
                       reason="Open MPI (mpicc, mpirun) not installed"),
]

RUN_DIR = Path(os.environ.get("IVCLOUD_RUN_DIR") or "/run/ivcloud")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEYS = ("level", "transport", "test", "size", "latency_us", "bandwidth_MBps")


def ivcloud(*args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True).stdout


def assert_no_cluster_left(name: str) -> None:
    assert not (RUN_DIR / f"cluster-{name}").exists()
    assert holder.find_by_marker(name) == []
    procs = subprocess.run(["pgrep", "-af", f"{name}-s|holder:{name}:"],
                           capture_output=True, text=True).stdout
    assert procs == "", procs      # no ivshmem-server, no holder
    for k in (0, 1):
        assert not Path(f"/dev/shm/ivcloud-{name}-s{k}").exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True,
                           text=True).stdout
    assert not re.search(r"\d+: (i-s\d+i\d+|br-s\d+|up-s\d+|cp-s\d+|"
                         r"i-head)[@:]", links), links


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Both quick benchmarks into one directory, as `make demo` runs
    them; (out dir, {name: completed process}, netns before)."""
    native = Path(os.environ["IVCLOUD_NATIVE_DIR"])
    for prog in ("mpi-osu", "mpi-halo"):
        assert (native / prog).exists(), \
            f"{native / prog} missing: run `make build`"
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("demo")
    before = netns_list()
    runs = {
        "hierarchy": ivcloud("bench", "hierarchy", "--quick", "--out", out,
                             "--json", out / "h-copy.json"),
        "halo": ivcloud("bench", "halo", "--quick", "--out", out),
    }
    return out, runs, before


def test_runs_succeed_and_leave_nothing(demo):
    out, runs, before = demo
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
        doc = json.loads((out / f"{name}.json").read_text())
        assert_no_cluster_left(doc["cluster"]["name"])
        assert f"cluster '{doc['cluster']['name']}' down" in proc.stderr
    assert netns_list() == before


def test_hierarchy_json_has_every_level_and_transport(demo):
    out, runs, _ = demo
    doc = json.loads((out / "hierarchy.json").read_text())
    assert doc == json.loads((out / "h-copy.json").read_text())  # --json
    assert doc["benchmark"] == "hierarchy" and doc["quick"] is True
    recs = doc["records"]
    for rec in recs:
        for key in KEYS:
            assert key in rec, (key, rec)
        # a tiny message at a loaded moment rounds to 0.0 MB/s
        assert rec["latency_us"] > 0 and rec["bandwidth_MBps"] >= 0
    for level in (1, 2, 3):
        for transport in ("tcp", "ivshmem"):
            for test in ("latency", "bw"):
                sizes = {r["size"] for r in recs if r["level"] == level
                         and r["transport"] == transport
                         and r["test"] == test}
                assert sizes == set(doc["sizes"]), (level, transport, test)
    # which BTL Open MPI used: the hierarchy itself
    btl = {(r["level"], r["transport"]): r["btl"] for r in recs}
    assert btl == {(1, "tcp"): "vader", (1, "ivshmem"): "vader",
                   (2, "tcp"): "tcp", (2, "ivshmem"): "ivshmem",
                   (3, "tcp"): "tcp", (3, "ivshmem"): "tcp"}
    names = [t["name"] for t in doc["targets"]]
    assert "level 2, 8 B latency tcp / ivshmem" in names
    for t in doc["targets"]:
        assert t["value"] is not None and t["status"] in ("PASS", "MISS")
    assert "L2 ivshmem" in runs["hierarchy"].stdout
    # the machine's load, sampled before measuring and after
    load = doc["load"]
    for when in ("before", "after"):
        assert 0 <= load[when]["cpu_share"] <= 1, load
        assert 0 <= load[when]["steal_share"] <= 1, load
    assert load["busy"] == bool(load["reasons"])
    if load["busy"]:
        assert "warning: the machine was busy" in runs["hierarchy"].stdout


def test_halo_json_both_placements(demo):
    out, runs, _ = demo
    doc = json.loads((out / "halo.json").read_text())
    assert doc["benchmark"] == "halo" and doc["ranks"] == 8
    assert doc["cluster"]["uplink_rate"] == "200mbit"
    placements = {r["placement"] for r in doc["records"]}
    assert placements == {"planned", "round-robin"}
    for rec in doc["records"]:
        assert rec["wall_s"] > 0 and rec["bad_faces"] == 0
        assert len(rec["hosts"]) == 8
    summ = doc["summary"]
    # planned keeps grid neighbours together: fewer edges across servers
    assert summ["planned"]["cut"]["across_servers"] < \
        summ["round-robin"]["cut"]["across_servers"]
    assert summ["planned"]["hosts"] != summ["round-robin"]["hosts"]
    (target,) = doc["targets"]
    assert target["value"] == pytest.approx(
        summ["round-robin"]["wall_s"] / summ["planned"]["wall_s"])
    assert "round-robin / planned" in runs["halo"].stdout


def test_plots_and_report(demo):
    out, _, _ = demo
    for png in ("latency.png", "bandwidth.png", "halo.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, png
    md = (out / "report.md").read_text()
    for png in ("latency.png", "bandwidth.png", "halo.png"):
        assert f"]({png})" in md
    assert "ivcloud bench hierarchy" in md and "ivcloud bench halo" in md
    assert "| L2 ivshmem |" in md and "| round-robin |" in md


def test_report_regenerates_from_json(demo, tmp_path):
    out, _, _ = demo
    for name in ("hierarchy.json", "halo.json"):
        shutil.copy(out / name, tmp_path / name)
    proc = ivcloud("bench", "report", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.md").read_text() == \
        (out / "report.md").read_text()
    assert (tmp_path / "halo.png").stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = ivcloud("bench", "report", empty, timeout=60)
    assert proc.returncode == 2 and "no hierarchy.json" in proc.stderr
