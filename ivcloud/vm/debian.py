"""The Debian guest image (`ivcloud vm image --kind debian`): a Debian 12
root built with mmdebstrap from Debian packages, the way an operator
builds a cloud image, with our ivcloud-guest package installed by dpkg.
`--release trixie` builds Debian 13 instead (RELEASES: its suite,
mirrors and a smaller package list: Open MPI 5.0.7 and libfabric 2.1,
mpi4py, no applications), cached the same way under names of its own.

Two cached layers, each in a directory named by the hash of its inputs,
outside the source tree (default /var/cache/ivcloud, $IVCLOUD_IMAGE_CACHE),
so that every clone and every CI run on the host reuses them:

- debian-base-<hash>/root.tar: `mmdebstrap --variant=apt` of BASE_PACKAGES
  (kernel, systemd, Open MPI, mpi4py, numpy, hpcc, openfoam, PETSc's
  petsc4py, ...). Inputs: suite, mirrors, package list, BASE_VERSION.
- guest-debian-<hash>/: vmlinuz, initrd.img (Debian's initramfs-tools
  run again with INITRAMFS_CONF: the root disk's modules only) and
  disk.img, a raw ext4 file
  system made with `mke2fs -d` from the base root after `dpkg -i` of the
  guest package (and extra packages: a VM cluster adds python3-micromag,
  the solver, when `make deb` built it beside the guest package) and the
  files of this module (agent and ready units). Inputs: the base hash,
  the .debs' sha256, the files, IMAGE_VERSION.

QEMU boots it directly (-kernel/-initrd, root=/dev/vda) with the disk in
snapshot mode, so any number of guests share one read-only image.

In the guest, ivcloud-agent.service serves the agent protocol of
agent.py on ttyS1 (no login), and ivcloud-ready.service prints the
launcher's banners on the console once the ivshmem device is bound.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import filelock
from ..errors import ImageError
from .image import (AGENT_LOOP, INIT_BANNER, READY_BANNER, GuestImage,
                    sha256_of)

# Bump when the build steps change in a way the inputs cannot see.
BASE_VERSION = 1
IMAGE_VERSION = 1

SUITE = "bookworm"
MIRRORS = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
]
BASE_PACKAGES = [
    "linux-image-amd64", "systemd-sysv", "udev", "kmod", "adduser",
    "openmpi-bin", "python3-mpi4py", "python3-numpy", "hpcc",
    "openssh-client", "openssh-server", "iproute2", "procps",
    # the application benchmarks (ivcloud.apps): OpenFOAM's solvers and
    # what the python3-micromag package of `make deb` depends on (PETSc,
    # SciPy, mpi4py-fft for the grid demag's distributed FFT) or
    # recommends (meshio for VTU snapshots, matplotlib for the <m>(t)
    # plot), so that dpkg -i of it needs nothing from a mirror
    "openfoam", "python3-scipy", "python3-petsc4py", "python3-mpi4py-fft",
    "python3-meshio", "python3-matplotlib",
    # a VM cluster's Slurm nodes (`cluster up --instance-kind vm
    # --scheduler slurm`): slurmd and munged, started by the cluster with
    # its own configuration; Slurm's mpi/pmix plugin (in the basic
    # plugins) dlopens libpmix.so, which only the -dev package has;
    # Intel MPI's tasks under `srun --mpi=pmi2` load Slurm's PMI-2 client
    # library (ivcloud/mpis/impi.py, PMI2_LIBRARY)
    "slurmd", "munge", "slurm-wlm-basic-plugins", "libpmix-dev",
    "libpmi2-0",
]
# Debian 13: what the guest package needs (Open MPI 5 reaches the region
# through libfabric's ivshm provider) and mpi4py, no applications.
TRIXIE_PACKAGES = [
    "linux-image-amd64", "initramfs-tools", "systemd-sysv", "udev", "kmod",
    "adduser", "openmpi-bin", "libfabric1", "python3-mpi4py",
    "openssh-client", "openssh-server", "iproute2", "procps",
]


@dataclass(frozen=True)
class Release:
    """A Debian release an image can be built from: mmdebstrap's suite,
    its mirrors and packages, and the prefix of its cache entries."""
    suite: str
    title: str
    mirrors: Tuple[str, ...]
    packages: Tuple[str, ...]
    cache_prefix: str   # its entries: PREFIX-base-HASH, guest-PREFIX-HASH


RELEASES = {
    "bookworm": Release(SUITE, "Debian 12", tuple(MIRRORS),
                        tuple(BASE_PACKAGES), "debian"),
    "trixie": Release("trixie", "Debian 13", (
        "deb http://deb.debian.org/debian trixie main",
        "deb http://deb.debian.org/debian trixie-updates main",
        "deb http://deb.debian.org/debian-security trixie-security main",
    ), tuple(TRIXIE_PACKAGES), "debian13"),
}
DEFAULT_RELEASE = "bookworm"


def release(name: Optional[str] = None) -> Release:
    """The Release called `name` (None: Debian 12); ImageError for one
    we cannot build."""
    name = name or DEFAULT_RELEASE
    if name not in RELEASES:
        raise ImageError(f"unknown Debian release '{name}' (choose from "
                         f"{', '.join(RELEASES)})", setting="release")
    return RELEASES[name]


GUEST_PACKAGE = "ivcloud-guest"
# the solver's package (`make deb` builds it beside the guest package):
# VM clusters install it too, for the application benchmarks
SOLVER_PACKAGE = "python3-micromag"
MPI_USER = "mpi"   # an unprivileged user in group ivshm, for mpirun
# the virtio serial of a guest's read-only share of a host directory
# (share.py), which the ready script mounts
SHARE_SERIAL = "ivcloud-share"
CACHE_ENV = "IVCLOUD_IMAGE_CACHE"
DEFAULT_CACHE = "/var/cache/ivcloud"
BASE_TIMEOUT_S = 1500
# the root file system gets this much room beyond its contents
DISK_SLACK = 256 << 20
# cache entries kept per layer (least recently used go first): every
# commit makes a new package, hence a new image of ~0.9 GB
KEEP_IMAGES = 3
KEEP_BASES = 2

# Files added to the image (path -> (mode, text)).
AGENT_SH = "#!/bin/sh\n# the ivcloud agent on ttyS1: see ivcloud/vm/agent.py\n" + AGENT_LOOP

READY_SH = r"""#!/bin/sh
# Console banners for `ivcloud vm up` (ivcloud/vm/debian.py): the name
# from the kernel command line, then the ivshmem binding once done.
arg() {
    for w in $(cat /proc/cmdline); do
        case "$w" in ivcloud.$1=*) echo "${w#*=}"; return;; esac
    done
}
NAME=$(arg name)
[ -z "$NAME" ] || hostname "$NAME"
echo "@INIT_BANNER@ $(uname -r)" > /dev/console
# The guests' own network (`vm up --network`): our address, the others'
# names. The NIC appears once udev has loaded virtio_net.
IP=$(arg ip)
if [ -n "$IP" ]; then
    i=0
    while :; do
        IF=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
        [ -z "$IF" ] && [ $i -lt 100 ] || break
        sleep 0.1; i=$((i+1))
    done
    if [ -n "$IF" ]; then
        ip addr add "$IP" dev "$IF"
        ip link set "$IF" up
    else
        echo "ivcloud-guest: no network interface for $IP" > /dev/console
    fi
    for h in $(arg hosts | tr , ' '); do
        echo "${h#*:} ${h%%:*}" >> /etc/hosts
    done
