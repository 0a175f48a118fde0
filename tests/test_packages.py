"""`make deb`: the ivcloud-guest and ivcloud-host Debian packages.

Builds both packages with packaging/mkdeb.sh from the native build,
checks what they hold, lints them, and installs, upgrades (same packages
with a bumped version), removes and purges them with dpkg inside a
throwaway Debian 12 root: the base root of the Debian guest image
(ivcloud/vm/debian.py, mmdebstrap, cached in /var/cache/ivcloud), unpacked
into a temporary directory. Nothing is installed on the host.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ivcloud.vm import debian

REPO = Path(__file__).resolve().parents[1]
NATIVE = Path(os.environ.get("IVCLOUD_NATIVE_DIR") or REPO / "build" / "native")
MKDEB = REPO / "packaging" / "mkdeb.sh"
BIND = REPO / "packaging" / "guest" / "ivshm-bind"
MCA_CONF = "etc/openmpi/openmpi-mca-params.conf"
BTL_SO = "usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/mca_btl_ivshmem.so"

pytestmark = pytest.mark.skipif(
    shutil.which("dpkg-deb") is None or
    not (NATIVE / "guest" / "ivshm-guest-shared").is_file(),
    reason="needs dpkg-deb and a native release build (make build)")


def run(cmd, timeout=300, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout}"
                             f"\n{p.stderr}")
    return p


def mkdeb(out: Path, version: str):
    run(["sh", str(MKDEB), str(NATIVE), str(out), version])
    return (out / f"ivcloud-guest_{version}_amd64.deb",
            out / f"ivcloud-host_{version}_amd64.deb")


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deb")
    return {"v1": mkdeb(out, "0.1.0"), "v2": mkdeb(out, "0.1.0+2")}


def contents(deb: Path):
    out = run(["dpkg-deb", "-c", str(deb)]).stdout
    return {line.split()[-1] if " -> " not in line
            else line.split(" -> ")[0].split()[-1]: line
            for line in out.splitlines()}


def field(deb: Path, name: str) -> str:
    return run(["dpkg-deb", "-f", str(deb), name]).stdout.strip()


def test_guest_package_contents(debs):
    guest, _ = debs["v1"]
    c = contents(guest)
    for path in ["./usr/lib/x86_64-linux-gnu/libivshm.so.1.0.0",
                 "./usr/lib/x86_64-linux-gnu/libivshm.so.1",
                 "./" + BTL_SO,
                 "./usr/bin/ivshm-guest",
                 "./usr/lib/x86_64-linux-gnu/libfabric/libivshm-fi.so",
                 "./etc/profile.d/ivcloud-guest.sh",
                 "./usr/libexec/ivcloud-guest/ivshm-bind",
                 "./lib/udev/rules.d/60-ivcloud-ivshmem.rules",
                 "./lib/systemd/system/ivshm-bind@.service",
                 "./etc/modprobe.d/ivcloud-guest.conf"]:
        assert path in c, path
    assert c["./usr/bin/ivshm-guest"].startswith("-rwxr-xr-x root/root")
    assert field(guest, "Package") == "ivcloud-guest"
    assert field(guest, "Version") == "0.1.0"
    assert "libopenmpi3 (<< 4.2) | libopenmpi40" in field(guest, "Depends")
    info = run(["dpkg-deb", "-I", str(guest)]).stdout
    for member in ("postinst", "prerm", "postrm", "triggers", "conffiles",
                   "md5sums", "shlibs"):
        assert member in info
    with tempfile.TemporaryDirectory() as tmp:
        run(["dpkg-deb", "-x", str(guest), tmp])
        # the BTL has no build-tree RUNPATH and needs no libivshm.so
        dyn = run(["readelf", "-d", f"{tmp}/{BTL_SO}"]).stdout
        assert "PATH" not in dyn and "libivshm" not in dyn
        assert "libivshm.so.1" in run(
            ["readelf", "-d", f"{tmp}/usr/bin/ivshm-guest"]).stdout
        rule = Path(tmp, "lib/udev/rules.d/60-ivcloud-ivshmem.rules").read_text()
        assert 'ATTR{vendor}=="0x1af4", ATTR{device}=="0x1110"' in rule
        assert "ivshm-bind@%k.service" in rule


def test_host_package_contents(debs):
    _, host = debs["v1"]
    c = contents(host)
    for path in ["./usr/sbin/ivshmem-server",
                 "./lib/systemd/system/ivshmem-server@.service",
                 "./usr/bin/ivcloud",
                 "./usr/lib/ivcloud/libivshm.so",
                 "./usr/lib/ivcloud/btl/mca_btl_ivshmem.so",
                 "./usr/lib/ivcloud/guest/ivshm-guest",
                 "./usr/lib/python3/dist-packages/ivcloud/__init__.py",
                 "./usr/lib/python3/dist-packages/ivcloud/cli/__init__.py",
                 "./usr/lib/python3/dist-packages/ivcloud/vm/debian.py",
                 "./usr/lib/python3/dist-packages/micromag/__init__.py"]:
        assert path in c, path
    assert not any("__pycache__" in p for p in c)
    assert field(host, "Package") == "ivcloud-host"
    with tempfile.TemporaryDirectory() as tmp:
        run(["dpkg-deb", "-x", str(host), tmp])
        unit = Path(tmp, "lib/systemd/system/ivshmem-server@.service").read_text()
        for opt in ("ProtectSystem=strict", "NoNewPrivileges=yes",
                    "PrivateTmp=yes", "RuntimeDirectory=ivshmem-server/%i"):
            assert opt in unit
        if shutil.which("systemd-analyze"):
            p = run(["systemd-analyze", "verify",
                     f"{tmp}/lib/systemd/system/ivshmem-server@.service"],
                    check=False)
            # the binary path is that of an installed package: only
            # complaints about our unit's syntax count
            bad = [ln for ln in p.stderr.splitlines()
                   if "ivshmem-server@" in ln and "Unknown" in ln]
            assert not bad, p.stderr


def test_solver_package_needs_only_what_the_guest_image_has(debs):
    """python3-micromag depends on mpi4py-fft (the grid demag's
    distributed FFT), and the Debian guest image installs every package
    it depends on, so that dpkg -i of it in the image needs no mirror."""
    from ivcloud.vm import debian
    solver = debs["v1"][0].with_name("python3-micromag_0.1.0_all.deb")
    depends = [d.split("(")[0].strip()
               for d in field(solver, "Depends").split(",")]
    assert "python3-mpi4py-fft" in depends
    missing = [d for d in depends
               if d != "python3" and d not in debian.BASE_PACKAGES]
    assert not missing, missing


@pytest.mark.skipif(shutil.which("lintian") is None, reason="no lintian")
def test_lintian_has_no_errors(debs):
    p = run(["lintian", "--tag-display-limit", "0", *map(str, debs["v1"])],
            check=False, timeout=300)
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("E:")]
    assert not errors, p.stdout


def test_bind_script_refuses_bad_input():
    p = run(["sh", str(BIND), "0000:00:01.0;reboot"], check=False)
    assert p.returncode == 2 and "bad PCI address" in p.stderr
    p = run(["sh", str(BIND)], check=False)
    assert p.returncode == 2 and "usage" in p.stderr
    p = run(["sh", str(BIND), "0000:ff:1f.7"], check=False)
    assert p.returncode == 1 and "no PCI device 0000:ff:1f.7" in p.stderr


# ---------------------------------------------------------------- dpkg

def _can_build_root() -> bool:
    return os.geteuid() == 0 and shutil.which("mmdebstrap") is not None


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A fresh Debian 12 root (Open MPI, udev, python3, ...), unpacked
    from the cached base tarball of the guest image."""
    if not _can_build_root():
        pytest.skip("needs root and mmdebstrap (apt-get install mmdebstrap)")
    tar = debian.base_root()
    d = Path(tempfile.mkdtemp(prefix="ivcloud-pkgroot-", dir="/var/tmp"))
    try:
        run(["tar", "-C", str(d), "--numeric-owner", "-xpf", str(tar)],
            timeout=600)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def chroot(root: Path, *cmd, check=True, timeout=300):
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
           "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root",
           "LC_ALL": "C"}
    return run(["chroot", str(root), *cmd], check=check, timeout=timeout,
               env=env)


