"""QEMU for `ivcloud vm`: the command line of a guest, the KVM probe (with
its TCG fallback) and a small QMP client.

Every guest is a q35 machine with a virtual Intel IOMMU, so that the
guest's vfio-pci can take the ivshmem-doorbell device's MSI-X interrupt
to user space (see native/src/doorbell_uio.c), two serial ports (ttyS0:
console log; ttyS1: the command agent, agent.py) and the ivshmem-doorbell
device connected to an ivshmem-server socket. A guest may also get PCIe
root ports, empty at boot, into which QMP plugs further ivshmem-doorbell
devices while it runs (plug_ivshmem, unplug_ivshmem): q35's root bus
takes no hot-plugged device. A guest that is to migrate has its device
of boot in a root port of its own as well (BOOT_PORT): QEMU migrates no
ivshmem-doorbell device, so it comes out before and a device on the
destination's server goes into the same port after (start_incoming,
migrate).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import QmpError, VmFailure
from .image import INIT_BANNER, GuestImage

QEMU_ENV = "IVCLOUD_QEMU"
DEFAULT_QEMU = "qemu-system-x86_64"
# A working KVM prints its init banner in about a second; a guest that
# says nothing for this long is the nested-KVM hang these hosts have.
KVM_PROBE_TIMEOUT_S = float(os.environ.get("IVCLOUD_KVM_PROBE_S", "8"))


# the ids of the root ports for hot-plugged devices: ROOT_PORT1, ...
ROOT_PORT = "rp"
# the root port of a device of boot that may be unplugged, and that
# device's id (and its chardev's); not a ROOT_PORT: a job's device never
# takes this port, even while it is empty during a migration
BOOT_PORT = "ivboot"
BOOT_DEVICE = "ivs"


def qemu_binary() -> Optional[str]:
    return shutil.which(os.environ.get(QEMU_ENV) or DEFAULT_QEMU)


def smp(accel: str, vcpus: int) -> str:
    """The -smp value. Under TCG a guest's `lock` instructions are atomic
    against other processes (the ivshmem region's other guests and the
    host) only when QEMU translates for parallel vCPUs, which it does
    only if the machine may have more than one: with -smp 1 a guest's
    atomic add on the region is a plain load and store, and concurrent
    adds of two 1-vCPU guests lost 11-19 % of their updates
    (tests/test_vm.py, test_atomics_across_guests_and_host). A second,
    absent (hot-pluggable) vCPU slot turns parallel translation on."""
    if accel == "tcg" and vcpus < 2:
        return f"{vcpus},maxcpus=2"
    return str(vcpus)


# TCG's default model with RDTSCP, which TCG emulates and Intel MPI's
# timer executes without asking CPUID (SIGILL on plain qemu64)
TCG_CPU = "qemu64,+rdtscp"
# qemu64 says AMD family 15: OpenBLAS then picks its Opteron kernels,
# whose 3DNow! instructions TCG does not emulate (SIGILL in numpy, HPL,
# PETSc); Prescott's need SSE3, which qemu64 has
TCG_OPENBLAS_CORE = "Prescott"


def guest_env(accel: str) -> Dict[str, str]:
    """What every program in a guest under `accel` needs in its
    environment."""
    return {"OPENBLAS_CORETYPE": TCG_OPENBLAS_CORE} if accel == "tcg" else {}


def guest_command(qemu: str, image: GuestImage, vm_dir: Path, name: str,
                  accel: str, vcpus: int, memory_mb: int,
                  server_socket: Optional[str], vectors: int = 1,
                  doorbell: str = "vfio", daemonize: bool = True,
                  net: Optional[Dict[str, str]] = None,
                  hotplug_ports: int = 0,
                  port_window: int = 256 << 20,
                  boot_port: bool = False,
                  overlay: Optional[Path] = None,
                  incoming: bool = False, share=None) -> List[str]:
    """The guest's QEMU command line. `hotplug_ports` empty PCIe root
    ports (ROOT_PORT1, ...) take hot-plugged devices, each with
    `port_window` bytes of 64-bit prefetchable address space reserved at
    boot: the firmware sizes a bridge's window by what is behind it
    then, and a hot-plugged ivshmem's BAR 2 (its region) finds no room
    in an empty port's window otherwise.

    boot_port: the device on `server_socket` (BOOT_DEVICE) sits in root
    port BOOT_PORT, before the others (its bus number, and so its PCI
    address, is the lowest: the guest's default device), and can be
    unplugged; the port is there also without a server (a migration's
    destination, whose device comes after). overlay: the root file
    system's writes go to this qcow2 file over the image (made by
    make_overlay), which a migration's source and destination share,
    instead of a temporary one of this QEMU's own. incoming: the QEMU
    waits, paused, for a migration (start_incoming) and stays paused
    after it until `cont`. share: a share.Share the guest mounts (its disk
    after every other device, whose PCI addresses stay as without it)."""
    # no_timer_check: on a loaded host, a TCG guest's early check that
    # the IO-APIC timer ticks can miss its window, and with the IOMMU's
    # interrupt remapping the kernel then panics (docs/vm.md)
    append = (f"console=ttyS0 quiet panic=-1 intel_iommu=on no_timer_check "
              f"ivcloud.name={name} ivcloud.doorbell={doorbell}")
    if image.disk is not None:
        # the Debian image (debian.py): its root on virtio, copy-on-write
        # in a temporary overlay, so guests share one read-only image
        append += " root=/dev/vda rw"
    if net is not None:
        # the guests' own network (debian.py configures it from these)
        append += f" ivcloud.ip={net['ip']} ivcloud.hosts={net['hosts']}"
    if share is not None:
        append += f" {share.kernel_arg()}"
    cmd = [qemu, "-name", f"{name},debug-threads=on",
           "-machine", "q35", "-accel", accel,
           "-smp", smp(accel, vcpus), "-m", f"{memory_mb}M",
           "-nodefaults", "-no-user-config", "-display", "none",
           "-no-reboot",  # a guest that panics or reboots ends its QEMU
           # before any PCI device: the IOMMU must see them all
           "-device", "intel-iommu",
           "-kernel", str(image.kernel), "-initrd", str(image.initrd),
           "-append", append,
           "-chardev", f"file,id=con,path={vm_dir / 'console.log'}",
           "-serial", "chardev:con",
           "-chardev", f"socket,id=agent,path={vm_dir / 'agent.sock'},"
                       f"server=on,wait=off",
           "-device", "isa-serial,chardev=agent",
           "-qmp", f"unix:{vm_dir / 'qmp.sock'},server=on,wait=off",
           "-pidfile", str(vm_dir / "qemu.pid")]
    if image.disk is not None and overlay is not None:
        cmd += ["-drive", f"file={overlay},format=qcow2,if=none,id=root",
                "-device", "virtio-blk-pci,drive=root"]
    elif image.disk is not None:
        cmd += ["-drive", f"file={image.disk},format=raw,if=none,id=root,"
                          f"snapshot=on",
                "-device", "virtio-blk-pci,drive=root"]
    if net is not None and net.get("tap"):
        # a tap that already exists (the caller made it and put it in a
        # bridge, in the network namespace QEMU runs in): QEMU only opens it
        cmd += ["-netdev", f"tap,id=net0,ifname={net['tap']},script=no,"
                           f"downscript=no",
                "-device", f"virtio-net-pci,netdev=net0,mac={net['mac']}"]
    elif net is not None:
        # a point-to-point Ethernet between two guests: datagrams between
        # two UNIX sockets, no host interface and no root-only tap
        cmd += ["-netdev", f"dgram,id=net0,local.type=unix,"
                           f"local.path={net['local']},remote.type=unix,"
                           f"remote.path={net['remote']}",
                "-device", f"virtio-net-pci,netdev=net0,mac={net['mac']}"]
    cmd += ["-cpu", "host" if accel == "kvm" else TCG_CPU]
    if boot_port:
        cmd += ["-device", f"pcie-root-port,id={BOOT_PORT},chassis=0,"
                           f"slot=0,pref64-reserve={port_window}"]
    if server_socket:
        cmd += ["-chardev", f"socket,path={server_socket},id={BOOT_DEVICE}",
                "-device", f"ivshmem-doorbell,id={BOOT_DEVICE},"
                           f"chardev={BOOT_DEVICE},vectors={vectors}"
                           + (f",bus={BOOT_PORT}" if boot_port else "")]
    for i in range(1, hotplug_ports + 1):
        cmd += ["-device", f"pcie-root-port,id={ROOT_PORT}{i},chassis={i},"
                           f"slot={i},pref64-reserve={port_window}"]
    if share is not None:
        cmd += share.qemu_args()
    if incoming:
        cmd += ["-incoming", "defer", "-S"]
    if daemonize:
        cmd.append("-daemonize")
    return cmd


def make_overlay(image: GuestImage, path: Path) -> None:
    """A qcow2 file at `path` over the image's root file system (its
    backing file, read only), for guest_command's overlay."""
    if image.disk is None:
        raise VmFailure("the image has no root file system to overlay")
    try:
        p = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F",
                            "raw", "-b", str(image.disk.absolute()),
                            str(path)],
                           stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VmFailure(f"qemu-img create {path}: {e}")
    if p.returncode != 0:
        raise VmFailure(f"qemu-img create {path}: "
                        f"{last_line(p.stderr or p.stdout)}")


