"""`ivcloud mpirun`: the command line of :mod:`ivcloud.mpis.local`."""

from __future__ import annotations

import shlex
import sys

from ..mpis.local import TRANSPORTS, planned_command, run
from . import add_job_arguments, job_program


def register(sub) -> None:
    p = sub.add_parser(
        "mpirun", help="run an MPI program over ivshmem (Open MPI)",
        description="Run an unmodified MPI program with Open MPI, its "
                    "ranks talking through the ivshmem BTL. Without "
                    "--region/--socket (and without $IVSHM_REGION / "
                    "$IVSHM_SOCKET) a private region is formatted in "
                    "/dev/shm for the job and removed afterwards. Exit "
                    "status: mpirun's.",
        usage="ivcloud mpirun [options] -np N -- PROGRAM [ARGS...]")
    p.add_argument("--transport", choices=TRANSPORTS, default="ivshmem",
                   help="ivshmem (default; tcp as fallback), or the stock "
                        "tcp / vader BTLs for comparison")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--region", metavar="PATH",
                       help="an already formatted region file")
    where.add_argument("--socket", metavar="SOCK",
                       help="an ivshmem-server socket (`ivcloud server`)")
    p.add_argument("--verbose-btl", action="store_true",
                   help="each rank prints its ivshmem traffic counters at "
                        "finalize")
    p.add_argument("--no-tcp-fallback", action="store_true",
                   help="BTL list self,ivshmem only: fail rather than use "
                        "tcp for ranks the region cannot connect")
    add_job_arguments(p, "extra MCA parameter passed to mpirun "
                         "(repeatable)")
    p.set_defaults(func=main)


def main(args) -> int:
    program = job_program(args, "ivcloud mpirun -np N -- PROGRAM [ARGS...]")
    kwargs = dict(transport=args.transport, region=args.region,
                  socket=args.socket, verbose_btl=args.verbose_btl,
                  tcp_fallback=not args.no_tcp_fallback,
                  extra_mca=[tuple(kv) for kv in args.mca])
    if args.dry_run:
        cmd, private = planned_command(program, args.np, **kwargs)
        print(shlex.join(cmd))
        if private:
            print(f"# {private} would be formatted for the job and removed "
                  f"afterwards", file=sys.stderr)
        return 0
    return run(program, args.np, **kwargs)
