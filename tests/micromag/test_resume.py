"""Resuming interrupted runs (`ivcloud mag run --resume`, and `ivcloud mag
converge` on a study started again).

Real runs, really killed: `ivcloud mag run` is started as a process
group of its own (setsid), the test waits until the run's checkpoint is
in the middle of the LLG stage, then sends SIGKILL (or SIGTERM, which
mpirun forwards) to the whole process group and waits for every process
of the run to be gone. The resumed run must end where an uninterrupted
one ends: <m> within 1e-4 at every table row (the integrator restarts
from the checkpoint, so step sizes differ; measured ~4e-6 at rtol 1e-6),
on 1 and 2 ranks in either direction (the checkpoint holds m in the
input mesh's numbering). A checkpoint of another problem, mesh or solver
version is never resumed from."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("petsc4py")

from micromag import checkpoint                                    # noqa: E402
from micromag.parallel import clean_mpi_env                        # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# standard problem 4's material and field on a 200 x 50 x 3 nm film of
# 10 nm cells (252 nodes): the relaxed state, then 0.15 ns of switching
# dynamics (three snapshots), ~1 s of CPU. What is tested is the kill,
# the checkpoint and the resume, not SP4 itself: a small, short run
# exercises all of it
PROBLEM = """\
title = "resume test"
[mesh]
shape = "box"
unit = "nm"
size = [200.0, 50.0, 3.0]
h = [{h}, {h}, 3.0]
structured = true
[material]
Ms = 8.0e5
A = 1.3e-11
alpha = {alpha}
gamma = 2.211e5
[initial]
m = [1.0, 0.1, 0.0]
[[stage]]
type = "relax"
name = "s-state"
method = "bb"
tol = 1e-5
[[stage]]
type = "llg"
name = "field-1"
duration = {duration}
integrator = "bdf"
rtol = 1e-6
atol = 1e-6
output_every = 1e-12
snapshot_every = 50e-12
[[stage.field]]
H = [-24.6, 4.3, 0.0]
unit = "mT"
"""
TOL = 1e-4


def _env():
    env = clean_mpi_env(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _problem(path: Path, h: float = 10.0, alpha: float = 0.02,
             duration: float = 150e-12) -> Path:
    path.write_text(PROBLEM.format(h=h, alpha=alpha, duration=duration))
    return path


def _run_cmd(problem: Path, out: Path, np_: int = 1, *extra):
    return [sys.executable, "-m", "ivcloud", "mag", "run", str(problem),
            "--out", str(out), "--np", str(np_), "--quiet", *extra]


def _run(problem: Path, out: Path, np_: int = 1, *extra):
    r = subprocess.run(_run_cmd(problem, out, np_, *extra),
                       capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL, env=_env())
    assert r.returncode == 0, r.stderr
    return r


def _processes_of(out: Path):
    r = subprocess.run(["pgrep", "-f", str(out)], capture_output=True,
                       text=True)
    return r.stdout.split()


def _job_dirs(pids):
    # the job scopes of `ivcloud mag run` processes (a launcher's, or a
    # singleton's own: ivcloud.process), each named for its pid
    return [d for p in pids
            for d in Path("/dev/shm").glob(f"ivcloud-job.{p}.*")]


def _kill_midway(cmd, out: Path, sig, after: float = 60e-12) -> dict:
    """Start cmd, wait for a checkpoint inside stage 2 past `after`,
    signal its process group; returns that checkpoint's meta data.
    Open MPI's session directory was in the run's job scope, and the
    scope is gone after the kill (a singleton's too)."""
    proc = subprocess.Popen(cmd, start_new_session=True,
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=_env())
    deadline = time.monotonic() + 240
    meta = None
    try:
        while time.monotonic() < deadline:
            meta = checkpoint.peek(out)
            if meta and meta["stage"] == 2 and not meta["done"] \
                    and meta["t"] > after:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.02)
        else:
            pytest.fail("no checkpoint inside the LLG stage")
        pids = _processes_of(out)
        scopes = _job_dirs(pids)
        assert len(scopes) == 1, scopes
        assert list(scopes[0].glob("ompi.*")), list(scopes[0].iterdir())
    finally:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
        proc.stderr.close()
    # SIGTERM: mpirun tears its ranks down after it (up to its grace
    # time); SIGKILL: the launcher's reaper kills the ranks, which are in
    # process groups of their own (test_mpirun_killed.py). Nothing may
    # outlive the run.
    deadline = time.monotonic() + (30 if sig == signal.SIGTERM else 10)
    while _processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_of(out)
    while _job_dirs(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _job_dirs(pids)
    assert not (out / "summary.json").exists()
    assert (out / ".incomplete" / checkpoint.NAME).is_file()
    return meta


def _table(out: Path):
    return np.genfromtxt(out / "table.csv", delimiter=",", names=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    d = tmp_path_factory.mktemp("resume-ref")
    prob = _problem(d / "p.toml")
    _run(prob, d / "out")
    return prob, d / "out"


@pytest.fixture(scope="module")
def killed(reference):
    """The reference problem killed (SIGKILL, 1 rank) inside its LLG
    stage, and that checkpoint's meta data: the tests that resume it or
    refuse it each take a copy of their own (_copy_killed)."""
    prob, ref = reference
    out = ref.parent / "killed"
    meta = _kill_midway(_run_cmd(prob, out, 1, "--checkpoint-every", "0"),
                        out, signal.SIGKILL)
    return out, meta


def _copy_killed(killed, dest: Path):
    src, meta = killed
    shutil.copytree(src, dest)
    return dest, dict(meta)


def _assert_same_curve(out: Path, ref: Path):
    a, b = _table(ref), _table(out)
    assert len(a) == len(b)
    assert np.array_equal(a["stage"], b["stage"])
    assert np.allclose(a["t"], b["t"], rtol=0, atol=1e-18)
    for k in ("mx", "my", "mz"):
        assert np.abs(a[k] - b[k]).max() < TOL, k
    sa = json.loads((ref / "summary.json").read_text())
    sb = json.loads((out / "summary.json").read_text())
    assert np.allclose(sa["m_final"], sb["m_final"], rtol=0, atol=TOL)
    assert sb["resumed"] and not sa["resumed"]
    # snapshots: one per 50 ps as in the uninterrupted run, none twice
    names = [ln.split()[0] for ln in
             (out / "snapshots" / "times.txt").read_text().splitlines()]
    ref_names = [ln.split()[0] for ln in
                 (ref / "snapshots" / "times.txt").read_text().splitlines()]
    assert names == ref_names
    assert sorted(p.name for p in (out / "snapshots").glob("*.vtu")) == \
        sorted(p.name for p in (ref / "snapshots").glob("*.vtu"))
    # a finished run leaves no checkpoint and no staging directory
    assert not (out / ".incomplete").exists()
    assert not list(out.glob("*checkpoint*"))


def test_killed_run_resumes_to_the_same_curve(reference, killed,
                                              tmp_path):
    prob, ref = reference
    out, meta = _copy_killed(killed, tmp_path / "out")
    r = _run(prob, out, 1, "--resume")
    assert "resuming" not in r.stderr         # --quiet
    summary = json.loads((out / "summary.json").read_text())
    (resumed,) = summary["resumed"]
    assert resumed["stage"] == 2 and resumed["t"] >= meta["t"]
    _assert_same_curve(out, ref)


# killed where the part on 2 ranks (the slower one, oversubscribed) is
# the shorter, either way still with a snapshot to come
@pytest.mark.parametrize("ranks_before,ranks_after,sig,after", [
    (2, 1, signal.SIGTERM, 60e-12), (1, 2, signal.SIGKILL, 100e-12)])
def test_resume_on_another_number_of_ranks(reference, tmp_path,
                                           ranks_before, ranks_after, sig,
                                           after):
    prob, ref = reference
    out = tmp_path / "out"
    _kill_midway(_run_cmd(prob, out, ranks_before, "--checkpoint-every",
                          "0"), out, sig, after)
    _run(prob, out, ranks_after, "--resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"][0]["ranks_before"] == ranks_before
    assert summary["ranks"] == ranks_after
    _assert_same_curve(out, ref)


def test_tied_film_resumes_on_its_stacks(tmp_path):
    # m tied through the film (uniform_z) and an explicit integrator: the
    # run integrates one m per stack (State.stacks) and checkpoints the
    # nodes; killed on 2 ranks and resumed on 1, it ends on the curve of
    # an uninterrupted run. At 5 nm cells and for 0.3 ns: the explicit
    # integrator's restart moves the curve less there (measured 1.4e-5;
    # 4.6e-5 at 10 nm), and 0.15 ns of this run on 2 ranks, killed at
    # 60 ps, was seen to finish (summary.json written) after SIGKILL of
    # its process group
    prob = _problem(tmp_path / "p.toml", h=5.0, duration=300e-12)
    prob.write_text(prob.read_text().replace(
        "structured = true", "structured = true\nuniform_z = true").replace(
        'integrator = "bdf"', 'integrator = "rk3bs"'))
    ref = tmp_path / "ref"
    _run(prob, ref)
    out = tmp_path / "out"
    _kill_midway(_run_cmd(prob, out, 2, "--checkpoint-every", "0"), out,
                 signal.SIGKILL)
    _run(prob, out, 1, "--resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"][0]["ranks_before"] == 2
    _assert_same_curve(out, ref)


def test_stale_checkpoint_is_never_resumed(reference, killed, tmp_path):
    prob, ref = reference
    killed, _ = _copy_killed(killed, tmp_path / "killed")
    changes = {"alpha": _problem(tmp_path / "alpha.toml", alpha=0.03),
               "cells": _problem(tmp_path / "cells.toml", h=25.0)}
    # the same problem with a comment added: another file, not resumed
    # either (the key includes the file's bytes)
    text = prob.read_text()
    (tmp_path / "comment.toml").write_text("# edited\n" + text)
    changes["comment"] = tmp_path / "comment.toml"
    for name, changed in changes.items():
        out = tmp_path / name
        shutil.copytree(killed, out)
        r = subprocess.run(_run_cmd(changed, out, 1, "--resume"),
                           capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL, env=_env())
        assert r.returncode == 0, r.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["resumed"] == [], name
        t = _table(out)
        # the table starts at the beginning (stage 1), one row per time
        assert t["stage"][0] == 1 and t["t"][0] == 0.0
        assert len(t) == len(_table(ref)), name
    # and without a change it would have resumed
    _run(prob, killed, 1, "--resume")
    assert json.loads((killed / "summary.json").read_text())["resumed"]


def test_stale_checkpoint_says_why(killed, tmp_path):
    out, _ = _copy_killed(killed, tmp_path / "out")
    changed = _problem(tmp_path / "alpha.toml", alpha=0.03)
    r = subprocess.run(
        [sys.executable, "-m", "ivcloud", "mag", "run", str(changed),
         "--out", str(out), "--resume"], capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL, env=_env())
    assert r.returncode == 0, r.stderr
    assert "belongs to another problem, mesh or solver version: starting " \
           "from the beginning" in r.stderr


def test_key_changes_with_the_solver_source(tmp_path):
    """The solver version a checkpoint is tied to is its source: a copy of
    the package with one line changed hashes differently."""
    code = ("import micromag, micromag.checkpoint as c; "
            "print(micromag.__file__, c.solver_hash())")
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "micromag", pkg / "micromag",
                    ignore=shutil.ignore_patterns("__pycache__"))

    def hash_at(root):
        env = _env()
        env["PYTHONPATH"] = str(root)
        out = subprocess.run([sys.executable, "-c", code], cwd=root,
                             capture_output=True, text=True, env=env,
                             check=True).stdout.split()
        assert out[0].startswith(str(root))
        return out[1]

    same = hash_at(pkg)
    assert same == checkpoint.solver_hash()
    llg = pkg / "micromag" / "llg.py"
    llg.write_text(llg.read_text() + "\n# changed\n")
    assert hash_at(pkg) != same


def test_torn_or_foreign_checkpoint_is_refused(tmp_path):
    path = tmp_path / checkpoint.NAME
    checkpoint.save(path, np.ones((4, 3)), np.zeros((0, 2)),
                    {"key": "k", "columns": ["a", "b"]})
    ck, why = checkpoint.load_matching(path, "k", 4, ["a", "b"])
    assert ck is not None and why == ""
    assert checkpoint.load_matching(path, "other", 4, ["a", "b"])[0] is None
    assert checkpoint.load_matching(path, "k", 5, ["a", "b"])[0] is None
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])          # torn write
    ck, why = checkpoint.load(path)
    assert ck is None and "unreadable" in why
    assert not list(tmp_path.glob(".*tmp"))


def test_converge_continues_an_interrupted_study(tmp_path):
    prob = _problem(tmp_path / "p.toml")
    study = tmp_path / "study"
    cmd = [sys.executable, "-m", "ivcloud", "mag", "converge", str(prob),
           "--out", str(study), "--cells", "10", "--layers", "1",
           "--checkpoint-every", "0", "--times", "1e-10,1.5e-10"]
    run_dir = study / "h10" / "run"
    meta = _kill_midway(cmd, run_dir, signal.SIGKILL)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL, env=_env())
    assert r.returncode == 0, r.stderr
    assert "continuing from the checkpoint at stage 2" in r.stderr
    summary = json.loads((study / "h10" / "summary.json").read_text())
    assert summary["resumed"][0]["t"] >= meta["t"]
    report = json.loads((study / "convergence.json").read_text())
    assert report["complete"] == [10.0]
    assert all(v is not None for v in report["values"][0]["m"])