def tree(root: Path):
    """Every path of the root that a package could leave behind (dpkg's
    own database, logs and caches excepted)."""
    # /run is a tmpfs on a booted system (adduser leaves its lock there)
    skip = ("var/lib/dpkg", "var/log", "var/cache", "etc/ld.so.cache",
            "tmp", "run")
    out = set()
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.startswith(skip) or rel.startswith(("proc", "sys", "dev")):
            dirs[:] = []
            continue
        for name in dirs + files:
            p = os.path.normpath(os.path.join(rel, name))
            if not p.startswith(skip) and not p.endswith("-"):
                out.add(p)
    return out


def test_install_upgrade_remove_purge(root, debs):
    mca_before = (root / MCA_CONF).read_bytes()
    group_before = (root / "etc/group").read_text()
    tree_before = tree(root)
    for deb in (*debs["v1"], *debs["v2"]):
        shutil.copy(deb, root / "tmp")
    g1, h1 = (f"/tmp/{d.name}" for d in debs["v1"])
    g2, h2 = (f"/tmp/{d.name}" for d in debs["v2"])

    chroot(root, "dpkg", "-i", g1, h1)
    status = chroot(root, "dpkg-query", "-W", "-f=${Package} ${Version} ${Status}\n",
                    "ivcloud-guest", "ivcloud-host").stdout
    assert "ivcloud-guest 0.1.0 install ok installed" in status
    assert "ivcloud-host 0.1.0 install ok installed" in status
    mca = (root / MCA_CONF).read_text()
    assert mca.startswith(mca_before.decode())
    # Debian's file lacks a final newline: ours must not glue onto its
    # last setting (that made "osc = ^ucx,pt2pt# BEGIN ...")
    assert "\n# BEGIN ivcloud-guest" in mca
    assert mca.count("# BEGIN ivcloud-guest") == 1
    assert "btl = self,vader,ivshmem,tcp" in mca
    assert "ivshm:" in (root / "etc/group").read_text()
    # the ldconfig trigger ran
    assert "libivshm.so.1" in chroot(root, "ldconfig", "-p").stdout
    # Open MPI finds and opens our component
    info = chroot(root, "ompi_info", "--parsable").stdout
    assert "mca:btl:ivshmem:version" in info
    assert "btl_ivshmem_region" in chroot(
        root, "ompi_info", "--param", "btl", "ivshmem", "--level", "9").stdout
    # the CLI and the server of the host package run
    assert "ivshmem-server" in chroot(root, "ivshmem-server", "--help").stdout
    assert "vm" in chroot(root, "ivcloud", "--help").stdout
    lib = chroot(root, "sh", "-c", "IVCLOUD_NATIVE_DIR=/usr/lib/ivcloud "
                 "python3 -c 'from ivcloud import native; "
                 "print(native.library())'", check=False)
    assert lib.returncode == 0, lib.stderr

    # upgrade: same packages, bumped version; our block stays single
    chroot(root, "dpkg", "-i", g2, h2)
    status = chroot(root, "dpkg-query", "-W", "-f=${Version}\n",
                    "ivcloud-guest", "ivcloud-host").stdout.split()
    assert status == ["0.1.0+2", "0.1.0+2"]
    assert (root / MCA_CONF).read_text().count("# BEGIN ivcloud-guest") == 1
    assert (root / BTL_SO).is_file()

    # remove: our files and our block go, conffile and group stay
    chroot(root, "dpkg", "-r", "ivcloud-guest", "ivcloud-host")
    assert (root / MCA_CONF).read_bytes() == mca_before
    assert not (root / BTL_SO).exists()
    assert not (root / "usr/lib/python3/dist-packages/ivcloud").exists()
    assert (root / "etc/modprobe.d/ivcloud-guest.conf").exists()
    assert "ivshmem" not in chroot(root, "ompi_info", "--parsable").stdout
    # Open MPI still works without us (a leftover `btl = ...ivshmem...`
    # line would make every mpirun fail)
    assert "mca:btl:tcp:version" in chroot(root, "ompi_info",
                                           "--parsable").stdout

    # purge: nothing of ours is left
    chroot(root, "dpkg", "-P", "ivcloud-guest", "ivcloud-host")
    for d in debs["v1"] + debs["v2"]:
        (root / "tmp" / d.name).unlink()
    assert (root / "etc/group").read_text() == group_before
    assert "ivcloud" not in chroot(root, "dpkg", "-l").stdout
    assert tree(root) == tree_before
    assert not (root / "run/ivshm").exists()


def test_image_cache_keeps_the_most_recently_used(tmp_path):
    """The image cache outside the clone does not grow without bound: a
    new entry evicts the least recently used beyond KEEP_IMAGES, never
    the current one and never one whose build holds its lock."""
    import fcntl
    dirs = []
    for i in range(5):
        d = tmp_path / f"guest-debian-{i}"
        d.mkdir()
        (d / ".used").touch()
        os.utime(d / ".used", (1000 + i, 1000 + i))
        dirs.append(d)
    current = dirs[0]          # the oldest, but the one just built
    with open(dirs[1] / ".lock", "a") as held:   # a build in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        debian._prune(tmp_path, "guest-debian", 3, current)
    left = sorted(d.name for d in tmp_path.iterdir())
    # current + the 2 most recently used others stay; dirs[1] is locked
    assert left == ["guest-debian-0", "guest-debian-1", "guest-debian-3",
                    "guest-debian-4"]
