"""What the demo report may say, from synthetic documents: the report
code (ivcloud.bench.report) and the summaries that feed it
(ivcloud.bench.apps, the load samples of ivcloud.bench.toolkit) run as
they do after a real `make demo`, on documents whose figures are chosen
here, so that each rule is checked where it bites: strong scaling only
over rank counts the host runs without oversubscription, no Amdahl fit
to fewer than 3 points or outside [0, 1], min..max bars, and a warning
when the machine was busy."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ivcloud.bench import apps, report, toolkit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUIET = {"seconds": 1.0, "cpus": 2, "loadavg": [0.1, 0.2, 0.3],
         "runnable": 1, "cpu_share": 0.02, "steal_share": 0.0}
BUSY = dict(QUIET, loadavg=[2.4, 2.0, 1.5], runnable=3, cpu_share=0.61)
STOLEN = dict(QUIET, steal_share=0.12)


def series(speedups, unit="s"):
    """A scaling series of a time (unit s, T1 = 10) with these speed-ups
    at 1, 2, 4, ... ranks."""
    rows = []
    for i, s in enumerate(speedups):
        p = 1 << i
        rows.append({"ranks": p, "value": 10.0 / s, "speedup": s,
                     "efficiency": s / p})
    return {"app": "openfoam", "metric": "solver_s",
            "label": "simpleFoam time", "unit": unit, "rows": rows}


# ---------------------------------------------------------------- scaling

def test_rank_counts_above_the_hosts_cpus_are_left_out():
    view = report.scaling_view(series([1.0, 1.6, 2.9]), cpus=2)
    assert [r["ranks"] for r in view["rows"]] == [1, 2]
    assert view["left_out"] == [4] and view["table"]
    assert view["fit"] is None
    assert any("4 ranks left out" in n and "oversubscribed" in n
               for n in view["notes"])
    # two points are not enough for a fit
    assert any("no Amdahl fit: 2 rank counts" in n for n in view["notes"])


def test_amdahl_is_fitted_to_three_points_inside_the_unit_interval():
    f = 0.2
    speedups = [1 / (f + (1 - f) / p) for p in (1, 2, 4)]
    view = report.scaling_view(series(speedups), cpus=4)
    assert view["fit"] == pytest.approx(f)
    assert view["left_out"] == [] and view["notes"] == []
    header, rows, notes = report.scaling_table(series(speedups), 4)
    assert len(rows) == 3
    assert notes == ["Amdahl's law fitted to 3 rank counts: serial "
                     "fraction 0.200"]


def test_no_fit_outside_zero_one():
    # slower with more ranks (a busy machine): the least-squares f is
    # above 1, which no serial fraction can be
    view = report.scaling_view(series([1.0, 0.55, 0.4]), cpus=4)
    assert view["fit"] is None and view["table"]
    (note,) = view["notes"]
    assert "outside [0, 1]" in note
    # and a super-linear series gives f < 0
    view = report.scaling_view(series([1.0, 2.5, 6.0]), cpus=4)
    assert view["fit"] is None and "outside [0, 1]" in view["notes"][0]


def test_one_cpu_gives_no_table_and_says_why():
    header, rows, notes = report.scaling_table(series([1.0, 1.7]), 1)
    assert rows == []
    assert any("no strong-scaling table" in n for n in notes)
    assert any("2 ranks left out" in n for n in notes)


def test_amdahl_fit_recovers_the_serial_fraction():
    f = 0.2
    pts = [(p, 1 / (f + (1 - f) / p)) for p in (1, 2, 4, 8)]
    assert abs(report.amdahl_serial_fraction(pts) - f) < 1e-12
    assert report.amdahl_serial_fraction([(1, 1.0)]) is None


def _runs(config, values, app="openfoam", metric="solver_s", ranks=2):
    return [{"app": app, "config": config, "ranks": ranks, "metric": metric,
             "value": v, "unit": "s"} for v in values]


def apps_doc(load, cpus=2):
    """An apps.json as `ivcloud bench apps` writes it, from runs whose
    figures are made up: OpenFOAM in one/tcp/ivshmem, and a scaling
    series at 1, 2 and 4 ranks."""
    runs = (_runs("one", [2.0, 2.2, 1.9]) + _runs("tcp", [3.0, 3.1, 2.9])
            + _runs("ivshmem", [2.1, 2.6, 2.0])
            + _runs("scaling", [4.0, 4.4, 3.8], ranks=1)
            + _runs("scaling", [2.4, 2.5, 2.2], ranks=2)
            + _runs("scaling", [2.0, 2.1, 1.7], ranks=4))
    summary = apps.summarize(runs)
    rel = apps.relative(summary)
    cluster = {"servers": 1, "instances_per_server": 2, "vcpus": 2,
               "host_cpus": cpus, "uplink_rate": None}
    return {"benchmark": "apps", "quick": False, "started": 0.0,
            "host": "test", "cpus": cpus, "kernel": "6", "load": load,
            "cluster": cluster,
            "scaling_cluster": dict(cluster, servers=2, vcpus=1),
            "configs": {c: list(h) for c, h in apps.PAIR_HOSTS.items()},
            "rounds": 3, "hpcc_n": 2000, "foam_iterations": 200,
            "records": summary, "relative": rel,
            "scaling": apps.scaling(summary, cpus), "scaling_cpus": cpus,
            "metrics": {"openfoam:solver_s": {"label": "simpleFoam time",
                                              "unit": "s",
                                              "higher_is_better": False}},
            "targets": [], "notes": []}


def test_the_scaling_series_records_what_the_report_may_say():
    doc = apps_doc({"before": QUIET, "after": QUIET})
    (s,) = doc["scaling"]
    assert [r["oversubscribed"] for r in s["rows"]] == [False, False, True]
    two = s["rows"][1]
    assert two["speedup"] == pytest.approx(4.0 / 2.4)
    # the extremes of the speed-up come from the extremes of the rounds
    assert two["speedup_min"] == pytest.approx(3.8 / 2.5)
    assert two["speedup_max"] == pytest.approx(4.4 / 2.2)
    assert s["amdahl_serial_fraction"] is None
    assert "4 ranks left out" in s["fit_note"]
    assert "no Amdahl fit" in s["fit_note"]


def test_ratios_carry_their_worst_and_best():
    doc = apps_doc({})
    (rel,) = doc["relative"]
    # a time: one's median over ours, and the extremes of both
    assert rel["ivshmem_vs_one"] == pytest.approx(2.0 / 2.1)
    assert rel["ivshmem_vs_one_worst"] == pytest.approx(1.9 / 2.6)
    assert rel["ivshmem_vs_one_best"] == pytest.approx(2.2 / 2.0)


def test_bars_span_min_to_max_or_nothing():
    recs = [{"v": 2.0, "v_min": 1.5, "v_max": 3.0}]
    assert report._bars(recs, "v") == [[0.5], [1.0]]
    assert report._bars([{"v": 2.0}], "v") is None


# ---------------------------------------------------------------- load

def test_busy_reasons_name_cpu_share_and_steal():
    assert toolkit.busy_reasons({"before": QUIET, "after": QUIET}) == []
    assert toolkit.busy_reasons(None) == []
    reasons = toolkit.busy_reasons({"before": BUSY, "after": STOLEN})
    assert len(reasons) == 2
    assert reasons[0].startswith("before the run, other processes used 61 %")
    assert "hypervisor took 12 %" in reasons[1]
    assert "machine was busy" in toolkit.busy_warning(reasons)
    assert toolkit.busy_warning([]) == ""


def test_load_sample_reads_proc(tmp_path):
    s = toolkit.load_sample(0.05)
    assert 0 <= s["cpu_share"] <= 1 and 0 <= s["steal_share"] <= 1
    assert len(s["loadavg"]) == 3 and s["runnable"] >= 1
    # the files' format, on a copy that does not change over the sample
    (tmp_path / "stat").write_text(
        "cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4\n")
    (tmp_path / "loadavg").write_text("1.50 1.00 0.50 3/120 4242\n")
    s = toolkit.load_sample(0.0, tmp_path)
    assert s["loadavg"] == [1.5, 1.0, 0.5] and s["runnable"] == 3
    assert s["cpu_share"] == 0 and s["steal_share"] == 0


def test_conclude_records_the_load_after_and_warns(monkeypatch):
    monkeypatch.setattr(toolkit, "load_sample", lambda *a: BUSY)
    out = io.StringIO()
    doc = toolkit.conclude("x", False, {"load": {"before": QUIET}},
                           toolkit.BenchResults(), [], out)
    assert doc["load"]["before"] == QUIET and doc["load"]["after"] == BUSY
    assert doc["load"]["busy"] is True and len(doc["load"]["reasons"]) == 1
    assert "warning: the machine was busy (after the run" in out.getvalue()
    # a document without samples: no load at all
    doc = toolkit.conclude("x", False, {}, toolkit.BenchResults(), [],
                           io.StringIO())
    assert "load" not in doc


# ---------------------------------------------------------------- report.md

def _write(tmp_path: Path, doc) -> str:
    pytest.importorskip("matplotlib")
    (tmp_path / "apps.json").write_text(json.dumps(doc))
    md = report.write(tmp_path).read_text()
    for png in ("apps.png", "speedup.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
        assert f"]({png})" in md
    return md


def test_report_of_a_busy_machine_says_so(tmp_path):
    md = _write(tmp_path, apps_doc({"before": BUSY, "after": QUIET}))
    assert "**Warning: the machine was busy during `bench apps`**" in md
    assert "**Warning: the machine was busy (before the run, other " \
        "processes used 61 %" in md
    # the scaling table: 1 and 2 ranks, no 4, no fit, and why
    assert "| 2 | 2.4 (2.2..2.5) | 1.67 (1.52..2.00) | 0.83 |" in md
    assert "| 4 |" not in md
    assert "- 4 ranks left out: the host has 2 CPUs" in md
    assert "- no Amdahl fit: 2 rank counts" in md
    assert "serial fraction" not in md


def test_report_of_a_quiet_machine_has_no_warning(tmp_path):
    md = _write(tmp_path, apps_doc({"before": QUIET, "after": QUIET}, 4))
    assert "Warning" not in md
    assert "The machine was quiet before and after the run" in md
    # on 4 CPUs all three rank counts stay; this series' fit is in range
    assert "| 4 |" in md
    assert "Amdahl's law fitted to 3 rank counts" in md


def test_report_of_an_old_document_recomputes_what_it_may_say(tmp_path):
    # a document written before these rules (a fit of 2.668 to two
    # points, no load samples, no spread of the speed-ups): the report
    # goes by the rows, not by the recorded fit
    doc = apps_doc(None)
    del doc["load"], doc["scaling_cpus"]
    for s in doc["scaling"]:
        s["amdahl_serial_fraction"] = 2.668
        for r in s["rows"]:
            for k in ("speedup_min", "speedup_max", "oversubscribed"):
                r.pop(k)
    md = _write(tmp_path, doc)
    assert "2.668" not in md and "| 4 |" not in md
    assert "Warning" not in md and "quiet" not in md
