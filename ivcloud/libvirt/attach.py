"""Hot-attach and detach of ivshmem devices through the libvirt API.

This is how an operator adds the ivshmem device to an instance that Nova
(or anyone else) already started: Nova has no ivshmem support, and it
rewrites the domain XML on hard reboot, resize and migration, so the
device is attached to the *running* domain (``VIR_DOMAIN_AFFECT_LIVE``),
either by hand (`attach_shmem`) or by a watcher that reacts to libvirt's
lifecycle events (`watch`), which attaches each Nova instance to its
own project's server (projects.py). A libvirt hook script cannot do it: hooks run
while libvirtd waits for them and must not call back into libvirt.

Attach needs ACPI hot-plug in the guest's machine (libvirt's default
i440fx machine with ``<acpi/>``, which Nova always sets). Detach is a
request: the device goes away only when the guest OS acknowledges the
ACPI eject, so `detach_shmem` waits for it with a deadline.

python3-libvirt (Debian) is imported lazily: the XML generators work
without it.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import time
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Callable, List, Optional

from ..errors import LibvirtFailure
from .domain import Shmem, SpecError, to_text
from .nova import nova_flavor, nova_project

if TYPE_CHECKING:
    from .projects import ProjectRegions

DEFAULT_URI = "qemu:///system"


def libvirt_module():
    try:
        import libvirt  # Debian python3-libvirt
    except ImportError:
        raise LibvirtFailure("python3-libvirt is not installed (apt-get "
                             "install python3-libvirt)") from None
    # The default handler prints every error to stderr as well; we report
    # each one once, as the exception's single line.
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


def _message(err: Exception) -> str:
    return " ".join(str(err).split())


def connect(uri: str = DEFAULT_URI):
    lv = libvirt_module()
    try:
        return lv.open(uri)
    except lv.libvirtError as e:
        raise LibvirtFailure(f"cannot connect to libvirt at {uri}: "
                             f"{_message(e)} (is libvirtd running?)") \
            from None


def lookup(conn, name: str):
    lv = libvirt_module()
    try:
        return conn.lookupByName(name)
    except lv.libvirtError:
        raise LibvirtFailure(f"no domain '{name}' at {conn.getURI()}") \
            from None


def shmem_elements(dom, live: bool = True) -> List[ET.Element]:
    lv = libvirt_module()
    flags = 0 if live else lv.VIR_DOMAIN_XML_INACTIVE
    root = ET.fromstring(dom.XMLDesc(flags))
    return root.findall("./devices/shmem")


def shmem_names(dom, live: bool = True) -> List[str]:
    return [e.get("name", "") for e in shmem_elements(dom, live)]


def _flags(lv, live: bool, persistent: bool) -> int:
    flags = 0
    if live:
        flags |= lv.VIR_DOMAIN_AFFECT_LIVE
    if persistent:
        flags |= lv.VIR_DOMAIN_AFFECT_CONFIG
    return flags


def check_server_socket(path: str) -> None:
    """QEMU's own error for a missing socket arrives late and wordy."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise LibvirtFailure(f"ivshmem-server socket {path} is not there "
                             f"({e.strerror}; start one with `ivcloud "
                             f"server start`)") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise LibvirtFailure(f"{path} is not a socket")


def _check_target(dom, live: bool, persistent: bool) -> None:
    if not live and not persistent:
        raise LibvirtFailure("nothing to change: neither the live domain "
                             "nor its persistent definition")
    if live and not dom.isActive():
        raise LibvirtFailure(f"domain '{dom.name()}' is not running (change "
                             f"only its persistent definition)",
                             setting="config")
    if persistent and not dom.isPersistent():
        raise LibvirtFailure(f"domain '{dom.name()}' is transient: it has "
                             f"no definition to change", setting="config")


