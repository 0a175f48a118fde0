"""`ivcloud <command>` builds its parser with the command's own area only
(ivcloud.cli.COMMANDS): the map must name every command an area
registers, and a process started for one command must not import the
others' libraries."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

from ivcloud import cli


def _registered(module_name: str):
    module = importlib.import_module(f"ivcloud.cli.{module_name}")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="area")
    module.register(sub)
    return set(sub.choices)


def test_command_map_matches_the_areas():
    seen = {}
    for name in cli.AREAS:
        for command in _registered(name):
            seen[command] = name
    assert seen == cli.COMMANDS


def test_full_and_narrow_parsers_agree():
    full = cli.build_parser([])
    for command, area in cli.COMMANDS.items():
        narrow = cli.build_parser([command, "--help"])
        sub = next(a for a in narrow._actions
                   if isinstance(a, argparse._SubParsersAction))
        full_sub = next(a for a in full._actions
                        if isinstance(a, argparse._SubParsersAction))
        assert command in sub.choices
        assert (sub.choices[command].format_help()
                == full_sub.choices[command].format_help())


def test_mag_process_imports_no_other_area():
    code = ("import sys\n"
            "from ivcloud.cli import main\n"
            "main(['mag', 'check', sys.argv[1]])\n"
            "bad = [m for m in sys.modules if m.startswith(("
            "'ivcloud.bench', 'ivcloud.cluster', 'ivcloud.vm', "
            "'ivcloud.cli.bench', 'ivcloud.cli.cluster', 'matplotlib'))]\n"
            "assert not bad, bad\n")
    example = Path(__file__).resolve().parents[1] / "examples" / "bar.toml"
    proc = subprocess.run([sys.executable, "-c", code, str(example)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[mesh]" in proc.stdout


def test_unknown_command_lists_all():
    proc = subprocess.run([sys.executable, "-m", "ivcloud", "nosuch"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "'mag'" in proc.stderr and "'mpirun'" in proc.stderr
