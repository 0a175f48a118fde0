"""`ivcloud bench apps --instance-kind vm`: the application
benchmark on a VM cluster, as a user runs it. Our solver's bar (from
the image's python3-micromag package) runs in one guest and in two
guests over the ivshmem device, on 1 server x 2 guests x 2 vCPUs under
TCG, with the quick input copied into the guests.

The Debian applications are left out (`--apps micromag`): each goes
through the same staging and launch as the bar, and under TCG HPCC
adds 30-40 s (14 s in one guest, 27 s in two, loaded) and OpenFOAM
about two minutes to a `make test` near its 30 minutes. They run on
namespace instances in test_bench_apps.py and `make demo` (OpenFOAM's
case meshed where it runs).

The third configuration, two guests over virtio-net, is left out
(`--configs one,ivshmem`): under TCG its runs took 3 of the test's
6-7 minutes (HPCC 78 s, OpenFOAM 61 s, the bar 55 s on 2026-11-26), a
sixth of the whole pytest run, and what they would check is covered
elsewhere: MPI between guests over virtio-net by test_cluster_vm.py,
the tcp configuration of bench apps by test_bench_apps.py.

Checked: every (app, configuration) run has its records (2 ranks, a
positive value, the instance kind and accelerator, the ranks' hosts),
every ivshmem run carried messages through the BTL on both ranks (its
counters, recorded by the benchmark), the table says TCG and that its
figures are no performance claims, the left-out configuration and the
skipped scaling series are noted with their reasons, and nothing is
left behind. Before that, bad input: one line, exit status 2, nothing
made.

The packages and the image are the session's, as in test_cluster_vm.py
(conftest.py's guest_deb: built once, the image cached in
/var/cache/ivcloud).
IVCLOUD_SKIP_GUEST_IMAGE=1 skips the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud.bench import apps

# the same requirements as the image tests (root, QEMU, mmdebstrap)
from test_guest_image import pytestmark  # noqa: F401
from vm_support import qemus_naming

RUN_DIR = Path("/var/tmp") / f"ivc-appsvm-{os.getpid()}"
RUN_CONFIGS = ("one", "ivshmem")
RUN_APPS = ("micromag",)


@pytest.fixture(scope="module", autouse=True)
def run_dir():
    yield RUN_DIR
    shutil.rmtree(RUN_DIR, ignore_errors=True)


def bench_apps(*args, env=None, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "ivcloud", "bench", "apps", *map(str, args)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout,
        env={**os.environ, "IVCLOUD_RUN_DIR": str(RUN_DIR), **(env or {})})


def assert_nothing_left():
    assert not qemus_naming(RUN_DIR)
    assert not list(RUN_DIR.glob("cluster-*"))
    out = subprocess.run(["ip", "-o", "link"], capture_output=True,
                         text=True).stdout
    assert "t-s0i" not in out


def test_bad_input_exits_2(guest_deb, tmp_path):
    # a guest package without the solver's beside it
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(guest_deb, lone / guest_deb.name)
    for extra, env, word in (
            (["--guest-deb", lone / guest_deb.name], {}, "python3-micromag"),
            (["--guest-deb", guest_deb], {"IVCLOUD_QEMU": "/nonexistent/qemu"},
             "QEMU"),
            (["--guest-deb", tmp_path / "none.deb"], {}, "none.deb")):
        r = bench_apps("--quick", "--instance-kind", "vm", "--out",
                       tmp_path / "out", *extra, env=env, timeout=60)
        assert r.returncode == 2, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr, \
            r.stderr
    # without the solver's package the other applications still run:
    # that refusal is the bar's only (checked before anything is made)
    r = bench_apps("--quick", "--vm-memory", 2048, "--out", tmp_path / "out",
                   timeout=60)
    assert r.returncode == 2 and "--instance-kind" in r.stderr
    assert not (tmp_path / "out").exists()
    assert_nothing_left()


def test_bench_apps_quick_on_vms(guest_deb, tmp_path):
    out = tmp_path / "demo"
    t0 = time.monotonic()
    try:
        r = bench_apps("--quick", "--instance-kind", "vm", "--accel", "tcg",
                       "--configs", ",".join(RUN_CONFIGS),
                       "--apps", ",".join(RUN_APPS),
                       "--guest-deb", guest_deb, "--out", out, "--json",
                       tmp_path / "apps.json", timeout=1200)
    finally:
        print(f"\nbench apps --quick on VMs: {time.monotonic() - t0:.0f} s")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "apps.json").read_text())
    assert doc == json.loads((out / "apps.json").read_text())
    assert doc["cluster"]["instance_kind"] == "vm"
    assert doc["cluster"]["accel"] == "tcg"
    recs = doc["records"]
    seen = {(r["app"], r["config"]) for r in recs}
    assert seen == {(app, config) for app in RUN_APPS
                    for config in RUN_CONFIGS}
    metrics = {app: {m for a, m in apps.METRICS if a == app}
               for app in RUN_APPS}
    for rec in recs:
        assert rec["config"] in RUN_CONFIGS, rec   # no scaling series
        assert rec["ranks"] == 2 and rec["metric"] in metrics[rec["app"]]
        assert rec["value"] > 0, rec
        assert rec["instance_kind"] == "vm" and rec["accel"] == "tcg", rec
        assert rec["hosts"] == list(apps.PAIR_HOSTS[rec["config"]]), rec
        assert rec["transport"] == ("ivshmem" if rec["config"] == "ivshmem"
                                    else "tcp")
        if rec["config"] == "ivshmem":
            # both ranks sent and received through the region
            btl = rec["ivshmem_btl"]
            assert sorted(btl) == ["0", "1"], rec
            for c in btl.values():
                assert c["sent_msgs"] > 0 and c["recv_msgs"] > 0, rec
                assert c["sent_bytes"] > 0 and c["recv_bytes"] > 0, rec
        else:
            assert "ivshmem_btl" not in rec
    # every metric of each app in each configuration
    for app in RUN_APPS:
        for config in RUN_CONFIGS:
            got = {r["metric"] for r in recs
                   if r["app"] == app and r["config"] == config}
            assert got == metrics[app], (app, config, got)
    assert {r["app"] for r in doc["relative"]} == set(RUN_APPS)
    assert doc["scaling"] == [] and doc["scaling_cluster"] is None
    assert any("scaling series was not run" in n for n in doc["notes"])
    assert "configuration(s) left out on request: tcp" in doc["notes"]
    assert "scaling series was not run" in r.stderr
    # the table and the report say what the figures are
    assert "QEMU guests under TCG" in r.stdout
    assert "not performance claims" in r.stdout
    assert "ivshmem/one" in r.stdout
    assert "ivshmem/tcp" not in r.stdout     # no column for what did not run
    md = (out / "report.md").read_text()
    assert "## Applications: `ivcloud bench apps`" in md
    assert "QEMU guests under TCG" in md
    assert_nothing_left()
