"""`ivcloud libvirt` and `ivcloud isolate`.

- domain XML for every option combination that matters, checked against
  libvirt's own schema (virt-xml-validate) and read back element by
  element;
- the Nova flavor commands and their refusals;
- the CPU-isolation planner on synthetic hwloc topologies with known
  answers (1 socket x 2 cores; 2 sockets x 4 cores x 2 threads with two
  NUMA nodes, in Linux's interleaved and in linear numbering; hwloc v1
  layout) and once on this machine;
- against a real libvirtd (started here if none runs; skipped only if it
  cannot start): a TCG domain with an ivshmem-doorbell device on our
  ivshmem-server, pinned vCPUs read back from /proc, hot-attach and
  detach of ivshmem devices through the libvirt API, and nothing left
  behind (the start-event watcher: test_nova_projects.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

from ivcloud import isolate
from ivcloud.errors import IsolationError
from ivcloud.libvirt import cpuset
from ivcloud.libvirt.domain import (Domain, Shmem, SpecError, parse_pins,
                                    validate_xml, validator)
from ivcloud.libvirt.nova import Flavor

REPO = Path(__file__).resolve().parent.parent
GUEST_DIR = Path(os.environ.get("IVCLOUD_GUEST_DIR", REPO / "build" / "guest"))


def ivcloud(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(proc, area: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    # ours ("ivcloud AREA: error:") or argparse's ("ivcloud AREA ACTION:")
    assert re.match(rf"ivcloud {area}( [a-z-]+)?: error: ", lines[0]), \
        proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def xml_validator() -> None:
    assert validator() is not None, (
        "virt-xml-validate/xmllint missing: apt-get install libvirt-clients "
        "libxml2-utils (make deps)")


# ---------------------------------------------------------------- cpu lists

def test_cpuset_round_trip():
    assert cpuset.parse("0-3,^2,8") == {0, 1, 3, 8}
    assert cpuset.parse(" 5 ") == {5}
    assert cpuset.format({0, 1, 3, 8, 9, 10}) == "0-1,3,8-10"
    assert cpuset.format([]) == ""
    for text in ("", "a", "3-1", "1,,2", "^1", "0-99999999", "1-2-3",
                 "^1-2,4"):
        with pytest.raises(ValueError):
            cpuset.parse(text)


def test_pin_list():
    assert parse_pins("0:2,1:3", 2) == {0: {2}, 1: {3}}
    # an item without a colon continues the previous vCPU's CPU list
    assert parse_pins("0:2-3,1:4,6", 2) == {0: {2, 3}, 1: {4, 6}}
    for text in ("0:2,0:3", "2:1", "x:1", "1", "0:", "0:2,,1:3"):
        with pytest.raises(SpecError):
            parse_pins(text, 2)


# ---------------------------------------------------------------- domain XML

def _el(root: ET.Element, path: str) -> ET.Element:
    el = root.find(path)
    assert el is not None, f"{path} missing in\n{ET.tostring(root).decode()}"
    return el


def test_domain_elements_read_back(xml_validator):
    dom = Domain("vm-a", 2 << 30, 4, kernel="/k", initrd="/i",
                 cmdline="console=ttyS0",
                 shmems=[Shmem("shm0", 64 << 20, server="/run/s.sock",
                               vectors=4),
                         Shmem("plain1", 16 << 20)],
                 pins={0: {2}, 1: {3}, 2: {4, 12}, 3: {5}},
                 emulator_pin={0, 8}, numa_nodes={0},
                 hugepage_size=2 << 20, threads=2)
    text = dom.xml()
    validate_xml(text)
    root = ET.fromstring(text)
    assert root.get("type") == "qemu"
    assert _el(root, "memory").text == str(2 << 20)           # KiB
    assert _el(root, "memoryBacking/hugepages/page").attrib == {
        "size": "2048", "unit": "KiB"}
    assert _el(root, "vcpu").text == "4"
    pins = {int(p.get("vcpu")): p.get("cpuset")
            for p in root.findall("cputune/vcpupin")}
    assert pins == {0: "2", 1: "3", 2: "4,12", 3: "5"}
    assert _el(root, "cputune/emulatorpin").get("cpuset") == "0,8"
    assert _el(root, "numatune/memory").attrib == {"mode": "strict",
                                                   "nodeset": "0"}
    assert _el(root, "cpu/topology").attrib == {
        "sockets": "1", "dies": "1", "cores": "2", "threads": "2"}
    assert _el(root, "features/acpi") is not None  # hot-plug needs it
    assert _el(root, "os/kernel").text == "/k"
    shm = root.findall("devices/shmem")
    assert [s.get("name") for s in shm] == ["shm0", "plain1"]
    assert _el(shm[0], "model").get("type") == "ivshmem-doorbell"
    assert _el(shm[0], "server").get("path") == "/run/s.sock"
    assert _el(shm[0], "msi").attrib == {"vectors": "4", "ioeventfd": "on"}
    assert _el(shm[0], "size").text == "64"
    assert _el(shm[1], "model").get("type") == "ivshmem-plain"
    assert shm[1].find("server") is None and shm[1].find("msi") is None


def test_single_vcpu_emulated_domain_has_a_second_slot():
    # TCG keeps a guest's atomics atomic against the region's other
    # processes only when the machine may have two vCPUs (test_vm.py,
    # test_atomics_across_guests_and_host); KVM needs no such slot
    root = ET.fromstring(Domain("vm-tcg", 64 << 20, 1).xml())
    assert _el(root, "vcpu").attrib == {"placement": "static",
                                        "current": "1"}
    assert _el(root, "vcpu").text == "2"
    assert _el(root, "cpu/topology").get("cores") == "2"
    root = ET.fromstring(Domain("vm-kvm", 64 << 20, 1, kvm=True).xml())
    assert _el(root, "vcpu").text == "1"
    assert _el(root, "vcpu").get("current") is None
    root = ET.fromstring(Domain("vm-two", 64 << 20, 2).xml())
    assert _el(root, "vcpu").text == "2"
    assert _el(root, "vcpu").get("current") is None


DOMAIN_CASES = {
    "minimal": [],
    "plain-shmem": ["--shmem-name", "shm0", "--shmem-size", "64M"],
    "plain-default-size": ["--shmem-name", "shm0"],
    "doorbell": ["--shmem-name", "shm0", "--shmem-server", "@SOCK@"],
    "doorbell-vectors": ["--shmem-name", "shm0", "--shmem-model",
                         "ivshmem-doorbell", "--shmem-server", "@SOCK@",
                         "--vectors", "4", "--shmem-size", "32M"],
    "doorbell-no-ioeventfd": ["--shmem-name", "s", "--shmem-server",
                              "@SOCK@", "--vectors", "1",
                              "--no-ioeventfd"],
    "pin": ["--vcpus", "2", "--pin", "0:0,1:1"],
    "pin-ranges-emulator": ["--vcpus", "3", "--pin", "0:2-3,1:4,6,2:^5,5-7",
                            "--emulator-pin", "0-1"],
    "numa": ["--numa-node", "0"],
    "numa-two-nodes": ["--numa-node", "0-1", "--vcpus", "2"],
    "hugepages-2m": ["--hugepages", "2M", "--memory", "2G"],
    "hugepages-1g": ["--hugepages", "1G", "--memory", "4G"],
    "kernel": ["--kernel", "@FILE@", "--initrd", "@FILE@", "--cmdline",
               "console=ttyS0 quiet"],
    "disk": ["--disk", "@FILE@"],
    "kvm-threads": ["--kvm", "--vcpus", "4", "--threads", "2"],
    "console-log": ["--console-log", "/tmp/console.log"],
    "q35": ["--machine", "q35"],
    "everything": ["--kvm", "--vcpus", "4", "--memory", "4G",
                   "--kernel", "@FILE@", "--initrd", "@FILE@",
                   "--cmdline", "console=ttyS0",
                   "--shmem-name", "ivs", "--shmem-server", "@SOCK@",
                   "--vectors", "2", "--pin", "0:2,1:3,2:4,3:5",
                   "--emulator-pin", "0", "--numa-node", "0",
                   "--hugepages", "2M", "--emulator",
                   "/usr/bin/qemu-system-x86_64"],
}


@pytest.fixture
def fake_socket(tmp_path):
    """A real listening unix socket, as the CLI checks the path."""
    import socket
    path = tmp_path / "ivshmem.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(1)
    yield path
    s.close()


@pytest.mark.parametrize("case", sorted(DOMAIN_CASES))
def test_domain_xml_validates(case, tmp_path, fake_socket, xml_validator):
    some_file = tmp_path / "image"
    some_file.write_bytes(b"\0" * 512)
    args = [str(fake_socket) if a == "@SOCK@" else
            str(some_file) if a == "@FILE@" else a
            for a in DOMAIN_CASES[case]]
    out = tmp_path / "d.xml"
    proc = ivcloud("libvirt", "domain-xml", "--name", f"t-{case}",
                   *args, "--validate", "-o", out)
    assert proc.returncode == 0, proc.stderr
    validate_xml(out.read_text())  # and once more, independently
    root = ET.fromstring(out.read_text())
    assert root.find("name").text == f"t-{case}"
    if "--pin" in args:
        pins = ",".join(f"{p.get('vcpu')}:{p.get('cpuset')}"
                        for p in root.findall("cputune/vcpupin"))
        want = parse_pins(args[args.index("--pin") + 1])
        assert parse_pins(pins) == want


def test_schema_rejects_broken_xml(xml_validator):
    good = Domain("x", 1 << 30, 1, numa_nodes={0}).xml()
    validate_xml(good)
    with pytest.raises(SpecError, match="schema"):
        validate_xml(good.replace("strict", "sometimes"))


@pytest.mark.parametrize("args,message", [
    (["--pin", "2:1"], "vCPU 2 is pinned"),
    (["--vcpus", "2", "--pin", "0:1,0:2"], "pinned twice"),
    (["--pin", "0:x"], "bad CPU list"),
    (["--kernel", "/nonexistent/vmlinuz"], "kernel /nonexistent/vmlinuz "
                                           "is not there"),
    (["--disk", "/nonexistent.img"], "is not there"),
    (["--initrd", "/x"], "need --kernel"),
    (["--shmem-name", "s", "--shmem-server", "/nonexistent.sock"],
     "socket /nonexistent.sock is not there"),
    (["--shmem-name", "s", "--shmem-size", "3M"], "power of two"),
    (["--shmem-name", "s", "--shmem-size", "512K"], "at least 1M"),
    (["--shmem-name", "a/b"], "bad shmem name"),
    (["--shmem-name", "s", "--vectors", "2"], "ivshmem-doorbell"),
    (["--shmem-name", "s", "--shmem-model", "ivshmem-doorbell"],
     "needs the ivshmem-server socket"),
    (["--shmem-size", "4M"], "need a shmem name"),
    (["--hugepages", "4M"], "2M or 1G"),
    (["--memory", "1025M", "--hugepages", "2M"], "not a multiple"),
    (["--vcpus", "3", "--threads", "2"], "do not split"),
    (["--memory", "1M"], "below"),
    (["--memory", "lots"], "bad size"),
    (["--numa-node", "a"], "bad CPU list"),
])
def test_domain_xml_bad_input(args, message):
    proc = ivcloud("libvirt", "domain-xml", "--name", "bad", *args)
    # argparse's own refusals and ours: both one line, exit 2
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("ivcloud libvirt"), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_bad_domain_name():
    proc = ivcloud("libvirt", "domain-xml", "--name", "a b")
    assert "bad domain name" in assert_one_line_error(proc, "libvirt")


def test_shmem_xml(fake_socket):
    proc = ivcloud("libvirt", "shmem-xml", "--name", "ivs", "--server",
                   fake_socket, "--vectors", "2")
    assert proc.returncode == 0, proc.stderr
    el = ET.fromstring(proc.stdout)
    assert el.tag == "shmem" and el.get("name") == "ivs"
    assert el.find("model").get("type") == "ivshmem-doorbell"
    assert el.find("server").get("path") == str(fake_socket)
    assert el.find("size") is None   # the server decides


# ---------------------------------------------------------------- Nova

def test_nova_flavor_commands():
    proc = ivcloud("libvirt", "nova-flavor", "--vcpus", "4", "--ram", "4096",
                   "--disk", "20", "--numa-nodes", "2", "--page-size", "1G",
                   "--emulator-threads", "isolate", "--name", "hpc.4")
    assert proc.returncode == 0, proc.stderr
    create, setp = proc.stdout.strip().splitlines()
    assert create == ("openstack flavor create --vcpus 4 --ram 4096 "
                      "--disk 20 hpc.4")
    props = dict(re.findall(r"--property (\S+?)=(\S+)", setp))
    assert setp.startswith("openstack flavor set hpc.4 ")
    assert props == {"hw:cpu_policy": "dedicated",
                     "hw:cpu_thread_policy": "isolate",
                     "hw:numa_nodes": "2", "hw:mem_page_size": "1GB",
                     "hw:emulator_threads_policy": "isolate"}


def test_nova_flavor_json_defaults():
    proc = ivcloud("libvirt", "nova-flavor", "--vcpus", "2", "--ram", "2048",
                   "--json", "--thread-policy", "prefer")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["extra_specs"] == {"hw:cpu_policy": "dedicated",
                                   "hw:cpu_thread_policy": "prefer",
                                   "hw:numa_nodes": "1",
                                   "hw:mem_page_size": "2MB"}
    assert len(data["commands"]) == 2
    assert Flavor("f", 2, 2048, page_size=None).extra_specs().get(
        "hw:mem_page_size") is None


@pytest.mark.parametrize("args,message", [
    (["--vcpus", "3", "--ram", "4096", "--numa-nodes", "2"], "vCPUs"),
    (["--vcpus", "2", "--ram", "4095", "--numa-nodes", "2"], "RAM"),
    (["--vcpus", "2", "--ram", "1025"], "page size"),
    (["--vcpus", "2", "--ram", "1536", "--page-size", "1G"], "page size"),
    (["--vcpus", "2", "--ram", "2048", "--page-size", "3M"], "page size"),
    (["--vcpus", "0", "--ram", "2048"], "at least 1"),
    (["--vcpus", "2", "--ram", "2048", "--name", "bad name"], "flavor name"),
])
def test_nova_flavor_bad_input(args, message):
    line = assert_one_line_error(ivcloud("libvirt", "nova-flavor", *args),
                                 "libvirt")
    assert message in line, line


# ---------------------------------------------------------------- hwloc XML

def synthetic_hwloc(packages: int, cores: int, threads: int,
                    interleaved: bool = True, v1: bool = False) -> str:
    """hwloc XML of packages x cores x threads, one NUMA node per package.
    Interleaved numbering is Linux's on Intel servers: the second
    threads of all cores come after all first threads (core 0 of package
    0 is PUs 0 and packages*cores)."""
    total = packages * cores

    def pu_index(p: int, c: int, t: int) -> int:
        if interleaved:
            return t * total + p * cores + c
        return (p * cores + c) * threads + t

    def mask(cpus) -> str:
        value = sum(1 << x for x in cpus)
        words = []
        while True:
            words.append(f"0x{value & 0xffffffff:08x}")
            value >>= 32
            if not value:
                break
        return ",".join(reversed(words))

    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           '<!DOCTYPE topology SYSTEM "hwloc2.dtd">',
           '<topology version="2.0">',
           f'<object type="Machine" os_index="0" cpuset="'
           f'{mask(range(total * threads))}">']
    for p in range(packages):
        cpus = [pu_index(p, c, t) for c in range(cores)
                for t in range(threads)]
        numa = (f'<object type="NUMANode" os_index="{p}" '
                f'cpuset="{mask(cpus)}" local_memory="1073741824"')
        if v1:
            out.append(numa + ">")
        out.append(f'<object type="Package" os_index="{p}" '
                   f'cpuset="{mask(cpus)}">')
        if not v1:
            out.append(numa + "/>")
        for c in range(cores):
            pus = [pu_index(p, c, t) for t in range(threads)]
            out.append(f'<object type="L2Cache" cpuset="{mask(pus)}" '
                       f'cache_size="1048576" depth="2">')
            out.append(f'<object type="Core" os_index="{c}" '
                       f'cpuset="{mask(pus)}">')
            for pu in pus:
                out.append(f'<object type="PU" os_index="{pu}" '
                           f'cpuset="{mask([pu])}"/>')
            out.append("</object></object>")
        out.append("</object>")
        if v1:
            out.append("</object>")
    out.append("</object></topology>")
    return "\n".join(out)


def test_parse_two_sockets_interleaved():
    topo = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2))
    assert topo.packages == [0, 1] and topo.numa_nodes == [0, 1]
    assert len(topo.cores) == 8 and topo.threads_per_core == 2
    assert topo.pus == list(range(16))
    assert [c.pus for c in topo.cores[:5]] == [(0, 8), (1, 9), (2, 10),
                                               (3, 11), (4, 12)]
    assert [c.numa for c in topo.cores] == [0] * 4 + [1] * 4
    assert [c.package for c in topo.cores] == [0] * 4 + [1] * 4


def test_parse_hwloc_v1_layout_same_answer():
    v2 = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2))
    v1 = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2, v1=True))
    assert v1.cores == v2.cores


def test_parse_bad_xml():
    for text in ("not xml", "<foo/>", "<topology/>"):
        with pytest.raises(IsolationError):
            isolate.parse_hwloc_xml(text)


@pytest.mark.skipif(shutil.which("hwloc-ls") is None,
                    reason="hwloc-ls missing (apt-get install hwloc)")
def test_parse_hwloc_generated_synthetic():
    """hwloc's own synthetic topology (linear numbering) gives the same
    plan as our hand-written XML in linear numbering."""
    proc = subprocess.run(["hwloc-ls", "--input", "pack:2 [numa] core:4 pu:2",
                           "--of", "xml", "-"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    real = isolate.parse_hwloc_xml(proc.stdout)
    ours = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2,
                                                   interleaved=False))
    assert [(c.package, c.numa, c.pus) for c in real.cores] == \
        [(c.package, c.numa, c.pus) for c in ours.cores]
    p = isolate.plan(real, vms=2, vcpus=2)
    assert p.host_pus == [0, 1, 8, 9]
    assert p.isolated_pus == [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert [vm.pins for vm in p.vms] == [{0: {2}, 1: {4}},
                                         {0: {10}, 1: {12}}]


# ---------------------------------------------------------------- planner

def test_plan_one_socket_two_cores():
    topo = isolate.parse_hwloc_xml(synthetic_hwloc(1, 2, 1))
    p = isolate.plan(topo, vms=1, vcpus=1)
    assert p.host_pus == [0] and p.isolated_pus == [1]
    assert p.kernel_params() == {"isolcpus": "managed_irq,domain,1",
                                 "nohz_full": "1", "rcu_nocbs": "1",
                                 "irqaffinity": "0"}
    assert p.nova_conf() == {"cpu_dedicated_set": "1",
                             "cpu_shared_set": "0"}
    (vm,) = p.vms
    assert vm.pins == {0: {1}} and vm.emulator_pin == {0}
    assert vm.numa_nodes == {0}
    with pytest.raises(IsolationError, match="need 4 isolated cores"):
        isolate.plan(topo, vms=2, vcpus=2)
    with pytest.raises(IsolationError, match="leaves none"):
        isolate.plan(topo, reserve_host=2)


def test_plan_two_sockets_isolate_policy():
    p = isolate.plan(isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2)),
                     vms=2, vcpus=2)
    # first core of each NUMA node, with its SMT sibling, stays with the host
    assert p.host_pus == [0, 4, 8, 12]
    assert cpuset.format(p.isolated_pus) == "1-3,5-7,9-11,13-15"
    assert p.kernel_cmdline() == (
        "isolcpus=managed_irq,domain,1-3,5-7,9-11,13-15 "
        "nohz_full=1-3,5-7,9-11,13-15 rcu_nocbs=1-3,5-7,9-11,13-15 "
        "irqaffinity=0,4,8,12")
    vm0, vm1 = p.vms
    # one vCPU per physical core, the sibling left idle; one VM per node
    assert vm0.pins == {0: {1}, 1: {2}} and vm0.numa_nodes == {0}
    assert vm0.emulator_pin == {0, 8}
    assert vm1.pins == {0: {5}, 1: {6}} and vm1.numa_nodes == {1}
    assert vm1.emulator_pin == {4, 12}
    assert not p.warnings


def test_plan_two_sockets_core_and_pack_policies():
    topo = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2))
    core = isolate.plan(topo, vms=1, vcpus=2, policy="core")
    assert core.vms[0].pins == {0: {1, 9}, 1: {2, 10}}
    pack = isolate.plan(topo, vms=2, vcpus=4, policy="pack")
    vm0, vm1 = pack.vms
    assert vm0.pins == {0: {1}, 1: {9}, 2: {2}, 3: {10}}
    assert vm1.pins == {0: {5}, 1: {13}, 2: {6}, 3: {14}}
    assert vm0.threads == 2 and "--threads" in vm0.pin_args()
    # 3 free cores per node: 4 packed VMs of 2 vCPUs fit, 7 do not
    assert len(isolate.plan(topo, vms=6, vcpus=2, policy="pack").vms) == 6
    with pytest.raises(IsolationError, match="2 vCPUs per core"):
        isolate.plan(topo, vms=7, vcpus=2, policy="pack")


def test_plan_spans_nodes_with_warning():
    p = isolate.plan(isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2)),
                     vms=1, vcpus=5)
    (vm,) = p.vms
    assert vm.numa_nodes == {0, 1}
    assert sorted(min(v) for v in vm.pins.values()) == [1, 2, 3, 5, 6]
    assert p.warnings and "spans NUMA nodes 0-1" in p.warnings[0]


def test_plan_reserve_host_spread_over_nodes():
    topo = isolate.parse_hwloc_xml(synthetic_hwloc(2, 4, 2))
    one = isolate.plan(topo, reserve_host=1, vms=2, vcpus=3)
    assert one.host_pus == [0, 8]
    # node 1 keeps no host core: its VM's emulator goes to the host cores
    vm_node1 = [vm for vm in one.vms if vm.numa_nodes == {1}][0]
    assert vm_node1.emulator_pin == {0, 8}
    three = isolate.plan(topo, reserve_host=3)
    assert three.host_pus == [0, 1, 4, 8, 9, 12]


def test_isolate_cli_on_synthetic_file(tmp_path, xml_validator):
    path = tmp_path / "topo.xml"
    path.write_text(synthetic_hwloc(2, 4, 2))
    proc = ivcloud("isolate", "--topology", path, "--vms", "2", "--vcpus",
                   "2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["host_pus"] == [0, 4, 8, 12]
    assert data["nova_conf"]["compute"]["cpu_dedicated_set"] == \
        "1-3,5-7,9-11,13-15"
    vm0 = data["vms"][0]
    assert vm0["vcpupin"] == {"0": "1", "1": "2"}
    # the snippet is what domain-xml writes for the same arguments
    proc = ivcloud("libvirt", "domain-xml", "--name", "vm0",
                   *vm0["domain_xml_args"], "--validate")
    assert proc.returncode == 0, proc.stderr
    cputune = ET.fromstring(proc.stdout).find("cputune")
    assert ET.tostring(cputune).split() == \
        ET.tostring(ET.fromstring(vm0["cputune_xml"])).split()
    text = ivcloud("isolate", "--topology", path, "--vms", "1")
    assert text.returncode == 0, text.stderr
    assert "isolcpus=managed_irq,domain,1-3,5-7,9-11,13-15" in text.stdout
    assert "<vcpupin vcpu=\"0\" cpuset=\"1\" />" in text.stdout


@pytest.mark.parametrize("args,message", [
    (["--vms", "9", "--vcpus", "2"], "need 18 isolated cores"),
    (["--reserve-host", "8"], "leaves none"),
    (["--reserve-host", "0"], "at least 1"),
    (["--vcpus", "0"], "at least 1"),
    (["--smt", "sometimes"], "invalid choice"),
])
def test_isolate_cli_bad_input(tmp_path, args, message):
    path = tmp_path / "topo.xml"
    path.write_text(synthetic_hwloc(2, 4, 2))
    proc = ivcloud("isolate", "--topology", path, *args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert message in proc.stderr


def test_isolate_cli_missing_file():
    line = assert_one_line_error(
        ivcloud("isolate", "--topology", "/nonexistent.xml"), "isolate")
    assert "cannot read /nonexistent.xml" in line


def _sys_cpu_siblings() -> Dict[int, Set[int]]:
    out = {}
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        f = d / "topology" / "thread_siblings_list"
        if f.exists():
            out[int(d.name[3:])] = cpuset.parse(f.read_text())
    return out


@pytest.mark.skipif(shutil.which("hwloc-ls") is None,
                    reason="hwloc-ls missing (apt-get install hwloc)")
def test_isolate_on_this_machine():
    proc = ivcloud("isolate", "--json")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        assert_one_line_error(proc, "isolate")
        return
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    host, iso = set(data["host_pus"]), set(data["isolated_pus"])
    assert host and iso and not host & iso
    assert sorted(host | iso) == sorted(data["topology"]["cores"][i]["pus"][j]
                                        for i in range(len(data["topology"]
                                                           ["cores"]))
                                        for j in range(len(data["topology"]
                                                           ["cores"][i]
                                                           ["pus"])))
    assert set(allowed) <= host | iso
    # the cores hwloc reports are the kernel's SMT sibling sets
    siblings = _sys_cpu_siblings()
    for core in data["topology"]["cores"]:
        for pu in core["pus"]:
            if pu in siblings:
                assert siblings[pu] == set(core["pus"]), (pu, core)
    assert data["kernel_isolated_now"] == sorted(
        isolate.host_isolated() or [])
    # the largest single VM that fits gets a valid domain
    n = len(data["isolated_cores"])
    proc = ivcloud("isolate", "--json", "--vms", "1", "--vcpus", n)
    assert proc.returncode == 0, proc.stderr
    vm = json.loads(proc.stdout)["vms"][0]
    proc = ivcloud("libvirt", "domain-xml", "--name", "here",
                   *vm["domain_xml_args"], "--validate")
    assert proc.returncode == 0, proc.stderr
    # one VM too many: one line, exit 2
    too_many = ivcloud("isolate", "--vms", "1", "--vcpus", n + 1)
    assert "isolated cores" in assert_one_line_error(too_many, "isolate")


# ------------------------------------------------------------ real libvirtd

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pid(pid: int, timeout: float = 15.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def libvirtd(tmp_path_factory):
    """A qemu:///system connection; libvirtd (and virtlogd) are started
    here when none runs, and stopped again at the end."""
    import libvirt  # python3-libvirt: in the Makefile's package list
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    started: List[int] = []
    workdir = tmp_path_factory.mktemp("libvirtd")

    def try_open():
        try:
            return libvirt.open("qemu:///system")
        except libvirt.libvirtError as e:
            return e

    # before libvirtd probes QEMU, so that it probes once
    restore_kvm = _let_qemu_user_see_kvm()
    try:
        conn = try_open()
        if isinstance(conn, libvirt.libvirtError):
            _start_libvirtd(workdir, started)
            deadline = time.monotonic() + 20
            while isinstance(conn, libvirt.libvirtError) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
                conn = try_open()
            if isinstance(conn, libvirt.libvirtError):
                pytest.skip(f"libvirtd started but does not answer: {conn}")
        yield conn
        conn.close()
    finally:
        for pid in reversed(started):
            _stop_pid(pid)
        if restore_kvm:
            restore_kvm()


def _start_libvirtd(workdir: Path, started: List[int]) -> None:
    """virtlogd (unless one runs) and libvirtd as daemons; their pids go
    to ``started``. Skips the tests when they cannot run here."""
    if os.geteuid() != 0:
        pytest.skip("libvirtd is not running and only root can start the "
                    "system instance here")
    missing = [t for t in ("libvirtd", "virtlogd") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"libvirtd is not running and {', '.join(missing)} is "
                    f"not installed (apt-get install libvirt-daemon-system)")
    for tool in ("virtlogd", "libvirtd"):
        if tool == "virtlogd" and subprocess.run(
                ["pgrep", "-x", "virtlogd"],
                capture_output=True).returncode == 0:
            continue  # someone else's virtlogd serves us too: leave it
        pidfile = workdir / f"{tool}.pid"
        proc = subprocess.run([tool, "-d", "-p", str(pidfile)],
                              capture_output=True, text=True, timeout=30)
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if pidfile.exists():
            started.append(int(pidfile.read_text().strip()))
        else:
            pytest.skip(f"{tool} cannot start here: "
                        f"{(proc.stderr.strip() or 'no pid file')[:200]}")


def _let_qemu_user_see_kvm():
    """libvirt 9.0 re-probes QEMU's capabilities on every lookup (about
    45 s per domain start) when it probed with KVM but /dev/kvm is not
    accessible to its QEMU user. Containers without udev leave /dev/kvm
    root:root 0600; give it Debian's udev permissions (root:kvm 0660) for
    the duration of these tests and put it back afterwards."""
    import grp
    import pwd
    kvm = Path("/dev/kvm")
    try:
        st = kvm.stat()
        gid = grp.getgrnam("kvm").gr_gid
        user = pwd.getpwnam("libvirt-qemu")
    except (OSError, KeyError):
        return None
    in_group = gid == user.pw_gid or "libvirt-qemu" in grp.getgrgid(gid).gr_mem
    if os.geteuid() != 0 or not in_group or (st.st_gid == gid
                                             and st.st_mode & 0o060 == 0o060):
        return None
    os.chown(kvm, -1, gid)
    os.chmod(kvm, (st.st_mode & 0o7777) | 0o060)

    def restore():
        os.chown(kvm, -1, st.st_gid)
        os.chmod(kvm, st.st_mode & 0o7777)
    return restore


@pytest.fixture
def ivs_server(unique):
    """An ivshmem-server whose socket QEMU (user libvirt-qemu) may use:
    group libvirt-qemu, in a directory it can traverse (pytest's tmp
    directories are 0700)."""
    run_dir = Path(f"/tmp/ivcloud-lv-{unique}")
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    name = f"lv{unique[-8:]}"
    try:
        import grp
        grp.getgrnam("libvirt-qemu")
        group = ["--group", "libvirt-qemu"]
    except KeyError:
        group = []
    proc = ivcloud("server", "start", "--name", name, "--run-dir", run_dir,
                   "--size", "16M", "--max-peers", "4", "--vectors", "2",
                   *group)
    assert proc.returncode == 0, proc.stderr
    state = run_dir / name / "state.json"
    yield run_dir / name / "ivshmem.sock", state
    ivcloud("server", "stop", "--name", name, "--run-dir", run_dir)
    region = Path(f"/dev/shm/ivcloud-{name}")
    if region.exists():
        region.unlink()
    shutil.rmtree(run_dir, ignore_errors=True)


def _peers(state: Path) -> List[Dict]:
    return json.loads(state.read_text())["peers"]


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for "
                                 f"{what}")
        time.sleep(0.1)


def _ivshmem_functions(dom) -> int:
    import libvirt_qemu
    out = libvirt_qemu.qemuMonitorCommand(
        dom, "info pci", libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP)
    return out.count("PCI device 1af4:1110")


def _vcpu_affinity(dom) -> Dict[int, Set[int]]:
    """vCPU index -> Cpus_allowed of its QEMU thread, from /proc (the
    threads found through QMP query-cpus-fast)."""
    import libvirt_qemu
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(
        dom, '{"execute":"query-cpus-fast"}', 0))
    pid = int(Path(f"/run/libvirt/qemu/{dom.name()}.pid").read_text())
    out = {}
    for cpu in reply["return"]:
        status = Path(f"/proc/{pid}/task/{cpu['thread-id']}/status")
        m = re.search(r"^Cpus_allowed_list:\s*(\S+)", status.read_text(),
                      re.M)
        out[cpu["cpu-index"]] = cpuset.parse(m.group(1))
    return out


def _guest_image() -> Optional[tuple]:
    kernel, initrd = GUEST_DIR / "vmlinuz", GUEST_DIR / "initrd.gz"
    if kernel.is_file() and initrd.is_file():
        return kernel, initrd
    return None


@pytest.fixture
def cleanup_domains(libvirtd):
    """Names of domains a test creates: destroyed, undefined and their
    plain shm files and logs removed afterwards, whatever happens."""
    import libvirt
    names: List[str] = []
    plain_files: List[Path] = []
    yield names, plain_files
    for name in names:
        try:
            dom = libvirtd.lookupByName(name)
            pid_file = Path(f"/run/libvirt/qemu/{name}.pid")
            pid = int(pid_file.read_text()) if pid_file.exists() else None
            persistent = dom.isPersistent()
            if dom.isActive():
                dom.destroy()
            if persistent:
                dom.undefine()
            if pid is not None:
                _wait(lambda: not _pid_alive(pid), 10,
                      f"QEMU {pid} to exit")
        except libvirt.libvirtError:
            pass  # already gone
        log = Path(f"/var/log/libvirt/qemu/{name}.log")
        if log.exists():
            log.unlink()
    for f in plain_files:
        if f.exists():
            f.unlink()


def test_real_domain_pinned_with_ivshmem_and_hot_attach(
        libvirtd, ivs_server, cleanup_domains, unique, tmp_path):
    import libvirt
    names, plain_files = cleanup_domains
    sock, state = ivs_server
    cpus = sorted(os.sched_getaffinity(0))
    vcpu_cpu, emu_cpu = cpus[-1], cpus[0]
    name = f"ivcloud-{unique}"
    names.append(name)
    console = Path(f"/tmp/ivcloud-lv-{unique}") / "console.log"
    boot: List[str] = []
    image = _guest_image()
    if image:
        # Copies: libvirt relabels (chowns) boot files while the domain
        # runs, and the originals belong to the VM tests.
        image = tuple(shutil.copy(f, console.parent) for f in image)
        boot = ["--kernel", image[0], "--initrd", image[1],
                "--cmdline", "console=ttyS0 panic=-1",
                "--console-log", console]
    print(f"guest: {'kernel ' + str(image[0]) if image else 'none (no OS)'}")
    xml_file = tmp_path / "domain.xml"
    proc = ivcloud("libvirt", "domain-xml", "--name", name, "--memory",
                   "256M", "--vcpus", "2", *boot,
                   "--shmem-name", f"ivcloud-{sock.parent.name}",
                   "--shmem-server", sock, "--vectors", "2",
                   "--pin", f"0:{vcpu_cpu},1:{vcpu_cpu}",
                   "--emulator-pin", str(emu_cpu), "--numa-node", "0",
                   "--validate", "-o", xml_file)
    assert proc.returncode == 0, proc.stderr

    dom = libvirtd.defineXML(xml_file.read_text())
    assert dom.isPersistent()
    dom.create()
    assert dom.isActive()
    qemu_pid = int(Path(f"/run/libvirt/qemu/{name}.pid").read_text())

    # QEMU connected to our server as a doorbell peer with 2 vectors
    peers = _wait(lambda: _peers(state), 15, "QEMU to join the server")
    assert peers == [{"id": 0, "vectors": 2}]
    assert _ivshmem_functions(dom) == 1
    # pinning took effect on the real vCPU threads
    assert _vcpu_affinity(dom) == {0: {vcpu_cpu}, 1: {vcpu_cpu}}
    assert dom.emulatorPinInfo(0)[emu_cpu]
    assert dom.numaParameters(0)["numa_nodeset"] == "0"
    if image:
        _wait(lambda: console.exists() and "ivcloud-guest: ready" in
              console.read_text(errors="replace"), 120, "the guest to boot")

    # hot-attach, as an operator would to a running Nova instance
    plain = f"ivcloud-{unique}-p"
    plain_files.append(Path("/dev/shm") / plain)
    proc = ivcloud("libvirt", "attach-shmem", "--domain", name, "--name",
                   plain, "--size", "4M", "--config")
    assert proc.returncode == 0, proc.stderr
    assert "running domain and definition" in proc.stdout
    assert _ivshmem_functions(dom) == 2
    assert (Path("/dev/shm") / plain).stat().st_size == 4 << 20
    inactive = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    assert plain in [s.get("name") for s in inactive.iter("shmem")]
    # the same name twice: refused, one line
    again = ivcloud("libvirt", "attach-shmem", "--domain", name, "--name",
                    plain, "--size", "4M")
    assert "already has" in assert_one_line_error(again, "libvirt")

    # a second doorbell device on the same server: a second peer
    proc = ivcloud("libvirt", "attach-shmem", "--domain", name, "--name",
                   "second", "--server", sock, "--vectors", "2")
    assert proc.returncode == 0, proc.stderr
    assert _ivshmem_functions(dom) == 3
    _wait(lambda: len(_peers(state)) == 2, 10, "the second peer")

    # detach: needs the guest's ACPI eject; without an OS it stays pending
    if image:
        proc = ivcloud("libvirt", "detach-shmem", "--domain", name,
                       "--name", "second", "--timeout", "30")
        assert proc.returncode == 0, proc.stderr
        assert _ivshmem_functions(dom) == 2
        _wait(lambda: len(_peers(state)) == 1, 10, "the peer to leave")
    else:
        proc = ivcloud("libvirt", "detach-shmem", "--domain", name,
                       "--name", "second", "--timeout", "1")
        assert "did not release" in assert_one_line_error(proc, "libvirt")
    # the definition-only removal works without the guest
    proc = ivcloud("libvirt", "detach-shmem", "--domain", name, "--name",
                   plain, "--offline")
    assert proc.returncode == 0, proc.stderr
    inactive = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
    assert plain not in [s.get("name") for s in inactive.iter("shmem")]

    # stop: QEMU leaves the server, nothing of the domain remains
    dom.destroy()
    dom.undefine()
    _wait(lambda: not _pid_alive(qemu_pid), 10, "QEMU to exit")
    _wait(lambda: _peers(state) == [], 10, "the server to drop the peers")
    with pytest.raises(libvirt.libvirtError):
        libvirtd.lookupByName(name)


def test_attach_failures_are_one_line(libvirtd, cleanup_domains, unique,
                                      tmp_path):
    names, _ = cleanup_domains
    missing = ivcloud("libvirt", "attach-shmem", "--domain",
                      f"nonexistent-{unique}", "--name", "x")
    assert "no domain" in assert_one_line_error(missing, "libvirt")
    no_sock = ivcloud("libvirt", "attach-shmem", "--domain", "whatever",
                      "--name", "x", "--server", tmp_path / "none.sock")
    assert "is not there" in assert_one_line_error(no_sock, "libvirt")
    # a defined but stopped domain cannot take a live device
    name = f"ivcloud-{unique}-off"
    names.append(name)
    libvirtd.defineXML(Domain(name, 64 << 20, 1).xml())
    stopped = ivcloud("libvirt", "attach-shmem", "--domain", name,
                      "--name", "x")
    assert "not running" in assert_one_line_error(stopped, "libvirt")
    not_there = ivcloud("libvirt", "detach-shmem", "--domain", name,
                        "--name", "x", "--offline")
    assert "no shmem device" in assert_one_line_error(not_there, "libvirt")
    bad_uri = ivcloud("libvirt", "attach-shmem", "--domain", name, "--name",
                      "x", "--connect", "qemu+unix:///system?socket=/none")
    assert "cannot connect" in assert_one_line_error(bad_uri, "libvirt")


def test_watch_needs_a_filter():
    proc = ivcloud("libvirt", "watch", "--name", "x")
    assert "--domain-glob" in assert_one_line_error(proc, "libvirt")
