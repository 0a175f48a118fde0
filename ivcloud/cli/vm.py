"""`ivcloud vm up|down|status|exec|image` and `ivcloud pin`: the command
line of :mod:`ivcloud.vm`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..errors import VmFailure
from ..server import format_size, parse_size
from ..vm import agent, debian, image
from ..vm.lifecycle import (DEFAULT_PREFIX, BOOT_TIMEOUT_S,
                            vm_root, vm_dir, list_vms, qemu_pid, up, stop_vm,
                            status, parse_cores, pin, check_name, run_in)
from . import (CliError, action, add_run_dir, checked, number, remainder,
               sub_actions)

_integer = number(int, "expected an integer, not '{}'")


def _run_dir_arg(p: argparse.ArgumentParser) -> None:
    add_run_dir(p, "parent of the vm/ state directory")


def _image_args(p: argparse.ArgumentParser) -> None:
    """The options of the guest image (vm up, vm image)."""
    p.add_argument("--kind", choices=["busybox", "debian"],
                   default="busybox",
                   help="guest image: busybox initramfs (default) or the "
                        "Debian 12 image (mmdebstrap) with the "
                        "ivcloud-guest package")
    p.add_argument("--image-dir", default=None,
                   help="guest image cache (default build/guest; debian: "
                        "$IVCLOUD_IMAGE_CACHE or /var/cache/ivcloud)")
    p.add_argument("--guest-deb", default=None, metavar="DEB",
                   help="debian kind: the ivcloud-guest package to install "
                        "(default the newest in build/deb)")
    p.add_argument("--extra-deb", action="append", default=None,
                   metavar="DEB", help="debian kind: also install this "
                                       "package (repeatable)")
    p.add_argument("--release", default=None, metavar="SUITE",
                   help=f"debian kind: the Debian release "
                        f"({', '.join(debian.RELEASES)}; default "
                        f"{debian.DEFAULT_RELEASE}, Debian 12)")


def register(sub) -> None:
    p = sub.add_parser("vm", help="boot QEMU guests attached to an "
                                  "ivshmem-server",
                       description="Boot, inspect and stop QEMU VMs whose "
                                   "ivshmem-doorbell device is attached to "
                                   "an ivshmem-server (see docs/vm.md).")
    actions = sub_actions(p)

    u = action(actions, "up", _cmd_up, help="boot N VMs")
    u.add_argument("--count", type=_integer, default=1,
                   help="how many VMs (default 1)")
    u.add_argument("--server", required=True, metavar="SOCKET",
                   help="ivshmem-server socket the VMs attach to")
    u.add_argument("--name", default=DEFAULT_PREFIX, metavar="PREFIX",
                   help=f"VMs are PREFIX0, PREFIX1, ... (default "
                        f"{DEFAULT_PREFIX})")
    u.add_argument("--memory", type=checked(parse_size), default=256 << 20,
                   help="guest memory (default 256M)")
    u.add_argument("--vcpus", type=_integer, default=1,
                   help="vCPUs per VM, at most the host's cores (default 1)")
    u.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto",
                   help="auto: KVM if a guest boots with it, else TCG")
    u.add_argument("--vectors", type=_integer, default=1,
                   help="ivshmem interrupt vectors, >= the server's "
                        "(default 1)")
    u.add_argument("--doorbell", choices=["vfio", "uio"], default="vfio",
                   help="guest driver for doorbell interrupts: vfio-pci "
                        "(MSI-X, default) or uio_pci_generic (INTx)")
    _image_args(u)
    u.add_argument("--network", action="store_true",
                   help="debian kind, 2 VMs: an Ethernet between them "
                        "(10.12.0.1, .2) for mpirun over ssh")
    u.add_argument("--kernel", default=None,
                   help="boot this kernel instead of the built one (its "
                        "modules must match the initramfs)")
    u.add_argument("--initrd", default=None,
                   help="boot this initramfs instead of the built one")
    u.add_argument("--boot-timeout", type=float, default=BOOT_TIMEOUT_S,
                   help=f"seconds to wait for the guests "
                        f"(default {BOOT_TIMEOUT_S:.0f})")
    _run_dir_arg(u)

    d = action(actions, "down", _cmd_down,
               help="stop VMs and remove their files")
    d.add_argument("--name", action="append", default=None,
                   help="a VM to stop (repeatable; default all)")
    _run_dir_arg(d)

    s = action(actions, "status", _cmd_status,
               help="list VMs, their QEMU and vCPU threads")
    s.add_argument("--name", action="append", default=None)
    s.add_argument("--json", action="store_true", help="print JSON")
    _run_dir_arg(s)

    e = action(actions, "exec", _cmd_exec, help="run a shell command in a VM")
    e.add_argument("vm", metavar="NAME")
    e.add_argument("--timeout", type=float, default=60.0)
    e.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- COMMAND [ARGS...] (run by the guest's sh)")
    _run_dir_arg(e)

    i = action(actions, "image", _cmd_image, _image_args,
               help="build the guest kernel + initramfs")
    i.add_argument("--rebuild", action="store_true")

    q = sub.add_parser("pin", help="pin the vCPU threads of running VMs to "
                                   "host cores",
                       description="Pin vCPU i of each VM to core "
                                   "CORES[i mod len]; threads are found "
                                   "through QMP query-cpus-fast.")
    who = q.add_mutually_exclusive_group(required=True)
    who.add_argument("--vm", action="append", metavar="NAME",
                     help="a VM to pin (repeatable)")
    who.add_argument("--all", action="store_true", help="every running VM")
    q.add_argument("--cores", required=True,
                   help="host cores, e.g. 0,1 or 0-3")
    q.add_argument("--json", action="store_true", help="print JSON")
    _run_dir_arg(q)
    q.set_defaults(func=_cmd_pin)


def _cmd_up(args) -> int:
    root = vm_root(args.run_dir)
    vms = up(root, args.count, args.server, args.name, args.memory,
             args.vcpus, args.accel, args.vectors, args.doorbell,
             args.image_dir, args.kernel, args.initrd, args.boot_timeout,
             kind=args.kind, guest_deb=args.guest_deb, network=args.network,
             extra_debs=args.extra_deb, release=args.release)
    for v in vms:
        print(f"{v['name']}: running (pid {v['pid']}, {v['accel']}, "
              f"{v['vcpus']} vCPU, {format_size(v['memory'])}, ivshmem id "
              f"{v['ivposition']}, booted in {v['boot_s']} s); console "
              f"{vm_dir(root, v['name']) / 'console.log'}")
    return 0


def _named(root: Path, names) -> list:
    """The VMs --name gives, each of which must be there."""
    names = [check_name(n) for n in names]
    missing = [n for n in names if not vm_dir(root, n).exists()]
    if missing:
        raise CliError(f"no VM {missing[0]} in {root}")
    return names


def _cmd_down(args) -> int:
    root = vm_root(args.run_dir)
    names = _named(root, args.name) if args.name else list_vms(root)
    if not names:
        print(f"no VMs in {root}")
        return 0
    for n in names:
        pid = stop_vm(vm_dir(root, n))
        print(f"{n}: stopped (pid {pid})" if pid else
              f"{n}: was not running; files removed")
    return 0


def _cmd_status(args) -> int:
    root = vm_root(args.run_dir)
    vms = status(root, _named(root, args.name) if args.name else None)
    if args.json:
        print(json.dumps(vms, indent=2, sort_keys=True))
        return 0
    if not vms:
        print(f"no VMs in {root}")
        return 0
    for v in vms:
        if not v["running"]:
            print(f"{v['name']}: not running (stale files in {v['dir']})")
            continue
        print(f"{v['name']}: running (pid {v['pid']}, {v['accel']}, "
              f"ivshmem id {v['ivposition']}, server {v['server']})")
        for t in v.get("vcpu_threads", []):
            print(f"  vCPU {t['cpu']}: thread {t['thread']}, cores "
                  f"{t['cpus_allowed']}")
    return 0


def _cmd_exec(args) -> int:
    root = vm_root(args.run_dir)
    d = vm_dir(root, check_name(args.vm))
    if qemu_pid(d) is None:
        raise CliError(f"VM {args.vm} is not running")
    cmd = remainder(args.command)
    if not cmd:
        raise CliError("no command given (ivcloud vm exec NAME -- CMD)")
    text = cmd[0] if len(cmd) == 1 else " ".join(shlex.quote(c) for c in cmd)
    try:
        r = run_in(d, text, args.timeout)
    except agent.AgentError as e:
        raise VmFailure(f"VM {args.vm}: {e}")
    sys.stdout.write(r.output)
    return r.status


def _cmd_image(args) -> int:
    log = lambda m: sys.stderr.write(m + "\n")  # noqa: E731
    if args.release is not None and args.kind != "debian":
        raise CliError("--release needs --kind debian")
    if args.kind == "debian":
        img = debian.build(Path(args.image_dir) if args.image_dir else None,
                           Path(args.guest_deb) if args.guest_deb else None,
                           force=args.rebuild, log=log,
                           extra=[Path(x) for x in args.extra_deb or ()],
                           release_name=args.release)
        print(f"kernel {img.kernel} ({img.kernel_version}), initramfs "
              f"{img.initrd}, root disk {img.disk} "
              f"({img.disk.stat().st_blocks * 512 >> 20} MiB used)")
        return 0
    img = image.build(Path(args.image_dir) if args.image_dir else None,
                      force=args.rebuild, log=log)
    print(f"kernel {img.kernel} ({img.kernel_version}), initramfs "
          f"{img.initrd} ({img.initrd.stat().st_size} bytes)")
    return 0


def _cmd_pin(args) -> int:
    root = vm_root(args.run_dir)
    cores = parse_cores(args.cores)
    if args.all:
        names = [n for n in list_vms(root) if qemu_pid(vm_dir(root, n))]
        if not names:
            raise CliError(f"no running VMs in {root}")
    else:
        names = [check_name(n) for n in args.vm]
    done = pin(root, names, cores)
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        for p in done:
            print(f"{p['vm']}: vCPU {p['cpu']} (thread {p['thread']}) -> "
                  f"core {p['core']} (allowed: {p['cpus_allowed']})")
    return 0
