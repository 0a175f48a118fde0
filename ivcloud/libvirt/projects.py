"""One ivshmem-server, so one region, per Nova project on a host.

A region is one trust domain (docs/security.md): whoever writes into it
can steer the MPI ranks that read it. Nova instances of different
projects (tenants) must therefore never share one, whatever flavor they
picked. The watcher (attach.py, `ivcloud libvirt watch`) reads each
instance's owning project from the metadata Nova writes into the domain
(``<nova:instance><nova:owner><nova:project uuid=...>``) and attaches the
instance to that project's own server, which it starts on demand
(``ivshmem-server@nova-PROJECT``, sized by the host's policy file) and
stops once the project's last instance on the host is gone.

How a server is started is behind `ServerControl`: `SystemdServers` for
real hosts (the packaged template unit, packaging/host), `DirectServers`
for hosts without systemd as PID 1 (it runs the daemon itself through
ivcloud/server.py, as the tests do).
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Set

from .. import server as server_mod
from ..errors import LibvirtFailure, ServerError
from .domain import Shmem

DEFAULT_POLICY = "/etc/ivcloud/nova-regions.conf"
SERVER_PREFIX = "nova-"
# Keystone project ids are 32 hex digits; anything that fits a server
# name (and a systemd instance name) without escaping is accepted.
_PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,58}$")


def check_project(project: str) -> str:
    if not _PROJECT.match(project):
        raise LibvirtFailure(f"Nova project id '{project}' is not usable as "
                             f"a server name (letters, digits, '_-', at most "
                             f"59)")
    return project


# ---------------------------------------------------------------- policy

@dataclass(frozen=True)
class RegionPolicy:
    """How big one project's region is on this host, and who may use it."""
    size: int = 256 << 20
    vectors: int = 1
    max_peers: int = 16
    max_clients: Optional[int] = None  # None: 2 x max_peers
    group: Optional[str] = "libvirt-qemu"
    # Off: the clients are the instances' QEMU devices, which come out at
    # a detach or migration, and QEMU's unplug of a device that was told
    # of a leave frees memory twice (docs/server-protocol.md, "Quiet
    # leaves").
    leave_notices: bool = False

    def server_options(self) -> List[str]:
        """The ivshmem-server options for this region."""
        opts = ["--size", str(self.size), "--vectors", str(self.vectors),
                "--max-peers", str(self.max_peers)]
        if self.max_clients is not None:
            opts += ["--max-clients", str(self.max_clients)]
        if self.group:
            opts += ["--group", self.group]
        if not self.leave_notices:
            opts.append("--no-leave-notices")
        return opts


_KEYS = {"size", "vectors", "max-peers", "max-clients", "group",
         "leave-notices"}
_BOOLEANS = {"yes": True, "true": True, "on": True, "1": True,
             "no": False, "false": False, "off": False, "0": False}


def _region(section, where: str) -> Dict:
    unknown = set(section) - _KEYS
    if unknown:
        raise LibvirtFailure(f"{where}: unknown key '{sorted(unknown)[0]}' "
                             f"(known: {', '.join(sorted(_KEYS))})")
    out: Dict = {}
    try:
        if "size" in section:
            out["size"] = server_mod.parse_size(section["size"])
        for key, field in (("vectors", "vectors"), ("max-peers", "max_peers"),
                           ("max-clients", "max_clients")):
            if key in section:
                out[field] = int(section[key])
    except ValueError as e:
        raise LibvirtFailure(f"{where}: {e}") from None
    if "group" in section:
        out["group"] = section["group"] or None
    if "leave-notices" in section:
        value = _BOOLEANS.get(section["leave-notices"].strip().lower())
        if value is None:
            raise LibvirtFailure(f"{where}: leave-notices must be yes or "
                                 f"no, not '{section['leave-notices']}'")
        out["leave_notices"] = value
    return out


@dataclass(frozen=True)
class HostPolicy:
    """The host's regions: defaults, and per project overrides. The file
    is INI: a [DEFAULT] section and optional [project ID] sections, keys
    size, vectors, max-peers, max-clients, group (empty: none),
    leave-notices (yes/no, default no)."""
    default: RegionPolicy = RegionPolicy()
    projects: Optional[Dict[str, RegionPolicy]] = None

    def region(self, project: str) -> RegionPolicy:
        return (self.projects or {}).get(project, self.default)

    @classmethod
    def load(cls, path: str) -> "HostPolicy":
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with open(path) as f:
                parser.read_file(f)
        except OSError as e:
            raise LibvirtFailure(f"cannot read policy {path}: "
                                 f"{e.strerror}") from None
        except configparser.Error as e:
            raise LibvirtFailure(f"policy {path}: "
                                 f"{' '.join(str(e).split())}") from None
        default = replace(RegionPolicy(),
                          **_region(parser.defaults(), f"{path} [DEFAULT]"))
        projects: Dict[str, RegionPolicy] = {}
        for name in parser.sections():
            kind, _, project = name.partition(" ")
            if kind != "project" or not project.strip():
                raise LibvirtFailure(f"{path}: section [{name}] is not "
                                     f"[project ID]")
            # a section sees [DEFAULT]'s keys too: the same values
            projects[check_project(project.strip())] = replace(
                default, **_region(parser[name], f"{path} [{name}]"))
        return cls(default, projects)


# ---------------------------------------------------------------- servers