def attach_shmem(conn, domain: str, shm: Shmem, live: bool = True,
                 persistent: bool = False, check_socket: bool = True) -> str:
    """Attach ``shm`` to ``domain``; returns the device XML. Refuses a
    second device with the same name (libvirt would accept it and QEMU
    would map the same region twice). ``check_socket=False`` for a
    server socket on another host than this one."""
    lv = libvirt_module()
    try:
        xml = shm.xml()
    except SpecError as e:
        raise LibvirtFailure(str(e)) from None
    if check_socket and shm.resolved_model == "ivshmem-doorbell":
        check_server_socket(shm.server or "")
    dom = lookup(conn, domain)
    _check_target(dom, live, persistent)
    for where, wanted, is_live in (("running", live, True),
                                   ("in its definition", persistent, False)):
        if wanted and shm.name in shmem_names(dom, live=is_live):
            raise LibvirtFailure(f"domain '{domain}' already has a shmem "
                                 f"device '{shm.name}' ({where})")
    try:
        dom.attachDeviceFlags(xml, _flags(lv, live, persistent))
    except lv.libvirtError as e:
        msg = _message(e)
        hint = ""
        if "Permission denied" in msg:
            hint = (" (QEMU runs as an unprivileged user: start the server "
                    "with --group libvirt-qemu)")
        elif "hotplug" in msg:
            hint = " (the domain needs <acpi/> for PCI hot-plug)"
        raise LibvirtFailure(f"attaching shmem '{shm.name}' to "
                             f"'{domain}' failed: {msg}{hint}") from None
    if live and shm.name not in shmem_names(dom, live=True):
        raise LibvirtFailure(f"libvirt accepted shmem '{shm.name}' but "
                             f"'{domain}' does not show it")
    return xml


def detach_shmem(conn, domain: str, name: str, live: bool = True,
                 persistent: bool = False, timeout: float = 10.0) -> bool:
    """Ask libvirt to remove shmem ``name``. Returns True once the device
    is gone from the live domain (or at once for --config only), False
    if the guest did not release it within ``timeout`` seconds; the
    request stays pending in QEMU then."""
    lv = libvirt_module()
    dom = lookup(conn, domain)
    _check_target(dom, live, persistent)
    # Detach the exact element libvirt reports (with its alias and PCI
    # address) so the match cannot pick a different device.
    source = shmem_elements(dom, live=live)
    found = [e for e in source if e.get("name") == name]
    if not found:
        raise LibvirtFailure(f"domain '{domain}' has no shmem device "
                             f"'{name}'")
    try:
        dom.detachDeviceFlags(to_text(found[0]), _flags(lv, live,
                                                        persistent))
    except lv.libvirtError as e:
        raise LibvirtFailure(f"detaching shmem '{name}' from '{domain}' "
                             f"failed: {_message(e)}") from None
    if not live:
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            if name not in shmem_names(dom, live=True):
                return True
        except lv.libvirtError:
            return True  # the domain went away, and the device with it
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


# ---------------------------------------------------------------- watcher

def matcher(glob: Optional[str], flavor: Optional[str]
            ) -> Callable[[str, str], bool]:
    """A predicate on (domain name, domain XML): every given criterion
    must hold."""
    def match(name: str, xml_text: str) -> bool:
        if glob is not None and not fnmatch.fnmatchcase(name, glob):
            return False
        if flavor is not None and nova_flavor(xml_text) != flavor:
            return False
        return True
    return match


