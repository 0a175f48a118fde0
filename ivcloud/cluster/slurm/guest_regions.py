"""A Slurm job's own region in the guests of a VM cluster: an ivshmem
device per guest, hot-plugged for the job's life into a free root port
through the guest's QMP socket, bound by its ivshm-bind, its env file
copied to JOB_DIR/ID.env for the task prolog; unplugged in two rounds,
every device_del first, then the chardevs (QEMU refuses to close one a
device still uses). docs/cluster.md, "Regions of VM clusters", says why.

QEMU's QMP socket takes one client at a time: every session here is
short, and a lock per guest orders prologs and epilogs on its ports.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ... import filelock
from ...errors import ClusterFailure, IvcloudError
from ...vm import agent, qemu
from ...vm import lifecycle as vm_lifecycle
from .. import vm_instance
from ..state import StateDir, load

# in each guest: the env file of the device of job ID is JOB_DIR/ID.env
JOB_DIR = "/run/ivcloud/slurm-jobs"
# where ivshm-bind writes a device's env file (packaging/guest/ivshm-bind)
BIND_DIR = "/run/ivshm"
# the doorbell vectors of a job's device, as the guests' boot device has
VECTORS = 1
# whether a job's servers tell a guest's device that a peer left: never
# (QEMU 7.2 could not unplug a device after a leave notice:
# docs/server-protocol.md, "Quiet leaves")
LEAVE_NOTICES = False
# bounds, in seconds, of a TCG guest on a loaded host: a QMP answer,
# the guest seeing a new device, binding it (vfio-pci; the unit allows
# 120 s), giving a device back, the lock of a guest's ports
QMP_TIMEOUT_S = 30.0
APPEAR_TIMEOUT_S = 30.0
BIND_TIMEOUT_S = 120.0
UNPLUG_TIMEOUT_S = 30.0
LOCK_TIMEOUT_S = 60.0
# the prolog's wait for a root port an ended job's epilog is freeing:
# that epilog's unplug of the guest's device, and its start
PORT_WAIT_S = 2 * UNPLUG_TIMEOUT_S
# the epilog's wait for a guest's ports: a migration of the guest holds
# them for its whole move (drain, copy, bind: minutes under TCG), after
# which the job's device is in the guest's new QEMU
EPILOG_LOCK_S = 900.0


def device_id(job: int) -> str:
    """QEMU's id of job `job`'s device and of its chardev."""
    return f"ivj{int(job)}"


def job_of(dev_id: str) -> Optional[int]:
    """The job whose device QEMU knows as `dev_id` (device_id's
    inverse), or None for another device."""
    head = device_id(0)[:-1]
    rest = dev_id[len(head):]
    return int(rest) if dev_id.startswith(head) and rest.isdigit() else None


def job_env_path(job: int) -> str:
    return f"{JOB_DIR}/{int(job)}.env"


def unit(addr: str) -> str:
    return f"ivshm-bind@{addr}.service"


def bind_lines(addr: str) -> List[str]:
    """Shell lines for the guest: the device at `addr` seen (bounded),
    its ivshm-bind unit run (the udev rule starts it once the guest has
    seen the device; starting it here as well waits for that run), its
    env file written."""
    q_ = agent.quote
    env = f"{BIND_DIR}/{addr}.env"
    tries = int(APPEAR_TIMEOUT_S / 0.2)
    return [
        "i=0",
        f"while [ ! -d /sys/bus/pci/devices/{addr} ] && [ $i -lt {tries} ];"
        f" do sleep 0.2; i=$((i+1)); done",
        f"[ -d /sys/bus/pci/devices/{addr} ] || "
        f"{{ echo 'the device did not appear at {addr}'; exit 1; }}",
        f"systemctl start {q_([unit(addr)])} || "
        f"{{ journalctl -q -u {q_([unit(addr)])} | tail -n 1; exit 1; }}",
        f"[ -s {q_([env])} ] || {{ echo 'ivshm-bind wrote no {env}'; "
        f"exit 1; }}"]


def port_lock(vm_dir: Path, timeout_s: float = LOCK_TIMEOUT_S):
    """The lock of a guest's root ports (a file in its VM directory)."""
    path = vm_dir / "ports.lock"
    return filelock.held(path, timeout_s,
                         lambda: ClusterFailure(f"{path} stays locked"))


