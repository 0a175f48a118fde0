"""Shared test setup: find the native build (a test that needs it fails,
never skips, without it), make `ivcloud` and `micromag` importable in
this process and in the subprocesses the tests start, and hand out
unique names for shm files and servers.

The solver's tests (tests/micromag/) need no native build: the check
is made per test, for every test outside that directory, so that
`pytest tests/micromag` runs on a machine without build/native while
every other test fails at setup with the one line that says what is
missing."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# tests below these directories do not use the native build
NATIVE_FREE = [Path(__file__).resolve().parent / "micromag"]
REQUIRED = ["libivshm.so", "ivshmem-server", "ivshm-pingpong",
            "tcp-pingpong"]


def _native_dir() -> Path:
    env = os.environ.get("IVCLOUD_NATIVE_DIR")
    return Path(env) if env else REPO / "build" / "native"


def _missing_native(native: Path) -> str:
    """'' if the native build is complete, else the line that says what
    is missing."""
    need = list(REQUIRED)
    if shutil.which("mpicc"):
        need.append("mpi-pingpong")  # built whenever mpicc exists
    missing = [n for n in need if not (native / n).exists()]
    if not missing:
        return ""
    return (f"native build missing in {native}: {', '.join(missing)} -- run "
            f"`make build` (or set IVCLOUD_NATIVE_DIR to a cmake build of "
            f"native/)")


def pytest_configure(config):
    native = _native_dir().resolve()
    config._ivcloud_native_missing = _missing_native(native)
    os.environ["IVCLOUD_NATIVE_DIR"] = str(native)
    # Subprocesses (`python -m ivcloud`, child peers) import the same tree.
    paths = [str(REPO)] + [p for p in
                           os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _needs_native(path: Path) -> bool:
    path = Path(path).resolve()
    return not any(path.is_relative_to(d) for d in NATIVE_FREE)


@pytest.fixture(autouse=True)
def _native_build(request):
    """Fail (not skip) every test that needs the native build when it is
    missing; the solver's tests go on without it."""
    missing = request.config._ivcloud_native_missing
    if missing and _needs_native(request.node.path):
        pytest.fail(missing, pytrace=False)


@pytest.fixture
def native_dir() -> Path:
    return Path(os.environ["IVCLOUD_NATIVE_DIR"])


@pytest.fixture(scope="session")
def mpicc(tmp_path_factory):
    """Compile an MPI C program (warnings are errors): mpicc(src) -> the
    executable, in a directory of this test session."""
    def build(src: Path) -> Path:
        cc = shutil.which("mpicc")
        assert cc, "mpicc not found (install libopenmpi-dev)"
        out = tmp_path_factory.mktemp("mpicc") / src.stem
        proc = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror",
                               "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return out
    return build


@pytest.fixture
def other_hostnames():
    """hosts("vmA:1,vmB:1") -> the mpirun options that start the ranks on
    this machine, each "node" under its own hostname, as in co-resident
    VMs (native/btl/tests/fake_rsh.sh as the launch agent). Skips the
    test without root and `unshare --uts`."""
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(
            ["unshare", "--uts", "true"], capture_output=True).returncode:
        pytest.skip("needs root and unshare --uts (fake_rsh.sh)")
    agent = REPO / "native" / "btl" / "tests" / "fake_rsh.sh"
    return lambda hosts: ["--host", hosts, "--bind-to", "none",
                          "--mca", "plm_rsh_agent", str(agent)]


@pytest.fixture
def unique() -> str:
    """A short name no other test run uses."""
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def shm_path(unique):
    """A /dev/shm path removed after the test, whatever happens."""
    path = Path("/dev/shm") / f"ivcloud-pytest-{unique}"
    yield path
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _c_environ_names():
    libc = ctypes.CDLL(None)
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
    names, i = [], 0
    while environ[i]:
        names.append(environ[i].split(b"=", 1)[0].decode(errors="replace"))
        i += 1
    return names


@pytest.fixture(autouse=True)
def _no_inherited_mpi_singleton():
    """Tests that use petsc4py/mpi4py in this process initialise MPI as a
    singleton, which setenv()s PMIx/ORTE variables behind os.environ; every
    subprocess would inherit them, and an mpirun started under them exits
    at once. Keep the C environment what os.environ says it is."""
    def scrub():
        for name in _c_environ_names():
            if name not in os.environ:
                os.unsetenv(name)
    scrub()  # collection may have imported petsc4py already
    yield
    scrub()


@pytest.fixture(scope="session")
def mpi_programs():
    """build(name, source) -> an MPI program compiled with mpicc into a
    directory outside /tmp (cluster instances have a /tmp of their own),
    removed at the end of the session."""
    if not (shutil.which("mpicc") and shutil.which("mpirun")):
        pytest.skip("Open MPI (mpicc, mpirun) not installed")
    d = Path(f"/var/tmp/ivcloud-test-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    d.mkdir()

    def build(name: str, source: str) -> Path:
        (d / f"{name}.c").write_text(source)
        subprocess.run(["mpicc", "-O2", "-o", str(d / name),
                        str(d / f"{name}.c")], check=True, timeout=120)
        return d / name

    try:
        yield build
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def guest_packages_dir(tmp_path_factory) -> Path:
    """The directory of this build's packages (packaging/mkdeb.sh:
    ivcloud-guest, ivcloud-host, python3-micromag), made once for the
    session: every module of QEMU guests uses the same."""
    from vm_support import guest_packages
    return guest_packages(tmp_path_factory.mktemp("deb")).parent


@pytest.fixture(scope="session")
def guest_deb(guest_packages_dir) -> Path:
    """The guest package, once the image a cluster of it boots (with the
    solver's package) is built or found in the cache."""
    from vm_support import cluster_guest_deb
    return cluster_guest_deb(guest_packages_dir /
                             "ivcloud-guest_0.1.0_amd64.deb")