def watch(uri: str, match: Callable[[str, str], bool],
          regions: "ProjectRegions", report: Callable[[str], None],
          once: bool = False, timeout: Optional[float] = None) -> int:
    """Attach every running domain that matches to its Nova project's
    own server (projects.py), now and each time one starts or arrives by
    migration (migrate.py), and stop a project's server once its last
    matching domain on this host is gone; until ``timeout`` (seconds) or, with ``once``, the first attach.
    Returns the number of attaches. A domain without a Nova project in
    its metadata is reported and left alone: it has no trust domain to
    share a region with.

    Failures on one domain are reported and do not stop the watcher: one
    misconfigured instance must not leave the others without the device.
    """
    lv = libvirt_module()
    # The event loop must exist before the connection is opened.
    lv.virEventRegisterDefaultImpl()
    conn = connect(uri)
    attached: List[str] = []
    pending: List[str] = []
    stopped: List[bool] = []

    def consider(dom) -> None:
        try:
            name = dom.name()
            if tuple(dom.state()) == (lv.VIR_DOMAIN_PAUSED,
                                      lv.VIR_DOMAIN_PAUSED_MIGRATION):
                # arriving (or leaving): QEMU's device set is the
                # migration stream's until libvirt resumes it here
                return
            xml = dom.XMLDesc(0) if dom.isActive() else None
            if xml is None or not match(name, xml):
                return
            project = nova_project(xml)
            if project is None:
                report(f"domain '{name}': no Nova project in its metadata: "
                       f"not attached")
                return
            shm = regions.shmem(project)
            if shm.name in shmem_names(dom, live=True):
                return
            attach_shmem(conn, name, shm, live=True, persistent=False)
            attached.append(name)
            report(f"attached shmem '{shm.name}' of project {project} to "
                   f"'{name}'")
        except (LibvirtFailure, lv.libvirtError) as e:
            # dom.name() is cached client-side: safe even if it is gone
            report(f"domain '{dom.name()}': {_message(e)}")

    def retire() -> None:
        live = set()
        for dom in conn.listAllDomains(lv.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
            try:
                xml = dom.XMLDesc(0)
            except lv.libvirtError:
                continue  # gone meanwhile
            project = nova_project(xml) if match(dom.name(), xml) else None
            if project is not None:
                live.add(project)
        try:
            for project in regions.retire(live):
                report(f"project {project}: no instance left on this host: "
                       f"its server stopped")
        except LibvirtFailure as e:
            report(_message(e))

    def on_lifecycle(_conn, dom, event, detail, _opaque) -> None:
        # Act outside the callback: libvirt is still delivering the
        # event while we would issue the next request. A domain migrated
        # in starts paused, as the target of the migration stream, which
        # a device attached then would break (and libvirt holds the
        # domain's job until it ends): it is a new instance here once it
        # resumes after the migration, or is left paused by it (the
        # migration of a paused guest).
        if (event == lv.VIR_DOMAIN_EVENT_STARTED and
                detail != lv.VIR_DOMAIN_EVENT_STARTED_MIGRATED) or \
                (event == lv.VIR_DOMAIN_EVENT_RESUMED and
                 detail == lv.VIR_DOMAIN_EVENT_RESUMED_MIGRATED) or \
                (event == lv.VIR_DOMAIN_EVENT_SUSPENDED and
                 detail == lv.VIR_DOMAIN_EVENT_SUSPENDED_PAUSED):
            pending.append(dom.name())
        elif event == lv.VIR_DOMAIN_EVENT_STOPPED:
            stopped.append(True)

    def tick(_timer, _opaque) -> None:
        pass  # only wakes the loop so the deadline is checked

    callback = conn.domainEventRegisterAny(
        None, lv.VIR_DOMAIN_EVENT_ID_LIFECYCLE, on_lifecycle, None)
    timer = lv.virEventAddTimeout(200, tick, None)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for dom in conn.listAllDomains(lv.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
            consider(dom)
        retire()  # servers whose instances went while nobody watched
        while not (once and attached):
            if deadline is not None and time.monotonic() >= deadline:
                break
            lv.virEventRunDefaultImpl()
            while pending:
                name = pending.pop(0)
                try:
                    consider(conn.lookupByName(name))
                except lv.libvirtError:
                    pass  # gone again before we got to it
                if once and attached:
                    break
            if stopped:
                stopped.clear()
                retire()
    finally:
        lv.virEventRemoveTimeout(timer)
        try:
            conn.domainEventDeregisterAny(callback)
        finally:
            conn.close()
    return len(attached)
