"""`ivcloud` command line: the top layer, a dispatcher to one module
per area (``ivcloud/cli/<area>.py``), whose ``register(subparsers)``
adds its command and sets ``func``, which returns the exit status. Only
here do the library's domain errors become one line on stderr and an
exit status (:func:`main`). Nothing below this package imports it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, TypeVar

from ..errors import IvcloudError, OperationFailed


class CliError(Exception):
    """Bad command-line input found by the CLI itself: one line, exit 2."""


T = TypeVar("T")


def number(convert: Callable[[str], T], bad: str,
           check: Callable[[T], Optional[str]] = lambda value: None
           ) -> Callable[[str], T]:
    """argparse type of a number option: `convert` of the text; `bad`
    when it does not convert, and check(value) when that says what is
    wrong (both formats of the text)."""
    def parse(text: str) -> T:
        try:
            value = convert(text)
        except (ValueError, ArithmeticError):
            raise argparse.ArgumentTypeError(bad.format(text))
        why = check(value)
        if why:
            raise argparse.ArgumentTypeError(why.format(text))
        return value
    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type of count options: an integer >= minimum."""
    kind = "a positive integer, " if minimum > 0 else ""
    return number(int, "'{}' is not an integer", lambda value: None
                  if value >= minimum else
                  f"must be {kind}at least {minimum}, not {value}")


positive_int = int_at_least(1)


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a library's parser or check: its message (a
    ValueError, an InvalidRequest) becomes the usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return convert


def comma_list(item: Callable[[str], T] = str,
               check: Optional[Callable] = None,
               what: str = "list") -> Callable[[str], List[T]]:
    """argparse type of a comma-separated list: each item parsed by
    `item`, the list checked by the library's `check`."""
    @checked
    def parse(text: str) -> List[T]:
        try:
            values = [item(t.strip()) for t in text.split(",") if t.strip()]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"bad {what} '{text}': {e}")
        return check(values) if check else values
    return parse


def remainder(items: List[str]) -> List[str]:
    """An argparse.REMAINDER without the `--` that ends the options."""
    return list(items[1:] if items[:1] == ["--"] else items)


def add_run_dir(p: argparse.ArgumentParser, what: str) -> None:
    """--run-dir: `what` lies below it (ivcloud.server.run_root)."""
    from ..server import DEFAULT_RUN_DIR
    p.add_argument("--run-dir", default=None,
                   help=f"{what} (default $IVCLOUD_RUN_DIR or "
                        f"{DEFAULT_RUN_DIR})")


def add_job_arguments(p: argparse.ArgumentParser, mca_help: str) -> None:
    """What `ivcloud mpirun` and `cluster mpirun` both take last: Open
    MPI's --mca, --dry-run, the ranks and the program."""
    p.add_argument("--mca", nargs=2, action="append", default=[],
                   metavar=("KEY", "VALUE"), help=mca_help)
    p.add_argument("--dry-run", action="store_true",
                   help="print the launcher's command instead of running it")
    p.add_argument("-np", "-n", "--np", dest="np", type=positive_int,
                   required=True, metavar="N", help="number of ranks")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="the MPI program and its arguments (after --)")


def job_program(args, usage: str) -> List[str]:
    """The program of add_job_arguments; bad input without one."""
    program = remainder(args.program)
    if not program:
        raise CliError(f"no program given (usage: {usage})")
    return program


def add_vm_arguments(p: argparse.ArgumentParser, kind_help: str,
                     default_memory_mb: int) -> None:
    """--instance-kind and the options of QEMU-guest instances (cluster
    up, the cluster benchmarks)."""
    p.add_argument("--instance-kind", choices=("namespace", "vm"),
                   default="namespace", help=kind_help)
    p.add_argument("--guest-deb", default=None, metavar="DEB",
                   help="vm: the ivcloud-guest package of the image "
                        "(default: the newest in build/deb)")
    p.add_argument("--vm-memory", type=positive_int,
                   default=default_memory_mb, metavar="MIB",
                   help=f"vm: memory per guest in MiB (default "
                        f"{default_memory_mb})")
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                   help="vm: QEMU accelerator (auto: KVM if a probe guest "
                        "boots with it, else TCG)")


