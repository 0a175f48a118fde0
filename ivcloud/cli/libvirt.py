"""`ivcloud libvirt domain-xml|shmem-xml|attach-shmem|detach-shmem|watch|
migrate|nova-flavor`: the command line of :mod:`ivcloud.libvirt` (domain
XML, ivshmem hot-attach, live migration, Nova flavors)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import SpecError
from ..libvirt import cpuset
from ..libvirt.domain import (HUGEPAGE_SIZES, SHMEM_MODELS, Domain, Shmem,
                              parse_pins, validate_xml)
from ..libvirt.nova import EMULATOR_POLICIES, THREAD_POLICIES, Flavor
from ..libvirt.projects import DEFAULT_POLICY
from ..server import parse_size, run_root
from . import (CliError, action, add_run_dir, checked, int_at_least, number,
               sub_actions)

DEFAULT_URI = "qemu:///system"


# ---------------------------------------------------------------- arguments

_size = checked(parse_size)
_cpus = checked(cpuset.parse)


_seconds = number(float, "'{}' is not a number", lambda value: None
                  if 0 < value <= 86400 * 365 else
                  "must be a positive number of seconds")


def _add_shmem_args(p: argparse.ArgumentParser, prefix: str,
                    name_required: bool) -> None:
    """The ivshmem device options; domain-xml prefixes them with
    'shmem-' (--shmem-name), the device actions do not (--name)."""
    p.add_argument(f"--{prefix}name", required=name_required,
                   dest="shm_name", metavar="NAME",
                   help="shmem name (for ivshmem-plain: /dev/shm/NAME)")
    p.add_argument(f"--{prefix}size", type=_size, dest="shm_size",
                   metavar="SIZE", help="region size, a power of two >= 1M "
                                        "(plain default 4M; doorbell: the "
                                        "server's)")
    p.add_argument(f"--{prefix}model", choices=SHMEM_MODELS,
                   dest="shm_model", help="default: doorbell with a server "
                                          "socket, plain without")
    p.add_argument(f"--{prefix}server", dest="shm_server", metavar="SOCKET",
                   help="ivshmem-server socket (ivshmem-doorbell)")
    p.add_argument("--vectors", type=int_at_least(1), dest="shm_vectors",
                   help="MSI-X vectors (ivshmem-doorbell; the server's -n)")
    p.add_argument("--no-ioeventfd", action="store_false",
                   dest="shm_ioeventfd",
                   help="doorbell writes exit to QEMU instead of KVM "
                        "signalling the eventfd directly")


def _shmem_from(args, check: bool = True) -> Optional[Shmem]:
    given = [f for f in ("shm_size", "shm_model", "shm_server",
                         "shm_vectors") if getattr(args, f) is not None]
    if args.shm_name is None:
        if given or not args.shm_ioeventfd:
            raise CliError("the shmem options need a shmem name "
                           "(--shmem-name)")
        return None
    server = args.shm_server
    if server is not None:
        server = os.path.abspath(server)
        if check:
            from ..libvirt.attach import check_server_socket
            check_server_socket(server)
    shm = Shmem(args.shm_name, args.shm_size, args.shm_model, server,
                args.shm_vectors, args.shm_ioeventfd)
    if shm.size is None and shm.resolved_model == "ivshmem-plain":
        # libvirt's own default, written out explicitly
        shm = dataclasses.replace(shm, size=4 << 20)
    try:
        shm.validate()
    except SpecError as e:
        raise CliError(str(e)) from None
    return shm


def _connect_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", default=os.environ.get("LIBVIRT_DEFAULT_URI")
                   or DEFAULT_URI, metavar="URI",
                   help=f"libvirt URI (default $LIBVIRT_DEFAULT_URI or "
                        f"{DEFAULT_URI})")


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="store_true",
                   help="also change the persistent definition")
    p.add_argument("--offline", action="store_true",
                   help="change only the persistent definition (the "
                        "running domain is left alone)")


# ---------------------------------------------------------------- register

def register(sub) -> None:
    p = sub.add_parser("libvirt", help="libvirt domain XML, ivshmem "
                                       "hot-attach, Nova flavors",
                       description="Generate libvirt domain XML with an "
                                   "ivshmem device and host tuning, "
                                   "hot-attach ivshmem devices to running "
                                   "domains, and print the Nova flavor for "
                                   "pinned instances.")
    actions = sub_actions(p)

    d = action(actions, "domain-xml", _cmd_domain_xml,
               help="print a domain definition")
    d.add_argument("--name", required=True, help="domain name")
    d.add_argument("--memory", type=_size, default=1 << 30,
                   help="guest RAM (default 1G)")
    d.add_argument("--vcpus", type=int_at_least(1), default=1,
                   help="vCPUs (default 1)")
    d.add_argument("--threads", type=int_at_least(1), default=1,
                   help="guest SMT threads per core (default 1)")
    d.add_argument("--kvm", action="store_true",
                   help="type='kvm' with host-passthrough CPUs (default: "
                        "TCG, type='qemu')")
    d.add_argument("--machine", default="pc",
                   help="machine type (default pc: i440fx with ACPI "
                        "hot-plug)")
    d.add_argument("--kernel", help="kernel for direct boot")
    d.add_argument("--initrd", help="initramfs (with --kernel)")
    d.add_argument("--cmdline", help="kernel command line (with --kernel)")
    d.add_argument("--disk", help="boot disk image (raw, or qcow2 by "
                                  "extension)")
    _add_shmem_args(d, "shmem-", name_required=False)
    d.add_argument("--pin", help="vCPU pinning VCPU:CPUS,... e.g. 0:2,1:3")
    d.add_argument("--emulator-pin", type=_cpus, metavar="CPUS",
                   help="host CPUs for QEMU's emulator threads")
    d.add_argument("--numa-node", type=_cpus, metavar="NODES",
                   help="bind guest memory to these host NUMA nodes "
                        "(strict)")
    d.add_argument("--hugepages", type=_size, metavar="SIZE",
                   help="back guest RAM with huge pages (2M or 1G)")
    d.add_argument("--console-log", metavar="FILE",
                   help="serial console to this file instead of a pty")
    d.add_argument("--emulator", metavar="PATH",
                   help="QEMU binary (default: libvirt's choice)")
    d.add_argument("--no-check", action="store_true",
                   help="do not check that the kernel, disk and socket "
                        "exist here (XML for another host)")
    d.add_argument("--validate", action="store_true",
                   help="check the result with virt-xml-validate")
    d.add_argument("--output", "-o", metavar="FILE",
                   help="write the XML here instead of stdout")

    s = action(actions, "shmem-xml", _cmd_shmem_xml,
               help="print one <shmem> device (for virsh attach-device)")
    _add_shmem_args(s, "", name_required=True)
    s.add_argument("--no-check", action="store_true",
                   help="do not check that the server socket exists")

    a = action(actions, "attach-shmem", _cmd_attach,
               help="hot-attach an ivshmem device to a domain")
    a.add_argument("--domain", required=True, help="libvirt domain name "
                                                   "(Nova: instance-XXXXXXXX)")
    _add_shmem_args(a, "", name_required=True)
    _connect_arg(a)
    _target_args(a)

    t = action(actions, "detach-shmem", _cmd_detach,
               help="detach an ivshmem device")
    t.add_argument("--domain", required=True, help="libvirt domain name")
    t.add_argument("--name", required=True, dest="shm_name",
                   help="shmem name")
    t.add_argument("--timeout", type=_seconds, default=10.0,
                   help="seconds to wait for the guest to release the "
                        "device (default 10)")
    _connect_arg(t)
    _target_args(t)

    w = action(actions, "watch", _cmd_watch,
               help="attach each Nova instance to its project's own "
                    "ivshmem-server as it starts",
               description="Attach every matching instance to the "
                           "ivshmem-server of the Nova project that owns "
                           "it (from the domain's Nova metadata), starting "
                           "that server on demand and stopping it when the "
                           "project's last instance on this host is gone: "
                           "instances of different projects never share a "
                           "region.")
    w.add_argument("--domain-glob", metavar="PATTERN",
                   help="domain names to serve, e.g. 'instance-*'")
    w.add_argument("--flavor", help="only Nova instances of this flavor "
                                    "(from the domain's Nova metadata)")
    w.add_argument("--name", default="ivcloud", dest="shm_name",
                   help="shmem device name in the domains (default ivcloud)")
    w.add_argument("--policy", default=DEFAULT_POLICY, metavar="FILE",
                   help=f"regions per project on this host (default "
                        f"{DEFAULT_POLICY}; built-in defaults if absent)")
    w.add_argument("--service", choices=("systemd", "direct"),
                   default="systemd",
                   help="start the servers as ivshmem-server@nova-PROJECT "
                        "units (default), or run them directly (hosts "
                        "without systemd)")
    add_run_dir(w, "with --service direct: directory of the servers")
    _connect_arg(w)
    w.add_argument("--once", action="store_true",
                   help="exit after the first attach")
    w.add_argument("--timeout", type=_seconds, default=None,
                   help="exit after this many seconds (default: never)")

    m = action(actions, "migrate", _cmd_migrate,
               help="live-migrate a domain to another host, its ivshmem "
                    "devices detached first and the destination's "
                    "attached after")
    m.add_argument("domain", metavar="DOMAIN")
    m.add_argument("dest_uri", metavar="DEST_URI",
                   help="the destination's libvirt URI")
    m.add_argument("--name", default="ivcloud", dest="shm_name",
                   help="shmem device to attach at the destination "
                        "(default ivcloud)")
    m.add_argument("--server", metavar="SOCKET",
                   help="attach the device on this ivshmem-server socket of "
                        "the destination (default: wait for the "
                        "destination's `libvirt watch` to attach it)")
    m.add_argument("--migrate-uri", metavar="URI",
                   help="where QEMU's migration stream goes, e.g. "
                        "tcp://10.0.0.2 (default: libvirt's choice)")
    m.add_argument("--timeout", type=_seconds, default=60.0,
                   help="seconds for each device to be released or attached "
                        "(default 60)")
    _connect_arg(m)

    n = action(actions, "nova-flavor", _cmd_nova_flavor,
               help="print `openstack flavor` commands with the extra specs")
    n.add_argument("--name", default="ivcloud.hpc",
                   help="flavor name (default ivcloud.hpc)")
    n.add_argument("--vcpus", type=int_at_least(1), required=True)
    n.add_argument("--ram", type=int_at_least(1), required=True, metavar="MB",
                   help="RAM in MB")
    n.add_argument("--disk", type=int_at_least(0), default=0, metavar="GB",
                   help="root disk in GB (default 0)")
    n.add_argument("--numa-nodes", type=int_at_least(1), default=1,
                   help="guest NUMA nodes (hw:numa_nodes, default 1)")
    n.add_argument("--thread-policy", choices=THREAD_POLICIES,
                   default="isolate",
                   help="hw:cpu_thread_policy (default isolate: one vCPU "
                        "per physical core)")
    n.add_argument("--page-size", default="2MB",
                   help="hw:mem_page_size: small, large, any, 4K, 2M, 1G "
                        "or none (default 2MB)")
    n.add_argument("--emulator-threads", choices=EMULATOR_POLICIES,
                   help="hw:emulator_threads_policy (default: not set)")
    n.add_argument("--json", action="store_true",
                   help="print the flavor and extra specs as JSON")


# ---------------------------------------------------------------- actions

def _existing_file(path: Optional[str], what: str, check: bool
                   ) -> Optional[str]:
    if path is None:
        return None
    full = os.path.abspath(path)
    if check and not os.path.isfile(full):
        raise CliError(f"{what} {full} is not there")
    return full


def _cmd_domain_xml(args) -> int:
    check = not args.no_check
    if args.kernel and args.disk:
        raise CliError("give --kernel (direct boot) or --disk, not both")
    if (args.initrd or args.cmdline) and not args.kernel:
        raise CliError("--initrd and --cmdline need --kernel")
    if args.hugepages is not None and args.hugepages not in HUGEPAGE_SIZES:
        raise CliError("--hugepages must be 2M or 1G")
    pins = parse_pins(args.pin, args.vcpus) if args.pin else {}
    shm = _shmem_from(args, check)
    dom = Domain(
        name=args.name, memory=args.memory, vcpus=args.vcpus,
        kvm=args.kvm, machine=args.machine,
        kernel=_existing_file(args.kernel, "kernel", check),
        initrd=_existing_file(args.initrd, "initrd", check),
        cmdline=args.cmdline,
        disk=_existing_file(args.disk, "disk image", check),
        shmems=[shm] if shm else [], pins=pins,
        emulator_pin=args.emulator_pin, numa_nodes=args.numa_node,
        hugepage_size=args.hugepages, threads=args.threads,
        console_log=(os.path.abspath(args.console_log)
                     if args.console_log else None),
        emulator=args.emulator)
    text = dom.xml()
    if args.validate:
        validate_xml(text)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise CliError(f"cannot write {args.output}: {e.strerror}") \
                from None
    else:
        sys.stdout.write(text)
    return 0


def _cmd_shmem_xml(args) -> int:
    shm = _shmem_from(args, check=not args.no_check)
    assert shm is not None  # --name is required
    sys.stdout.write(shm.xml())
    return 0


def _live_config(args):
    if args.offline and args.config:
        raise CliError("--offline already means the definition only; drop "
                       "--config")
    return (not args.offline), (args.config or args.offline)


def _cmd_attach(args) -> int:
    from ..libvirt import attach
    live, persistent = _live_config(args)
    # The socket check happens in attach_shmem for doorbell devices.
    shm = _shmem_from(args, check=False)
    assert shm is not None
    with contextlib.closing(attach.connect(args.connect)) as conn:
        attach.attach_shmem(conn, args.domain, shm, live, persistent)
    where = " and ".join(w for w, on in (("running domain", live),
                                          ("definition", persistent)) if on)
    print(f"attached {shm.resolved_model} '{shm.name}' to "
          f"'{args.domain}' ({where})")
    return 0


def _cmd_detach(args) -> int:
    from ..libvirt import attach
    live, persistent = _live_config(args)
    with contextlib.closing(attach.connect(args.connect)) as conn:
        gone = attach.detach_shmem(conn, args.domain, args.shm_name, live,
                                   persistent, args.timeout)
    if not gone:
        raise attach.LibvirtFailure(
            f"detach of shmem '{args.shm_name}' requested, but "
            f"'{args.domain}' did not release it within {args.timeout:g} s "
            f"(does the guest OS handle ACPI hot-unplug?)")
    print(f"detached shmem '{args.shm_name}' from '{args.domain}'")
    return 0


def _cmd_watch(args) -> int:
    from ..libvirt import attach, projects
    if args.domain_glob is None and args.flavor is None:
        raise CliError("give --domain-glob and/or --flavor: the watcher "
                       "does not attach to every domain")
    if args.run_dir is not None and args.service != "direct":
        raise CliError("--run-dir goes with --service direct")
    policy = (projects.HostPolicy.load(args.policy)
              if args.policy != DEFAULT_POLICY or os.path.exists(args.policy)
              else projects.HostPolicy())
    if args.service == "systemd":
        control = projects.SystemdServers()
    else:
        control = projects.DirectServers(str(run_root(args.run_dir)))
    regions = projects.ProjectRegions(control, policy, args.shm_name)
    count = attach.watch(args.connect,
                         attach.matcher(args.domain_glob, args.flavor),
                         regions, lambda line: print(line, flush=True),
                         once=args.once, timeout=args.timeout)
    if args.once and count == 0:
        raise attach.LibvirtFailure("no matching domain started before the "
                                    "timeout")
    return 0


def _cmd_migrate(args) -> int:
    from ..libvirt import migrate
    # --server is a path on the destination host: taken as given
    report = migrate.migrate(args.domain, args.dest_uri, args.connect,
                             args.shm_name, args.server, args.migrate_uri,
                             args.timeout, args.timeout)
    print(migrate.describe(report))
    return 0


def _cmd_nova_flavor(args) -> int:
    page = None if args.page_size.lower() == "none" else args.page_size
    flavor = Flavor(args.name, args.vcpus, args.ram, args.disk,
                    args.numa_nodes, args.thread_policy, page,
                    args.emulator_threads)
    commands = flavor.commands()
    specs = flavor.extra_specs()
    if args.json:
        print(json.dumps({"name": flavor.name, "vcpus": flavor.vcpus,
                          "ram_mb": flavor.ram_mb, "disk_gb": flavor.disk_gb,
                          "extra_specs": specs, "commands": commands},
                         indent=2))
    else:
        print("\n".join(commands))
    return 0
