"""`ivcloud cluster up|status|mpirun|srun|sbatch|exec|put|migrate|down`:
argument parsing and output; the work is in ivcloud.cluster: lifecycle
(up/down/status), kinds (the instances), job (the job pipeline) and
slurm (its daemons and commands)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .. import mpis
from ..cluster import kinds, lifecycle, migrate, vm_instance
from ..cluster.job import (Job, check_job, describe_job, plan_job, run_job,
                           run_slurm)
from ..cluster.launch import PLACEMENTS
from ..cluster.slurm.conf import hosts_of_rankfile
from ..cluster.slurm.daemons import SCHEDULERS, Slurm, SlurmOptions
from ..cluster.state import state_dir
from ..cluster.topology import DEFAULT_NAME, check_name, format_rate, plan
from ..server import format_size
from . import (CliError, action, add_job_arguments, add_run_dir,
               add_vm_arguments, job_program, positive_int, remainder,
               sub_actions, vm_options)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME,
                   help=f"cluster name (default {DEFAULT_NAME})")
    add_run_dir(p, "parent of the cluster's state directory")


def _sd(args):
    return state_dir(check_name(args.name), args.run_dir)


def register(sub) -> None:
    p = sub.add_parser(
        "cluster", help="emulate a cluster of VMs with namespaces",
        description="Emulate servers hosting VM-like instances (network, "
                    "UTS, IPC and mount namespaces with private /tmp and "
                    "/dev/shm, pinned to vCPUs), one ivshmem-server per "
                    "server, and run Open MPI jobs across them.")
    actions = sub_actions(p)

    u = action(actions, "up", _cmd_up, _common, help="create a cluster")
    u.add_argument("--servers", type=int, required=True, metavar="S")
    u.add_argument("--instances-per-server", type=int, required=True,
                   metavar="I")
    u.add_argument("--vcpus", type=int, default=1, metavar="V",
                   help="host CPUs per instance (affinity; default 1)")
    u.add_argument("--uplink-rate", default=None, metavar="RATE",
                   help="limit each server's uplink, both ways (tbf), "
                        "e.g. 1gbit, 100mbit")
    u.add_argument("--oversubscribe", action="store_true",
                   help="allow more vCPUs in total than host CPUs")
    add_vm_arguments(u, "namespace (default): namespaces pinned to vCPUs; "
                        "vm: a QEMU guest per instance (Debian image with "
                        "the guest package), its NIC on a tap in the "
                        "server's bridge, its ivshmem device on the "
                        "server's region, vCPU threads pinned",
                     vm_instance.DEFAULT_MEMORY_MB)
    u.add_argument("--scheduler", choices=SCHEDULERS, default="none",
                   help="slurm: munge and slurmctld on the head node, "
                        "slurmd in every instance, jobs through `cluster "
                        "srun|sbatch` (namespace instances)")
    u.add_argument("--slurm-time-slice", type=positive_int, default=None,
                   metavar="SEC",
                   help="slurm: gang scheduling, two jobs per vCPU taking "
                        "turns every SEC seconds (5..65533)")

    action(actions, "down", _cmd_down, _common,
           help="remove a cluster (also a half-built one)")

    s = action(actions, "status", _cmd_status, _common,
               help="servers, instances, peers")
    s.add_argument("--json", action="store_true", help="print JSON")

    m = action(
        actions, "mpirun", _cmd_mpirun, _common,
        help="run an MPI job across the instances",
        usage="ivcloud cluster mpirun [options] -np N -- PROGRAM [ARGS...]",
        description="Run PROGRAM with an MPI's own launcher on the "
                    "cluster's instances (the launcher runs on the head "
                    "node; ranks start through the cluster's launch "
                    "agent). The program must be on a path the instances "
                    "see (not under /tmp or /dev/shm). Exit status: the "
                    "launcher's.")
    m.add_argument("--mpi", default=mpis.DEFAULT, metavar="NAME",
                   help=mpis.choices() + "; the PyPI MPIs are the "
                        "wheels `make build` installs")
    m.add_argument("--transport", choices=mpis.ACROSS_INSTANCES,
                   default="tcp",
                   help="between instances: tcp (default) or ivshmem "
                        "(same-server instances; tcp across servers); "
                        "for openmpi5, mpich and impi libfabric's tcp "
                        "provider or our ivshm provider")
    m.add_argument("--placement", choices=PLACEMENTS, default="block",
                   help="block: fill instance by instance; round-robin: "
                        "spread consecutive ranks across servers")
    m.add_argument("--rankfile", default=None, metavar="FILE",
                   help="place ranks by an Open MPI rankfile (e.g. from "
                        "`ivcloud place --cluster NAME`) instead of "
                        "--placement")
    m.add_argument("--btl", default=None,
                   help="openmpi: override the BTL list (default "
                        "self,vader,tcp or self,vader,ivshmem,tcp)")
    m.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than the instances' vCPUs")
    m.add_argument("--shared-region", action="store_true",
                   help="run in each server's standing region, shared with "
                        "the other jobs that ask for it (one tenant's jobs); "
                        "by default an ivshmem job gets regions of its own "
                        "(not on a VM cluster: its jobs always share the "
                        "standing regions, and say so unless given this)")
    m.add_argument("--report-transport", "--verbose-btl",
                   dest="report_transport", action="store_true",
                   help="ivshmem: every rank prints one line at its end "
                        "(openmpi: its BTL counters, 'btl_ivshmem: rank "
                        "R ...'; the others: 'fi_ivshm: pid P sent S "
                        "received R delegated D')")
    m.add_argument("--timeout", type=float, default=None, metavar="SEC",
                   help="tear the job down after SEC seconds (exit 124)")
    add_job_arguments(m, "openmpi: extra MCA parameter")

    for command, what in (("srun", "run a job step (srun)"),
                          ("sbatch", "submit a batch job (sbatch)")):
        j = action(
            actions, command, _cmd_slurm, _common,
            help=f"{what} on a cluster's Slurm",
            usage=f"ivcloud cluster {command} [--name NAME] [--mpi NAME] "
                  f"[--rankfile FILE] [--report-transport] -- "
                  f"{command.upper()}_ARGS...",
            description=f"Run Slurm's {command} in the head node with the "
                        f"cluster's SLURM_CONF (`cluster exec head -- "
                        f"{command} ...` works too). Every job gets a "
                        f"region of its own on each server it uses; Open "
                        f"MPI ranks started by srun (--mpi=pmix, the "
                        f"default) use it between instances of a server "
                        f"and TCP across. Exit status: {command}'s.")
        j.add_argument("--rankfile", default=None, metavar="FILE",
                       help="place task R on the rankfile's host of rank R "
                            "(Slurm's arbitrary distribution; e.g. from "
                            "`ivcloud place --cluster NAME`)")
        j.add_argument("--mpi", default=None, metavar="NAME",
                       help="the tasks are ranks of this MPI over the "
                            "job's region: its variables (those of "
                            "`cluster mpirun --mpi NAME --transport "
                            "ivshmem`) and its PMI plugin (srun's --mpi: "
                            "pmi2 for mpich and impi, pmix for openmpi "
                            "and openmpi5), which the job's own override; "
                            "default: the task prolog's, for openmpi and "
                            "mpich")
        j.add_argument("--report-transport", action="store_true",
                       help="every rank prints one line at its end, as "
                            "with `cluster mpirun --report-transport` (the "
                            "tasks get the variables through Slurm's "
                            "--export=ALL, its default)")
        j.add_argument("args", nargs=argparse.REMAINDER)
        j.set_defaults(command=command)

    e = action(
        actions, "exec", _cmd_exec, _common,
        help="run a command inside an instance",
        usage="ivcloud cluster exec [--name NAME] HOST -- COMMAND [ARGS...]")
    e.add_argument("host", help="instance hostname (e.g. s0i1) or head")
    e.add_argument("command", nargs=argparse.REMAINDER)

    c = action(
        actions, "put", _cmd_put, _common,
        help="copy files into the instances (VM instances)",
        usage="ivcloud cluster put [--name NAME] [--host HOST]... "
              "FILE... DIR",
        description="Copy host files into DIR (an absolute path, made if "
                    "missing) of every guest of a VM cluster, or of the "
                    "--host ones, through the guests' command agents; "
                    "e.g. the MPI programs `cluster mpirun` is to run. "
                    "Files keep their names and permission bits and "
                    "become readable to every user.")
    c.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a guest to copy into (repeatable; default all)")
    c.add_argument("paths", nargs="+", metavar="FILE... DIR")

    g = action(
        actions, "migrate", _cmd_migrate, _common,
        help="move a QEMU guest to another server, live",
        usage="ivcloud cluster migrate [--name NAME] INSTANCE --to SERVER",
        description="Live-migrate instance INSTANCE of a VM cluster to "
                    "emulated server SERVER: its ivshmem device is "
                    "unplugged, QEMU moves the guest to a new QEMU process "
                    "with its tap in SERVER's bridge (same address), and "
                    "a device on SERVER's region is plugged in. Progress "
                    "on stderr; a failed step is undone. A running Slurm "
                    "job's device moves to a region of the job's own on "
                    "SERVER. Refused while ranks of an Open MPI job over "
                    "the ivshmem BTL (a Slurm job's too), or a Slurm job "
                    "not running, are in the guest (docs/cluster.md, "
                    "\"Migration\").")
    g.add_argument("instance", help="instance hostname (e.g. s1i0)")
    g.add_argument("--to", required=True, metavar="SERVER",
                   help="the destination server: its index, sN or its name")
    g.add_argument("--wait-jobs", type=float, nargs="?", const=3600.0,
                   default=None, metavar="SEC",
                   help="wait for BTL jobs, and Slurm jobs that cannot "
                        "move, in the guest to end "
                        "(at most SEC seconds, default 3600) instead of "
                        "refusing")


# ---------------------------------------------------------------- actions

def _cmd_up(args) -> int:
    topo = plan(args.name, args.servers, args.instances_per_server,
                args.vcpus, args.uplink_rate, args.oversubscribe)
    sd = state_dir(topo.name, args.run_dir)
    kind = kinds.choose(topo, vm_options(args, vm_instance.DEFAULT_MEMORY_MB))
    scheduler = None
    if args.scheduler == "slurm":
        scheduler = Slurm(SlurmOptions(
            time_slice_s=args.slurm_time_slice or 0))
    elif args.slurm_time_slice is not None:
        raise CliError("--slurm-time-slice needs --scheduler slurm")
    lifecycle.up(topo, sd, log=lambda line: print(line, flush=True),
                 kind=kind, scheduler=scheduler)
    print(f"cluster '{topo.name}' is up (state {sd.state})")
    return 0


def _cmd_down(args) -> int:
    sd = _sd(args)
    lifecycle.down(sd)
    print(f"cluster '{sd.name}' is down")
    return 0


def _cmd_status(args) -> int:
    info = lifecycle.status(_sd(args))
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0 if info["healthy"] else 1
    rate = info["uplink_rate_bps"]
    print(f"cluster '{info['name']}': {info['phase']}"
          f"{'' if info['healthy'] else ' (DEGRADED)'}; "
          f"{info['servers_count']} servers x {info['instances_per_server']}"
          f" {info['kind_title']}"
          f" x {info['vcpus']} vCPUs; uplinks "
          f"{format_rate(rate) if rate else 'unlimited'}")
    head = info["head"]
    print(f"  head {head['address']} pid {head['pid']} "
          f"{'alive' if head['alive'] else 'DEAD'}")
    for srv in info["servers"]:
        print(f"  server s{srv['index']} ({srv['name']}): ivshmem-server "
              f"{'pid ' + str(srv['pid']) if srv['running'] else 'NOT RUNNING'}"
              f", region {format_size(srv['size'])}, "
              f"{len(srv['peers'])}/{srv['max_peers']} peers")
        for peer in srv["peers"]:
            fields = " ".join(f"{k}={v}" for k, v in peer.items())
            print(f"      peer {fields}")
        for inst in info["instances"]:
            if inst["server"] != srv["index"]:
                continue
            cpus = ",".join(map(str, inst.get("cpus",
                                              inst["planned_cpus"])))
            print(f"    {inst['hostname']:<8} {inst['address']:<15} "
                  f"pid {inst['pid']} "
                  f"{'alive' if inst['alive'] else 'DEAD'}  cpus {cpus}")
    sl = info.get("slurm")
    if sl:
        alive = [n for n, d in sl["daemons"].items() if d["alive"]]
        dead = [n for n, d in sl["daemons"].items() if not d["alive"]]
        nodes = " ".join(f"{n}={st}" for n, st in sorted(sl["nodes"].items()))
        print(f"  slurm ({sl['topology']} topology): {len(alive)} daemons "
              f"alive{'; DEAD: ' + ', '.join(dead) if dead else ''}; "
              f"nodes {nodes or 'unknown (slurmctld does not answer)'}")
        print(f"  SLURM_CONF={sl['conf']}")
    return 0 if info["healthy"] else 1


def _cmd_mpirun(args) -> int:
    program = job_program(args, "ivcloud cluster mpirun -np N -- PROGRAM "
                                "[ARGS...]")
    _refuse_options(args)
    options = [tuple(kv) for kv in args.mca]
    if args.btl is not None:
        options.append(("btl", args.btl))
    job = Job(program, args.np, mpi=args.mpi, transport=args.transport,
              placement=args.placement, rankfile=_rankfile_text(args),
              shared_region=args.shared_region, options=options,
              report=args.report_transport,
              oversubscribe=args.oversubscribe, timeout=args.timeout)
    check_job(job)
    state = lifecycle.load_up(_sd(args))
    if args.dry_run:
        first, *notes = describe_job(state, job)
        print(first)
        for line in notes:
            print(line, file=sys.stderr)
        return 0
    plan = plan_job(state, job)
    if plan.note:
        sys.stderr.write(f"ivcloud cluster: note: {plan.note}\n")
    return run_job(state, job, plan=plan)


def _refuse_options(args) -> None:
    """Options of an MPI's own that --mpi's MPI does not take."""
    for opt, value, takes in (("--btl", args.btl, "options_name"),
                              ("--mca", args.mca, "options_name"),
                              ("--rankfile", args.rankfile, "takes_rankfile")):
        if value and not getattr(mpis.flavor(args.mpi), takes):
            takers = [n for n in mpis.NAMES
                      if getattr(mpis.flavor(n), takes)]
            raise CliError(f"{opt} applies to --mpi {', '.join(takers)} "
                           f"only, not '{args.mpi}'")


def _rankfile_text(args) -> Optional[str]:
    """The text of --rankfile, read before anything starts, or None."""
    if args.rankfile is None:
        return None
    try:
        return open(args.rankfile).read()
    except OSError as e:
        raise CliError(f"rankfile {args.rankfile}: {e.strerror}")


def _cmd_slurm(args) -> int:
    """srun or sbatch in the head node."""
    argv = remainder(args.args)
    if not argv:
        raise CliError(f"no {args.command} arguments given (usage: ivcloud "
                       f"cluster {args.command} -- ARGS...)")
    state = lifecycle.load_up(_sd(args))
    hosts = None
    if args.rankfile is not None:
        hosts = hosts_of_rankfile(_rankfile_text(args),
                                  sorted(state["instances"]))
    return run_slurm(state, args.command, argv, hosts,
                     report=args.report_transport, mpi=args.mpi)


def _cmd_put(args) -> int:
    if len(args.paths) < 2:
        raise CliError("give the files and then the directory in the guests")
    *files, dest = args.paths
    state = lifecycle.load_up(_sd(args))
    for copy in kinds.of_state(state).put(state, args.host, files, dest):
        print(copy)
    return 0


def _cmd_exec(args) -> int:
    state = lifecycle.load_up(_sd(args))
    return kinds.of_state(state).exec(state, args.host,
                                      remainder(args.command))


def _cmd_migrate(args) -> int:
    state = lifecycle.load_up(_sd(args))
    report = kinds.of_state(state).migrate(
        _sd(args), state, args.instance, args.to, args.wait_jobs,
        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(migrate.describe(report))
    return 0
