"""The VM life cycle behind `ivcloud vm up|down|status|exec` and
`ivcloud pin`: boot, find, pin and stop QEMU guests.

A VM NAME keeps everything under RUN_DIR/vm/NAME: vm.json (what was
started, how), qemu.pid, console.log (ttyS0), agent.sock (ttyS1, the
command agent), qmp.sock and qemu.log. `vm down` finds its QEMU through
the pid file and, should that be lost, through the process command lines
that name this directory; it removes the directory either way.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .. import procfs
from ..errors import VmError, VmFailure
from ..server import format_size, run_root
from . import agent, debian, image, qemu

DEFAULT_PREFIX = "vm"
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_SUN_PATH_MAX = 107
MAX_VMS = 64
MIN_MEMORY = 96 << 20
BOOT_TIMEOUT_S = 120.0
IMAGE_KINDS = ("busybox", "debian")
NET_PREFIX = "10.12.0"


# ---------------------------------------------------------------- paths

def vm_root(run_dir: Optional[str]) -> Path:
    return run_root(run_dir) / "vm"


def vm_dir(root: Path, name: str) -> Path:
    return root / name


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise VmError(f"bad VM name '{name}' (a letter, then letters, "
                      f"digits, '_' or '-', at most 32)")
    return name


def _read_json(path: Path) -> Optional[Dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def list_vms(root: Path) -> List[str]:
    try:
        return sorted(p.name for p in root.iterdir()
                      if p.is_dir() and _NAME_RE.match(p.name))
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- processes

def _names_dir(pid: int, d: Path) -> bool:
    """Is `pid` a QEMU started for the VM directory `d`?"""
    prefix = str(d) + "/"
    return any(prefix in a for a in procfs.cmdline(pid))


def qemu_pid(d: Path) -> Optional[int]:
    try:
        pid = int((d / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and procfs.alive(pid) and _names_dir(pid, d) else None


def pids_naming(d: Path) -> List[int]:
    """Every live process whose command line names `d` (a QEMU whose pid
    file is gone, after a crash of `vm up`)."""
    out = []
    for pid in procfs.pids():
        if pid != os.getpid() and procfs.alive(pid) and _names_dir(pid, d):
            out.append(pid)
    return out


def _wait_gone(pids: List[int], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if procfs.alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def stop_vm(d: Path) -> Optional[int]:
    """Stop the VM in `d` (QMP quit, then SIGKILL) and remove `d`.
    Returns the pid that was stopped, if any."""
    pid = qemu_pid(d)
    pids = sorted(set(([pid] if pid else []) + pids_naming(d)))
    grace = 0.0
    if pid is not None:
        try:
            with qemu.Qmp(d / "qmp.sock", timeout=2.0) as q:
                q.execute("quit")
            grace = 3.0
        except (qemu.QmpError, OSError, ValueError):
            pass
    for p in _wait_gone(pids, grace):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = _wait_gone(pids, 5.0)
    if left:
        raise VmFailure(f"QEMU {left} of {d.name} did not die")
    _remove_tree(d)
    return pid


def _remove_tree(d: Path) -> None:
    for p in sorted(d.glob("**/*"), reverse=True):
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- up

def host_cores() -> int:
    return os.cpu_count() or 1


def _check_socket(path: str) -> str:
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise VmError(f"server socket {path} does not exist (start a "
                      f"server with `ivcloud server start`)")
    except OSError as e:
        raise VmError(f"server socket {path}: {e.strerror}")
    if not stat.S_ISSOCK(st.st_mode):
        raise VmError(f"{path} is not a socket")
    return str(p.absolute())


def ready_banner(text: str) -> Optional[Dict[str, str]]:
    """The key=value words of the guest's ready banner on its console,
    or None. The banner may follow other output on its line: getty's
    login prompt, printed by another service at the same time, ends
    without a newline. Only a finished line counts: QEMU writes the
    console file as the guest prints, so under load a read can end in
    the middle of the banner (a cut-off "device=" read as no device)."""
    for line in text.split("\n")[:-1]:
        at = line.find(image.READY_BANNER)
        if at >= 0:
            return dict(w.split("=", 1) for w in line[at:].split()
                        if "=" in w)
    return None


def up(root: Path, count: int, server: str, prefix: str = DEFAULT_PREFIX,
       memory: int = 256 << 20, vcpus: int = 1, accel: str = "auto",
       vectors: int = 1, doorbell: str = "vfio",
       image_dir: Optional[str] = None, kernel: Optional[str] = None,
       initrd: Optional[str] = None,
       boot_timeout: float = BOOT_TIMEOUT_S, log=None,
       kind: str = "busybox", guest_deb: Optional[str] = None,
       network: bool = False, extra_debs: Optional[List[str]] = None,
       release: Optional[str] = None) -> List[Dict]:
    """Boot `count` VMs named PREFIX0.. attached to `server`. All or
    nothing: on failure every VM started here is stopped again. `kind`
    picks the image: the busybox initramfs (image.py) or the Debian
    image with the ivcloud-guest package (debian.py; `release` names a
    Debian release other than 12, e.g. trixie). `network` links
    two Debian guests by an Ethernet of their own (10.12.0.1 and .2, each
    other's names in /etc/hosts), for mpirun between them.

    In order: the request is checked (_check_request, _check_names),
    the image built or found (_guest_image), the accelerator chosen
    (_choose_accel); then every VM is launched (_launch), and once all
    of them printed their ready banner (wait_booted) each is recorded as
    running (_record_running)."""
    log = log or (lambda msg: sys.stderr.write(msg + "\n"))
    _check_request(count, vcpus, memory, vectors, doorbell, kind, kernel,
                   initrd, network, prefix, release)
    binary = qemu.qemu_binary()
    if binary is None:
        raise VmError(f"{os.environ.get(qemu.QEMU_ENV) or qemu.DEFAULT_QEMU}"
                      f" not found (apt-get install qemu-system-x86)")
    server = _check_socket(server)
    names = _check_names(root, prefix, count)
    for what, path in (("kernel", kernel), ("initramfs", initrd)):
        if path is not None and not Path(path).is_file():
            raise VmError(f"guest {what} image {path} is missing")
    img = _guest_image(kind, image_dir, guest_deb, extra_debs, kernel,
                       initrd, log, release)
    if accel == "auto":
        accel = _choose_accel(binary, img, root, log)

    root.mkdir(parents=True, exist_ok=True)
    started: List[Path] = []
    try:
        for i, n in enumerate(names):
            d = vm_dir(root, n)
            if d.exists():
                stop_vm(d)  # leftovers of a VM that died
            d.mkdir(mode=0o700)
            started.append(d)
            net = _guest_network(root, names, i) if network else None
            _launch(d, n, binary, img, accel, vcpus, memory, server, vectors,
                    doorbell, kind, net)
        t0 = time.monotonic()
        banners = wait_booted({d.name: d for d in started}, boot_timeout,
                              accel)
        return [_record_running(d, banners[d.name], t0) for d in started]
    except BaseException:
        for d in started:
            try:
                stop_vm(d)
            except VmFailure:
                pass
        raise


def _check_request(count: int, vcpus: int, memory: int, vectors: int,
                   doorbell: str, kind: str, kernel: Optional[str],
                   initrd: Optional[str], network: bool,
                   prefix: str, release: Optional[str] = None) -> None:
    """Refuse, before anything starts, what `up` cannot boot."""
    if not 1 <= count <= MAX_VMS:
        raise VmError(f"the number of VMs must be 1..{MAX_VMS}, not {count}",
                      setting="count")
    if vcpus < 1:
        raise VmError(f"vCPUs per VM must be at least 1, not {vcpus}",
                      setting="vcpus")
    if vcpus > host_cores():
        raise VmError(f"{vcpus} vCPUs per VM is more than the "
                      f"{host_cores()} host cores", setting="vcpus")
    if memory < MIN_MEMORY:
        raise VmError(f"memory {format_size(memory)} is too small (at "
                      f"least {format_size(MIN_MEMORY)})", setting="memory")
    if not 1 <= vectors <= 64:
        raise VmError(f"vectors must be 1..64, not {vectors}",
                      setting="vectors")
    if doorbell not in ("vfio", "uio"):
        raise VmError(f"the doorbell must be vfio or uio, not {doorbell}",
                      setting="doorbell")
    if kind not in IMAGE_KINDS:
        raise VmError(f"the image kind must be one of "
                      f"{', '.join(IMAGE_KINDS)}, not {kind}", setting="kind")
    if kind == "debian" and doorbell != "vfio":
        # ivshm-bind in the guest picks the driver from the device itself
        # (vfio with an IOMMU group, uio only with INTx, which QEMU's
        # ivshmem-doorbell lacks)
        raise VmError("the Debian image binds the device to vfio-pci "
                      "itself; uio needs a device with INTx",
                      setting="doorbell")
    if kind == "debian" and (kernel or initrd):
        raise VmError("the Debian image boots its own kernel and initramfs",
                      setting="kernel")
    if release is not None and kind != "debian":
        raise VmError("a Debian release applies to the Debian image only",
                      setting="release")
    if network and (kind != "debian" or count != 2):
        raise VmError("a guest network links exactly 2 Debian guests",
                      setting="network")
    check_name(prefix)


def _check_names(root: Path, prefix: str, count: int) -> List[str]:
    """PREFIX0..: names whose sockets fit, none of them running."""
    names = [check_name(f"{prefix}{i}") for i in range(count)]
    if len(str(vm_dir(root, names[-1]) / "agent.sock")) > _SUN_PATH_MAX:
        raise VmError(f"run directory {root} is too long for UNIX sockets",
                      setting="run_dir")
    for n in names:
        pid = qemu_pid(vm_dir(root, n))
        if pid is not None:
            raise VmError(f"VM {n} is already running (pid {pid}); take "
                          f"it down first")
    return names


def _guest_image(kind: str, image_dir: Optional[str],
                 guest_deb: Optional[str], extra_debs: Optional[List[str]],
                 kernel: Optional[str], initrd: Optional[str],
                 log, release: Optional[str] = None) -> image.GuestImage:
    """The image to boot: Debian's, a given kernel and initramfs, or the
    busybox one (with either of them replaced when given)."""
    if kind == "debian":
        img = debian.build(Path(image_dir) if image_dir else None,
                           Path(guest_deb) if guest_deb else None, log=log,
                           extra=[Path(x) for x in extra_debs or ()],
                           release_name=release)
    elif kernel and initrd:
        img = image.GuestImage(Path(kernel).absolute(),
                               Path(initrd).absolute(), "custom")
    else:
        img = image.build(Path(image_dir) if image_dir else None, log=log)
        if kernel or initrd:
            img = image.GuestImage(Path(kernel or img.kernel).absolute(),
                                   Path(initrd or img.initrd).absolute(),
                                   "custom" if kernel else img.kernel_version)
    if not img.exists():
        raise VmError(f"guest kernel image {img.kernel} is missing")
    return img


def _choose_accel(binary: str, img: image.GuestImage, root: Path,
                  log) -> str:
    """kvm if a probe guest boots with it, else tcg. The probe waits a
    few seconds for an init banner: the busybox image prints it at
    once, a Debian boot does not, so the probe of the Debian kind boots
    the busybox image if there is one."""
    probe_img = img if img.disk is None else image.cached()
    if probe_img is None:
        ok, why = False, "no busybox image to probe KVM with"
    else:
        ok, why = qemu.kvm_usable(
            binary, probe_img, probe_img.kernel.parent
            if os.access(probe_img.kernel.parent, os.W_OK) else root)
    if not ok:
        log(f"ivcloud vm: KVM unusable ({why}); using TCG emulation")
    return "kvm" if ok else "tcg"


def _guest_network(root: Path, names: List[str], i: int) -> Dict:
    """The Ethernet of guest i of two: its address, both names, and the
    socket pair QEMU links them by."""
    d, peer = vm_dir(root, names[i]), vm_dir(root, names[1 - i])
    return {"ip": f"{NET_PREFIX}.{i + 1}/24",
            "hosts": ",".join(f"{m}:{NET_PREFIX}.{j + 1}"
                              for j, m in enumerate(names)),
            "local": str(d / "net.sock"), "remote": str(peer / "net.sock"),
            "mac": f"52:54:00:12:00:{i + 1:02x}"}


def _launch(d: Path, name: str, binary: str, img: image.GuestImage,
            accel: str, vcpus: int, memory: int, server: str, vectors: int,
            doorbell: str, kind: str, net: Optional[Dict]) -> None:
    """Write vm.json (what is started, how) and start the VM's QEMU."""
    cmd = qemu.guest_command(binary, img, d, name, accel, vcpus,
                             memory >> 20, server, vectors, doorbell, net=net)
    _write_json(d / "vm.json", {
        "name": name, "server": server, "accel": accel, "vcpus": vcpus,
        "memory": memory, "vectors": vectors, "doorbell": doorbell,
        "kernel": str(img.kernel), "initrd": str(img.initrd),
        "kind": kind, "network": net,
        "disk": str(img.disk) if img.disk else None,
        "command": cmd, "state": "starting", "started": time.time()})
    qemu.launch(cmd, d, name)


def wait_booted(dirs: Dict[str, Path], timeout_s: float, accel: str,
                what: str = "VM") -> Dict[str, Dict[str, str]]:
    """Wait until every guest (name -> its directory) printed its ready
    banner; returns the banners' key=value words by name. VmFailure
    when one died while booting, or did not boot in `timeout_s` (with
    its last console line)."""
    t0 = time.monotonic()
    pending = dict(dirs)
    banners: Dict[str, Dict[str, str]] = {}
    while pending:
        for n, d in list(pending.items()):
            banner = ready_banner(qemu.console_text(d))
            if banner is not None:
                banners[n] = banner
                del pending[n]
            elif qemu_pid(d) is None:
                raise VmFailure(f"{what} {n} died while booting: "
                                f"{qemu.last_line(qemu.console_text(d))}")
        if pending and time.monotonic() - t0 > timeout_s:
            n = sorted(pending)[0]
            raise VmFailure(
                f"{what} {n} did not boot within {timeout_s:.0f} s "
                f"({accel}); last console line: "
                f"{qemu.last_line(qemu.console_text(pending[n]))}")
        time.sleep(0.1)
    return banners


def _record_running(d: Path, banner: Dict[str, str], t0: float) -> Dict:
    """Once the VM's agent answers: vm.json says it runs, with its pid,
    boot time, device and ivposition; returns that record."""
    agent.wait_ready(d / "agent.sock", timeout=30)
    st = _read_json(d / "vm.json") or {}
    st.update(state="running", pid=qemu_pid(d),
              boot_s=round(time.monotonic() - t0, 1),
              device=banner.get("device"),
              ivposition=int(banner["ivposition"])
              if banner.get("ivposition", "").isdigit() else None)
    _write_json(d / "vm.json", st)
    return st


# ---------------------------------------------------------------- status

def cpus_allowed(pid: int, tid: int) -> Optional[str]:
    try:
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text(
                ).splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_in(d: Path, command: str, timeout: float) -> agent.Result:
    """`command` with the guest's sh in the VM of directory `d`, in the
    environment every program there needs (qemu.guest_env of the VM's
    accelerator); its status and output."""
    accel = (_read_json(d / "vm.json") or {}).get("accel") or ""
    exports = "".join(f"export {k}={shlex.quote(v)}; "
                      for k, v in qemu.guest_env(accel).items())
    return agent.run(d / "agent.sock", exports + command, timeout)


def status(root: Path, names: Optional[List[str]] = None) -> List[Dict]:
    out = []
    for n in names or list_vms(root):
        d = vm_dir(root, n)
        st = _read_json(d / "vm.json") or {"name": n}
        pid = qemu_pid(d)
        info = {k: st.get(k) for k in ("name", "server", "accel", "vcpus",
                                       "memory", "ivposition", "device",
                                       "doorbell", "boot_s")}
        info.update(running=pid is not None, pid=pid, dir=str(d))
        if pid is not None:
            try:
                threads = qemu.vcpu_threads(d / "qmp.sock")
                for t in threads:
                    t["cpus_allowed"] = cpus_allowed(pid, t["thread"])
                info["vcpu_threads"] = threads
            except qemu.QmpError as e:
                info["qmp_error"] = str(e)
        out.append(info)
    return out


# ---------------------------------------------------------------- pin

def parse_cores(text: str) -> List[int]:
    """'0,1,4-6' -> [0, 1, 4, 5, 6], each a core we may run on."""
    cores: List[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise VmError(f"bad core list '{text}' (expected e.g. 0,1 or "
                          f"0-3)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise VmError(f"bad core range '{part.strip()}'")
        cores.extend(range(lo, hi + 1))
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cores if c not in allowed]
    if bad:
        raise VmError(f"core {bad[0]} is not a host core we may use "
                      f"(available: {','.join(map(str, sorted(allowed)))})")
    return list(dict.fromkeys(cores))


def pin(root: Path, names: List[str], cores: List[int]) -> List[Dict]:
    """Pin vCPU i of each VM to cores[i % len(cores)]; vCPU threads come
    from QMP query-cpus-fast."""
    done = []
    for n in names:
        d = vm_dir(root, n)
        pid = qemu_pid(d)
        if pid is None:
            raise VmError(f"VM {n} is not running")
        try:
            threads = qemu.vcpu_threads(d / "qmp.sock")
        except qemu.QmpError as e:
            raise VmFailure(f"VM {n}: {e}")
        for i, t in enumerate(threads):
            core = cores[i % len(cores)]
            try:
                os.sched_setaffinity(t["thread"], {core})
            except OSError as e:
                raise VmFailure(f"VM {n}: cannot pin vCPU {t['cpu']} "
                                      f"(thread {t['thread']}): {e.strerror}")
            done.append({"vm": n, "cpu": t["cpu"], "thread": t["thread"],
                         "core": core,
                         "cpus_allowed": cpus_allowed(pid, t["thread"])})
    return done
