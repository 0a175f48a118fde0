"""The cluster's network: bridges, veths, uplinks and their shaping
(docs/cluster.md, "Topology"). Every link lives in the namespaces the
cluster owns, the switches in the "fabric" holder's; the host's own
network namespace is never touched. Commands run through `nsenter -t
HOLDER -n ip -batch -`, one process per step rather than per link.
"""

from __future__ import annotations

import subprocess
from typing import List, Optional, Sequence

from ..errors import NetworkError
from . import holder
from .topology import CORE_BRIDGE, INSTANCE_IFNAME, PREFIX_LEN, Server

HEAD_PORT = "i-head"
TBF_LATENCY = "50ms"


def _run(argv: Sequence[str], stdin: str = "", check: bool = True,
         timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetworkError(f"{' '.join(argv[-3:])}: "
                           f"{msg[-1] if msg else proc.returncode}")
    return proc


def ip_batch(holder_pid: int, lines: Sequence[str], force: bool = False):
    """Run `ip` commands inside holder_pid's network namespace. force:
    keep going past errors (teardown of links that may be gone)."""
    argv = holder.enter_argv(holder_pid, ("net",)) + ["ip"]
    if force:
        argv.append("-force")
    argv += ["-batch", "-"]
    return _run(argv, "\n".join(lines) + "\n", check=not force)


def tbf_burst_bytes(rate_bps: int) -> int:
    # 10 ms worth of tokens, but at least one 64 KiB GSO super-packet
    # (veths hand tbf unsegmented TCP bursts; a smaller bucket drops them).
    return max(64 * 1024, rate_bps // 8 // 100)


def create_core(fabric_pid: int) -> List[str]:
    ip_batch(fabric_pid, [f"link add {CORE_BRIDGE} type bridge",
                          f"link set {CORE_BRIDGE} up"])
    return [CORE_BRIDGE]


def create_server_switch(fabric_pid: int, server: Server,
                         rate_bps: Optional[int]) -> List[str]:
    """The server's bridge and its uplink into the core bridge. Returns
    the link names created (for the state file)."""
    br, up, cp = server.bridge, server.uplink, server.uplink_peer
    ip_batch(fabric_pid, [
        f"link add {br} type bridge",
        f"link add {up} type veth peer name {cp}",
        f"link set {up} master {br}",
        f"link set {cp} master {CORE_BRIDGE}",
        f"link set {br} up",
        f"link set {up} up",
        f"link set {cp} up",
    ])
    if rate_bps:
        # tbf on both ends: up-sK's egress is the server's outbound
        # traffic, cp-sK's egress its inbound.
        for dev in (up, cp):
            _run(holder.enter_argv(fabric_pid, ("net",)) + [
                "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_bps}bit",
                "burst", str(tbf_burst_bytes(rate_bps)),
                "latency", TBF_LATENCY])
    return [br, up, cp]


def attach(fabric_pid: int, holder_pid: int, bridge: str, port: str,
           address: str) -> None:
    """A veth from `bridge` (port name `port`) into the holder's network
    namespace, where it is eth0 with `address`."""
    ip_batch(fabric_pid, [
        f"link add {port} type veth peer name {INSTANCE_IFNAME} "
        f"netns {holder_pid}",
        f"link set {port} master {bridge}",
        f"link set {port} up",
    ])
    ip_batch(holder_pid, [
        f"addr add {address}/{PREFIX_LEN} dev {INSTANCE_IFNAME}",
        f"link set {INSTANCE_IFNAME} up",
    ])


def add_tap(fabric_pid: int, tap: str, bridge: str) -> None:
    """A guest's tap, up in `bridge` of the fabric's namespace."""
    ip_batch(fabric_pid, [f"tuntap add dev {tap} mode tap",
                          f"link set {tap} master {bridge}",
                          f"link set {tap} up"])


def delete_links(fabric_pid: int, links: Sequence[str]) -> None:
    """Best effort: the links vanish with the fabric namespace anyway;
    deleting them first keeps `down` ordered (ports before bridges)."""
    if links:
        ip_batch(fabric_pid, [f"link del {name}" for name in links],
                 force=True)

