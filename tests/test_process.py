"""ivcloud/process.py: a rollback's undo steps run to their end under
real signals (SIGINT, SIGTERM, SIGHUP sent while they run), each tried
even when one fails; the first signal held back is delivered after
them, not lost."""

from __future__ import annotations

import signal
import subprocess
import sys

PROGRAM = r"""
import os, signal, sys, time
from ivcloud import process

def step(name, signum=None, fail=False):
    def run():
        if signum:
            os.kill(os.getpid(), signum)
            time.sleep(0.3)   # a handler, if any, has run by now
        print("undone", name, flush=True)
        if fail:
            raise RuntimeError(name + " went wrong")
    return (name, run)

# latest first: c's Ctrl-C is the first held back
steps = [step("a", signal.SIGHUP), step("b", signal.SIGTERM, fail=True),
         step("c", signal.SIGINT)]
try:
    with process.interrupts():
        raise process.Interrupted(signal.SIGTERM)
except process.Interrupted:
    try:
        process.undo(steps, lambda line: print(line, flush=True))
        print("not delivered", flush=True)
    except KeyboardInterrupt:
        print("then Ctrl-C", flush=True)
print("left", steps, flush=True)
os.kill(os.getpid(), signal.SIGTERM)   # no longer shielded
time.sleep(5)
"""


def test_undo_is_shielded_from_signals():
    r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "undone c", "rolled back: c", "undone b",
        "not rolled back: b: b went wrong", "undone a", "rolled back: a",
        "then Ctrl-C", "left []"], r.stdout