def launch(cmd: List[str], vm_dir: Path, name: str,
           timeout_s: float = 60.0) -> None:
    """Run a daemonizing QEMU command line (`guest_command`), its output
    in VM_DIR/qemu.log; VmFailure with QEMU's last word if it does not
    come up."""
    with open(vm_dir / "qemu.log", "w") as qlog:
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=qlog,
                               stderr=subprocess.PIPE, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise VmFailure(f"QEMU for {name} did not start within "
                            f"{timeout_s:g} s")
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        raise VmFailure(f"QEMU for {name} failed: "
                        f"{lines[-1] if lines else p.returncode}")


def console_text(vm_dir: Path) -> str:
    try:
        return (vm_dir / "console.log").read_text(errors="replace")
    except OSError:
        return ""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no console output)"


# ---------------------------------------------------------------- KVM

def _probe_key(qemu: str, image: GuestImage) -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    h = hashlib.sha256(f"{boot}|{os.path.realpath(qemu)}|{image.kernel}|"
                       f"{image.kernel_version}".encode())
    return h.hexdigest()[:16]


def kvm_usable(qemu: str, image: GuestImage, cache_dir: Path,
               timeout_s: float = KVM_PROBE_TIMEOUT_S) -> Tuple[bool, str]:
    """Does a KVM guest boot here? Boots the image without devices and
    waits for its init banner. The answer is cached per host boot.
    Returns (usable, reason)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    cache = cache_dir / "kvm-probe.json"
    key = _probe_key(qemu, image)
    try:
        old = json.loads(cache.read_text())
        if old.get("key") == key:
            return bool(old["usable"]), old.get("reason", "cached")
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory(prefix="ivcloud-kvm-probe-") as tmp:
        d = Path(tmp)
        cmd = guest_command(qemu, image, d, "kvm-probe", "kvm", 1, 128, None,
                            daemonize=False)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        usable, reason = False, ""
        try:
            while time.monotonic() < deadline:
                if INIT_BANNER in console_text(d):
                    usable, reason = True, "guest booted under KVM"
                    break
                if proc.poll() is not None:
                    err = (proc.stderr.read() or "").strip().splitlines()
                    reason = (f"QEMU with KVM exited: "
                              f"{err[-1] if err else proc.returncode}")
                    break
                time.sleep(0.1)
            else:
                out = console_text(d)
                reason = (f"a KVM guest printed {'nothing' if not out else 'no init banner'} "
                          f"in {timeout_s:.0f} s")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "usable": usable,
                                     "reason": reason}) + "\n")
    except OSError:
        pass
    return usable, reason


# ---------------------------------------------------------------- QMP

class Qmp:
    """One QMP session over the VM's UNIX socket (use as a context
    manager)."""

    def __init__(self, path: Path, timeout: float = 5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise QmpError(f"cannot connect to QMP at {path}: "
                           f"{e.strerror or e}")
        self.buf = b""
        greeting = self._read()
        if "QMP" not in greeting:
            self.close()
            raise QmpError("no QMP greeting")
        self.execute("qmp_capabilities")

    def _read(self) -> Dict[str, Any]:
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError as e:
                raise QmpError(f"QMP read: {e}")
            if not chunk:
                raise QmpError("QMP connection closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def execute(self, command: str, fd: Optional[int] = None,
                **arguments) -> Any:
        """Run `command`; `fd` goes with it (SCM_RIGHTS), for getfd."""
        msg: Dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        data = json.dumps(msg).encode() + b"\n"
        try:
            if fd is None:
                self.sock.sendall(data)
            else:
                socket.send_fds(self.sock, [data], [fd])
        except OSError as e:
            raise QmpError(f"QMP write: {e}")
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise QmpError(f"{command}: {reply['error'].get('desc')}")
            # asynchronous events ({"event": ...}) are skipped

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Qmp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vcpu_threads(qmp_path: Path) -> List[Dict[str, int]]:
    """[{"cpu": index, "thread": host tid}] from query-cpus-fast."""
    with Qmp(qmp_path) as q:
        cpus = q.execute("query-cpus-fast")
    return [{"cpu": int(c["cpu-index"]), "thread": int(c["thread-id"])}
            for c in cpus]


# ---------------------------------------------------------------- hot-plug

def _pci_functions(q: Qmp) -> List[Dict[str, Any]]:
    """Every PCI function QEMU has, bridges' children included, as
    query-pci gives them (their "bus" is the number the guest gave it)."""
    out: List[Dict[str, Any]] = []

    def walk(devices):
        for d in devices:
            out.append(d)
            walk((d.get("pci_bridge") or {}).get("devices") or [])

    for bus in q.execute("query-pci"):
        walk(bus.get("devices") or [])
    return out


def pci_address(dev: Dict[str, Any]) -> str:
    """The guest's name of a query-pci function (domain 0)."""
    return f"0000:{dev['bus']:02x}:{dev['slot']:02x}.{dev['function']:x}"


