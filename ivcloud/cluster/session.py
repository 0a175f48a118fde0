"""A cluster for the length of one `with` block: brought up on entry,
taken down on exit whatever happened (an error, Ctrl-C, SIGTERM or
SIGHUP), and MPI jobs run on it as `ivcloud cluster mpirun` runs them.
The cloud benchmarks (ivcloud.bench.hierarchy, ivcloud.bench.halo) use
it; anything else that needs a throw-away cluster can. Its instances are
namespaces, or QEMU guests (VmOptions): then host programs are copied
into the guests (`stage`) and jobs run from the first guest
(vm_instance), in the servers' standing regions. With SlurmOptions it
runs Slurm (ivcloud.cluster.slurm) and takes jobs through `srun`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpi
from ..errors import ClusterFailure
from ..vm import agent
from . import jobs, kinds, lifecycle, vm_instance
from .launch import enter_command, mpirun_command
from .state import state_dir
from .topology import plan
from .slurm import Slurm, SlurmOptions
from .slurm.client import client_command
from .vm_instance import VmOptions


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP inside a session: unwinds like Ctrl-C (the running
    job is torn down, the cluster taken down, the CLI exits 130)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


# where `stage` puts host programs in the guests
GUEST_PROGRAM_DIR = "/opt/ivcloud/bin"
# where `stage_dir` puts its archive in the guests on the way
GUEST_STAGING_DIR = "/var/tmp/ivcloud-staging"
# preparing inputs in the guests (meshing, decomposing) under TCG
PREPARE_TIMEOUT_S = 900.0


class ClusterSession:
    """An emulated cluster under a unique name made from `prefix`: up on
    entry, down on exit unless `keep`. `log` gets a line when it is up
    and when it is down (or kept). `vm`: its instances are QEMU guests."""

    def __init__(self, prefix: str, servers: int, instances: int,
                 vcpus: int, uplink_rate: Optional[str] = None,
                 keep: bool = False, log=None,
                 vm: Optional[VmOptions] = None,
                 slurm: Optional[SlurmOptions] = None):
        # unique, and short enough for the socket paths (24 characters)
        self.name = f"{prefix}{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.topo = plan(self.name, servers, instances, vcpus, uplink_rate,
                         oversubscribe=True)
        self.uplink_rate = uplink_rate
        self.keep = keep
        self.log = log or sys.stderr
        self.state: Optional[Dict] = None
        self._old_handlers: Dict = {}
        self.vm = vm
        # refuses (no QEMU, no package, memory) before anything exists
        self.instances = kinds.choose(self.topo, vm,
                                      slurmd=slurm is not None)
        self.scheduler = Slurm(slurm) if slurm is not None else None
        self._staged: Dict[str, str] = {}

    @property
    def kind(self) -> str:
        return self.instances.name

    @property
    def accel(self) -> Optional[str]:
        """VM instances: the accelerator they run under (kvm or tcg)."""
        if self.state is None:
            return None
        return vm_instance.guest_accel(self.state)

    def describe(self) -> Dict:
        t = self.topo
        d = {"name": self.name, "servers": t.servers,
             "instances_per_server": t.instances_per_server,
             "vcpus": t.vcpus, "host_cpus": len(t.host_cpus),
             "uplink_rate": self.uplink_rate, "instance_kind": self.kind}
        if self.vm is not None:
            d.update(accel=self.accel, vm_memory_mb=self.vm.memory_mb)
        if self.scheduler is not None:
            d["scheduler"] = "slurm"
        return d

    def __enter__(self) -> "ClusterSession":
        self.sd = state_dir(self.name)
        self._old_handlers = {s: signal.signal(s, _raise_interrupted)
                              for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            # up() rolls back by itself when it fails or is interrupted
            lifecycle.up(self.topo, self.sd, log=lambda line: None,
                         kind=self.instances, scheduler=self.scheduler)
            self.state = lifecycle.load_up(self.sd)
        except BaseException:
            self._restore()
            raise
        self.log.write(f"cluster '{self.name}' up: {self.topo.describe()}"
                       f"\n")
        return self

    def _restore(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}

    def __exit__(self, *exc) -> None:
        try:
            if self.keep:
                self.log.write(f"cluster '{self.name}' kept (remove it with "
                               f"`ivcloud cluster down --name {self.name}`)\n")
                return
            # a second Ctrl-C must not leave half a cluster: finish down
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                lifecycle.down(self.sd)
            finally:
                signal.signal(signal.SIGINT, old_int)
            self.log.write(f"cluster '{self.name}' down\n")
        finally:
            self._restore()

    def stage(self, program: os.PathLike) -> str:
        """The path by which the instances run host program `program`:
        itself for namespaces (they see the host's files); for guests a
        copy put into every guest's GUEST_PROGRAM_DIR once."""
        path = str(program)
        if self.vm is None:
            return path
        if path not in self._staged:
            for host in sorted(self.state["vms"]):
                dest = vm_instance.put_files(self.state, host, [Path(path)],
                                             GUEST_PROGRAM_DIR)[0]
            self._staged[path] = dest
        return self._staged[path]

    @property
    def guest_packages(self) -> List[str]:
        """VM instances: the packages their image has besides the guest
        package (file names)."""
        return self.instances.guest_packages()

    def _guests(self) -> List[str]:
        return sorted(self.state["vms"])

    def stage_dir(self, path: os.PathLike) -> None:
        """Make host directory `path` (an absolute path, with everything
        under it) exist at the same path in every instance, owned by the
        user jobs run as there (they write their output into it): for
        namespaces nothing to do (they see the host's files); guests get
        one archive of it, unpacked in place of what was there."""
        path = Path(path)
        if self.vm is None:
            return
        if not path.is_absolute() or not path.is_dir():
            raise ClusterFailure(f"{path} is not an absolute path of a "
                                 f"directory")
        with tempfile.TemporaryDirectory(prefix="ivcloud-stage-") as tmp:
            archive = Path(tmp) / f"{path.name}.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(path, arcname=path.name)
            parent = agent.quote([str(path.parent)])
            target = agent.quote([str(path)])

            def one(host: str) -> None:
                [copy] = vm_instance.put_files(self.state, host, [archive],
                                               GUEST_STAGING_DIR)
                q = agent.quote([copy])
                self._guest_shell(host, f"rm -rf {target} && mkdir -p "
                                        f"{parent} && tar -C {parent} "
                                        f"--no-same-owner -xf {q} && "
                                        f"rm -f {q} && chown -R "
                                        f"{vm_instance.MPI_USER}: {target}",
                                  120)
            self._each_guest(one)

    def run_everywhere(self, argv: Sequence[str],
                       env: Optional[Dict[str, str]] = None,
                       timeout: float = PREPARE_TIMEOUT_S) -> None:
        """Run a preparation command (e.g. meshing a case) once in every
        instance, as the user jobs run as there, with `env` added to a
        plain environment; for namespaces once on this host (they share
        its files). ClusterFailure with its last lines if it fails."""
        env = dict(env or {})
        if self.vm is None:
            full_env = {"PATH": "/usr/bin:/bin", **env}
            try:
                p = subprocess.run(list(argv), stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True,
                                   env=full_env, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ClusterFailure(f"{argv[0]}: {e}")
            if p.returncode != 0:
                tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
                raise ClusterFailure(f"{argv[0]} failed: {' '.join(tail)}")
            return
        cmd = ["runuser", "-u", vm_instance.MPI_USER, "--", "env"] + \
            [f"{k}={v}" for k, v in env.items()] + list(argv)
        # its output stays in the guest (the serial line is slow) unless
        # it fails
        log = f"/tmp/prepare-{uuid.uuid4().hex[:8]}.log"
        self._each_guest(lambda host: self._guest_shell(
            host, f"{agent.quote(cmd)} > {log} 2>&1; rc=$?; "
                  f"[ $rc = 0 ] || tail -n 3 {log}; rm -f {log}; exit $rc",
            timeout))

    def read_file(self, path: os.PathLike, remove: bool = False) -> str:
        """The text of file `path` in the first instance (where rank 0 of
        every placement here runs), removed after reading if `remove`;
        ClusterFailure if it is missing."""
        if self.vm is None:
            try:
                text = Path(path).read_text(errors="replace")
                if remove:
                    Path(path).unlink()
            except OSError as e:
                raise ClusterFailure(f"cannot read {path}: {e.strerror}")
            return text
        host = vm_instance.first_guest(self.state)
        q = agent.quote([str(path)])
        r = agent.run(vm_instance.guest(self.state, host),
                      f"cat {q}" + (f" && rm -f {q}" if remove else ""), 120)
        if not r.ok:
            raise ClusterFailure(f"cannot read {path} in {host}: "
                                 f"{r.output.strip()[-200:]}")
        return r.output

    def _guest_shell(self, host: str, command: str, timeout: float) -> None:
        r = agent.run(vm_instance.guest(self.state, host),
                                  command, timeout)
        if not r.ok:
            tail = " ".join(r.output.strip().splitlines()[-3:])
            raise ClusterFailure(f"in {host}: {tail or f'exit {r.status}'}")

    def _each_guest(self, fn) -> None:
        """fn(host) for every guest at once (each has its own agent)."""
        hosts = self._guests()
        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            for f in [pool.submit(fn, h) for h in hosts]:
                f.result()

    def mpirun(self, program: Sequence[str], np: int, transport: str,
               timeout: Optional[float] = None, stdout=None, stderr=None,
               placement: str = "block",
               rankfile: Optional[Sequence[str]] = None,
               extra_mca: Sequence[Tuple[str, str]] = (),
               shared_region: bool = False) -> int:
        """Run one job from the head node; its exit status, as
        ivcloud.mpi.run_command (the job is torn down and
        subprocess.TimeoutExpired raised at `timeout`; LaunchError if it
        cannot be launched). rankfile: its lines ("rank R=HOST slot=K"),
        else `placement`'s mapping. An ivshmem job gets regions of its
        own unless `shared_region` (ivcloud.cluster.jobs); a VM job
        always runs in the servers' standing regions."""
        if self.vm is not None:
            return self._mpirun_vm(program, np, transport, timeout, stdout,
                                   stderr, placement, rankfile, extra_mca)
        path = None
        if rankfile is not None:
            # in the state directory: the head node sees it (not /tmp)
            path = self.sd.dir / f"rankfile.{uuid.uuid4().hex[:8]}"
            path.write_text("\n".join(rankfile) + "\n")
        try:
            cmd = mpirun_command(self.state, self.sd, list(program), np,
                                 transport=transport, placement=placement,
                                 extra_mca=list(extra_mca), rankfile=path)
            full, env, _ = enter_command(self.state, "head", cmd)
            with jobs.regions_for(self.state, env, transport,
                                  shared_region):
                return mpi.run_command(full, timeout, env=env,
                                       stdout=stdout, stderr=stderr)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    def srun(self, args: Sequence[str], timeout: Optional[float] = None,
             stdout=None, stderr=None) -> int:
        """Run `srun ARGS` in the head node of a cluster brought up with
        `slurm`; its exit status, as mpirun's (torn down and
        subprocess.TimeoutExpired at `timeout`)."""
        full, env, _, _ = client_command(self.state, "srun", list(args))
        return mpi.run_command(full, timeout, env=env, stdout=stdout,
                               stderr=stderr)

    def _mpirun_vm(self, program, np, transport, timeout, stdout, stderr,
                   placement, rankfile, extra_mca) -> int:
        tag = uuid.uuid4().hex[:8]
        text = path = None
        if rankfile is not None:
            text = "\n".join(rankfile) + "\n"
            path = f"/tmp/rankfile.{tag}"
        # stderr apart from stdout, as for a namespace job: in a file of
        # the first guest, read when the job ended
        err = f"/tmp/mpirun-{tag}.err"
        cmd = vm_instance.mpirun_command(
            self.state, list(program), np, transport=transport,
            placement=placement, rankfile=path, stderr_path=err,
            extra_mca=list(extra_mca) + [("rmaps_base_oversubscribe", "1")])
        try:
            r = vm_instance.run_job(self.state, cmd, timeout,
                                    rankfile_text=text, rankfile=path)
        except TimeoutError:
            raise subprocess.TimeoutExpired(cmd, timeout)
        errors = vm_instance.take_file(self.state, err)
        for f, data in ((stdout or sys.stdout, r.output),
                        (stderr or sys.stderr, errors)):
            f.write(data)
            f.flush()
        return r.status


def floating_rankfile(hosts: Sequence[str], vcpus: int) -> List[str]:
    """Rankfile lines putting rank r on hosts[r], free to run on any of
    its instance's vCPUs. Open MPI binds a rankfile's rank to its slot
    even under --bind-to none, so slot=0 on every instance would pin the
    ranks of all instances to one host CPU; the whole range keeps them
    floating like `--bind-to none` placements do."""
    slots = "0" if vcpus == 1 else f"0-{vcpus - 1}"
    return [f"rank {r}={host} slot={slots}" for r, host in enumerate(hosts)]
