"""Shared test setup: find the native build (fail, never skip, without it),
make `ivcloud` importable in this process and in the subprocesses the
tests start, and hand out unique names for shm files and servers."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ["libivshm.so", "ivshmem-server", "ivshm-pingpong",
            "tcp-pingpong"]


def _native_dir() -> Path:
    env = os.environ.get("IVCLOUD_NATIVE_DIR")
    return Path(env) if env else REPO / "build" / "native"


def pytest_configure(config):
    native = _native_dir().resolve()
    need = list(REQUIRED)
    if shutil.which("mpicc"):
        need.append("mpi-pingpong")  # built whenever mpicc exists
    missing = [n for n in need if not (native / n).exists()]
    if missing:
        raise pytest.UsageError(
            f"native build missing in {native}: {', '.join(missing)} -- run "
            f"`make build` (or set IVCLOUD_NATIVE_DIR to a cmake build of "
            f"native/)")
    os.environ["IVCLOUD_NATIVE_DIR"] = str(native)
    # Subprocesses (`python -m ivcloud`, child peers) import the same tree.
    paths = [str(REPO)] + [p for p in
                           os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


@pytest.fixture
def native_dir() -> Path:
    return Path(os.environ["IVCLOUD_NATIVE_DIR"])


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
