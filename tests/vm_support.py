"""What the tests of QEMU guests share: finding the QEMU processes a run
directory started, and taking guests and their ivshmem-server down so
that nothing is left, whatever the test did.

    from vm_support import qemus_naming, vm_down
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ivcloud.server import stop as server_stop


def qemus_naming(path: Path):
    """Live QEMU processes (not zombies) whose command line names `path`."""
    out = []
    needle = str(path).encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if ((p / "comm").read_text().startswith("qemu-system") and
                        needle in (p / "cmdline").read_bytes() and
                        ") Z" not in (p / "stat").read_text()):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def vm_down(run_dir: Path, paths) -> None:
    """`ivcloud vm down` of `run_dir`, then the server of `paths`; kills
    any QEMU left and removes the directory, then fails the test if `vm
    down` failed or left a QEMU behind."""
    try:
        r = subprocess.run([sys.executable, "-m", "ivcloud", "vm", "down",
                            "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=300)
    finally:
        # the rest also when `vm down` hung
        try:
            server_stop(paths)
        except Exception:
            pass
        left = qemus_naming(run_dir)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert not left, f"vm down left QEMU processes {left}"
