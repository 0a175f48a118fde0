"""The package's layers, read from its imports: every import points down.

    command line      ivcloud.cli, ivcloud.__main__
    workloads, benchmarks  ivcloud.apps, ivcloud.bench
    library           server, mpi, mpis, netns, cluster, vm, place, libvirt,
                      isolate
    binding, errors   ivcloud.native, ivcloud.errors, ivcloud.procfs,
                      ivcloud.filelock

The solver, micromag, is its own package and imports nothing of ivcloud.
Static: the test reads the source (ast), so an import hidden inside a
function counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent

LAYERS = {
    "ivcloud.errors": 0,
    "ivcloud.native": 0,
    "ivcloud.procfs": 0,
    "ivcloud.filelock": 0,
    "ivcloud.server": 1, "ivcloud.mpi": 1, "ivcloud.mpis": 1,
    "ivcloud.netns": 1,
    "ivcloud.cluster": 1, "ivcloud.vm": 1, "ivcloud.place": 1,
    "ivcloud.libvirt": 1, "ivcloud.isolate": 1,
    "ivcloud.apps": 2, "ivcloud.bench": 2,
    "ivcloud.cli": 3, "ivcloud.__main__": 3,
}
NAMES = {0: "binding/errors", 1: "library", 2: "workloads/benchmarks",
         3: "command line"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _area(module: str) -> str:
    """The LAYERS key a module belongs to (longest matching prefix)."""
    best = ""
    for key in LAYERS:
        if (module == key or module.startswith(key + ".")) and \
                len(key) > len(best):
            best = key
    return best


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, absolute module) of every import in a source file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else \
        module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module
                                          else []))
            else:
                target = node.module or ""
            if node.module is None or node.level:
                # `from . import x`: each name may be a module
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}"
            yield node.lineno, target


def _sources(package: str):
    return sorted((REPO / package).rglob("*.py"))


def test_every_ivcloud_module_has_a_layer():
    missing = [_module_name(p) for p in _sources("ivcloud")
               if _module_name(p) != "ivcloud" and not _area(_module_name(p))]
    assert not missing, f"modules outside the layer map: {missing}"


def test_imports_point_only_down():
    wrong = []
    for path in _sources("ivcloud"):
        module = _module_name(path)
        area = _area(module)
        if not area:
            continue
        for line, target in _imports(path):
            if not target.startswith("ivcloud"):
                continue
            other = _area(target)
            if not other or other == area:
                continue
            if LAYERS[other] > LAYERS[area]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {module} "
                             f"({NAMES[LAYERS[area]]}) imports {target} "
                             f"({NAMES[LAYERS[other]]})")
    assert not wrong, "imports pointing up:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_cli():
    wrong = [f"{p.relative_to(REPO)}:{line}"
             for p in _sources("ivcloud")
             if LAYERS.get(_area(_module_name(p))) != 3
             for line, target in _imports(p)
             if target == "ivcloud.cli" or target.startswith("ivcloud.cli.")]
    assert not wrong, f"library modules importing the CLI: {wrong}"


def test_the_solver_imports_nothing_of_ivcloud():
    if not (REPO / "micromag").is_dir():
        pytest.fail("the solver package micromag/ is missing")
    wrong = [f"{p.relative_to(REPO)}:{line}: {target}"
             for p in _sources("micromag")
             for line, target in _imports(p)
             if target == "ivcloud" or target.startswith("ivcloud.")]
    assert not wrong, f"micromag importing ivcloud: {wrong}"


def test_library_errors_name_no_command_line_flags():
    # A message raised below the CLI is read by programs and benchmarks
    # too: it names the thing at fault, and the CLI adds its option.
    wrong = []
    for path in _sources("ivcloud"):
        if LAYERS.get(_area(_module_name(path))) == 3:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            for const in ast.walk(node.exc):
                if isinstance(const, ast.Constant) and \
                        isinstance(const.value, str) and \
                        _names_a_flag(const.value):
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: "
                                 f"{const.value!r}")
    assert not wrong, "library errors naming flags:\n" + "\n".join(wrong)


def _names_a_flag(text: str) -> bool:
    import re
    return re.search(r"(^|[\s(`'\"])--[a-z][a-z-]+", text) is not None
