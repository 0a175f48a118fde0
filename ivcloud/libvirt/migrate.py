"""Live migration of a libvirt domain that uses ivshmem devices
(`ivcloud libvirt migrate DOMAIN DEST_URI`, docs/operators.md section 5).

QEMU refuses to migrate a guest with an ivshmem device ("Migration is
disabled when using feature 'peer mode' in device 'ivshmem'"), and the
device's server socket is a path on the source host anyway. So the
devices come out first, libvirt migrates the domain without them, and
the destination host's server goes in after. The steps, each a phase on
the progress lines:

1. check    both connections, the domain runs on the source, the
            destination is another host (libvirt's host UUIDs) without a
            domain of that name
2. detach   every <shmem> device of the running domain, each waited for
            (the guest OS acknowledges the ACPI eject; its ranks must
            have let go of the region)
3. migrate  virDomainMigrate3, live, the destination XML the domain's
            migratable live XML without <shmem>; a persistent domain is
            defined at the destination (without the source's <shmem>
            devices: their sockets are this host's) and undefined here
4. attach   at the destination: the device on the server socket given
            (a path on the destination host), or, by default, the
            destination's `libvirt watch`, which treats the arriving
            domain as a new instance of its Nova project and attaches
            that project's server there; waited for either way

A failure in steps 2-3 re-attaches the detached devices on the source
(libvirt resumes the source itself when a migration fails). A failure
in step 4 migrates the domain back, restores its definition and
re-attaches its devices on the source. Either way the error names the
step. An interrupt (SIGINT, SIGTERM) cancels libvirt's migration job
and rolls back the same way.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Callable, Dict, List, Optional, Tuple

from .. import process
from ..errors import LibvirtFailure, MigrationStepFailed, QmpError
from ..vm import qemu
from .attach import (_message, attach_shmem, connect, detach_shmem,
                     libvirt_module, lookup, shmem_elements, shmem_names)
from .domain import Shmem, to_text

# bounds, in seconds
DETACH_TIMEOUT_S = 30.0
ATTACH_TIMEOUT_S = 60.0
# a live migration that does not converge (a guest dirtying memory faster
# than it is sent) is cancelled, and the guest stays on the source
MIGRATE_TIMEOUT_S = 600.0
# libvirt's end of a cancelled job
ABORT_TIMEOUT_S = 60.0
# rounds of guarding an unplugged device's descriptor numbers
GUARD_TRIES = 3


def host_uuid(conn) -> str:
    root = ET.fromstring(conn.getCapabilities())
    el = root.find("./host/uuid")
    return el.text.strip() if el is not None and el.text else ""


def without_shmem(xml_text: str) -> str:
    """A domain XML without its <shmem> devices."""
    root = ET.fromstring(xml_text)
    devices = root.find("./devices")
    if devices is not None:
        for el in devices.findall("shmem"):
            devices.remove(el)
    return to_text(root)


def device_xml(el: ET.Element) -> str:
    """A live <shmem> element as attach XML: libvirt's own alias is not
    accepted back, the PCI address is kept so the guest finds the device
    where it was."""
    el = ET.fromstring(ET.tostring(el))
    for alias in el.findall("alias"):
        el.remove(alias)
    return to_text(el)


def _vectors(el: ET.Element) -> Optional[int]:
    msi = el.find("msi")
    text = msi.get("vectors") if msi is not None else None
    return int(text) if text and text.isdigit() else None


class _MonitorOfDomain:
    """QMP of a domain through libvirt (local connections only: the
    descriptor of getfd travels over libvirt's unix socket), in the
    shape ivcloud.vm.qemu.guard_eventfds uses."""

    def __init__(self, dom):
        self.dom = dom

    def execute(self, command: str, fd: Optional[int] = None,
                **arguments):
        import libvirt_qemu
        msg: Dict = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        try:
            text, _ = libvirt_qemu.qemuMonitorCommandWithFiles(
                self.dom, json.dumps(msg), [] if fd is None else [fd], 0)
        except libvirt_module().libvirtError as e:
            raise QmpError(f"QMP through libvirt: {_message(e)}") from None
        reply = json.loads(text)
        if "error" in reply:
            raise QmpError(f"{command}: {reply['error'].get('desc')}")
        return reply.get("return")


def emulated_qemu_pid(dom) -> Optional[int]:
    """The QEMU process of an emulated (TCG, type='qemu') domain when it
    runs on this machine; None for a KVM domain (its doorbells are KVM
    irqfds: no stale handlers, below) or one not found here."""
    root = ET.fromstring(dom.XMLDesc(0))
    if root.get("type") != "qemu":
        return None
    want = f"guest={dom.name()},".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"-name" in args and any((a + b",").startswith(want)
                                    for a in args):
            found.append(int(entry))
    return found[0] if len(found) == 1 else None


class _Move:
    """One domain moving from `conn` to `dconn`: its steps, what undoes
    each, the progress lines."""

    def __init__(self, conn, dconn, name: str, say, t0: float):
        self.lv = libvirt_module()
        self.conn, self.dconn, self.name = conn, dconn, name
        self.say, self.t0 = say, t0
        self.step = "check"
        self.undo: List[Tuple[str, Callable[[], None]]] = []
        self.detached: List[ET.Element] = []
        self.result: Dict = {"domain": name}

    def phase(self, name: str) -> None:
        self.step = name
        self.say(f"migrate {self.name}: {name} "
                 f"({time.monotonic() - self.t0:.1f} s)")

    # -- steps

    def check(self) -> None:
        lv = self.lv
        dom = lookup(self.conn, self.name)
        if not dom.isActive():
            raise LibvirtFailure(f"domain '{self.name}' is not running: "
                                 f"nothing to migrate live")
        if host_uuid(self.conn) == host_uuid(self.dconn):
            raise LibvirtFailure(f"{self.dconn.getURI()} is the host "
                                 f"'{self.name}' runs on (the same libvirt "
                                 f"host UUID)")
        try:
            self.dconn.lookupByName(self.name)
        except lv.libvirtError:
            pass
        else:
            raise LibvirtFailure(f"{self.dconn.getURI()} already has a "
                                 f"domain '{self.name}'")
        self.dom = dom
        self.persistent = bool(dom.isPersistent())
        self.definition = (dom.XMLDesc(lv.VIR_DOMAIN_XML_INACTIVE |
                                       lv.VIR_DOMAIN_XML_MIGRATABLE)
                           if self.persistent else None)
        self.result.update(source=self.conn.getHostname(),
                           destination=self.dconn.getHostname())

    def detach(self, timeout: float) -> None:
        self.phase("detach")
        self.undo.append(("the source's devices attached again",
                          self.reattach_source))
        # Emulated QEMU 7.2 leaves an unplugged doorbell's fd handlers
        # on its eventfds' numbers, and the next descriptor opened there
        # (the device attached again at a rollback) runs the freed
        # device's handler: SIGSEGV (docs/cluster.md, "Two QEMU 7.2
        # bugs"). Those numbers get idle eventfds, as in a VM cluster.
        pid = emulated_qemu_pid(self.dom)
        for el in shmem_elements(self.dom, live=True):
            self.detached.append(el)
            name = el.get("name", "")
            before = qemu._eventfd_numbers(pid) if pid else set()
            if not detach_shmem(self.conn, self.name, name, live=True,
                                timeout=timeout):
                raise LibvirtFailure(f"the guest did not release shmem "
                                     f"'{name}' within {timeout:g} s (does "
                                     f"it handle ACPI hot-unplug?)")
            if pid:
                self._guard(pid, before, name)
        self.result["detached"] = [e.get("name") for e in self.detached]

    def _guard(self, pid: int, before: set, name: str) -> None:
        monitor = _MonitorOfDomain(self.dom)
        try:
            holes = before - set(qemu._fd_numbers(pid))
            for _ in range(GUARD_TRIES):
                holes = qemu.guard_eventfds(monitor, pid, holes,
                                            f"shmem-{name}")
                if not holes:
                    break
                # a number taken meanwhile by something short-lived is
                # free again a moment later
                time.sleep(0.2)
                if not holes - set(qemu._fd_numbers(pid)):
                    break   # all still taken
        except QmpError as e:
            holes = {f"({e})"}
        if holes:
            self.say(f"migrate {self.name}: the descriptors of shmem "
                     f"'{name}' in QEMU {pid} are not all guarded "
                     f"{sorted(map(str, holes))}: attaching it again here "
                     f"may crash QEMU")

    def reattach_source(self) -> None:
        dom = lookup(self.conn, self.name)
        if not dom.isActive():
            # e.g. a QEMU that aborted at an unplug (docs/operators.md,
            # "Quiet servers")
            raise LibvirtFailure(f"'{self.name}' no longer runs at the "
                                 f"source")
        present = shmem_names(dom, live=True)
        for el in self.detached:
            if el.get("name") not in present:
                try:
                    dom.attachDeviceFlags(device_xml(el),
                                          self.lv.VIR_DOMAIN_AFFECT_LIVE)
                except self.lv.libvirtError as e:
                    raise LibvirtFailure(f"shmem '{el.get('name')}': "
                                         f"{_message(e)}") from None

    def _migrate(self, dom, to, definition: Optional[str],
                 migrate_uri: Optional[str]):
        lv = self.lv
        params = {lv.VIR_MIGRATE_PARAM_DEST_XML: without_shmem(
            dom.XMLDesc(lv.VIR_DOMAIN_XML_MIGRATABLE))}
        # a TCG domain (type 'qemu') moves paused: QEMU 7.2 loses guest
        # writes made during a live copy under TCG (docs/cluster.md,
        # "Migration", step 6)
        tcg = ET.fromstring(dom.XMLDesc(0)).get("type") == "qemu"
        flags = 0 if tcg else lv.VIR_MIGRATE_LIVE
        if definition is not None:
            params[lv.VIR_MIGRATE_PARAM_PERSIST_XML] = definition
            flags |= lv.VIR_MIGRATE_PERSIST_DEST | \
                lv.VIR_MIGRATE_UNDEFINE_SOURCE
        if migrate_uri:
            params[lv.VIR_MIGRATE_PARAM_URI] = migrate_uri
        # In a thread, so that an interrupt (Ctrl-C, SIGTERM) is seen
        # while libvirt works: the job is cancelled, and what it came to
        # decides the rollback.
        box: Dict = {}

        def run() -> None:
            try:
                box["dom"] = dom.migrate3(to, params, flags)
            except lv.libvirtError as e:
                box["error"] = e
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.monotonic() + MIGRATE_TIMEOUT_S
        try:
            while worker.is_alive():
                worker.join(0.2)
                if worker.is_alive() and time.monotonic() > deadline:
                    raise LibvirtFailure(f"the migration did not end within "
                                         f"{MIGRATE_TIMEOUT_S:.0f} s")
        except BaseException:
            with process.shielded():
                try:
                    dom.abortJob()
                except lv.libvirtError:
                    pass   # no job any more: it ended meanwhile
                worker.join(ABORT_TIMEOUT_S)
            self.arrived = box.get("dom")
            raise
        if "error" in box:
            raise LibvirtFailure(_message(box["error"]))
        return box["dom"]

    def migrate(self, migrate_uri: Optional[str]) -> None:
        self.phase("migrate")
        self.migrate_uri = migrate_uri
        started = time.monotonic()
        self.arrived = None
        try:
            self.ddom = self._migrate(
                self.dom, self.dconn,
                None if self.definition is None else
                without_shmem(self.definition), migrate_uri)
        except BaseException:
            if self.arrived is not None:   # interrupted too late
                self.ddom = self.arrived
                self._arrived()
            raise
        self._arrived()
        self.result["migrate_s"] = round(time.monotonic() - started, 1)
        downtime = self._downtime()
        if downtime is not None:
            self.result["downtime_ms"] = downtime
        self.say(f"migrate {self.name}: migrated "
                 f"({time.monotonic() - self.t0:.1f} s), downtime "
                 f"{downtime if downtime is not None else '?'} ms")

    def _arrived(self) -> None:
        # from here the guest runs at the destination: undone by moving
        # it back
        self.undo = [("the domain migrated back and its devices attached "
                      "again", self.move_back)]

    def _downtime(self) -> Optional[int]:
        try:
            stats = self.ddom.jobStats(
                self.lv.VIR_DOMAIN_JOB_STATS_COMPLETED)
        except (self.lv.libvirtError, AttributeError):
            return None
        value = stats.get("downtime")
        return int(value) if value is not None else None

    def move_back(self) -> None:
        ddom = self.ddom
        for name in shmem_names(ddom, live=True):
            if not detach_shmem(self.dconn, self.name, name, live=True,
                                timeout=DETACH_TIMEOUT_S):
                raise LibvirtFailure(f"the guest did not release shmem "
                                     f"'{name}' at the destination")
        self.dom = self._migrate(ddom, self.conn, self.definition,
                                 self.migrate_uri)
        self.reattach_source()

    def attach(self, device: str, server: Optional[str],
               timeout: float) -> None:
        self.phase("attach")
        if server is not None:
            old = [e for e in self.detached if e.get("name") == device]
            shm = Shmem(device, None, "ivshmem-doorbell", server,
                        _vectors(old[0]) if old else None)
            attach_shmem(self.dconn, self.name, shm, live=True,
                         persistent=False, check_socket=False)
            how = f"on {server}"
        else:
            deadline = time.monotonic() + timeout
            while device not in shmem_names(self.ddom, live=True):
                if time.monotonic() >= deadline:
                    raise LibvirtFailure(
                        f"no shmem '{device}' appeared at the destination "
                        f"within {timeout:g} s (does `ivcloud libvirt "
                        f"watch` run there and match the domain?)")
                time.sleep(0.2)
            how = "by the destination's watcher"
        el = [e for e in shmem_elements(self.ddom, live=True)
              if e.get("name") == device][0]
        src = el.find("server")
        self.result["attached"] = {"name": device, "server": (
            src.get("path") if src is not None else None)}
        self.say(f"migrate {self.name}: attached shmem '{device}' {how} "
                 f"({time.monotonic() - self.t0:.1f} s)")



def migrate(domain: str, dest_uri: str, source_uri: str,
            device: str = "ivcloud", server: Optional[str] = None,
            migrate_uri: Optional[str] = None,
            detach_timeout: float = DETACH_TIMEOUT_S,
            attach_timeout: float = ATTACH_TIMEOUT_S,
            log: Optional[Callable[[str], None]] = None) -> Dict:
    """Move running `domain` from `source_uri` to `dest_uri`, live, with
    its ivshmem devices let go here and device `device` attached there
    (the module's docstring). Returns {"domain", "source", "destination",
    "detached", "attached", "migrate_s", "downtime_ms", "seconds"}.
    LibvirtFailure for a request that cannot be (nothing was touched);
    MigrationStepFailed, naming the step, when a step failed (undone: the
    domain runs on the source with its devices, unless the message says
    otherwise)."""
    say = log or (lambda line: sys.stderr.write(line + "\n"))
    t0 = time.monotonic()
    if server is not None:
        # the socket is on the destination host: only its form is checked
        Shmem(device, None, "ivshmem-doorbell", server).validate()
    conn = connect(source_uri)
    try:
        dconn = connect(dest_uri)
        try:
            m = _Move(conn, dconn, domain, say, t0)
            m.check()
            where = m.result["destination"]
            try:
                with process.interrupts():
                    m.detach(detach_timeout)
                    m.migrate(migrate_uri)
                    m.attach(device, server, attach_timeout)
            except BaseException as e:
                step = m.step
                problems = process.undo(
                    m.undo, lambda ln: say(f"migrate {domain}: {ln}"),
                    _message)
                if not isinstance(e, Exception):
                    raise
                text = (f"migration of '{domain}' to {where} failed at "
                        f"step '{step}': {_message(e)}; ")
                if problems:
                    text += f"rolling back failed: {'; '.join(problems)}"
                else:
                    text += f"rolled back, it runs on {m.result['source']}"
                raise MigrationStepFailed(text) from None
            m.result["seconds"] = round(time.monotonic() - t0, 1)
            return m.result
        finally:
            dconn.close()
    finally:
        conn.close()


def describe(report: Dict) -> str:
    """One line of a migration's report."""
    att = report.get("attached") or {}
    return (f"{report['domain']} moved from {report['source']} to "
            f"{report['destination']} in {report.get('seconds')} s "
            f"(downtime {report.get('downtime_ms', '?')} ms); shmem "
            f"'{att.get('name')}' on {att.get('server')}")