def free_root_port(q: Qmp) -> Optional[Tuple[str, str]]:
    """(id, the PCI address a device plugged into it gets) of the first
    root port for hot-plug that holds no device; None when all do."""
    for d in _pci_functions(q):
        qid = d.get("qdev_id") or ""
        bridge = d.get("pci_bridge")
        if not qid.startswith(ROOT_PORT) or bridge is None:
            continue
        if not bridge.get("devices"):
            # a PCIe port's one slot is device 0 of its secondary bus
            secondary = bridge["bus"]["secondary"]
            return qid, f"0000:{secondary:02x}:00.0"
    return None


def ivshmem_ids(q: Qmp) -> List[str]:
    """QEMU's ids of the guest's ivshmem devices (1af4:1110)."""
    return sorted(d.get("qdev_id") or "?" for d in _pci_functions(q)
                  if (d.get("id") or {}).get("vendor") == 0x1af4 and
                  (d.get("id") or {}).get("device") == 0x1110)


def find_device(q: Qmp, dev_id: str) -> Optional[str]:
    """The guest PCI address of the device QEMU knows as `dev_id`."""
    for d in _pci_functions(q):
        if d.get("qdev_id") == dev_id:
            return pci_address(d)
    return None


def port_of(q: Qmp, dev_id: str) -> Optional[str]:
    """The id of the root port that holds the device QEMU knows as
    `dev_id`."""
    for d in _pci_functions(q):
        bridge = d.get("pci_bridge") or {}
        if any(c.get("qdev_id") == dev_id
               for c in bridge.get("devices") or []):
            return d.get("qdev_id") or None
    return None


