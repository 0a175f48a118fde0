"""libvirt domain XML for VMs that share an ivshmem region.

Everything here is pure XML generation (xml.etree): no libvirt connection
is needed, so an operator can produce the XML on one machine and define it
on another. What goes in and why:

- ``<shmem>``: the ivshmem device. ``ivshmem-plain`` maps /dev/shm/NAME
  (no interrupts); ``ivshmem-doorbell`` connects to an ivshmem-server
  socket, which hands out the region and the eventfd doorbells (our
  ``ivcloud server``). libvirt does not start the server.
- ``<cputune>`` / ``<numatune>`` / ``<memoryBacking>``: vCPU pinning, NUMA
  memory placement and huge pages, the host tuning of seeds 000 (sec. 5.4,
  6.3) and 004 (sec. V).
- ``<features><acpi/>``: without ACPI the i440fx root bus cannot hot-plug,
  and hot-attaching the ivshmem device is how it reaches a running
  (Nova-managed) instance.

``type='qemu'`` (TCG) is the default because nested KVM does not boot on
the machines this project is tested on; ``kvm=True`` switches to KVM with
host-passthrough CPUs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from ..errors import SpecError
from . import cpuset

SHMEM_MODELS = ("ivshmem-plain", "ivshmem-doorbell")
# libvirt refuses shmem sizes that are not a power of two or below 1 MiB
# (QEMU maps the region as a PCI BAR).
MIN_SHMEM_SIZE = 1 << 20
MAX_VECTORS = 1024  # QEMU's limit for ivshmem MSI-X vectors
HUGEPAGE_SIZES = {2 << 20: "2M", 1 << 30: "1G"}
MIN_MEMORY = 16 << 20

# libvirt domain names may hold almost anything, but they end up in file
# names and on command lines; a conservative set avoids quoting trouble.
_DOMAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
# A plain shmem's name is the file /dev/shm/NAME: no '/', no leading dot.
_SHMEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _size_text(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0 and n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return f"{n}B"


# ---------------------------------------------------------------- shmem

@dataclass(frozen=True)
class Shmem:
    """One ivshmem device. ``model=None`` picks doorbell when a server
    socket is given and plain otherwise."""

    name: str
    size: Optional[int] = None
    model: Optional[str] = None
    server: Optional[str] = None
    vectors: Optional[int] = None
    ioeventfd: bool = True

    @property
    def resolved_model(self) -> str:
        if self.model:
            return self.model
        return "ivshmem-doorbell" if self.server else "ivshmem-plain"

    def validate(self) -> None:
        model = self.resolved_model
        if not _SHMEM_NAME.match(self.name):
            raise SpecError(f"bad shmem name '{self.name}' (letters, "
                            f"digits, '_.-', at most 64, no '/')")
        if model not in SHMEM_MODELS:
            raise SpecError(f"unknown shmem model '{model}' (one of "
                            f"{', '.join(SHMEM_MODELS)})")
        if self.size is not None:
            if not _is_pow2(self.size) or self.size < MIN_SHMEM_SIZE:
                raise SpecError(f"shmem size {_size_text(self.size)} must be "
                                f"a power of two of at least 1M")
        if model == "ivshmem-plain":
            if self.server:
                raise SpecError("a shmem server socket needs the "
                                "ivshmem-doorbell model")
            if self.vectors is not None:
                raise SpecError("interrupt vectors need the "
                                "ivshmem-doorbell model")
        else:
            if not self.server:
                raise SpecError("ivshmem-doorbell needs the ivshmem-server "
                                "socket path", setting="shmem_server")
            if not self.server.startswith("/"):
                raise SpecError(f"server socket '{self.server}' must be an "
                                f"absolute path (QEMU runs elsewhere)")
            if self.vectors is not None and not 1 <= self.vectors \
                    <= MAX_VECTORS:
                raise SpecError(f"vectors must be 1..{MAX_VECTORS}, not "
                                f"{self.vectors}")

    def element(self) -> ET.Element:
        self.validate()
        shm = ET.Element("shmem", name=self.name)
        ET.SubElement(shm, "model", type=self.resolved_model)
        if self.size is not None:
            # MiB units: every valid size is a whole number of MiB.
            size = ET.SubElement(shm, "size", unit="M")
            size.text = str(self.size >> 20)
        if self.resolved_model == "ivshmem-doorbell":
            ET.SubElement(shm, "server", path=self.server)
            msi = {"ioeventfd": "on" if self.ioeventfd else "off"}
            if self.vectors is not None:
                msi["vectors"] = str(self.vectors)
            ET.SubElement(shm, "msi", **msi)
        return shm

    def xml(self) -> str:
        return to_text(self.element())


# ---------------------------------------------------------------- pinning

def parse_pins(text: str, vcpus: Optional[int] = None) -> Dict[int, Set[int]]:
    """'0:2,1:3' -> {0: {2}, 1: {3}}.

    A vCPU may get several host CPUs: '0:2-3,1:4,5' pins vCPU 0 to 2-3
    and vCPU 1 to 4 and 5 (an item without ':' continues the previous
    vCPU's list, so the CPU-list syntax works unchanged after the colon).
    """
    pins: Dict[int, List[str]] = {}
    current: Optional[int] = None
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise SpecError(f"bad pin list '{text}' (empty item)")
        if ":" in item:
            vcpu_text, cpus_text = item.split(":", 1)
            if not vcpu_text.strip().isdigit():
                raise SpecError(f"bad vCPU '{vcpu_text}' in '{text}' "
                                f"(expected VCPU:CPUS, e.g. 0:2,1:3)")
            current = int(vcpu_text)
            if current in pins:
                raise SpecError(f"vCPU {current} is pinned twice in "
                                f"'{text}'")
            pins[current] = [cpus_text]
        elif current is None:
            raise SpecError(f"bad pin list '{text}' (expected VCPU:CPUS, "
                            f"e.g. 0:2,1:3)")
        else:
            pins[current].append(item)
    result: Dict[int, Set[int]] = {}
    for vcpu, parts in pins.items():
        if vcpus is not None and vcpu >= vcpus:
            raise SpecError(f"vCPU {vcpu} is pinned but the domain has "
                            f"{vcpus} vCPU{'s' if vcpus != 1 else ''} "
                            f"(0..{vcpus - 1})")
        try:
            result[vcpu] = cpuset.parse(",".join(parts))
        except ValueError as e:
            raise SpecError(f"vCPU {vcpu}: {e}") from None
    return result


def format_pins(pins: Dict[int, Set[int]]) -> str:
    """The inverse of parse_pins: {0: {2}, 1: {3, 4}} -> '0:2,1:3-4'."""
    return ",".join(f"{v}:{cpuset.format(pins[v])}" for v in sorted(pins))


def cputune_element(pins: Dict[int, Set[int]],
                    emulator: Optional[Set[int]] = None
                    ) -> Optional[ET.Element]:
    """``<cputune>`` with one ``<vcpupin>`` per pinned vCPU and the
    emulator (QEMU's main and I/O threads) pin; None if nothing is
    pinned."""
    if not pins and not emulator:
        return None
    tune = ET.Element("cputune")
    for vcpu in sorted(pins):
        ET.SubElement(tune, "vcpupin", vcpu=str(vcpu),
                      cpuset=cpuset.format(pins[vcpu]))
    if emulator:
        ET.SubElement(tune, "emulatorpin", cpuset=cpuset.format(emulator))
    return tune


# ---------------------------------------------------------------- domain

@dataclass
class Domain:
    name: str
    memory: int                      # bytes
    vcpus: int
    kvm: bool = False
    machine: str = "pc"
    kernel: Optional[str] = None
    initrd: Optional[str] = None
    cmdline: Optional[str] = None
    disk: Optional[str] = None
    shmems: List[Shmem] = field(default_factory=list)
    pins: Dict[int, Set[int]] = field(default_factory=dict)
    emulator_pin: Optional[Set[int]] = None
    numa_nodes: Optional[Set[int]] = None
    hugepage_size: Optional[int] = None   # bytes
    threads: int = 1                       # guest SMT threads per core
    console_log: Optional[str] = None
    emulator: Optional[str] = None

    def validate(self) -> None:
        if not _DOMAIN_NAME.match(self.name):
            raise SpecError(f"bad domain name '{self.name}' (letters, "
                            f"digits, '_.+-', at most 64)")
        if self.memory < MIN_MEMORY:
            raise SpecError(f"memory {_size_text(self.memory)} is below "
                            f"{_size_text(MIN_MEMORY)}")
        if self.memory % 1024:
            raise SpecError("memory must be a whole number of KiB")
        if not 1 <= self.vcpus <= 255:
            raise SpecError(f"vcpus must be 1..255, not {self.vcpus}")
        if self.threads < 1 or self.vcpus % self.threads:
            raise SpecError(f"{self.vcpus} vCPUs do not split into cores "
                            f"of {self.threads} threads")
        if self.disk and self.kernel:
            raise SpecError("give a kernel (direct boot) or a disk, not both")
        if (self.initrd or self.cmdline) and not self.kernel:
            raise SpecError("an initrd or kernel command line needs a "
                            "kernel")
        for vcpu in self.pins:
            if not 0 <= vcpu < self.vcpus:
                raise SpecError(f"vCPU {vcpu} is pinned but the domain "
                                f"has {self.vcpus} vCPUs")
        if self.hugepage_size is not None:
            if self.hugepage_size not in HUGEPAGE_SIZES:
                raise SpecError(f"huge page size "
                                f"{_size_text(self.hugepage_size)} is not "
                                f"one of 2M, 1G")
            if self.memory % self.hugepage_size:
                raise SpecError(f"memory {_size_text(self.memory)} is not a "
                                f"multiple of the "
                                f"{HUGEPAGE_SIZES[self.hugepage_size]} huge "
                                f"page size")
        names = [s.name for s in self.shmems]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SpecError(f"shmem name '{sorted(dup)[0]}' is used twice")
        for shm in self.shmems:
            shm.validate()

    def max_vcpus(self) -> int:
        """vCPU slots of the machine. Emulated (TCG) guests translate their
        atomic instructions as atomic against other processes, such as
        the peers of a shared-memory device, only on a machine that may
        have more than one vCPU (see ivcloud.vm.qemu.smp): a single-vCPU
        emulated domain gets a second, absent slot."""
        return 2 if not self.kvm and self.vcpus == 1 else self.vcpus

    def element(self) -> ET.Element:
        self.validate()
        dom = ET.Element("domain", type="kvm" if self.kvm else "qemu")
        ET.SubElement(dom, "name").text = self.name
        ET.SubElement(dom, "memory", unit="KiB").text = \
            str(self.memory // 1024)
        if self.hugepage_size is not None:
            backing = ET.SubElement(dom, "memoryBacking")
            pages = ET.SubElement(backing, "hugepages")
            ET.SubElement(pages, "page", size=str(self.hugepage_size // 1024),
                          unit="KiB")
        vcpu = ET.SubElement(dom, "vcpu", placement="static")
        vcpu.text = str(self.max_vcpus())
        if self.max_vcpus() != self.vcpus:
            vcpu.set("current", str(self.vcpus))
        tune = cputune_element(self.pins, self.emulator_pin)
        if tune is not None:
            dom.append(tune)
        if self.numa_nodes:
            # strict: an allocation the node cannot satisfy fails instead
            # of silently landing on a remote node (seed 000 sec. 6.3.1).
            numa = ET.SubElement(dom, "numatune")
            ET.SubElement(numa, "memory", mode="strict",
                          nodeset=cpuset.format(self.numa_nodes))
        os_el = ET.SubElement(dom, "os")
        ET.SubElement(os_el, "type", arch="x86_64",
                      machine=self.machine).text = "hvm"
        if self.kernel:
            ET.SubElement(os_el, "kernel").text = self.kernel
            if self.initrd:
                ET.SubElement(os_el, "initrd").text = self.initrd
            if self.cmdline:
                ET.SubElement(os_el, "cmdline").text = self.cmdline
        else:
            ET.SubElement(os_el, "boot", dev="hd")
        features = ET.SubElement(dom, "features")
        ET.SubElement(features, "acpi")
        ET.SubElement(features, "apic")
        cpu = ET.SubElement(dom, "cpu")
        if self.kvm:
            cpu.set("mode", "host-passthrough")
        # Guest topology matching the pinning: the guest scheduler then
        # treats vCPUs as cores (or SMT siblings when threads > 1).
        ET.SubElement(cpu, "topology", sockets="1", dies="1",
                      cores=str(self.max_vcpus() // self.threads),
                      threads=str(self.threads))
        ET.SubElement(dom, "clock", offset="utc")
        ET.SubElement(dom, "on_poweroff").text = "destroy"
        ET.SubElement(dom, "on_crash").text = "destroy"
        devices = ET.SubElement(dom, "devices")
        if self.emulator:
            ET.SubElement(devices, "emulator").text = self.emulator
        if self.disk:
            disk = ET.SubElement(devices, "disk", type="file", device="disk")
            fmt = "qcow2" if self.disk.endswith(".qcow2") else "raw"
            ET.SubElement(disk, "driver", name="qemu", type=fmt)
            ET.SubElement(disk, "source", file=self.disk)
            ET.SubElement(disk, "target", dev="vda", bus="virtio")
        if self.console_log:
            serial = ET.SubElement(devices, "serial", type="file")
            ET.SubElement(serial, "source", path=self.console_log)
        else:
            serial = ET.SubElement(devices, "serial", type="pty")
        ET.SubElement(serial, "target", port="0")
        console = ET.SubElement(devices, "console",
                                type="file" if self.console_log else "pty")
        if self.console_log:
            ET.SubElement(console, "source", path=self.console_log)
        ET.SubElement(console, "target", type="serial", port="0")
        for shm in self.shmems:
            devices.append(shm.element())
        # No balloon: it would let the guest hand back pages that a
        # pinned, NUMA-placed VM is meant to keep.
        ET.SubElement(devices, "memballoon", model="none")
        return dom

    def xml(self) -> str:
        return to_text(self.element())


def to_text(element: ET.Element) -> str:
    ET.indent(element, space="  ")
    return ET.tostring(element, encoding="unicode") + "\n"


# ---------------------------------------------------------------- validation

def validator() -> Optional[str]:
    """virt-xml-validate, if it can work: it is a shell script around
    xmllint and reports success when xmllint is missing."""
    if shutil.which("xmllint") is None:
        return None
    return shutil.which("virt-xml-validate")


def validate_xml(text: str, schema: str = "domain") -> None:
    """Check ``text`` against libvirt's RNG schema with virt-xml-validate
    (Debian libvirt-clients; it needs xmllint from libxml2-utils).

    Raises SpecError with the validator's first error line."""
    tool = validator()
    if tool is None:
        raise SpecError("virt-xml-validate not found (apt-get install "
                        "libvirt-clients libxml2-utils)")
    with tempfile.NamedTemporaryFile("w", suffix=".xml",
                                     prefix="ivcloud-") as f:
        f.write(text)
        f.flush()
        proc = subprocess.run([tool, f.name, schema], capture_output=True,
                              text=True, timeout=60)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines()
                 if ln.strip() and "fails to validate" not in ln]
        first = lines[0] if lines else f"exit status {proc.returncode}"
        raise SpecError(f"libvirt schema rejects the XML: "
                        f"{first.replace(f.name, '<xml>')}")