class ServerControl(ABC):
    """Starts and stops the ivshmem-server of one project."""

    @abstractmethod
    def start(self, project: str, region: RegionPolicy) -> Path:
        """Start the project's server (if it does not run); its socket."""

    @abstractmethod
    def stop(self, project: str) -> None:
        """Stop the project's server."""

    @abstractmethod
    def running(self) -> Set[str]:
        """Projects whose server runs."""

    @staticmethod
    def name(project: str) -> str:
        return SERVER_PREFIX + check_project(project)


class DirectServers(ServerControl):
    """Runs the daemons itself (ivcloud/server.py), each in
    RUN_DIR/nova-PROJECT: for hosts without systemd as PID 1."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def _paths(self, project: str):
        return server_mod.paths_for(self.name(project), self.run_dir)

    def start(self, project: str, region: RegionPolicy) -> Path:
        paths = self._paths(project)
        if server_mod.running_pid(paths) is None:
            try:
                server_mod.start(paths, region.size, region.vectors,
                                 region.max_peers, region.group,
                                 max_clients=region.max_clients,
                                 leave_notices=region.leave_notices)
            except ServerError as e:
                raise LibvirtFailure(f"project {project}: {e}") from None
        return paths.socket

    def stop(self, project: str) -> None:
        paths = self._paths(project)
        if server_mod.running_pid(paths) is not None or \
                server_mod.leftovers(paths):
            server_mod.stop(paths)

    def running(self) -> Set[str]:
        root = Path(self.run_dir)
        if not root.is_dir():
            return set()
        out = set()
        for d in root.iterdir():
            if d.name.startswith(SERVER_PREFIX):
                project = d.name[len(SERVER_PREFIX):]
                if _PROJECT.match(project) and server_mod.running_pid(
                        server_mod.paths_for(d.name, self.run_dir)):
                    out.add(project)
        return out


class SystemdServers(ServerControl):
    """The packaged template unit: /etc/ivshmem-server/nova-PROJECT.conf
    holds the region's options, `systemctl start
    ivshmem-server@nova-PROJECT` serves
    /run/ivshmem-server/nova-PROJECT/ivshmem.sock."""

    UNIT = "ivshmem-server@{}.service"

    def __init__(self, conf_dir: str = "/etc/ivshmem-server",
                 run_dir: str = "/run/ivshmem-server",
                 timeout_s: float = 15.0):
        self.conf_dir = Path(conf_dir)
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        if shutil.which("systemctl") is None:
            raise LibvirtFailure("systemctl not found (on a host without "
                                 "systemd, run the servers directly)")

    def _systemctl(self, *args: str, check: bool = True
                   ) -> subprocess.CompletedProcess:
        proc = subprocess.run(["systemctl", *args], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL,
                              timeout=self.timeout_s)
        if check and proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or
                   [f"exit status {proc.returncode}"])[-1]
            raise LibvirtFailure(f"systemctl {' '.join(args)}: {why}")
        return proc

    @staticmethod
    def conf_text(region: RegionPolicy) -> str:
        """The unit's environment file for a region."""
        return ('IVSHMEM_SERVER_OPTS="' + " ".join(region.server_options())
                + '"\n')

    def socket(self, project: str) -> Path:
        return self.run_dir / self.name(project) / "ivshmem.sock"

    def start(self, project: str, region: RegionPolicy) -> Path:
        name = self.name(project)
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / f"{name}.conf").write_text(self.conf_text(region))
        self._systemctl("start", self.UNIT.format(name))
        sock = self.socket(project)
        deadline = time.monotonic() + self.timeout_s
        while not sock.exists():
            if time.monotonic() > deadline:
                raise LibvirtFailure(f"{self.UNIT.format(name)} started but "
                                     f"{sock} did not appear")
            time.sleep(0.05)
        return sock

    def stop(self, project: str) -> None:
        name = self.name(project)
        self._systemctl("stop", self.UNIT.format(name))
        try:
            (self.conf_dir / f"{name}.conf").unlink()
        except FileNotFoundError:
            pass

    def running(self) -> Set[str]:
        proc = self._systemctl("list-units", "--plain", "--no-legend",
                               "--state=active",
                               self.UNIT.format(SERVER_PREFIX + "*"))
        out = set()
        for line in proc.stdout.splitlines():
            unit = line.split()[0] if line.split() else ""
            m = re.fullmatch(r"ivshmem-server@" + SERVER_PREFIX +
                             r"(.+)\.service", unit)
            if m and _PROJECT.match(m.group(1)):
                out.add(m.group(1))
        return out


# ---------------------------------------------------------------- regions

class ProjectRegions:
    """The servers of the projects whose instances run on this host."""

    def __init__(self, control: ServerControl, policy: HostPolicy,
                 device: str = "ivcloud"):
        self.control = control
        self.policy = policy
        self.device = device

    def shmem(self, project: str) -> Shmem:
        """The device that attaches an instance of `project` to its own
        server, started here if it does not run."""
        region = self.policy.region(check_project(project))
        sock = self.control.start(project, region)
        return Shmem(self.device, None, "ivshmem-doorbell", str(sock),
                     region.vectors)

    def retire(self, live_projects: Set[str]) -> List[str]:
        """Stop the servers of projects with no instance left on this
        host; returns those projects."""
        gone = sorted(self.control.running() - live_projects)
        for project in gone:
            self.control.stop(project)
        return gone
