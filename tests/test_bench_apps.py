"""`ivcloud bench apps` end to end on tiny inputs: real HPCC and OpenFOAM
runs in every configuration on real emulated clusters (root only), the
records, the summary, the ratios and the scaling series in its JSON,
the tables and plots in report.md, and no cluster left behind. Plus the
pure arithmetic of the summary (medians, speeds; what the report may
say of them is tests/test_bench_report.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ivcloud.bench import apps, report
from ivcloud.errors import InvalidRequest

from test_demo import PNG_MAGIC, RUN_DIR


def ivcloud(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------- pure

def test_summary_is_median_and_spread():
    recs = [{"app": "openfoam", "config": "one", "ranks": 2,
             "metric": "solver_s", "value": v} for v in (3.0, 1.0, 2.0)]
    (row,) = apps.summarize(recs)
    assert (row["value"], row["value_min"], row["value_max"],
            row["runs"]) == \
        (2.0, 1.0, 3.0, 3)


def test_speed_is_relative_to_one_instance_both_ways():
    # a time: the reference's time over ours; a rate: ours over the
    # reference's
    assert apps.speed("openfoam", "solver_s", 2.0, 1.0) == 0.5
    assert apps.speed("hpcc", "HPL_Tflops", 2.0, 1.0) == 2.0
    assert apps.speed("hpcc", "RandomlyOrderedRingLatency_usec",
                      2.0, 1.0) == 0.5


def test_ratios_carry_the_most_favourable_one_the_spread_allows():
    def rec(config, metric, lo, med, hi):
        return {"app": "hpcc", "config": config, "ranks": 2,
                "metric": metric, "value": med, "value_min": lo,
                "value_max": hi}
    rate, lat = "RandomlyOrderedRingBandwidth_GBytes", \
        "RandomlyOrderedRingLatency_usec"
    rel = {r["metric"]: r for r in apps.relative([
        rec("one", rate, 9.0, 10.0, 11.0), rec("ivshmem", rate, 8.0, 8.5, 9.9),
        rec("one", lat, 0.9, 1.0, 1.2), rec("ivshmem", lat, 1.1, 1.25, 1.3)])}
    # a rate: our best run over the reference's worst
    assert rel[rate]["ivshmem_vs_one"] == 0.85
    assert rel[rate]["ivshmem_vs_one_best"] == 9.9 / 9.0
    # a time: the reference's worst over our best
    assert rel[lat]["ivshmem_vs_one"] == 0.8
    assert rel[lat]["ivshmem_vs_one_best"] == 1.2 / 1.1
    assert rel[lat]["ivshmem_vs_tcp"] is None
    assert rel[lat]["ivshmem_vs_tcp_best"] is None
    s = apps.AppsSettings.make(apps=["hpcc"])
    ts = {t.name: t for t in apps.targets(list(rel.values()), s)}
    t = ts["hpcc ring bandwidth: ivshmem vs one"]
    assert (t.status, t.within_spread) == ("MISS", True)
    assert t.to_json()["within_spread"] is True


def test_settings_refuse_without_flag_names():
    with pytest.raises(InvalidRequest) as e:
        apps.AppsSettings.make(apps=["lammps"])
    assert "--" not in str(e.value) and e.value.setting == "apps"
    with pytest.raises(InvalidRequest):
        apps.AppsSettings.make(scaling_ranks=[9])
    with pytest.raises(InvalidRequest):
        apps.AppsSettings.make(rounds=0)
    for configs, word in ((["tcp", "ivshmem"], "one"), (["one", "rdma"],
                                                        "rdma")):
        with pytest.raises(InvalidRequest) as e:
            apps.AppsSettings.make(configs=configs)
        assert word in str(e.value) and e.value.setting == "configs"


def test_left_out_configurations_have_no_targets_columns_or_bars():
    s = apps.AppsSettings.make(configs=["ivshmem", "one"])
    assert s.configs("openfoam") == ("one", "ivshmem")
    assert s.configs("hpcc") == ("one", apps.TWO_COPY, "ivshmem")
    recs = [{"app": "openfoam", "config": c, "ranks": 2,
             "metric": "solver_s", "value": v}
            for c, v in (("one", 2.0), ("ivshmem", 2.1))]
    summary = apps.summarize(recs)
    rel = apps.relative(summary)
    names = [t.name for t in apps.targets(rel, s)]
    assert names == ["openfoam simpleFoam time: ivshmem vs one"]
    doc = {"records": summary, "relative": rel,
           "metrics": {"openfoam:solver_s": {"label": "simpleFoam time",
                                             "unit": "s"}}}
    header, rows = report.apps_table(doc)
    assert header == ["application", "figure", "one", "ivshmem",
                      "ivshmem/one"]
    assert rows[0][-1] == "0.95"
    # without ivshmem, no target at all
    s = apps.AppsSettings.make(configs=["one", "tcp"])
    assert apps.targets(rel, s) == []


# ---------------------------------------------------------------- real

@pytest.mark.skipif(os.geteuid() != 0, reason="clusters need root")
@pytest.mark.skipif(not (shutil.which("hpcc") and
                         shutil.which("simpleFoam")),
                    reason="needs hpcc and openfoam")
def test_bench_apps_quick_end_to_end(tmp_path):
    before = {p.name for p in RUN_DIR.glob("cluster-*")} \
        if RUN_DIR.exists() else set()
    out = tmp_path / "demo"
    proc = ivcloud("bench", "apps", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "apps.json").read_text())
    recs = doc["records"]
    for r in recs:
        for key in ("app", "config", "ranks", "metric", "value"):
            assert key in r, r
    configs = {(r["app"], r["config"]) for r in recs}
    for app in apps.APPS:
        for config in apps.CONFIGS + ("scaling",):
            assert (app, config) in configs, (app, config)
    # HPCC's two-copy reference: one instance, vader's CMA off
    assert {r["app"] for r in recs if r["config"] == apps.TWO_COPY} == \
        set(apps.TWO_COPY_APPS)
    assert all(r["mca"] == {"btl_vader_single_copy_mechanism": "none"}
               for r in recs if r["config"] == apps.TWO_COPY)
    assert all(r["ivshmem_vs_one_twocopy"] > 0 for r in doc["relative"]
               if r["app"] in apps.TWO_COPY_APPS)
    # ivshmem really means two instances; one means one
    for r in recs:
        if r["config"] in apps.PAIR_HOSTS:
            assert r["hosts"] == list(apps.PAIR_HOSTS[r["config"]])
    assert {r["app"] for r in doc["relative"]} == set(apps.APPS)
    assert all(r["ivshmem_vs_one"] and r["ivshmem_vs_one"] > 0
               for r in doc["relative"])
    assert {s["app"] for s in doc["scaling"]} == set(apps.APPS)
    for s in doc["scaling"]:
        assert [r["ranks"] for r in s["rows"]] == [1, 2]
        assert s["rows"][0]["speedup"] == 1.0
    assert doc["targets"]
    # the tables on stdout, the report with its plots
    assert "ivshmem/one" in proc.stdout and "Strong scaling" in proc.stdout
    assert "ivshmem/one, 2 copies" in proc.stdout
    md = (out / "report.md").read_text()
    assert "## Applications: `ivcloud bench apps`" in md
    for png in ("apps.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
        assert f"]({png})" in md
    # this run's clusters (apps<pid><hex>, scal<pid><hex>) are gone; others'
    # tests on a shared machine may have brought theirs up meanwhile
    after = {p.name for p in RUN_DIR.glob("cluster-*")}
    left = {n for n in after - before
            if n.startswith(("cluster-apps", "cluster-scal"))}
    assert not left, left
