"""Guest image: a Debian kernel and a small initramfs, built from Debian
packages only.

Inputs, all fetched with `apt-get download` into CACHE/debs (nothing is
installed on the host):

- linux-image-<abi>-amd64, the package the `linux-image-amd64` metapackage
  points to: vmlinuz, and the modules the guest needs to drive the ivshmem
  device from user space (uio + uio_pci_generic for INTx; vfio, vfio-pci,
  vfio_iommu_type1 for MSI-X, which is the only interrupt QEMU's
  ivshmem-doorbell raises) with their dependencies, read from each
  module's .modinfo (the .deb carries no modules.dep);
- busybox-static: the whole user land;
- our statically linked `ivshm-guest` from the native build.

The initramfs is a gzipped newc cpio written here (no cpio or
initramfs-tools needed). CACHE/manifest.json records the inputs; the image
is rebuilt only when one of them (or this builder) changes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ..errors import ImageError

# Bump when the layout of the image or the init script changes in a way
# the input hashes cannot see.
BUILDER_VERSION = 3

KERNEL_META = "linux-image-amd64"
BUSYBOX_PKG = "busybox-static"
GUEST_TOOL = "ivshm-guest"

# Modules the init script loads, in this order; dependencies are added
# (before their users) from .modinfo.
GUEST_MODULES = ["uio", "uio_pci_generic", "vfio_iommu_type1", "vfio_pci"]
# Extra arguments for insmod. Without interrupt remapping in the virtual
# IOMMU, type1 refuses MSI unless told the guest is trusted (it is: it is
# ours, and the device is an emulated one).
MODULE_PARAMS = {"vfio_iommu_type1": "allow_unsafe_interrupts=1"}

# Lines the init script prints on the console (ttyS0); the launcher waits
# for READY_BANNER to know the guest is up.
INIT_BANNER = "ivcloud-guest: init"
READY_BANNER = "ivcloud-guest: ready"


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    kernel_version: str
    # a root file system (the Debian image, debian.py); None: the
    # initramfs is the whole guest
    disk: Optional[Path] = None

    def exists(self) -> bool:
        return (self.kernel.is_file() and self.initrd.is_file()
                and (self.disk is None or self.disk.is_file()))


def default_cache_dir() -> Path:
    env = os.environ.get("IVCLOUD_GUEST_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "build" / "guest"


# ---------------------------------------------------------------- packages

def _run(cmd: List[str], cwd: Optional[Path] = None, timeout: float = 600
         ) -> str:
    try:
        p = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ImageError(f"{cmd[0]} not found (a Debian host is needed to "
                         f"build the guest image)")
    except subprocess.TimeoutExpired:
        raise ImageError(f"{' '.join(cmd)} timed out")
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {p.returncode}"
        raise ImageError(f"{' '.join(cmd[:3])}: {why}")
    return p.stdout


def kernel_package() -> str:
    """The versioned kernel package the metapackage depends on now."""
    out = _run(["apt-cache", "depends", KERNEL_META])
    m = re.search(r"Depends:\s*(linux-image-\S+-amd64)\b", out)
    if not m:
        raise ImageError(f"apt-cache knows no {KERNEL_META} (run apt-get "
                         f"update?)")
    return m.group(1)


def _find_deb(debs: Path, package: str) -> Optional[Path]:
    # apt-get download names files package_version_arch.deb, with the
    # epoch's ':' escaped as %3a
    found = sorted(debs.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def fetch_deb(debs: Path, package: str) -> Path:
    """The .deb of `package` in `debs`, downloaded once."""
    have = _find_deb(debs, package)
    if have is not None:
        return have
    debs.mkdir(parents=True, exist_ok=True)
    # apt's sandbox user cannot write into root's build tree: download
    # into a world-writable temporary directory, then move.
    with tempfile.TemporaryDirectory(prefix="ivcloud-apt-") as tmp:
        os.chmod(tmp, 0o777)
        _run(["apt-get", "download", "-q", package], cwd=Path(tmp))
        got = list(Path(tmp).glob(f"{package}_*.deb"))
        if not got:
            raise ImageError(f"apt-get download {package} produced no .deb")
        dest = debs / got[0].name
        shutil.move(str(got[0]), dest)
    return dest


def _deb_extract(deb: Path, dest: Path, members: Iterable[str]) -> None:
    """Extract `members` (tar globs) of a .deb's data into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    data = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(dest), "--wildcards",
                          *members], stdin=data.stdout, capture_output=True,
                         text=True)
    data.stdout.close()
    err = data.stderr.read().decode(errors="replace")
    data.wait()
    if data.returncode != 0 or tar.returncode != 0:
        why = (err or tar.stderr).strip().splitlines()
        raise ImageError(f"cannot extract {deb.name}: "
                         f"{why[-1] if why else 'tar failed'}")