def state_now(state: Dict) -> Dict:
    """The cluster's state as state.json says it now: a migration
    (`cluster migrate`) may have moved a guest to a new QEMU since the
    caller read `state`."""
    return load(StateDir.of(Path(state["dir"]))) or state


def dir_now(state: Dict, host: str) -> Path:
    return vm_instance.vm_dir_of(state_now(state), host)


@contextlib.contextmanager
def ports_now(state: Dict, host: str, timeout_s: float = EPILOG_LOCK_S
              ) -> Iterator[Path]:
    """The lock of guest `host`'s ports held for the block; yields its VM
    directory. A guest that moved while we waited for its old QEMU's lock
    is followed to its new one (a move holds both until the job's device
    is bound there)."""
    for _ in range(4):
        d = dir_now(state, host)
        with port_lock(d, timeout_s):
            if dir_now(state, host) == d:
                yield d
                return
    raise ClusterFailure(f"guest {host} moved again and again while its "
                         f"ports were waited for")



def clear_script(addr: str, *files: str) -> str:
    """In a guest: the bind unit of the device at `addr` stopped, its env
    file and `files` removed."""
    q = agent.quote
    return (f"systemctl stop {q([unit(addr)])} 2>/dev/null; "
            f"rm -f {q([f'{BIND_DIR}/{addr}.env', *files])}")


def plug_one(state: Dict, host: str, job: int, server_socket: str) -> str:
    """Job `job`'s device on `server_socket` in guest `host`, bound there
    and named in its job env file; its PCI address. When it fails, what
    went in stays for the caller's unplug (plug)."""
    d = vm_instance.vm_dir_of(state, host)
    qmp = d / "qmp.sock"
    dev = device_id(job)
    deadline = time.monotonic() + PORT_WAIT_S
    while True:
        with port_lock(d):
            with qemu.Qmp(qmp, QMP_TIMEOUT_S) as q:
                if qemu.find_device(q, dev) is not None:
                    raise ClusterFailure(f"guest {host} has a device {dev} "
                                         f"already")
                port = qemu.free_root_port(q)
            if port is not None:
                port_id, addr = port
                vm_instance.shell_in(state, host,
                                     clear_script(addr, job_env_path(job)), 60)
                with qemu.Qmp(qmp, QMP_TIMEOUT_S) as q:
                    got = qemu.plug_ivshmem(q, dev, port_id, server_socket,
                                            VECTORS)
                break
        # Slurm gives an ended job's CPUs to the next job before the
        # ended one's epilog has unplugged its device, and a guest has a
        # port per vCPU: the port comes free within that unplug
        if time.monotonic() > deadline:
            raise ClusterFailure(f"guest {host} has no free root port for "
                                 f"the job's device within {PORT_WAIT_S:.0f} "
                                 f"s (it runs as many jobs as it has ports)")
        time.sleep(0.5)
    if got != addr:
        raise ClusterFailure(f"guest {host}: the job's device is at {got}, "
                             f"not at {addr} as its port said")
    vm_instance.shell_in(state, host, "\n".join(
        bind_lines(addr) + job_env_lines(addr, job)),
        APPEAR_TIMEOUT_S + BIND_TIMEOUT_S + 10)
    return addr


def job_env_lines(addr: str, job: int) -> List[str]:
    """Shell lines for the guest: the env file ivshm-bind wrote for the
    device at `addr` copied, whole or not at all, to job `job`'s env
    file, which the task prolog and the provider's rejoin read."""
    q_ = agent.quote
    env = f"{BIND_DIR}/{addr}.env"
    return [f"mkdir -p {q_([JOB_DIR])}",
            f"cp {q_([env])} {q_([job_env_path(job) + '.tmp'])}",
            f"mv {q_([job_env_path(job) + '.tmp', job_env_path(job)])}"]


