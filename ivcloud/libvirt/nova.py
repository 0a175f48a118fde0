"""OpenStack Nova: the flavor for pinned, NUMA-placed, huge-page
instances, and what Nova's metadata in a domain says (flavor, project).

Nova turns these flavor extra specs into the same libvirt elements that
`domain.Domain` writes by hand: hw:cpu_policy=dedicated -> <vcpupin> on
host cores from nova.conf's [compute] cpu_dedicated_set,
hw:numa_nodes -> <numatune> and guest NUMA cells, hw:mem_page_size ->
<memoryBacking><hugepages>. Nova has no ivshmem device: that is attached
to the running instance afterwards (see attach.py and docs/operators.md).
"""

from __future__ import annotations

import re
import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

from .domain import SpecError

THREAD_POLICIES = ("prefer", "isolate", "require")
EMULATOR_POLICIES = ("share", "isolate")
# Nova's symbolic page sizes, and the explicit ones we accept (-> KiB).
PAGE_SYMBOLS = ("small", "large", "any")
_PAGE_EXPLICIT = {"2m": 2048, "2mb": 2048, "2048": 2048,
                  "1g": 1 << 20, "1gb": 1 << 20, "1048576": 1 << 20,
                  "4k": 4, "4kb": 4, "4": 4}
_FLAVOR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,254}$")
# The namespace of Nova's <metadata>; its version (1.0, 1.1, ...) changes
# between releases.
NOVA_NS_PREFIX = "http://openstack.org/xmlns/libvirt/nova/"


def _nova_elements(parent: ET.Element, local: str) -> Iterator[ET.Element]:
    for el in parent.iter():
        if el.tag.startswith("{" + NOVA_NS_PREFIX) and \
                el.tag.endswith("}" + local):
            yield el


def _nova_attr(xml_text: str, path: List[str], attr: str) -> Optional[str]:
    """An attribute of the first Nova element along `path`, or None."""
    try:
        found = [ET.fromstring(xml_text)]
    except ET.ParseError:
        return None
    for local in path:
        found = [el for parent in found for el in _nova_elements(parent,
                                                                 local)]
    return found[0].get(attr) if found else None


def nova_flavor(xml_text: str) -> Optional[str]:
    """The flavor name Nova records in a domain's <metadata>, if any."""
    return _nova_attr(xml_text, ["flavor"], "name")


def nova_project(xml_text: str) -> Optional[str]:
    """The project that owns a Nova instance
    (<nova:owner><nova:project uuid=...>); None for a domain Nova did not
    write, or wrote without an owner."""
    return _nova_attr(xml_text, ["owner", "project"], "uuid")


def page_size_spec(text: str) -> str:
    """'2M', '2MB', '1G', 'large', ... -> the value Nova expects."""
    low = text.strip().lower()
    if low in PAGE_SYMBOLS:
        return low
    kib = _PAGE_EXPLICIT.get(low)
    if kib is None:
        raise SpecError(f"bad page size '{text}' (small, large, any, 4K, 2M "
                        f"or 1G)")
    return {4: "4KB", 2048: "2MB", 1 << 20: "1GB"}[kib]


@dataclass
class Flavor:
    name: str
    vcpus: int
    ram_mb: int
    disk_gb: int = 0
    numa_nodes: int = 1
    thread_policy: str = "isolate"
    page_size: Optional[str] = "2MB"
    emulator_threads: Optional[str] = None

    def validate(self) -> None:
        if not _FLAVOR_NAME.match(self.name):
            raise SpecError(f"bad flavor name '{self.name}'")
        if self.vcpus < 1:
            raise SpecError(f"vcpus must be at least 1, not {self.vcpus}")
        if self.ram_mb < 1:
            raise SpecError(f"ram must be at least 1 MB, not {self.ram_mb}")
        if self.disk_gb < 0:
            raise SpecError(f"disk must not be negative, not {self.disk_gb}")
        if self.thread_policy not in THREAD_POLICIES:
            raise SpecError(f"thread policy must be one of "
                            f"{', '.join(THREAD_POLICIES)}")
        if (self.emulator_threads is not None
                and self.emulator_threads not in EMULATOR_POLICIES):
            raise SpecError(f"emulator threads policy must be one of "
                            f"{', '.join(EMULATOR_POLICIES)}")
        if self.numa_nodes < 1:
            raise SpecError(f"numa nodes must be at least 1, not "
                            f"{self.numa_nodes}")
        # Nova splits vCPUs and RAM evenly over the guest NUMA cells
        # unless hw:numa_cpus.N / hw:numa_mem.N say otherwise, and refuses
        # the flavor at boot time if they do not divide: fail here instead.
        if self.vcpus % self.numa_nodes:
            raise SpecError(f"{self.vcpus} vCPUs do not split evenly over "
                            f"{self.numa_nodes} NUMA nodes")
        if self.ram_mb % self.numa_nodes:
            raise SpecError(f"{self.ram_mb} MB of RAM does not split evenly "
                            f"over {self.numa_nodes} NUMA nodes")
        if self.page_size is not None:
            size = page_size_spec(self.page_size)
            page_mb = {"2MB": 2, "1GB": 1024}.get(size)
            cell_mb = self.ram_mb // self.numa_nodes
            if page_mb and cell_mb % page_mb:
                raise SpecError(f"{cell_mb} MB per NUMA node is not a "
                                f"multiple of the {size} page size")

    def extra_specs(self) -> Dict[str, str]:
        self.validate()
        specs = {
            "hw:cpu_policy": "dedicated",
            "hw:cpu_thread_policy": self.thread_policy,
            "hw:numa_nodes": str(self.numa_nodes),
        }
        if self.page_size is not None:
            specs["hw:mem_page_size"] = page_size_spec(self.page_size)
        if self.emulator_threads is not None:
            specs["hw:emulator_threads_policy"] = self.emulator_threads
        return specs

    def commands(self) -> List[str]:
        specs = self.extra_specs()
        q = shlex.quote
        create = (f"openstack flavor create --vcpus {self.vcpus} "
                  f"--ram {self.ram_mb} --disk {self.disk_gb} "
                  f"{q(self.name)}")
        props = " ".join(f"--property {q(f'{k}={v}')}"
                         for k, v in specs.items())
        return [create, f"openstack flavor set {q(self.name)} {props}"]