# ---------------------------------------------------------------- modules

def modinfo(ko: bytes) -> Dict[str, List[str]]:
    """key -> values of an ELF64 kernel module's .modinfo section."""
    if ko[:4] != b"\x7fELF" or ko[4] != 2 or ko[5] != 1:
        raise ImageError("not a little-endian ELF64 kernel module")
    shoff, = struct.unpack_from("<Q", ko, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ko, 0x3a)

    def section(i: int) -> Tuple[int, int, int]:
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", ko, base)
        off, size = struct.unpack_from("<QQ", ko, base + 0x18)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    info: Dict[str, List[str]] = {}
    for i in range(shnum):
        name, off, size = section(i)
        end = ko.index(b"\0", stroff + name)
        if ko[stroff + name:end] != b".modinfo":
            continue
        for item in ko[off:off + size].split(b"\0"):
            key, sep, value = item.decode(errors="replace").partition("=")
            if sep:
                info.setdefault(key, []).append(value)
    return info


def module_closure(modules_dir: Path, wanted: List[str]) -> List[Path]:
    """.ko files for `wanted` and their dependencies, dependencies first."""
    by_name: Dict[str, Path] = {}
    for ko in modules_dir.rglob("*.ko"):
        by_name[ko.stem.replace("-", "_")] = ko
    order: List[Path] = []
    seen: Dict[str, bool] = {}

    def visit(name: str, chain: Tuple[str, ...]) -> None:
        key = name.replace("-", "_")
        if seen.get(key):
            return
        if key in chain:
            raise ImageError(f"module dependency cycle: {' -> '.join(chain)}")
        ko = by_name.get(key)
        if ko is None:
            raise ImageError(f"kernel package has no module {name}")
        deps = modinfo(ko.read_bytes()).get("depends", [""])[0]
        for dep in filter(None, deps.split(",")):
            visit(dep, chain + (key,))
        seen[key] = True
        order.append(ko)

    for name in wanted:
        visit(name, ())
    return order


# ---------------------------------------------------------------- cpio