def take_device(d: Path, host: str, dev: str, what: str) -> Optional[str]:
    """QEMU's device `dev` (`what`, in messages) out of the QEMU in `d`
    once guest `host` gave it back (its chardev stays: remove_chardev);
    its PCI address, None when the QEMU had no such device.
    ClusterFailure when the QEMU is gone or the guest keeps the device."""
    pid = vm_lifecycle.qemu_pid(d)
    if pid is None:
        raise ClusterFailure(f"the QEMU of {host} is gone")
    with qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
        addr = qemu.find_device(q, dev)
        with agent.quiet(d / "agent.sock", UNPLUG_TIMEOUT_S):
            back = qemu.unplug_ivshmem(q, pid, dev, UNPLUG_TIMEOUT_S)
    if not back:
        raise ClusterFailure(
            f"guest {host} did not give {what} ({addr}) back within "
            f"{UNPLUG_TIMEOUT_S:.0f} s (a process holds it)")
    return addr


def _take_out(state: Dict, host: str, job: int
              ) -> Tuple[Optional[str], List[str]]:
    """The first half of an unplug: job `job`'s device out of live guest
    `host` (its chardev stays); (its PCI address, if it had the device;
    the problems)."""
    d = vm_instance.vm_dir_of(state, host)
    try:
        with ports_now(state, host) as d:
            if vm_lifecycle.qemu_pid(d) is None:
                return None, []
            return take_device(d, host, device_id(job),
                               f"device {device_id(job)}"), []
    except IvcloudError as e:
        if vm_lifecycle.qemu_pid(d) is None:
            return None, []    # the guest died meanwhile
        return None, [str(e) if isinstance(e, ClusterFailure)
                      else f"guest {host}: {e}"]


def _finish(state: Dict, host: str, job: int, addr: Optional[str]
            ) -> List[str]:
    """The second half: the device's chardev closed and the guest's
    files of it removed; the problems."""
    state = state_now(state)
    d = vm_instance.vm_dir_of(state, host)
    if vm_lifecycle.qemu_pid(d) is None:
        return []
    problems = []
    try:
        with ports_now(state, host) as d, \
                qemu.Qmp(d / "qmp.sock", QMP_TIMEOUT_S) as q:
            qemu.remove_chardev(q, device_id(job))
    except IvcloudError as e:
        problems.append(f"guest {host}: {e}")
    # and the job's file as a migration killed after its drain hid it
    # (migrate.drain_ranks)
    files = [job_env_path(job), job_env_path(job) + ".away"]
    script = (clear_script(addr, *files) if addr is not None
              else f"rm -f {agent.quote(files)}")
    try:
        vm_instance.shell_in(state, host, script, 60)
    except IvcloudError as e:
        if vm_lifecycle.qemu_pid(d) is not None:
            problems.append(str(e))
    return problems


def guests_of(state: Dict, nodes: Sequence[str]) -> List[str]:
    return [n for n in nodes if n in state.get("vms", {})]


def plug(state: Dict, job: int, nodes: Sequence[str],
         sockets: Dict[int, str]) -> Dict[str, str]:
    """Job `job`'s device into each of its guests, on the job's server
    of the guest's emulated server (`sockets`: {server index: socket},
    regions.start_regions); {guest: PCI address}. All or nothing."""
    hosts = guests_of(state, nodes)
    done = vm_instance.each(hosts, lambda h: plug_one(
        state, h, job, sockets[state["instances"][h]["server"]]))
    failed = [(h, e) for h, _, e in done if e is not None]
    if failed:
        unplug(state, job, hosts)
        raise ClusterFailure("; ".join(
            str(e) if isinstance(e, IvcloudError) else f"{h}: {e!r}"
            for h, e in failed))
    return {h: addr for h, addr, _ in done}


def unplug(state: Dict, job: int, nodes: Sequence[str]) -> List[str]:
    """Job `job`'s devices out of those of `nodes` that live; the
    problems left. Every device first, then every chardev of a device
    that came out; a guest of the job that died is skipped (its server
    told the others nothing: docs/server-protocol.md, "Quiet leaves")."""
    hosts = guests_of(state, nodes)
    problems: List[str] = []
    taken: Dict[str, Optional[str]] = {}
    for h, result, e in vm_instance.each(hosts, lambda h: _take_out(state, h, job)):
        addr, found = result if e is None else (None, [f"{h}: {e!r}"])
        problems += found
        if not found:
            taken[h] = addr
    for h, found, e in vm_instance.each(sorted(taken), lambda h: _finish(
            state, h, job, taken[h])):
        problems += found if e is None else [f"{h}: {e!r}"]
    return problems