def plug_ivshmem(q: Qmp, dev_id: str, port: str, server_socket: str,
                 vectors: int = 1) -> str:
    """An ivshmem-doorbell device `dev_id` on the ivshmem-server at
    `server_socket` (a socket chardev of the same id), into root port
    `port`; its guest PCI address. QEMU has the server's handshake (its
    position, the region) done when device_add returns. When it fails,
    the caller removes what went in (unplug_ivshmem, then
    remove_chardev: in that order across all the server's guests)."""
    q.execute("chardev-add", id=dev_id, backend={
        "type": "socket",
        "data": {"addr": {"type": "unix", "data": {"path": server_socket}},
                 "server": False}})
    q.execute("device_add", driver="ivshmem-doorbell", id=dev_id,
              bus=port, chardev=dev_id, vectors=vectors)
    addr = find_device(q, dev_id)
    if addr is None:
        raise QmpError(f"device {dev_id} is not on the PCI bus after "
                       f"device_add")
    return addr


def unplug_ivshmem(q: Qmp, qemu_pid: int, dev_id: str,
                   timeout_s: float) -> bool:
    """Ask the guest to give device `dev_id` back and wait, at most
    `timeout_s`, until it did; then the numbers of the device's eventfds
    are taken by idle ones (guard_eventfds). Its chardev stays
    (remove_chardev). False when the device is still there: a guest that
    does not answer the unplug request keeps it."""
    before = _eventfd_numbers(qemu_pid)
    if find_device(q, dev_id) is not None:
        _quietly(q, "device_del", id=dev_id)   # also: already pending
        deadline = time.monotonic() + timeout_s
        while find_device(q, dev_id) is not None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    now = set(_fd_numbers(qemu_pid))
    # a number that a file other than an eventfd holds already was taken
    # before it could be covered (an eventfd opened there since cannot
    # be told from the device's: no agent connection is, agent.quiet)
    open_holes = (before & now) - _eventfd_numbers(qemu_pid)
    open_holes |= guard_eventfds(q, qemu_pid, before - now, dev_id)
    if open_holes:
        raise QmpError(f"{dev_id} is unplugged, but its descriptors "
                       f"{sorted(open_holes)} could not be guarded: QEMU "
                       f"{qemu_pid} may crash (guard_eventfds)")
    return True


