"""What a cluster is made of: servers, instances, names, addresses, CPUs
(docs/cluster.md, "Topology"; the names exist only inside the cluster's
own network namespaces, so two clusters never collide on them). Pure
data: `plan()` turns the `up` options into a ClusterTopology, or refuses
them (ClusterError); the rest of the package creates what it describes.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from .. import server as server_mod
from ..errors import ClusterError

SUBNET = "10.251.0.0/16"
PREFIX_LEN = 16
HEAD_HOSTNAME = "head"
HEAD_ADDRESS = "10.251.255.254"
INSTANCE_IFNAME = "eth0"
CORE_BRIDGE = "core"
MAX_SERVERS = 250          # third octet of the address
MAX_INSTANCES = 250        # fourth octet (1..250)
MAX_PEERS_PER_REGION = server_mod.MAX_PEERS  # ivshm_geometry.max_peers bound
DEFAULT_NAME = "default"
# Server names become region files /dev/shm/ivcloud-<cluster>-s<k> and
# socket paths under the state directory (108 bytes at most).
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,23}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|"
                      r"bps|kbps|mbps|gbps|tbps)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9,
               "tbit": 10**12, "bps": 8, "kbps": 8 * 10**3,
               "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
MIN_RATE_BPS = 8_000            # below this tbf's burst maths gets silly
MAX_RATE_BPS = 100 * 10**9


def named(template: str) -> property:
    """A name made of the dataclass's own fields by `template`."""
    return property(lambda self: template.format(**vars(self)))


@dataclass(frozen=True)
class Instance:
    server: int
    index: int
    cpus: tuple

    hostname = named("s{server}i{index}")
    # the bridge side of the instance's veth (IFNAMSIZ: 15 chars)
    bridge_port = named("i-s{server}i{index}")

    @property
    def address(self) -> str:
        return f"10.251.{self.server}.{self.index + 1}"


@dataclass(frozen=True)
class Server:
    index: int
    cluster: str

    name = named("{cluster}-s{index}")
    bridge = named("br-s{index}")
    uplink = named("up-s{index}")
    uplink_peer = named("cp-s{index}")


@dataclass
class ClusterTopology:
    name: str
    servers: int
    instances_per_server: int
    vcpus: int
    uplink_rate_bps: Optional[int] = None
    oversubscribe: bool = False
    host_cpus: List[int] = field(default_factory=list)

    def server_list(self) -> List[Server]:
        return [Server(k, self.name) for k in range(self.servers)]

    def instance_list(self) -> List[Instance]:
        """Server-major order; instance n gets vcpus consecutive host CPUs
        round-robin, so neighbours share as little as the host allows."""
        out = []
        ncpu = len(self.host_cpus)
        for k in range(self.servers):
            for i in range(self.instances_per_server):
                n = k * self.instances_per_server + i
                cpus = tuple(sorted({self.host_cpus[(n * self.vcpus + c) % ncpu]
                                     for c in range(self.vcpus)}))
                out.append(Instance(k, i, cpus))
        return out

    def describe(self) -> str:
        rate = (f", uplinks {format_rate(self.uplink_rate_bps)}"
                if self.uplink_rate_bps else "")
        return (f"{self.servers} servers x {self.instances_per_server} "
                f"instances x {self.vcpus} vCPUs{rate}")

    def to_dict(self) -> Dict:
        return asdict(self)


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise ClusterError(f"bad cluster name '{name}' (letters, digits, '_.-', "
                           f"at most 24, not starting with '.' or '-')")
    return name


def parse_rate(text: str) -> int:
    """'1gbit', '100mbit', '500kbit', '10mbps' (bytes) -> bits per second,
    in tc's units (k = 1000)."""
    m = _RATE_RE.match(text or "")
    if not m:
        raise ClusterError(f"bad uplink rate '{text}' (expected e.g. 1gbit, "
                           f"100mbit, 500kbit, 10mbps)")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ClusterError(f"uplink rate '{text}' out of range (8kbit..100gbit)")
    return bps


def format_rate(bps: int) -> str:
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= f and bps % f == 0:
            return f"{bps // f}{unit}"
    return f"{bps}bit"


def plan(name: str, servers: int, instances_per_server: int, vcpus: int,
         uplink_rate: Optional[str] = None,
         oversubscribe: bool = False) -> ClusterTopology:
    """Validate an `up` request; every refusal is a ClusterError."""
    check_name(name)
    if not 1 <= servers <= MAX_SERVERS:
        raise ClusterError(f"the number of servers must be 1..{MAX_SERVERS}, "
                           f"not {servers}", setting="servers")
    if not 1 <= instances_per_server <= MAX_INSTANCES:
        raise ClusterError(f"instances per server must be 1..{MAX_INSTANCES}, "
                           f"not {instances_per_server}",
                           setting="instances_per_server")
    if vcpus < 1:
        raise ClusterError(f"vCPUs per instance must be at least 1, not "
                           f"{vcpus}", setting="vcpus")
    if instances_per_server * vcpus > MAX_PEERS_PER_REGION:
        raise ClusterError(f"{instances_per_server} instances x {vcpus} vCPUs "
                           f"per server exceed the {MAX_PEERS_PER_REGION} "
                           f"peers one ivshmem region holds")
    cpus = sorted(os.sched_getaffinity(0))
    want = servers * instances_per_server * vcpus
    if want > len(cpus) and not oversubscribe:
        raise ClusterError(f"{servers} servers x {instances_per_server} "
                           f"instances x {vcpus} vCPUs = {want} vCPUs but "
                           f"this host has {len(cpus)} CPUs and "
                           f"oversubscription was not allowed",
                           setting="oversubscribe")
    if vcpus > len(cpus) and not oversubscribe:
        raise ClusterError(f"{vcpus} vCPUs per instance exceed the host's "
                           f"{len(cpus)} CPUs and oversubscription was not "
                           f"allowed", setting="oversubscribe")
    rate = parse_rate(uplink_rate) if uplink_rate is not None else None
    return ClusterTopology(name, servers, instances_per_server, vcpus, rate,
                    oversubscribe, cpus)


def topology_from_dict(d: Dict) -> ClusterTopology:
    """The topology of ClusterTopology.to_dict's `d`."""
    return ClusterTopology(**d)


def hosts_file_text(topo: ClusterTopology) -> str:
    """/etc/hosts as every instance (and the head node) sees it."""
    lines = ["127.0.0.1\tlocalhost",
             f"{HEAD_ADDRESS}\t{HEAD_HOSTNAME}"]
    lines += [f"{inst.address}\t{inst.hostname}"
              for inst in topo.instance_list()]
    return "\n".join(lines) + "\n"