fi
# A host directory shared read only at its host path (share.py), mounted
# before the banner: jobs may start as soon as it is out.
SHARE=$(arg share)
if [ -n "$SHARE" ]; then
    DISK=/dev/disk/by-id/virtio-@SHARE_SERIAL@
    i=0
    while [ ! -e $DISK ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
    mkdir -p "$SHARE" && mount -t ext4 -o ro $DISK "$SHARE" ||
        echo "ivcloud-guest: cannot mount the share at $SHARE" > /dev/console
fi
DEV=
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ]; then
        DEV=${d##*/}; break
    fi
done
if [ -z "$DEV" ]; then
    echo "@READY_BANNER@ name=$NAME device=none" > /dev/console
    exit 0
fi
i=0
# ivshm-bind@ may take up to its 120 s start timeout on a loaded TCG host
while [ ! -e /run/ivshm/ivshm.env ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
if [ ! -e /run/ivshm/ivshm.env ]; then
    echo "ivcloud-guest: ivshm-bind@$DEV did not bind the device:" \
        "$(systemctl is-failed ivshm-bind@$DEV.service)" > /dev/console
    exit 1
fi
set -a; . /run/ivshm/ivshm.env; set +a
# IVPosition, our id at the server, for `vm status`: ivshm-bind read it
# from BAR0 before vfio-pci took the BAR (IVSHM_POSITION). Without it,
# ask libivshm (a short attachment, before any user runs); a loaded TCG
# host can take longer than one try's 20 s, so up to 4 tries
POS=$(echo "${IVSHM_POSITION:-}" | grep -x '[0-9][0-9]*'); i=0
while [ -z "$POS" ] && [ $i -lt 4 ]; do
    POS=$(timeout 20 ivshm-guest info --job 1 2>/dev/null | sed -n 's/^{"cmd":"info","slot":[0-9-]*,"doorbell_id":\([0-9]*\).*/\1/p' | head -n 1)
    i=$((i+1))
done
echo "@READY_BANNER@ name=$NAME device=$DEV ivposition=${POS:-unknown} doorbell=$IVSHM_DOORBELL irq=$IVSHM_UIO" > /dev/console
"""

# The initramfs: Debian's default (MODULES=most) packs every storage,
# USB and input driver, 36 MB that a TCG guest unpacks and whose udev
# coldplug it runs before it mounts its root. A guest needs only its
# root disk (virtio-blk, ext4); the rest of the modules load from the root
# file system once systemd's udev runs (ivshm-bind's vfio among them).
INITRAMFS_CONF = """# ivcloud guest image (ivcloud/vm/debian.py): only what mounting the
# root on virtio-blk needs; the rest loads from the root file system
MODULES=list
"""
INITRAMFS_MODULES = """# ivcloud guest image (ivcloud/vm/debian.py): the root disk
virtio_pci
virtio_blk
ext4
"""

AGENT_UNIT = """[Unit]
Description=ivcloud command agent on ttyS1
After=local-fs.target

[Service]
ExecStart=/bin/sh /usr/local/sbin/ivcloud-agent
Restart=always
Environment=HOME=/root

[Install]
WantedBy=multi-user.target
"""

READY_UNIT = """[Unit]
Description=ivcloud console banner
After=ivcloud-agent.service systemd-udevd.service ssh.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh /usr/local/sbin/ivcloud-ready

[Install]
WantedBy=multi-user.target
"""


def _files() -> Dict[str, tuple]:
    ready = (READY_SH.replace("@INIT_BANNER@", INIT_BANNER)
             .replace("@READY_BANNER@", READY_BANNER)
             .replace("@SHARE_SERIAL@", SHARE_SERIAL))
    return {
        "usr/local/sbin/ivcloud-agent": (0o755, AGENT_SH),
        "usr/local/sbin/ivcloud-ready": (0o755, ready),
        "etc/systemd/system/ivcloud-agent.service": (0o644, AGENT_UNIT),
        "etc/systemd/system/ivcloud-ready.service": (0o644, READY_UNIT),
        "etc/hostname": (0o644, "ivcloud-guest\n"),
        "etc/fstab": (0o644, "/dev/vda / ext4 rw,errors=remount-ro 0 1\n"),
        "etc/initramfs-tools/conf.d/ivcloud.conf": (0o644, INITRAMFS_CONF),
        "etc/initramfs-tools/modules": (0o644, INITRAMFS_MODULES),
        f"home/{MPI_USER}/.ssh/config": (0o644, SSH_CONFIG),
    }


# mpirun between guests goes over ssh as MPI_USER, whose key pair is made
# at image build: the guests of one image trust each other (and share
# their host keys), which is what a test image wants and a production
# image must not do (docs/vm.md).
SSH_CONFIG = """Host *
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
"""

# Units enabled (multi-user.target.wants) and masked (slow or pointless in
# a short-lived test guest; slurmd and munged only ever run with a
# cluster's configuration and key, which the cluster starts them with:
# the packages' own units would start them with the image's). Nobody
# logs in on a guest's console (commands go through the agent on ttyS1,
# jobs through ssh), so no getty runs: under TCG every process of the
# boot takes the one vCPU from the units the ready banner waits for.
ENABLE = ["ivcloud-agent.service", "ivcloud-ready.service"]
MASK = ["apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer",
        "fstrim.timer", "e2scrub_reap.service", "slurmd.service",
        "munge.service", "serial-getty@ttyS0.service", "getty@tty1.service",
        "getty-static.service"]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()
                          ).hexdigest()[:16]


def _run(cmd: List[str], timeout: float, what: str) -> str:
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout)
    except FileNotFoundError:
        raise ImageError(f"{cmd[0]} not found (apt-get install "
                         f"{'mmdebstrap' if cmd[0] == 'mmdebstrap' else 'e2fsprogs'})")
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what} did not finish within {timeout:.0f} s")
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr + p.stdout).splitlines()
                 if ln.strip()]
        raise ImageError(f"{what} failed: "
                         f"{lines[-1] if lines else p.returncode}")
    return p.stdout


def _locked(d: Path, timeout: float = BASE_TIMEOUT_S + 600):
    """Hold d/.lock: one builder per cache entry (two test runs, or CI
    jobs, that want the same image wait for each other)."""
    d.mkdir(parents=True, exist_ok=True)
    return filelock.held(d / ".lock", timeout, lambda: ImageError(
        f"{d} is locked by another build for more than {timeout:.0f} s"))


def _used(d: Path) -> None:
    try:
        (d / ".used").touch()
    except OSError:
        pass


def _in_use(d: Path) -> bool:
    """Whether a process holds a file under `d` open: a running guest's
    image or share (a QEMU, or a qcow2 overlay's backing file), which
    the next QEMU of that guest (a migration's destination) opens by
    its path again."""
    below = os.path.realpath(d) + "/"   # what /proc's fd links give
    me = str(os.getpid())               # (holding its lock)
    for pid in os.listdir("/proc"):
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd") if pid.isdigit() else []
            if any(os.readlink(f"/proc/{pid}/fd/{n}").startswith(below)
                   for n in fds):
                return True
        except OSError:   # gone, or closed meanwhile
            continue
    return False


def _prune(cache: Path, prefix: str, keep: int, current: Path) -> None:
    """Remove all but the `keep` most recently used entries `prefix`-*,
    never `current`, never one being built (its lock is held) and never
    one in use (_in_use)."""
    def last_use(d: Path) -> float:
        try:
            return (d / ".used").stat().st_mtime
        except OSError:
            return d.stat().st_mtime
    entries = sorted((d for d in cache.glob(prefix + "-*")
                      if d.is_dir() and d != current), key=last_use,
                     reverse=True)
    for d in entries[max(keep - 1, 0):]:
        try:
            with open(d / ".lock", "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not _in_use(d):
                    shutil.rmtree(d, ignore_errors=True)
        except (BlockingIOError, OSError):
            pass


def base_inputs(rel: Optional[Release] = None) -> Dict:
    rel = rel or release()
    return {"version": BASE_VERSION, "suite": rel.suite,
            "mirrors": list(rel.mirrors), "packages": sorted(rel.packages)}


def base_root(cache: Optional[Path] = None, force: bool = False,
              log=None, rel: Optional[Release] = None) -> Path:
    """The mmdebstrap tarball of the base root, built once per inputs."""
    rel = rel or release()
    prefix = f"{rel.cache_prefix}-base"
    d = Path(cache or cache_root()) / f"{prefix}-{_hash(base_inputs(rel))}"
    tar = d / "root.tar"
    if tar.is_file() and not force:
        _used(d)
        return tar
    if os.geteuid() != 0:
        raise ImageError("building the Debian image needs root "
                         "(mmdebstrap in root mode, mke2fs)")
    with _locked(d):
        if tar.is_file() and not force:
            _used(d)
            return tar
        _build_base(d, tar, log, rel)
    _prune(d.parent, prefix, KEEP_BASES, d)
    return tar


def _build_base(d: Path, tar: Path, log, rel: Release) -> None:
    if log:
        log(f"mmdebstrap {rel.suite} ({len(rel.packages)} packages) into "
            f"{tar}")
    t0 = time.monotonic()
    tmp = d / "root.tar.tmp"
    _run(["mmdebstrap", "--mode=root", "--variant=apt", "--quiet",
          "--format=tar",
          "--aptopt=APT::Install-Recommends \"false\"",
          "--include=" + ",".join(rel.packages), rel.suite, str(tmp),
          *rel.mirrors], BASE_TIMEOUT_S, "mmdebstrap")
    os.replace(tmp, tar)
    (d / "inputs.json").write_text(json.dumps(
        dict(base_inputs(rel), seconds=round(time.monotonic() - t0, 1)),
        indent=2) + "\n")
    _used(d)


def default_guest_deb() -> Path:
    """The newest guest package in build/deb; made there first from this
    checkout's native build (what `make deb` runs) when there is none or
    when the native build is newer, so that a guest image is built from
    what `make build` left."""
    repo = Path(__file__).resolve().parents[2]
    debs = repo / "build" / "deb"
    found = _guest_debs(debs)
    from ..native import native_dir
    built = native_dir() / "btl" / "mca_btl_ivshmem.so"
    if not found or (built.is_file() and
                     built.stat().st_mtime > found[-1].stat().st_mtime):
        _make_debs(repo, native_dir(), debs)
        found = _guest_debs(debs)
    if not found:
        raise ImageError(f"no {GUEST_PACKAGE} package in {debs}",
                         setting="guest_deb")
    return found[-1]


def _guest_debs(debs: Path) -> List[Path]:
    return sorted(debs.glob(f"{GUEST_PACKAGE}_*_amd64.deb"),
                  key=lambda p: p.stat().st_mtime)


def _make_debs(repo: Path, native: Path, out: Path) -> None:
    """packaging/mkdeb.sh over the native build, at pyproject's version;
    ImageError with its last line if it fails."""
    version = ""
    for line in (repo / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            version = line.split("=", 1)[1].strip().strip('"')
    try:
        p = subprocess.run(["sh", str(repo / "packaging" / "mkdeb.sh"),
                            str(native), str(out), version],
                           stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise ImageError(f"cannot build the guest packages: {e}")
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        raise ImageError(f"cannot build the guest packages: "
                         f"{lines[-1] if lines else p.returncode}")


def solver_deb_beside(deb: Path) -> Optional[Path]:
    """The python3-micromag package `make deb` built with guest package
    `deb` (same directory, same version), or None."""
    name = Path(deb).name
    prefix = f"{GUEST_PACKAGE}_"
    if not (name.startswith(prefix) and name.endswith("_amd64.deb")):
        return None
    version = name[len(prefix):-len("_amd64.deb")]
    solver = Path(deb).parent / f"{SOLVER_PACKAGE}_{version}_all.deb"
    return solver if solver.is_file() else None


def image_dir_for(deb: Path, cache: Optional[Path] = None,
                  extra: Sequence[Path] = (),
                  rel: Optional[Release] = None) -> Path:
    rel = rel or release()
    files = {k: [m, hashlib.sha256(t.encode()).hexdigest()]
             for k, (m, t) in _files().items()}
    inputs = {"version": IMAGE_VERSION, "base": _hash(base_inputs(rel)),
              "deb": sha256_of(deb), "files": files, "enable": ENABLE,
              "extra": [sha256_of(Path(x)) for x in extra],
              "mask": MASK, "user": MPI_USER}
    return Path(cache or cache_root()) / \
        f"guest-{rel.cache_prefix}-{_hash(inputs)}"


def _install_into(root: Path, deb: Path, extra: Sequence[Path] = ()
                  ) -> None:
    """dpkg -i the guest package into `root` (its maintainer scripts run
    in the chroot), then our files, units and user."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive",
               PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    for pkg in (deb, *map(Path, extra)):
        target = root / "tmp" / pkg.name
        shutil.copyfile(pkg, target)
        p = subprocess.run(["chroot", str(root), "dpkg", "-i",
                            f"/tmp/{pkg.name}"],
                           stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300, env=env)
        target.unlink()
        if p.returncode != 0:
            lines = [ln for ln in (p.stderr + p.stdout).splitlines()
                     if ln.strip()]
            raise ImageError(f"dpkg -i {pkg.name} in the image failed: "
                             f"{lines[-1] if lines else p.returncode}")
    for rel, (mode, text) in _files().items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if f.is_symlink():
            f.unlink()
        f.write_text(text)
        os.chmod(f, mode)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in ENABLE:
        link = wants / unit
        if not link.is_symlink():
            link.symlink_to(f"/etc/systemd/system/{unit}")
    for unit in MASK:
        link = root / "etc/systemd/system" / unit
        if not link.exists() and not link.is_symlink():
            link.symlink_to("/dev/null")
    p = subprocess.run(["chroot", str(root), "useradd", "--create-home",
                        "--groups", "ivshm", "--shell", "/bin/bash",
                        MPI_USER], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60, env=env)
    if p.returncode != 0:
        raise ImageError(f"useradd {MPI_USER} in the image failed: "
                         f"{p.stderr.strip()}")
    home = f"/home/{MPI_USER}"
    p = subprocess.run(
        ["chroot", str(root), "sh", "-c",
         f"ssh-keygen -q -t ed25519 -N '' -C {MPI_USER}@ivcloud "
         f"-f {home}/.ssh/id_ed25519 && "
         f"cp {home}/.ssh/id_ed25519.pub {home}/.ssh/authorized_keys && "
         f"chmod 700 {home}/.ssh && chown -R {MPI_USER}: {home}"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        env=env)
    if p.returncode != 0:
        raise ImageError(f"ssh keys for {MPI_USER} in the image failed: "
                         f"{p.stderr.strip()}")


def build(cache: Optional[Path] = None, deb: Optional[Path] = None,
          force: bool = False, log=None, extra: Sequence[Path] = (),
          release_name: Optional[str] = None) -> GuestImage:
    """Build (or reuse) the Debian guest image with package `deb` (and
    the `extra` packages, e.g. ivcloud-host to test its unit in a guest
    that runs systemd), of Debian 12 or the release named."""
    rel = release(release_name)
    deb = Path(deb) if deb else default_guest_deb()
    if not deb.is_file():
        raise ImageError(f"guest package {deb} does not exist",
                         setting="guest_deb")
    for x in extra:
        if not Path(x).is_file():
            raise ImageError(f"package {x} does not exist",
                             setting="extra_deb")
    out = image_dir_for(deb, cache, extra, rel)
    if not force:
        img = cached_dir(out)
        if img is not None:
            _used(out)
            return img
    tar = base_root(cache, log=log, rel=rel)
    with _locked(out):
        img = None if force else cached_dir(out)
        if img is None:
            img = _build_image(out, tar, deb, log, extra)
        _used(out)
    _prune(out.parent, f"guest-{rel.cache_prefix}", KEEP_IMAGES, out)
    return img


def _build_image(out: Path, tar: Path, deb: Path, log,
                 extra: Sequence[Path] = ()) -> GuestImage:
    manifest = out / "manifest.json"
    if log:
        log(f"building the Debian guest image in {out}")
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ivcloud-root-",
                                     dir=str(out)) as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        _run(["tar", "-C", str(root), "--numeric-owner", "-xpf", str(tar)],
             600, "unpacking the base root")
        _install_into(root, deb, extra)
        kernels = sorted((root / "boot").glob("vmlinuz-*"))
        if not kernels:
            raise ImageError(f"the base root {tar} holds no kernel")
        kver = kernels[-1].name[len("vmlinuz-"):]
        initrd = root / "boot" / f"initrd.img-{kver}"
        if not initrd.is_file():
            raise ImageError(f"the base root {tar} holds no {initrd.name}")
        _make_initrd(root, kver)
        shutil.copyfile(kernels[-1], out / "vmlinuz.tmp")
        shutil.copyfile(initrd, out / "initrd.img.tmp")
        used = int(_run(["du", "-sb", "--apparent-size", str(root)], 300,
                        "du").split()[0])
        size_mb = (used * 5 // 4 + DISK_SLACK) >> 20
        disk_tmp = out / "disk.img.tmp"
        if disk_tmp.exists():
            disk_tmp.unlink()
        _run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", "ivcloud-root",
              "-d", str(root), str(disk_tmp), f"{size_mb}M"], 900,
             "mke2fs")
    os.replace(out / "vmlinuz.tmp", out / "vmlinuz")
    os.replace(out / "initrd.img.tmp", out / "initrd.img")
    os.replace(disk_tmp, out / "disk.img")
    manifest.write_text(json.dumps({
        "kernel_version": kver, "deb": deb.name, "deb_sha256": sha256_of(deb),
        "extra": [Path(x).name for x in extra],
        "base": str(tar), "disk_mb": size_mb,
        "seconds": round(time.monotonic() - t0, 1)}, indent=2) + "\n")
    return GuestImage(out / "vmlinuz", out / "initrd.img", kver,
                      out / "disk.img")


def _make_initrd(root: Path, kver: str) -> None:
    """The initramfs of kernel `kver` again, in the chroot, from our
    initramfs-tools configuration (INITRAMFS_CONF, INITRAMFS_MODULES)."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
    try:
        p = subprocess.run(["chroot", str(root), "mkinitramfs", "-o",
                            f"/boot/initrd.img-{kver}", kver],
                           stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageError(f"mkinitramfs in the image failed: {e}")
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr + p.stdout).splitlines()
                 if ln.strip()]
        raise ImageError(f"mkinitramfs in the image failed: "
                         f"{lines[-1] if lines else p.returncode}")


def cached_dir(out: Path) -> Optional[GuestImage]:
    try:
        kver = json.loads((out / "manifest.json").read_text())[
            "kernel_version"]
    except (OSError, ValueError, KeyError):
        return None
    img = GuestImage(out / "vmlinuz", out / "initrd.img", kver,
                     out / "disk.img")
    return img if img.exists() else None
