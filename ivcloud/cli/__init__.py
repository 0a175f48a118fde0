"""`ivcloud` command line: a dispatcher to one module per area.

Each area module exposes ``register(subparsers)``: it adds its subcommand
(with its own sub-actions) and sets ``func`` on the parsed namespace. A
function returns the exit code; bad input is reported by raising
:class:`CliError`, which becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


class CliError(Exception):
    """Bad input or a refused request: one line on stderr, exit 2."""

    exit_code = 2


def int_at_least(minimum: int):
    """argparse type of count options: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer")
        if value < minimum:
            kind = "a positive integer, " if minimum > 0 else ""
            raise argparse.ArgumentTypeError(
                f"must be {kind}at least {minimum}, not {value}")
        return value
    return parse


positive_int = int_at_least(1)


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are a single line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        message = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _areas():
    # Imported here so that `ivcloud --help` works even if one area's
    # optional dependencies are missing, and new areas are one line.
    from .. import bench, cluster, isolate, mpi, place, server, vm
    from . import mag
    from .. import libvirt as libvirt_area
    return [server, bench, mpi, place, cluster, mag, vm, libvirt_area,
            isolate]


def build_parser() -> Parser:
    parser = Parser(prog="ivcloud",
                    description="ivcloud: shared-memory channels for VMs "
                                "and processes")
    sub = parser.add_subparsers(dest="area", metavar="COMMAND",
                                parser_class=Parser)
    sub.required = True
    for area in _areas():
        area.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # an area given without its action, e.g. `ivcloud server`
        parser.error(f"'{args.area}' needs an action (see ivcloud "
                     f"{args.area} --help)")
    try:
        return int(func(args) or 0)
    except CliError as e:
        sys.stderr.write(f"ivcloud {args.area}: error: "
                         f"{' '.join(str(e).split())}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("ivcloud: interrupted\n")
        return 130


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
