"""A host directory that QEMU guests see, read only, at the same path.

The directory becomes an ext4 image of its own (no journal: nobody
writes it), built once per content and cached beside the guest images
(CACHE/share-<hash>/disk.img, docs/vm.md), keyed by a manifest of the
tree (every entry's path, mode, owner, size, inode, mtime, ctime and
link target), which is cheap to read where hashing the contents
(hundreds of MB for the MPIs) is not. A guest gets it as a read-only virtio disk with serial SERIAL
and the path on its kernel command line (`ivcloud.share=PATH`); the
Debian image's ready script mounts it there before the guest reports
ready (debian.py).

The same path as on the host, so that what names it runs unchanged in
the guests: the PyPI MPIs' launchers start their daemons and proxies by
absolute path, and the programs built with their compilers carry the
prefix's lib directory as RUNPATH. A disk rather than a 9p export: QEMU
refuses to migrate a guest while a 9p export is mounted in it, and a
read-only disk migrates like the root file system's backing image.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import ImageError
from . import agent
from .debian import (SHARE_SERIAL as SERIAL, _hash, _locked, _prune, _run,
                     _used, cache_root)
from .qemu import console_text

KERNEL_ARG = "ivcloud.share"
# Bump when the way the image is made changes
VERSION = 1
KEEP = 2
# room beyond the files: inodes, directories, ext4's own
SLACK = 64 << 20
# an agent command in a guest (unmounted)
MOUNT_CHECK_S = 30.0
# what a kernel command line word can carry
_PATH_RE = re.compile(r"^/[A-Za-z0-9._+,@/-]*$")


@dataclass(frozen=True)
class Share:
    """A built share: its image and where guests mount it."""
    disk: Path
    path: str

    def to_dict(self) -> Dict[str, str]:
        return {"disk": str(self.disk), "path": self.path}

    @classmethod
    def from_dict(cls, d: Optional[Dict]) -> Optional["Share"]:
        return cls(Path(d["disk"]), d["path"]) if d else None

    def qemu_args(self) -> List[str]:
        return ["-drive", f"file={self.disk},format=raw,if=none,id=share,"
                          f"readonly=on",
                "-device", f"virtio-blk-pci,drive=share,serial={SERIAL}"]

    def kernel_arg(self) -> str:
        return f"{KERNEL_ARG}={self.path}"

    def unmounted(self, vm_dir: Path) -> Optional[str]:
        """Why the guest of the QEMU in `vm_dir` has not mounted it (its
        ready script only says so on the console); None when it has."""
        if agent.run(vm_dir / "agent.sock", f"mountpoint -q "
                     f"{agent.quote([self.path])}", MOUNT_CHECK_S).ok:
            return None
        said = [ln.strip() for ln in console_text(vm_dir).splitlines()
                if "cannot mount the share" in ln] or ["console: nothing"]
        return f"the share {self.path} is not mounted ({said[-1]})"


def manifest(src: Path) -> List[List]:
    """Every entry under `src` (not following links): relative path,
    mode, owner, size, inode, mtime and ctime (ns: a copy that keeps the
    mtime still moves the ctime) and, for a link, its target."""
    out: List[List] = []
    try:
        for d, dirs, files in os.walk(src):
            dirs.sort()
            for name in sorted(dirs + files):
                p = os.path.join(d, name)
                st = os.lstat(p)
                out.append([os.path.relpath(p, src), st.st_mode, st.st_uid,
                            st.st_gid, st.st_size, st.st_ino, st.st_mtime_ns,
                            st.st_ctime_ns,
                            os.readlink(p) if os.path.islink(p) else None])
    except OSError as e:   # written meanwhile (a build into it)
        raise ImageError(f"{src}: {e.filename}: {e.strerror}") from None
    return out


def build(src: os.PathLike, cache: Optional[Path] = None,
          log=None) -> Share:
    """The share of host directory `src` (its absolute path, as given:
    a link in it stays a link, as the RUNPATHs that name it), built or
    reused; ImageError if it cannot be."""
    path = Path(src).absolute()
    if not _PATH_RE.match(str(path)):
        raise ImageError(f"{path}: a path a guest's kernel command line "
                         f"cannot carry (letters, digits and ._+,@/- only)")
    if not path.is_dir():
        raise ImageError(f"{path} is not a directory")
    real = path.resolve()
    entries = manifest(real)
    d = Path(cache or cache_root()) / \
        f"share-{_hash({'version': VERSION, 'entries': entries})}"
    disk = d / "disk.img"
    if not disk.is_file():
        if os.geteuid() != 0:
            raise ImageError("building a guest share needs root (mke2fs "
                             "keeps the files' owners)")
        with _locked(d):
            if not disk.is_file():
                if log:
                    log(f"sharing {path} with the guests: {disk}")
                used = sum(e[4] for e in entries) + 4096 * len(entries)
                tmp = d / "disk.img.tmp"
                tmp.unlink(missing_ok=True)
                try:
                    _run(["mke2fs", "-q", "-F", "-t", "ext4", "-O",
                          "^has_journal", "-L", SERIAL[:16], "-d", str(real),
                          str(tmp), f"{(used * 9 // 8 + SLACK) >> 20}M"],
                         900, "mke2fs of the share")
                except BaseException:
                    tmp.unlink(missing_ok=True)   # hundreds of MB
                    raise
                os.replace(tmp, disk)
        _prune(d.parent, "share", KEEP, d)
    _used(d)
    return Share(disk, str(path))


def prefixes(root: os.PathLike, log) -> Tuple[Optional[Share], List[str]]:
    """The share of `root` and the prefixes in it (its directories that
    hold a bin/, as `make build` installs the MPIs); (None, []) when it
    has none, or when it cannot be shared (said on `log`: the guests
    then lack them, which their jobs are told)."""
    found = [str(p.parent) for p in sorted(Path(root).glob("*/bin"))]
    if not found:
        return None, []
    try:
        return build(root, log=log), found
    except ImageError as e:
        log(f"the guests get nothing of {root}: {e}")
        return None, []
