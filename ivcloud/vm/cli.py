"""`ivcloud vm up|down|status|exec|image` and `ivcloud pin`.

A VM NAME keeps everything under RUN_DIR/vm/NAME: vm.json (what was
started, how), qemu.pid, console.log (ttyS0), agent.sock (ttyS1, the
command agent), qmp.sock and qemu.log. `vm down` finds its QEMU through
the pid file and, should that be lost, through the process command lines
that name this directory; it removes the directory either way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..cli import CliError
from ..server import OperationFailed, format_size, parse_size
from . import agent, image, qemu

DEFAULT_RUN_DIR = "/run/ivcloud"
DEFAULT_PREFIX = "vm"
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_SUN_PATH_MAX = 107
MAX_VMS = 64
MIN_MEMORY = 96 << 20
BOOT_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- paths

def vm_root(run_dir: Optional[str]) -> Path:
    rd = run_dir or os.environ.get("IVCLOUD_RUN_DIR") or DEFAULT_RUN_DIR
    return Path(rd).absolute() / "vm"


def vm_dir(root: Path, name: str) -> Path:
    return root / name


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise CliError(f"bad VM name '{name}' (a letter, then letters, "
                       f"digits, '_' or '-', at most 32)")
    return name


def _read_json(path: Path) -> Optional[Dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def list_vms(root: Path) -> List[str]:
    try:
        return sorted(p.name for p in root.iterdir()
                      if p.is_dir() and _NAME_RE.match(p.name))
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- processes

def _cmdline(pid: int) -> List[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st[st.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _names_dir(pid: int, d: Path) -> bool:
    """Is `pid` a QEMU started for the VM directory `d`?"""
    prefix = str(d) + "/"
    return any(prefix in a for a in _cmdline(pid))


def qemu_pid(d: Path) -> Optional[int]:
    try:
        pid = int((d / "qemu.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and _alive(pid) and _names_dir(pid, d) else None


def _pids_naming(d: Path) -> List[int]:
    """Every live process whose command line names `d` (a QEMU whose pid
    file is gone, after a crash of `vm up`)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            if pid != os.getpid() and _alive(pid) and _names_dir(pid, d):
                out.append(pid)
    return out