class Cpio:
    """A newc ("070701") archive, the format the kernel unpacks."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1
        self.dirs = set()

    def _entry(self, name: str, mode: int, data: bytes = b"",
               rdev: Tuple[int, int] = (0, 0)) -> None:
        name_b = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1],
            len(name_b), 0))
        self.ino += 1
        out = self.buf
        out.write(hdr.encode() + name_b)
        out.write(b"\0" * (-(110 + len(name_b)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    def mkdir(self, path: str) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self.dirs:
                self.dirs.add(d)
                self._entry(d, stat.S_IFDIR | 0o755)

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = path.strip("/")
        if "/" in path:
            self.mkdir(path.rsplit("/", 1)[0])
        self._entry(path, stat.S_IFREG | mode, data)

    def symlink(self, path: str, target: str) -> None:
        path = path.strip("/")
        if "/" in path:
            self.mkdir(path.rsplit("/", 1)[0])
        self._entry(path, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, path: str, major: int, minor: int) -> None:
        self._entry(path.strip("/"), stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        data = self.buf.getvalue()
        return data + b"\0" * (-len(data) % 512)


# ---------------------------------------------------------------- init

# The guest's /init (busybox sh). It loads the modules, hands the ivshmem
# device to user space and then serves commands from the host on ttyS1:
# one line "ID BASE64(command)" in; "@@ivc-ack ID", then "@@ivc-begin ID",
# the output in base64, "@@ivc-end ID STATUS" out (agent.py). Base64 both ways keeps the serial
# line discipline away from the payload.
INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
echo "@INIT_BANNER@ $(uname -r)" > /dev/console

arg() { # value of ivcloud.$1= on the kernel command line
    for w in $(cat /proc/cmdline); do
        case "$w" in ivcloud.$1=*) echo "${w#*=}"; return;; esac
    done
}
NAME=$(arg name)
MODE=$(arg doorbell)
[ -n "$MODE" ] || MODE=vfio
hostname "${NAME:-guest}"

while read -r mod params; do
    insmod "/lib/modules/$mod.ko" $params 2>/dev/console
done < /lib/modules/load.list

# The ivshmem device (1af4:1110): BAR0 registers, BAR2 the region.
DEV=
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ]; then
        DEV=${d##*/}; break
    fi
done
: > /etc/ivshm.env
if [ -n "$DEV" ]; then
    SYS=/sys/bus/pci/devices/$DEV
    # IVPosition (BAR0 + 8): our id at the ivshmem-server, read before a
    # driver claims the BAR
    set -- $(head -n 1 $SYS/resource)
    POS=$(devmem $(( $1 + 8 )) 32 2>/dev/null)
    POS=$(( ${POS:-0xffffffff} ))
    if [ "$MODE" = uio ]; then
        [ "$(cat $SYS/irq)" != 0 ] || echo "ivcloud-guest: warning: the" \
            "ivshmem device has no INTx line: uio doorbells cannot work" \
            "(use vfio)" > /dev/console
        echo "1af4 1110" > /sys/bus/pci/drivers/uio_pci_generic/new_id
        N=$(ls $SYS/uio 2>/dev/null | head -n 1)
        IRQDEV=/dev/$N
    else
        # MSI-X through vfio-pci: the device's IOMMU group is its handle.
        echo vfio-pci > $SYS/driver_override
        echo $DEV > /sys/bus/pci/drivers_probe
        G=$(readlink $SYS/iommu_group); G=${G##*/}
        IRQDEV=/dev/vfio/$G
    fi
    i=0
    while [ ! -e "$IRQDEV" ] && [ $i -lt 50 ]; do usleep 20000; i=$((i+1)); done
    cat > /etc/ivshm.env <<EOF
IVSHM_PCI=$DEV
IVSHM_POSITION=$POS
IVSHM_UIO=$IRQDEV
IVSHM_BAR0=$SYS/resource0
IVSHM_BAR2=$SYS/resource2
EOF
    echo "@READY_BANNER@ name=$NAME device=$DEV ivposition=$POS doorbell=$MODE irq=$IRQDEV" > /dev/console
else
    echo "@READY_BANNER@ name=$NAME device=none" > /dev/console
fi
set -a; . /etc/ivshm.env; set +a

# Commands from the host, served from a pid namespace of our own: every
# kernel's initial pid namespace has the same inode, so without this a
# guest process would look co-resident with host processes to libivshm's
# liveness probe (which then reads the other kernel's pids).
cat > /bin/ivcloud-agent <<'EOF'
@AGENT_LOOP@EOF
exec unshare -p -f /bin/sh /bin/ivcloud-agent
"""

# The agent loop on ttyS1 (protocol in agent.py), shared with the Debian
# image (debian.py), which runs it as a systemd service.
AGENT_LOOP = r"""stty -F /dev/ttyS1 raw -echo 115200 2>/dev/null
exec 3<>/dev/ttyS1
last=
while :; do
    if ! read -r id b64 <&3; then sleep 1; continue; fi
    [ -n "$id" ] || continue
    echo "@@ivc-ack $id" >&3
    # The host resends a command it got no acknowledgement for: run each
    # id once, answer every copy.
    if [ "$id" != "$last" ]; then
        echo "$b64" | base64 -d > /tmp/.cmd 2>/dev/null
        sh /tmp/.cmd < /dev/null > /tmp/.out 2>&1 3>&-
        echo $? > /tmp/.rc
        last=$id
    fi
    { echo "@@ivc-begin $id"; base64 /tmp/.out; echo "@@ivc-end $id $(cat /tmp/.rc)"; } >&3
done
"""



def init_script() -> str:
    return (INIT_SCRIPT.replace("@AGENT_LOOP@", AGENT_LOOP)
            .replace("@INIT_BANNER@", INIT_BANNER)
            .replace("@READY_BANNER@", READY_BANNER))


# ---------------------------------------------------------------- build