def vm_options(args, default_memory_mb: int):
    """The VmOptions of --instance-kind vm, None for namespaces; VM
    options without it are bad input."""
    if args.instance_kind == "vm":
        from ..cluster.vm_instance import VmOptions
        return VmOptions(args.guest_deb, args.vm_memory, args.accel)
    if args.guest_deb or args.accel != "auto" or \
            args.vm_memory != default_memory_mb:
        raise CliError("--guest-deb, --vm-memory and --accel need "
                       "--instance-kind vm")
    return None


def sub_actions(p: argparse.ArgumentParser, metavar: str = "ACTION"):
    """A command's required actions, parsed as the command is."""
    actions = p.add_subparsers(dest="action", metavar=metavar,
                               parser_class=type(p))
    actions.required = True
    return actions


def action(actions, name: str, func: Callable[..., int], *options,
           **kw) -> argparse.ArgumentParser:
    """Action `name` of a command (sub_actions), run by func(args), with
    the options that each of `options` (functions of the parser) adds
    first: those its command's actions share."""
    p = actions.add_parser(name, **kw)
    for add in options:
        add(p)
    p.set_defaults(func=func)
    return p


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors are a single line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        message = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


# command -> the area module that registers it, in the order of
# `ivcloud --help` (tests/test_cli_areas.py checks it against what the
# modules register)
COMMANDS = {"server": "server", "bench": "bench", "mpirun": "mpirun",
            "place": "place", "cluster": "cluster", "mag": "mag",
            "vm": "vm", "pin": "vm", "libvirt": "libvirt",
            "isolate": "isolate"}
AREAS = tuple(dict.fromkeys(COMMANDS.values()))


def _areas(command: Optional[str] = None):
    # Imported here so that `ivcloud --help` works even if one area's
    # optional dependencies are missing, and new areas are one line.
    import importlib
    names = (COMMANDS[command],) if command in COMMANDS else AREAS
    return [importlib.import_module(f".{name}", __name__) for name in names]


def build_parser(argv: Optional[List[str]] = None) -> Parser:
    """The parser; when `argv` starts with a command's name, with that
    command's area only: the others import their libraries (benchmarks,
    clusters, VMs), ~0.1 s of the start of every process, e.g. of each
    rank of `ivcloud mag run --np N` and of the process that launches
    them."""
    parser = Parser(prog="ivcloud",
                    description="ivcloud: shared-memory channels for VMs "
                                "and processes")
    sub = parser.add_subparsers(dest="area", metavar="COMMAND",
                                parser_class=Parser)
    sub.required = True
    for area in _areas(argv[0] if argv else None):
        area.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        # an area given without its action, e.g. `ivcloud server`
        parser.error(f"'{args.area}' needs an action (see ivcloud "
                     f"{args.area} --help)")
    try:
        return int(func(args) or 0)
    except (CliError, IvcloudError) as e:
        sys.stderr.write(f"ivcloud {args.area}: error: {message(e)}\n")
        return exit_code(e)
    except KeyboardInterrupt as e:
        # Ctrl-C, or SIGTERM/SIGHUP (ivcloud.process.Interrupted): the
        # work below has been torn down on the way out
        sys.stderr.write("ivcloud: interrupted\n")
        return 128 + getattr(e, "signum", 2)


def message(error: BaseException) -> str:
    """One line for an error; a library error that names the parameter at
    fault gets the command-line option of that name appended."""
    text = " ".join(str(error).split())
    setting = getattr(error, "setting", "")
    if setting:
        text += f" [--{setting.replace('_', '-')}]"
    return text


def exit_code(error: BaseException) -> int:
    """The exit status an error ends a command with."""
    status = getattr(error, "exit_status", None)
    if status is not None:
        return status
    return 1 if isinstance(error, OperationFailed) else 2


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