def _wait_gone(pids: List[int], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if _alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def stop_vm(d: Path) -> Optional[int]:
    """Stop the VM in `d` (QMP quit, then SIGKILL) and remove `d`.
    Returns the pid that was stopped, if any."""
    pid = qemu_pid(d)
    pids = sorted(set(([pid] if pid else []) + _pids_naming(d)))
    grace = 0.0
    if pid is not None:
        try:
            with qemu.Qmp(d / "qmp.sock", timeout=2.0) as q:
                q.execute("quit")
            grace = 3.0
        except (qemu.QmpError, OSError, ValueError):
            pass
    for p in _wait_gone(pids, grace):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = _wait_gone(pids, 5.0)
    if left:
        raise OperationFailed(f"QEMU {left} of {d.name} did not die")
    _remove_tree(d)
    return pid


def _remove_tree(d: Path) -> None:
    for p in sorted(d.glob("**/*"), reverse=True):
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- up

def host_cores() -> int:
    return os.cpu_count() or 1


def _check_socket(path: str) -> str:
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise CliError(f"server socket {path} does not exist (start a "
                       f"server with `ivcloud server start`)")
    except OSError as e:
        raise CliError(f"server socket {path}: {e.strerror}")
    if not stat.S_ISSOCK(st.st_mode):
        raise CliError(f"{path} is not a socket")
    return str(p.absolute())


def _banner(text: str) -> Optional[Dict[str, str]]:
    for line in text.splitlines():
        if line.startswith(image.READY_BANNER):
            return dict(w.split("=", 1) for w in line.split()
                        if "=" in w)
    return None


def up(root: Path, count: int, server: str, prefix: str = DEFAULT_PREFIX,
       memory: int = 256 << 20, vcpus: int = 1, accel: str = "auto",
       vectors: int = 1, doorbell: str = "vfio",
       image_dir: Optional[str] = None, kernel: Optional[str] = None,
       initrd: Optional[str] = None,
       boot_timeout: float = BOOT_TIMEOUT_S, log=None) -> List[Dict]:
    """Boot `count` VMs named PREFIX0.. attached to `server`. All or
    nothing: on failure every VM started here is stopped again."""
    log = log or (lambda msg: sys.stderr.write(msg + "\n"))
    if not 1 <= count <= MAX_VMS:
        raise CliError(f"--count must be 1..{MAX_VMS}, not {count}")
    if vcpus < 1:
        raise CliError(f"--vcpus must be at least 1, not {vcpus}")
    if vcpus > host_cores():
        raise CliError(f"--vcpus {vcpus} is more than the {host_cores()} "
                       f"host cores")
    if memory < MIN_MEMORY:
        raise CliError(f"--memory {format_size(memory)} is too small (at "
                       f"least {format_size(MIN_MEMORY)})")
    if not 1 <= vectors <= 64:
        raise CliError(f"--vectors must be 1..64, not {vectors}")
    if doorbell not in ("vfio", "uio"):
        raise CliError(f"--doorbell must be vfio or uio, not {doorbell}")
    _check_name(prefix)
    binary = qemu.qemu_binary()
    if binary is None:
        raise CliError(f"{os.environ.get(qemu.QEMU_ENV) or qemu.DEFAULT_QEMU}"
                       f" not found (apt-get install qemu-system-x86)")
    server = _check_socket(server)
    names = [_check_name(f"{prefix}{i}") for i in range(count)]
    if len(str(vm_dir(root, names[-1]) / "agent.sock")) > _SUN_PATH_MAX:
        raise CliError(f"run directory {root} is too long for UNIX sockets "
                       f"(use a shorter --run-dir)")
    for n in names:
        d = vm_dir(root, n)
        pid = qemu_pid(d)
        if pid is not None:
            raise CliError(f"VM {n} is already running (pid {pid}); "
                           f"`ivcloud vm down --name {n}` first")
    for what, path in (("kernel", kernel), ("initramfs", initrd)):
        if path is not None and not Path(path).is_file():
            raise CliError(f"guest {what} image {path} is missing")
    if kernel and initrd:
        img = image.GuestImage(Path(kernel).absolute(),
                               Path(initrd).absolute(), "custom")
    else:
        img = image.build(Path(image_dir) if image_dir else None, log=log)
        if kernel or initrd:
            img = image.GuestImage(Path(kernel or img.kernel).absolute(),
                                   Path(initrd or img.initrd).absolute(),
                                   "custom" if kernel else img.kernel_version)
    if not img.exists():
        raise CliError(f"guest kernel image {img.kernel} is missing")

    if accel == "auto":
        ok, why = qemu.kvm_usable(binary, img, img.kernel.parent
                                  if os.access(img.kernel.parent, os.W_OK)
                                  else root)
        accel = "kvm" if ok else "tcg"
        if not ok:
            log(f"ivcloud vm: KVM unusable ({why}); using TCG emulation")

    root.mkdir(parents=True, exist_ok=True)
    started: List[Path] = []
    try:
        for n in names:
            d = vm_dir(root, n)
            if d.exists():
                stop_vm(d)  # leftovers of a VM that died
            d.mkdir(mode=0o700)
            started.append(d)
            cmd = qemu.guest_command(binary, img, d, n, accel, vcpus,
                                     memory >> 20, server, vectors, doorbell)
            _write_json(d / "vm.json", {
                "name": n, "server": server, "accel": accel, "vcpus": vcpus,
                "memory": memory, "vectors": vectors, "doorbell": doorbell,
                "kernel": str(img.kernel), "initrd": str(img.initrd),
                "command": cmd, "state": "starting",
                "started": time.time()})
            with open(d / "qemu.log", "w") as qlog:
                try:
                    p = subprocess.run(cmd, stdin=subprocess.DEVNULL,
                                       stdout=qlog, stderr=subprocess.PIPE,
                                       text=True, timeout=60)
                except subprocess.TimeoutExpired:
                    raise OperationFailed(f"QEMU for {n} did not start "
                                          f"within 60 s")
            if p.returncode != 0:
                lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
                raise OperationFailed(f"QEMU for {n} failed: "
                                      f"{lines[-1] if lines else p.returncode}")
        t0 = time.monotonic()
        pending = {d.name: d for d in started}
        info: Dict[str, Dict[str, str]] = {}
        while pending:
            for n, d in list(pending.items()):
                banner = _banner(qemu.console_text(d))
                if banner is not None:
                    info[n] = banner
                    del pending[n]
                elif qemu_pid(d) is None:
                    raise OperationFailed(
                        f"VM {n} died while booting: "
                        f"{qemu.last_line(qemu.console_text(d))}")
            if pending and time.monotonic() - t0 > boot_timeout:
                n = sorted(pending)[0]
                raise OperationFailed(
                    f"VM {n} did not boot within {boot_timeout:.0f} s "
                    f"({accel}); last console line: "
                    f"{qemu.last_line(qemu.console_text(pending[n]))}")
            time.sleep(0.1)
        result = []
        for d in started:
            agent.wait_ready(d / "agent.sock", timeout=30)
            st = _read_json(d / "vm.json") or {}
            b = info[d.name]
            st.update(state="running", pid=qemu_pid(d),
                      boot_s=round(time.monotonic() - t0, 1),
                      device=b.get("device"),
                      ivposition=int(b["ivposition"])
                      if b.get("ivposition", "").isdigit() else None)
            _write_json(d / "vm.json", st)
            result.append(st)
        return result
    except BaseException:
        for d in started:
            try:
                stop_vm(d)
            except OperationFailed:
                pass
        raise


# ---------------------------------------------------------------- status

def cpus_allowed(pid: int, tid: int) -> Optional[str]:
    try:
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text(
                ).splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def status(root: Path, names: Optional[List[str]] = None) -> List[Dict]:
    out = []
    for n in names or list_vms(root):
        d = vm_dir(root, n)
        st = _read_json(d / "vm.json") or {"name": n}
        pid = qemu_pid(d)
        info = {k: st.get(k) for k in ("name", "server", "accel", "vcpus",
                                       "memory", "ivposition", "device",
                                       "doorbell", "boot_s")}
        info.update(running=pid is not None, pid=pid, dir=str(d))
        if pid is not None:
            try:
                threads = qemu.vcpu_threads(d / "qmp.sock")
                for t in threads:
                    t["cpus_allowed"] = cpus_allowed(pid, t["thread"])
                info["vcpu_threads"] = threads
            except qemu.QmpError as e:
                info["qmp_error"] = str(e)
        out.append(info)
    return out


# ---------------------------------------------------------------- pin

def parse_cores(text: str) -> List[int]:
    """'0,1,4-6' -> [0, 1, 4, 5, 6], each a core we may run on."""
    cores: List[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise CliError(f"bad core list '{text}' (expected e.g. 0,1 or "
                           f"0-3)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo:
            raise CliError(f"bad core range '{part.strip()}'")
        cores.extend(range(lo, hi + 1))
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cores if c not in allowed]
    if bad:
        raise CliError(f"core {bad[0]} is not a host core we may use "
                       f"(available: {','.join(map(str, sorted(allowed)))})")
    return list(dict.fromkeys(cores))


def pin(root: Path, names: List[str], cores: List[int]) -> List[Dict]:
    """Pin vCPU i of each VM to cores[i % len(cores)]; vCPU threads come
    from QMP query-cpus-fast."""
    done = []
    for n in names:
        d = vm_dir(root, n)
        pid = qemu_pid(d)
        if pid is None:
            raise CliError(f"VM {n} is not running")
        try:
            threads = qemu.vcpu_threads(d / "qmp.sock")
        except qemu.QmpError as e:
            raise OperationFailed(f"VM {n}: {e}")
        for i, t in enumerate(threads):
            core = cores[i % len(cores)]
            try:
                os.sched_setaffinity(t["thread"], {core})
            except OSError as e:
                raise OperationFailed(f"VM {n}: cannot pin vCPU {t['cpu']} "
                                      f"(thread {t['thread']}): {e.strerror}")
            done.append({"vm": n, "cpu": t["cpu"], "thread": t["thread"],
                         "core": core,
                         "cpus_allowed": cpus_allowed(pid, t["thread"])})
    return done


# ---------------------------------------------------------------- CLI

def _integer(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not '{text}'")
    return v


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _run_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help=f"parent of the vm/ state directory (default "
                        f"$IVCLOUD_RUN_DIR or {DEFAULT_RUN_DIR})")


def register(sub) -> None:
    p = sub.add_parser("vm", help="boot QEMU guests attached to an "
                                  "ivshmem-server",
                       description="Boot, inspect and stop QEMU VMs whose "
                                   "ivshmem-doorbell device is attached to "
                                   "an ivshmem-server (see docs/vm.md).")
    actions = p.add_subparsers(dest="action", metavar="ACTION",
                               parser_class=type(p))
    actions.required = True

    u = actions.add_parser("up", help="boot N VMs")
    u.add_argument("--count", type=_integer, default=1,
                   help="how many VMs (default 1)")
    u.add_argument("--server", required=True, metavar="SOCKET",
                   help="ivshmem-server socket the VMs attach to")
    u.add_argument("--name", default=DEFAULT_PREFIX, metavar="PREFIX",
                   help=f"VMs are PREFIX0, PREFIX1, ... (default "
                        f"{DEFAULT_PREFIX})")
    u.add_argument("--memory", type=_size_arg, default=256 << 20,
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
    u.add_argument("--image-dir", default=None,
                   help="guest image cache (default build/guest)")
    u.add_argument("--kernel", default=None,
                   help="boot this kernel instead of the built one (its "
                        "modules must match the initramfs)")
    u.add_argument("--initrd", default=None,
                   help="boot this initramfs instead of the built one")
    u.add_argument("--boot-timeout", type=float, default=BOOT_TIMEOUT_S,
                   help=f"seconds to wait for the guests "
                        f"(default {BOOT_TIMEOUT_S:.0f})")
    _run_dir_arg(u)
    u.set_defaults(func=_cmd_up)

    d = actions.add_parser("down", help="stop VMs and remove their files")
    d.add_argument("--name", action="append", default=None,
                   help="a VM to stop (repeatable; default all)")
    _run_dir_arg(d)
    d.set_defaults(func=_cmd_down)

    s = actions.add_parser("status", help="list VMs, their QEMU and vCPU "
                                          "threads")
    s.add_argument("--name", action="append", default=None)
    s.add_argument("--json", action="store_true", help="print JSON")
    _run_dir_arg(s)
    s.set_defaults(func=_cmd_status)

    e = actions.add_parser("exec", help="run a shell command in a VM")
    e.add_argument("vm", metavar="NAME")
    e.add_argument("--timeout", type=float, default=60.0)
    e.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- COMMAND [ARGS...] (run by the guest's sh)")
    _run_dir_arg(e)
    e.set_defaults(func=_cmd_exec)

    i = actions.add_parser("image", help="build the guest kernel + "
                                         "initramfs")
    i.add_argument("--image-dir", default=None)
    i.add_argument("--rebuild", action="store_true")
    i.set_defaults(func=_cmd_image)

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
             args.image_dir, args.kernel, args.initrd, args.boot_timeout)
    for v in vms:
        print(f"{v['name']}: running (pid {v['pid']}, {v['accel']}, "
              f"{v['vcpus']} vCPU, {format_size(v['memory'])}, ivshmem id "
              f"{v['ivposition']}, booted in {v['boot_s']} s); console "
              f"{vm_dir(root, v['name']) / 'console.log'}")
    return 0


def _cmd_down(args) -> int:
    root = vm_root(args.run_dir)
    names = [_check_name(n) for n in args.name] if args.name else \
        list_vms(root)
    if args.name:
        missing = [n for n in names if not vm_dir(root, n).exists()]
        if missing:
            raise CliError(f"no VM {missing[0]} in {root}")
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
    names = [_check_name(n) for n in args.name] if args.name else None
    if names:
        missing = [n for n in names if not vm_dir(root, n).exists()]
        if missing:
            raise CliError(f"no VM {missing[0]} in {root}")
    vms = status(root, names)
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
    d = vm_dir(root, _check_name(args.vm))
    if qemu_pid(d) is None:
        raise CliError(f"VM {args.vm} is not running")
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise CliError("no command given (ivcloud vm exec NAME -- CMD)")
    text = cmd[0] if len(cmd) == 1 else " ".join(shlex.quote(c) for c in cmd)
    try:
        r = agent.run(d / "agent.sock", text, timeout=args.timeout)
    except agent.AgentError as e:
        raise OperationFailed(f"VM {args.vm}: {e}")
    sys.stdout.write(r.output)
    return r.status


def _cmd_image(args) -> int:
    img = image.build(Path(args.image_dir) if args.image_dir else None,
                      force=args.rebuild,
                      log=lambda m: sys.stderr.write(m + "\n"))
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
        names = [_check_name(n) for n in args.vm]
    done = pin(root, names, cores)
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        for p in done:
            print(f"{p['vm']}: vCPU {p['cpu']} (thread {p['thread']}) -> "
                  f"core {p['core']} (allowed: {p['cpus_allowed']})")
    return 0