def remove_chardev(q: Qmp, chardev_id: str, timeout_s: float = 10.0
                   ) -> None:
    """Close chardev `chardev_id` (an ivshmem-server sees its peer
    leave), if it is there; its device must be unplugged first.

    QEMU 7.2's ivshmem-doorbell frees a peer's eventfd array when its
    server says the peer left, without forgetting it, and its unrealize
    frees it again: glibc aborted a guest's QEMU (in its call_rcu
    thread) at the unplug of a job's device after the other guest of
    the job had been killed. So the other devices on a server whose
    peers leave must be unplugged before this; a server started with
    --no-leave-notices (server.start, leave_notices=False; the job
    servers of a VM cluster) tells them nothing, and any order, or a
    dead peer, is safe (docs/server-protocol.md, "Quiet leaves").

    QEMU refuses while the chardev is busy, which an unplugged device
    may keep it for a moment: retried for at most `timeout_s`, then
    QmpError with QEMU's reason."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            q.execute("chardev-remove", id=chardev_id)
            return
        except QmpError as e:
            if not str(e).startswith("chardev-remove:"):
                raise   # the connection failed, not the command
            labels = [c.get("label") for c in q.execute("query-chardev")]
            if chardev_id not in labels:
                return
            if time.monotonic() > deadline:
                raise QmpError(f"chardev {chardev_id} stays: {e}")
        time.sleep(0.2)


def _fd_numbers(pid: int) -> List[int]:
    try:
        return [int(n) for n in os.listdir(f"/proc/{pid}/fd")]
    except OSError as e:
        raise QmpError(f"cannot list the files of QEMU {pid}: "
                       f"{e.strerror}")


def _eventfd_numbers(pid: int) -> set:
    out = set()
    for n in _fd_numbers(pid):
        try:
            if os.readlink(f"/proc/{pid}/fd/{n}") == "anon_inode:[eventfd]":
                out.add(n)
        except OSError:
            pass   # closed meanwhile
    return out


# at most this many idle eventfds handed to a QEMU per unplug
GUARD_LIMIT = 256


def guard_eventfds(q: Qmp, pid: int, numbers: set, tag: str) -> set:
    """Make QEMU `pid` hold idle eventfds (never signalled; QMP getfd,
    named after `tag`) under each of `numbers`, the descriptor numbers
    an unplugged ivshmem-doorbell's eventfds had; the numbers left
    unguarded (one that something else took meanwhile).

    Why: without KVM's irqfd (TCG), QEMU 7.2's ivshmem-doorbell watches
    its own vectors' eventfds with fd handlers that its unrealize does
    not remove. The device is freed, its eventfds are closed, and the
    next descriptor QEMU opens under such a number (a connection to the
    guest's agent or QMP socket) calls the freed device's handler as
    soon as it is readable: QEMU died of SIGSEGV in
    object_dynamic_cast_assert, from aio_dispatch, at the first agent
    command after an unplug. An idle eventfd under the number is never
    readable, so the stale handler never runs. Descriptors open at the
    lowest free number: idle eventfds that land below the holes are
    given back (closefd) once the holes are filled."""
    todo = set(numbers)
    extra: List[str] = []
    for k in range(GUARD_LIMIT):
        if not todo:
            break
        name = f"{tag}-guard-{time.monotonic_ns()}-{k}"
        before = set(_fd_numbers(pid))
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            q.execute("getfd", fd=efd, fdname=name)
        finally:
            os.close(efd)
        got = set(_fd_numbers(pid)) - before
        if not got & todo:
            extra.append(name)
            if not got or min(got) > max(todo):
                break   # the holes were taken by something else
        todo -= got
    for name in extra:
        _quietly(q, "closefd", fdname=name)
    return todo


def _quietly(q: Qmp, command: str, **arguments) -> None:
    """A QMP command whose refusal (nothing of that id) changes nothing."""
    try:
        q.execute(command, **arguments)
    except QmpError as e:
        if not str(e).startswith(f"{command}:"):
            raise   # the connection failed, not the command


# ---------------------------------------------------------------- migration

# the bandwidth a migration may take, in bytes/s: QEMU's default (32 MiB/s)
# would spend 16 s on a 512 MiB guest that a local socket moves in one
MIGRATE_BANDWIDTH = 8 << 30
# query-migrate's states of a migration still under way
_MIGRATING = ("none", "setup", "active", "pre-switchover", "device",
              "wait-unplug", "cancelling", "postcopy-active")


def start_incoming(q: Qmp, uri: str) -> None:
    """A QEMU started with guest_command(incoming=True) listens at `uri`
    (unix:PATH) for the migration stream."""
    q.execute("migrate-incoming", uri=uri)


def migrate(q: Qmp, uri: str, timeout_s: float,
            progress=None, paused: bool = False) -> Dict[str, Any]:
    """Migrate the guest of `q`'s QEMU to the one listening at `uri` and
    wait, at most `timeout_s`, until it is done; {"downtime_ms",
    "total_ms", "transferred"} as QEMU reports them. With `paused` the
    guest is stopped before the first copy, not live: its downtime is
    then the whole migration's time, and so reported. The source stays
    paused afterwards (quit it, or `cont` to take the guest back while
    the destination never ran). QmpError when the migration fails or
    takes too long (then cancelled: the source stays paused if `paused`,
    else it runs on). progress(info) is called with each query-migrate
    answer."""
    q.execute("migrate-set-parameters", **{"max-bandwidth":
                                           MIGRATE_BANDWIDTH})
    if paused:
        q.execute("stop")
    q.execute("migrate", uri=uri)
    deadline = time.monotonic() + timeout_s
    while True:
        info = q.execute("query-migrate")
        status = info.get("status")
        if status == "completed":
            return {"downtime_ms": info.get("total-time" if paused else
                                            "downtime"),
                    "total_ms": info.get("total-time"),
                    "transferred": (info.get("ram") or {}).get(
                        "transferred")}
        if status not in _MIGRATING:
            raise QmpError(f"migration {status}: "
                           f"{info.get('error-desc', 'no reason given')}")
        if time.monotonic() > deadline:
            _quietly(q, "migrate_cancel")
            end = time.monotonic() + 30
            while q.execute("query-migrate").get("status") in _MIGRATING \
                    and time.monotonic() < end:
                time.sleep(0.2)
            raise QmpError(f"migration did not complete within "
                           f"{timeout_s:.0f} s (cancelled)")
        if progress is not None:
            progress(info)
        time.sleep(0.2)


def run_state(q: Qmp) -> str:
    """QEMU's run state (running, paused, postmigrate, inmigrate, ...)."""
    return str(q.execute("query-status").get("status"))


def resume(q: Qmp) -> None:
    """Let a paused guest run (after a failed migration, or one whose
    destination is given up before it ran); a running one is left."""
    if run_state(q) != "running":
        q.execute("cont")
