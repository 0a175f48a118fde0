"""A CPU-isolation and vCPU-pinning plan from the host topology (hwloc),
for `ivcloud isolate`.

Seed 000 (sec. 5.4.4.3) found that pinning vCPUs alone can make things
worse on a busy host: the host's own daemons keep landing on the pinned
cores. Isolating those cores from the scheduler (isolcpus=), from the
timer tick (nohz_full=) and from RCU callbacks (rcu_nocbs=), and leaving
one core per NUMA node to the host, fixed it. This module computes such a
split from `hwloc-ls --of xml` (or a saved XML file):

- the host keeps the first core (all its SMT siblings) of each NUMA node
  (of each package when the machine has a single NUMA node), or
  a given number of cores spread over the nodes;
- every other core is isolated;
- VMs get isolated cores, each VM inside one NUMA node when it fits
  (seed 004 sec. V: cross-socket traffic is what unpinned VMs lose),
  its memory bound to that node and its emulator threads on the host
  cores of that node.

SMT policies: ``isolate`` puts one vCPU on each physical core and leaves
the sibling threads idle (Nova's hw:cpu_thread_policy=isolate); ``core``
gives each vCPU a whole physical core (it may run on any sibling);
``pack`` puts consecutive vCPUs of one VM on the siblings of a core
(Nova's require) and tells the guest they are threads. Cores are never
shared between VMs.
"""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from .errors import IsolationError
from .libvirt import cpuset
from .libvirt.domain import cputune_element, format_pins, to_text

POLICIES = ("isolate", "core", "pack")


# ---------------------------------------------------------------- topology

@dataclass(frozen=True)
class Core:
    index: int                # logical, in hwloc order
    package: int
    numa: int
    pus: Tuple[int, ...]      # OS (Linux) CPU numbers, ascending


@dataclass
class HostTopology:
    cores: List[Core]

    @property
    def packages(self) -> List[int]:
        return sorted({c.package for c in self.cores})

    @property
    def numa_nodes(self) -> List[int]:
        return sorted({c.numa for c in self.cores})

    @property
    def pus(self) -> List[int]:
        return sorted(p for c in self.cores for p in c.pus)

    @property
    def threads_per_core(self) -> int:
        return max(len(c.pus) for c in self.cores)

    def summary(self) -> str:
        def n(count: int, word: str) -> str:
            return f"{count} {word}{'' if count == 1 else 's'}"
        return (f"{n(len(self.packages), 'package')}, "
                f"{n(len(self.numa_nodes), 'NUMA node')}, "
                f"{n(len(self.cores), 'core')}, {n(len(self.pus), 'PU')} "
                f"({n(self.threads_per_core, 'thread')} per core)")

    def to_json(self) -> Dict:
        return {"packages": self.packages, "numa_nodes": self.numa_nodes,
                "cores": [{"index": c.index, "package": c.package,
                           "numa": c.numa, "pus": list(c.pus)}
                          for c in self.cores]}


def _bitmap(text: Optional[str]) -> Set[int]:
    """hwloc's bitmap string: comma-separated 32-bit hex words, most
    significant first; '0xf...f' stands for an infinite run of ones
    above the listed words (only the finite part matters here)."""
    bits: Set[int] = set()
    if not text:
        return bits
    words = [w.strip() for w in text.split(",")]
    for shift, word in enumerate(reversed(words)):
        if "..." in word:
            continue
        try:
            value = int(word, 16)
        except ValueError:
            raise IsolationError(f"bad hwloc cpuset '{text}'") from None
        base = 32 * shift
        while value:
            low = value & -value
            bits.add(base + low.bit_length() - 1)
            value ^= low
    return bits


