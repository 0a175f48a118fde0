"""What the tests of QEMU guests share: the guest package a cluster
boots, finding the QEMU processes a run directory started, and taking
guests and their ivshmem-server down so that nothing is left, whatever
the test did.

    from vm_support import cluster_guest_deb, qemus_naming, vm_down

The packages themselves come from the session's fixtures in conftest.py
(guest_packages_dir, guest_deb): made once for the whole run.

Run as a script (`python tests/vm_support.py DIR`, what `make test` does
while the C tests and the fuzzers run), it makes the packages in DIR and
builds both Debian images the VM modules boot (prebuild): the build is
mostly disk work (tar, dpkg, mke2fs), theirs CPU, and the modules then
find the images in the cache.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ivcloud.server import stop as server_stop

REPO = Path(__file__).resolve().parents[1]
NATIVE = Path(os.environ.get("IVCLOUD_NATIVE_DIR") or REPO / "build" / "native")


def guest_packages(out: Path) -> Path:
    """The guest package of this build, made in `out` by
    packaging/mkdeb.sh with the host's and the solver's beside it."""
    subprocess.run(["sh", str(REPO / "packaging" / "mkdeb.sh"), str(NATIVE),
                    str(out), "0.1.0"], check=True, capture_output=True,
                   timeout=300)
    return out / "ivcloud-guest_0.1.0_amd64.deb"


# what test_guest_image.py's image adds to the guest package (its
# hardened unit runs under the guest's systemd)
HOST_DEB = "ivcloud-host_0.1.0_amd64.deb"


def cluster_guest_deb(deb: Path) -> Path:
    """`deb` (guest_packages'), once the image a cluster of it boots is
    built (once per package, cached in /var/cache/ivcloud): with the
    solver's package beside it."""
    from ivcloud.vm import debian
    solver = debian.solver_deb_beside(deb)
    assert solver is not None, "mkdeb.sh built no python3-micromag"
    debian.build(deb=deb, extra=[solver])
    return deb


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


def prebuild(out: Path) -> str:
    """The packages in `out` and both images of them (cluster_guest_deb's
    and test_guest_image.py's) built into the cache, unless the VM
    modules would skip (the same conditions as test_guest_image.py's
    pytestmark): what was done, in a line."""
    from ivcloud.vm import debian, qemu
    if os.environ.get("IVCLOUD_SKIP_GUEST_IMAGE") == "1":
        return "IVCLOUD_SKIP_GUEST_IMAGE=1: no images"
    if (qemu.qemu_binary() is None or os.geteuid() != 0 or
            shutil.which("mmdebstrap") is None or
            shutil.which("dpkg-deb") is None):
        return "no QEMU, root, mmdebstrap or dpkg-deb: the VM tests skip"
    deb = guest_packages(out)
    cluster_guest_deb(deb)
    debian.build(deb=deb, extra=[deb.parent / HOST_DEB])
    return f"the guest images of {deb.parent} are in the cache"


if __name__ == "__main__":
    print(prebuild(Path(sys.argv[1])))