def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_static_elf(path: Path) -> bool:
    """An ELF without a PT_INTERP program header runs without ld.so."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", data, phoff + i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def guest_tool(native: Optional[Path] = None) -> Path:
    if native is None:
        from ..native import native_dir
        native = native_dir()
    tool = native / "guest" / GUEST_TOOL
    if not tool.is_file():
        raise ImageError(f"{tool} not found (run `make build`)")
    if not _is_static_elf(tool):
        raise ImageError(f"{tool} is not statically linked (sanitizer "
                         f"build?); use the release build")
    return tool


def build(cache: Optional[Path] = None, native: Optional[Path] = None,
          force: bool = False, log=None) -> GuestImage:
    """Build (or reuse) the guest kernel + initramfs in `cache`."""
    cache = Path(cache or default_cache_dir())
    tool = guest_tool(native)
    debs = cache / "debs"
    kpkg = _find_deb(debs, "linux-image-*-amd64")
    kpkg_name = kpkg.name.split("_")[0] if kpkg else kernel_package()
    kernel_deb = fetch_deb(debs, kpkg_name)
    busybox_deb = fetch_deb(debs, BUSYBOX_PKG)

    inputs = {
        "builder": BUILDER_VERSION,
        "kernel_deb": kernel_deb.name,
        "busybox_deb": busybox_deb.name,
        "tool": sha256_of(tool),
        "init": hashlib.sha256(init_script().encode()).hexdigest(),
        "modules": GUEST_MODULES,
        "params": MODULE_PARAMS,
    }
    manifest = cache / "manifest.json"
    kernel = cache / "vmlinuz"
    initrd = cache / "initrd.gz"
    try:
        old = json.loads(manifest.read_text())
    except (OSError, ValueError):
        old = None
    if (not force and old and old.get("inputs") == inputs and kernel.is_file()
            and initrd.is_file()):
        return GuestImage(kernel, initrd, old["kernel_version"])

    if log:
        log(f"building guest image in {cache}")
    work = cache / "extract"
    shutil.rmtree(work, ignore_errors=True)
    _deb_extract(kernel_deb, work / "k",
                 ["./boot/vmlinuz-*", "./lib/modules/*/kernel/drivers/uio/*",
                  "./lib/modules/*/kernel/drivers/vfio/*",
                  "./lib/modules/*/kernel/virt/lib/*"])
    _deb_extract(busybox_deb, work / "bb", ["./bin/busybox"])
    vmlinuz = sorted((work / "k" / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise ImageError(f"{kernel_deb.name} holds no vmlinuz")
    kver = vmlinuz[0].name[len("vmlinuz-"):]
    mods = module_closure(work / "k" / "lib" / "modules" / kver, GUEST_MODULES)

    cpio = Cpio()
    for d in ("bin", "sbin", "dev", "proc", "sys", "tmp", "etc", "root",
              "lib/modules"):
        cpio.mkdir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3)
    cpio.file("bin/busybox", (work / "bb" / "bin" / "busybox").read_bytes(),
              0o755)
    cpio.file("bin/" + GUEST_TOOL, tool.read_bytes(), 0o755)
    cpio.file("init", init_script().encode(), 0o755)
    load = []
    for ko in mods:
        name = ko.stem.replace("-", "_")
        cpio.file(f"lib/modules/{name}.ko", ko.read_bytes())
        load.append(f"{name} {MODULE_PARAMS.get(name, '')}".rstrip())
    cpio.file("lib/modules/load.list", ("\n".join(load) + "\n").encode())

    cache.mkdir(parents=True, exist_ok=True)
    tmp_initrd = initrd.with_suffix(".tmp")
    with open(tmp_initrd, "wb") as f:
        f.write(gzip.compress(cpio.finish(), compresslevel=6, mtime=0))
    shutil.copyfile(vmlinuz[0], kernel.with_suffix(".tmp"))
    os.replace(kernel.with_suffix(".tmp"), kernel)
    os.replace(tmp_initrd, initrd)
    manifest.write_text(json.dumps({"inputs": inputs, "kernel_version": kver,
                                    "modules": load}, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return GuestImage(kernel, initrd, kver)


def cached(cache: Optional[Path] = None) -> Optional[GuestImage]:
    """The image already in `cache`, without checking inputs."""
    cache = Path(cache or default_cache_dir())
    try:
        kver = json.loads((cache / "manifest.json").read_text())[
            "kernel_version"]
    except (OSError, ValueError, KeyError):
        return None
    img = GuestImage(cache / "vmlinuz", cache / "initrd.gz", kver)
    return img if img.exists() else None