def parse_hwloc_xml(text: str) -> HostTopology:
    """Cores and PUs from hwloc XML (v2, and v1 where NUMA nodes are the
    parents of packages). A PU's NUMA node is the node whose cpuset holds
    it, which works for both layouts."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise IsolationError(f"not hwloc XML: {e}") from None
    if root.tag != "topology":
        raise IsolationError(f"not hwloc XML: root element <{root.tag}>")
    numa: List[Tuple[int, Set[int]]] = []
    # (pu os index, package, core key) in document order
    pus: List[Tuple[int, int, object]] = []
    packages_seen: List[int] = []

    def os_index(el: ET.Element, fallback: int) -> int:
        value = el.get("os_index")
        try:
            return int(value) if value is not None else fallback
        except ValueError:
            raise IsolationError(f"bad os_index '{value}' in hwloc XML") from None

    def walk(el: ET.Element, package: int, core: object) -> None:
        for child in el.findall("object"):
            kind = child.get("type")
            pkg, key = package, core
            if kind in ("Package", "Socket"):
                pkg = os_index(child, len(packages_seen))
                packages_seen.append(pkg)
            elif kind == "Core":
                key = child
            elif kind == "NUMANode":
                numa.append((os_index(child, len(numa)),
                             _bitmap(child.get("cpuset"))))
            elif kind == "PU":
                pu = os_index(child, len(pus))
                # A PU without a Core above it is a core of its own.
                pus.append((pu, pkg, key if key is not None else child))
            walk(child, pkg, key)

    walk(root, 0, None)
    if not pus:
        raise IsolationError("the hwloc topology has no PUs")
    cores: Dict[int, List[int]] = {}
    meta: Dict[int, Tuple[int, int]] = {}
    order: List[int] = []
    for pu, pkg, key in pus:
        k = id(key)
        node = next((n for n, cpus in numa if pu in cpus), 0)
        if k not in cores:
            cores[k] = []
            meta[k] = (pkg, node)
            order.append(k)
        cores[k].append(pu)
    return HostTopology([Core(i, meta[k][0], meta[k][1], tuple(sorted(cores[k])))
                     for i, k in enumerate(order)])


def host_topology_xml() -> str:
    for tool in ("hwloc-ls", "lstopo-no-graphics"):
        path = shutil.which(tool)
        if path:
            break
    else:
        raise IsolationError("hwloc-ls not found (apt-get install hwloc)")
    try:
        proc = subprocess.run([path, "--no-io", "--of", "xml", "-"],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise IsolationError(f"{tool} did not finish within 60 s") from None
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["no output"])[0]
        raise IsolationError(f"{tool} failed: {err}")
    return proc.stdout


def host_isolated() -> Optional[Set[int]]:
    """CPUs the running kernel isolates (isolcpus=), None if unknown."""
    try:
        text = Path("/sys/devices/system/cpu/isolated").read_text().strip()
    except OSError:
        return None
    return cpuset.parse(text) if text else set()


def read_topology(path: Optional[Path] = None
                  ) -> Tuple[HostTopology, Optional[Set[int]]]:
    """(topology, CPUs isolated now): of a saved `hwloc-ls --of xml`
    file (isolated now: None, the file is not this host), or of this
    host and its running kernel."""
    if path is None:
        return parse_hwloc_xml(host_topology_xml()), host_isolated()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise IsolationError(f"cannot read {path}: {e.strerror}") from None
    return parse_hwloc_xml(text), None


# ---------------------------------------------------------------- plan

@dataclass
class VmPlan:
    name: str
    vcpus: int
    cores: List[Core]
    pins: Dict[int, Set[int]]
    numa_nodes: Set[int]
    emulator_pin: Set[int]
    threads: int

    def pin_args(self) -> List[str]:
        args = ["--vcpus", str(self.vcpus), "--pin", format_pins(self.pins),
                "--emulator-pin", cpuset.format(self.emulator_pin),
                "--numa-node", cpuset.format(self.numa_nodes)]
        # The guest sees SMT pairs only when they really are siblings.
        if self.threads > 1 and self.vcpus % self.threads == 0:
            args += ["--threads", str(self.threads)]
        return args

    def cputune_xml(self) -> str:
        el = cputune_element(self.pins, self.emulator_pin)
        return to_text(el) if el is not None else ""

    def numatune_xml(self) -> str:
        el = ET.Element("numatune")
        ET.SubElement(el, "memory", mode="strict",
                      nodeset=cpuset.format(self.numa_nodes))
        return to_text(el)

    def to_json(self) -> Dict:
        return {"name": self.name, "vcpus": self.vcpus,
                "cores": [c.index for c in self.cores],
                "vcpupin": {str(v): cpuset.format(p)
                            for v, p in sorted(self.pins.items())},
                "emulatorpin": cpuset.format(self.emulator_pin),
                "numa_nodes": sorted(self.numa_nodes),
                "threads": self.threads,
                "domain_xml_args": self.pin_args(),
                "cputune_xml": self.cputune_xml(),
                "numatune_xml": self.numatune_xml()}


@dataclass
class Plan:
    topology: HostTopology
    policy: str
    host_cores: List[Core]
    isolated_cores: List[Core]
    vms: List[VmPlan] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    @property
    def host_pus(self) -> List[int]:
        return sorted(p for c in self.host_cores for p in c.pus)

    @property
    def isolated_pus(self) -> List[int]:
        return sorted(p for c in self.isolated_cores for p in c.pus)

    def kernel_params(self) -> Dict[str, str]:
        iso = cpuset.format(self.isolated_pus)
        return {
            # domain: off the scheduler's load balancing; managed_irq:
            # no managed device interrupts on these CPUs either.
            "isolcpus": f"managed_irq,domain,{iso}",
            "nohz_full": iso,
            "rcu_nocbs": iso,
            "irqaffinity": cpuset.format(self.host_pus),
        }

    def kernel_cmdline(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.kernel_params().items())

    def nova_conf(self) -> Dict[str, str]:
        return {"cpu_dedicated_set": cpuset.format(self.isolated_pus),
                "cpu_shared_set": cpuset.format(self.host_pus)}

    def to_json(self) -> Dict:
        return {"topology": self.topology.to_json(),
                "summary": self.topology.summary(),
                "policy": self.policy,
                "host_cores": [c.index for c in self.host_cores],
                "host_pus": self.host_pus,
                "isolated_cores": [c.index for c in self.isolated_cores],
                "isolated_pus": self.isolated_pus,
                "kernel_params": self.kernel_params(),
                "kernel_cmdline": self.kernel_cmdline(),
                "nova_conf": {"compute": self.nova_conf()},
                "vms": [vm.to_json() for vm in self.vms],
                "warnings": self.warnings}


def _domains(topo: HostTopology) -> Dict[int, List[Core]]:
    """Cores grouped by NUMA node, or by package on a single-node
    machine; each group in hwloc order."""
    by_numa = len(topo.numa_nodes) > 1
    groups: Dict[int, List[Core]] = {}
    for core in topo.cores:
        groups.setdefault(core.numa if by_numa else core.package,
                          []).append(core)
    return dict(sorted(groups.items()))


def plan(topo: HostTopology, reserve_host: Optional[int] = None, vms: int = 0,
         vcpus: int = 1, policy: str = "isolate") -> Plan:
    if policy not in POLICIES:
        raise IsolationError(f"unknown SMT policy '{policy}' (one of "
                        f"{', '.join(POLICIES)})")
    groups = _domains(topo)
    if reserve_host is None:
        reserve_host = len(groups)
    if reserve_host < 1:
        raise IsolationError("the host needs at least one core")
    if reserve_host >= len(topo.cores):
        raise IsolationError(f"keeping {reserve_host} of {len(topo.cores)} cores "
                        f"for the host leaves none to isolate")
    # Round-robin over the groups so every node keeps a housekeeping
    # core close to its VMs' emulator threads and interrupts.
    free = {g: list(cores) for g, cores in groups.items()}
    host: List[Core] = []
    while len(host) < reserve_host:
        for g in free:
            if free[g] and len(host) < reserve_host:
                host.append(free[g].pop(0))
    isolated = [c for c in topo.cores if c not in host]
    result = Plan(topo, policy, sorted(host, key=lambda c: c.index),
                  isolated)
    if vms < 0 or vcpus < 1:
        raise IsolationError("the number of VMs must be >= 0 and of vCPUs "
                             ">= 1")
    if vms == 0:
        return result

    threads = topo.threads_per_core if policy == "pack" else 1
    cores_per_vm = -(-vcpus // threads)
    need, have = vms * cores_per_vm, len(isolated)
    if need > have:
        per = ("" if threads == 1 else
               f", {threads} vCPUs per core")
        raise IsolationError(f"{vms} VM{'s' if vms != 1 else ''} x {vcpus} "
                        f"vCPU{'s' if vcpus != 1 else ''} need {need} "
                        f"isolated cores (SMT policy {policy}{per}) but "
                        f"only {have} of {len(topo.cores)} are left after "
                        f"keeping {len(host)} for the host")
    host_by_group = {g: [c for c in host if c in cores]
                     for g, cores in groups.items()}
    for i in range(vms):
        # The group with the most free cores that holds the whole VM
        # (spreading VMs keeps memory bandwidth per VM up); otherwise
        # span groups, most free first, and say so.
        fits = [g for g in free if len(free[g]) >= cores_per_vm]
        taken: List[Core] = []
        if fits:
            g = max(fits, key=lambda g: (len(free[g]), -g))
            taken, free[g] = free[g][:cores_per_vm], free[g][cores_per_vm:]
            used = [g]
        else:
            used = []
            for g in sorted(free, key=lambda g: (-len(free[g]), g)):
                take = min(cores_per_vm - len(taken), len(free[g]))
                if take:
                    taken += free[g][:take]
                    free[g] = free[g][take:]
                    used.append(g)
            what = ("NUMA nodes" if len(topo.numa_nodes) > 1
                    else "packages")
            result.warnings.append(
                f"vm{i} spans {what} {cpuset.format(used)}: not all of its "
                f"memory can be local")
        pins: Dict[int, Set[int]] = {}
        for v in range(vcpus):
            core = taken[v // threads]
            if policy == "isolate":
                pins[v] = {core.pus[0]}
            elif policy == "core":
                pins[v] = set(core.pus)
            else:
                pins[v] = {core.pus[(v % threads) % len(core.pus)]}
        emulator = {p for g in used for c in host_by_group[g] for p in c.pus}
        if not emulator:
            emulator = set(result.host_pus)
        result.vms.append(VmPlan(f"vm{i}", vcpus, taken, pins,
                                 {c.numa for c in taken}, emulator,
                                 threads))
    return result


# ---------------------------------------------------------------- output

def render_text(p: Plan, current: Optional[Set[int]] = None) -> str:
    lines = [f"topology: {p.topology.summary()}"]
    for g, cores in _domains(p.topology).items():
        label = ("NUMA node" if len(p.topology.numa_nodes) > 1
                 else "package")
        pus = [x for c in cores for x in c.pus]
        lines.append(f"  {label} {g}: {len(cores)} cores, PUs "
                     f"{cpuset.format(pus)}")
    lines.append(f"keep for the host: PUs {cpuset.format(p.host_pus)} "
                 f"({len(p.host_cores)} core"
                 f"{'s' if len(p.host_cores) != 1 else ''})")
    lines.append(f"isolate:           PUs {cpuset.format(p.isolated_pus)} "
                 f"({len(p.isolated_cores)} core"
                 f"{'s' if len(p.isolated_cores) != 1 else ''})")
    if current is not None:
        lines.append("now isolated by the kernel: "
                     + (cpuset.format(current) if current else "none"))
    lines.append("kernel command line (GRUB_CMDLINE_LINUX, then "
                 "update-grub and reboot):")
    lines.append(f"  {p.kernel_cmdline()}")
    lines.append("nova.conf on this compute host:")
    lines.append("  [compute]")
    for k, v in p.nova_conf().items():
        lines.append(f"  {k} = {v}")
    for vm in p.vms:
        nodes = cpuset.format(vm.numa_nodes)
        lines.append(f"{vm.name}: {vm.vcpus} vCPU"
                     f"{'s' if vm.vcpus != 1 else ''} on cores "
                     f"{','.join(str(c.index) for c in vm.cores)}, NUMA "
                     f"node{'s' if len(vm.numa_nodes) > 1 else ''} {nodes}")
        lines.append("  ivcloud libvirt domain-xml --name " + vm.name + " "
                     + " ".join(vm.pin_args()) + " ...")
        for xml_text in (vm.cputune_xml(), vm.numatune_xml()):
            lines += ["  " + ln for ln in xml_text.splitlines()]
    for w in p.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


def plan_json(p: Plan, current: Optional[Set[int]] = None) -> Dict:
    """The plan as JSON, with the CPUs the kernel isolates now when
    known."""
    data = p.to_json()
    if current is not None:
        data["kernel_isolated_now"] = sorted(current)
    return data
