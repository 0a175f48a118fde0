"""The benchmark toolkit and the layering of ivcloud.bench: real programs
for running jobs (failing, hanging, chatty), the step loop that notes a
failure and goes on, settings checks that name no command-line flag, and
imports that point only down (benchmarks -> toolkit/report -> library;
the command line above them all)."""

from __future__ import annotations

import ast
import functools
import os
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ivcloud import process
from ivcloud.bench import btl, halo, hierarchy, p2p, report, toolkit
from ivcloud.cluster.launch import LaunchError
from ivcloud.errors import BenchError, InvalidRequest, ReportError

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = {"p2p", "mpi", "small", "hierarchy", "halo"}


def _imports(path: Path):
    """(module, names) of every import in a file, relative ones resolved
    against ivcloud.<package>."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, [a.name for a in node.names]


def _targets(path: Path):
    """Fully named modules a file imports (ivcloud.bench.p2p, ...)."""
    for module, names in _imports(path):
        yield module
        for n in names:
            yield f"{module}.{n}"


def test_imports_point_down():
    bench = REPO / "ivcloud" / "bench"
    lower = [REPO / "ivcloud" / "cluster" / "session.py",
             REPO / "ivcloud" / "errors.py", *bench.glob("*.py")]
    for path in lower:
        for target in _targets(path):
            assert not (target == "ivcloud.cli"
                        or target.startswith("ivcloud.cli.")), \
                f"{path.name} imports the command line ({target})"
    for path in bench.glob("*.py"):
        me = path.stem
        for target in _targets(path):
            if target.startswith("ivcloud.bench."):
                other = target.split(".")[2]
                assert other not in BENCHMARKS or other == me, \
                    f"{me} imports the benchmark {other}"
                if me in ("toolkit", "report"):
                    assert other not in BENCHMARKS, (me, target)
    # one BenchError: no benchmark defines its own
    for path in bench.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not names & {"BenchError", "ReportError"}, path
    assert issubclass(ReportError, InvalidRequest)


def _job(script: str, timeout_s: float = 20, origin: str = "job"):
    start = functools.partial(process.run_launcher,
                              [sys.executable, "-c", script],
                              dict(os.environ))
    return toolkit.checked_run(start, timeout_s, origin)


def test_run_job_failure_names_the_last_real_stderr_line():
    script = ("import sys; print('{\"x\": 1}'); "
              "sys.stderr.write('the real reason\\n"
              "[h:12] mca: bml: Using tcp btl for send\\n"
              "--------------------\\n'); sys.exit(3)")
    with pytest.raises(BenchError) as e:
        _job(script, origin="my job")
    assert str(e.value) == "my job: exit status 3: the real reason"


def test_run_job_tears_a_hung_program_down_at_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(BenchError, match="no result within 0.5 s"):
        _job("import time; time.sleep(60)", timeout_s=0.5)
    assert time.monotonic() - t0 < 20


def test_run_job_output_bigger_than_a_pipe():
    out, _ = _job("import sys; sys.stdout.write('x' * (1 << 20))")
    assert len(out) == 1 << 20


def test_run_job_prefixes_a_lower_layers_error_with_the_job():
    def start(**io):
        raise LaunchError("instance 's9i9' was never started")
    with pytest.raises(BenchError, match="^lvl: instance 's9i9'"):
        toolkit.checked_run(start, 5, "lvl")


def test_parse_records_checks_every_record():
    keys = ("a", "b")
    assert toolkit.parse_records('noise\n{"a": 1, "b": 2}\n', "o",
                                 keys) == [{"a": 1, "b": 2}]
    with pytest.raises(BenchError, match="o: record without 'b'"):
        toolkit.parse_records('{"a": 1}\n', "o", keys)
    with pytest.raises(BenchError, match="unparsable output line"):
        toolkit.parse_records('{"a": \n', "o", keys)
    with pytest.raises(BenchError, match="produced no records"):
        toolkit.parse_records("nothing here\n", "o", keys)


def test_attempt_notes_a_failed_step_and_goes_on():
    res = toolkit.BenchResults()
    log = io.StringIO()
    steps = [
        ("fails", lambda: _job("import sys; sys.exit(5)")),
        ("launch", lambda: (_ for _ in ()).throw(LaunchError("no head"))),
        ("oserror", lambda: subprocess.run(["/nonexistent/prog"])),
        ("works", lambda: _job("print('{\"a\": 1}')")),
    ]
    got = [toolkit.attempt(res, "t", name, fn, log) for name, fn in steps]
    assert got[:3] == [None, None, None] and got[3][0].strip() == '{"a": 1}'
    assert res.failed == ["fails", "launch", "oserror"]
    assert res.exit_status == 1
    assert "fails failed: job: exit status 5" in res.notes[0]
    assert "bench t: works done in" in log.getvalue()
    # a bug is not a failed measurement: it is not swallowed
    with pytest.raises(TypeError):
        toolkit.attempt(res, "t", "bug", lambda: len(3), log)


def test_rounds_alternate_the_steps_and_reverse_every_second_round():
    res = toolkit.BenchResults()
    order = []

    def step(name):
        order.append(name)
        return [{"step": name}]

    steps = [(n, functools.partial(step, n)) for n in "abc"]
    toolkit.measure_rounds(res, "t", 3, steps, io.StringIO())
    assert "".join(order) == "abccbaabc"
    assert [(r["step"], r["round"]) for r in res.runs[3:6]] == [
        ("c", 1), ("b", 1), ("a", 1)]


def test_ratio_targets():
    num, den = {"v": 6.0}, {"v": 2.0}
    t = toolkit.ratio_target("n", num, den, "v", ">=", 2.0)
    assert (t.value, t.status) == (3.0, "PASS")
    t = toolkit.ratio_target("n", None, den, "v", "<=", 1.0, "no record")
    assert t.to_json()["missing"] == "no record" and t.status == "N/A"
    t = toolkit.ratio_target("n", num, {"v": 0}, "v", "<=", 1.0)
    assert t.why_missing == "zero denominator"
    # a miss the runs' spread still reaches is told apart from a miss
    t = toolkit.Target("n", 1.2, "<=", 1.0, best=0.95)
    assert (t.status, t.within_spread) == ("MISS", True)
    t = toolkit.Target("n", 1.2, "<=", 1.0, best=1.1)
    assert (t.status, t.within_spread) == ("MISS", False)
    assert not toolkit.Target("n", 0.9, "<=", 1.0, best=0.8).within_spread
    out = io.StringIO()
    toolkit.print_targets([toolkit.Target("n", 1.2, "<=", 1.0, best=0.95)],
                          out)
    assert "within the runs' spread: up to 0.95" in out.getvalue()


def test_settings_checks_name_no_flags():
    for call in (lambda: p2p.P2pSettings.make(sizes=[0]),
                 lambda: p2p.P2pSettings.make(iters=0),
                 lambda: btl.MpiSettings.make(transports=["udp"]),
                 lambda: hierarchy.HierarchySettings.make(iters=-1),
                 lambda: halo.HaloSettings.make(face=12),
                 lambda: halo.HaloSettings.make(reps=0),
                 lambda: halo.HaloSettings.make(transport="udp")):
        with pytest.raises(InvalidRequest) as e:
            call()
        assert "--" not in str(e.value), str(e.value)
    s = p2p.P2pSettings.make(quick=True, netns=False)
    assert s.quick and s.sizes == p2p.QUICK_SIZES and not s.netns
    assert btl.MpiSettings.make(transports=["tcp"]).transports == ["tcp"]


def test_report_refuses_an_empty_directory(tmp_path):
    with pytest.raises(ReportError, match="no hierarchy.json"):
        report.write(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ivcloud", "bench",
                           "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "no hierarchy.json" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
