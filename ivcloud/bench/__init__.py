"""`ivcloud bench ...`: benchmarks. Each benchmark is a module with
``add_arguments(parser)`` and ``run(args) -> exit code``."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from . import halo, hierarchy, mpi, p2p

    p = sub.add_parser("bench", help="run benchmarks",
                       description="Benchmarks of libivshm against "
                                   "reference transports.")
    actions = p.add_subparsers(dest="action", metavar="BENCHMARK",
                               parser_class=type(p))
    actions.required = True
    b = actions.add_parser("p2p", help=p2p.__doc__.splitlines()[0],
                           description=p2p.__doc__)
    p2p.add_arguments(b)
    b.set_defaults(func=p2p.run)
    b = actions.add_parser("mpi", help=mpi.__doc__.splitlines()[0],
                           description=mpi.__doc__)
    mpi.add_arguments(b)
    b.set_defaults(func=mpi.run)
    # their descriptions are laid out lists: keep the line breaks
    for name, mod in (("hierarchy", hierarchy), ("halo", halo)):
        b = actions.add_parser(
            name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(b)
        b.set_defaults(func=mod.run)
