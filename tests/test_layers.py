"""The package's layers, read from its imports: every import points
down, and no modules import each other in a circle.

LAYERS lists the library's parts from the bottom up, one row a layer
(docs/ARCHITECTURE.md shows the same table). A module belongs to the
longest entry that names it or a package above it; it may import
modules of its own layer and of the layers below, never above, and the
modules' imports form no cycle (a cycle is reported with its members).
The command line is the top layer and nothing else imports it.

The solver, micromag, is its own package and imports nothing of ivcloud.
Static: the test reads the source (ast), so an import hidden inside a
function, or under TYPE_CHECKING, counts as well.

The command line only parses, calls and maps errors: a CLI module
imports nothing that runs or waits for processes, signals or time
(THIN_CLI_FORBIDS), and none of its functions has more than
THIN_CLI_STATEMENTS statements (its `register`, which only declares
arguments, aside).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent

# From the bottom up; see docs/ARCHITECTURE.md, "Layers".
LAYERS: List[Tuple[str, List[str]]] = [
    ("errors", ["ivcloud.errors"]),
    ("binding", ["ivcloud.native", "ivcloud.procfs", "ivcloud.filelock"]),
    ("processes", ["ivcloud.process", "ivcloud.server"]),
    ("MPIs", ["ivcloud.mpis"]),
    ("hosts", ["ivcloud.vm", "ivcloud.netns", "ivcloud.libvirt"]),
    ("isolation", ["ivcloud.isolate"]),
    ("cluster records", ["ivcloud.cluster.topology", "ivcloud.cluster.state",
                         "ivcloud.cluster.holder", "ivcloud.cluster.regions",
                         "ivcloud.cluster", "ivcloud.cluster.slurm"]),
    ("cluster network", ["ivcloud.cluster.network", "ivcloud.cluster.launch",
                         "ivcloud.cluster.slurm.conf"]),
    ("guests", ["ivcloud.cluster.vm_instance"]),
    ("Slurm nodes", ["ivcloud.cluster.slurm.nodes"]),
    ("Slurm in guests", ["ivcloud.cluster.slurm.guest_regions",
                         "ivcloud.cluster.slurm.moves",
                         "ivcloud.cluster.slurm.guests"]),
    ("guest migration", ["ivcloud.cluster.migrate"]),
    ("instance kinds", ["ivcloud.cluster.kinds"]),
    ("Slurm", ["ivcloud.cluster.slurm.client", "ivcloud.cluster.slurm.hooks",
               "ivcloud.cluster.slurm.daemons"]),
    ("job pipeline", ["ivcloud.cluster.job"]),
    ("cluster lifecycle", ["ivcloud.cluster.lifecycle"]),
    ("sessions", ["ivcloud.cluster.session"]),
    ("placement", ["ivcloud.place"]),
    ("workloads", ["ivcloud.apps"]),
    ("benchmarks", ["ivcloud.bench"]),
    ("command line", ["ivcloud.cli", "ivcloud.__main__"]),
]
LEVEL: Dict[str, int] = {m: i for i, (_, mods) in enumerate(LAYERS)
                         for m in mods}
CLI_LEVEL = LEVEL["ivcloud.cli"]
THIN_CLI_FORBIDS = {"subprocess", "signal", "threading", "time", "socket",
                    "shutil", "tempfile", "multiprocessing", "concurrent"}
THIN_CLI_STATEMENTS = 30


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _area(module: str) -> str:
    """The LAYERS entry a module belongs to (longest matching prefix)."""
    best = ""
    for key in LEVEL:
        if (module == key or module.startswith(key + ".")) and \
                len(key) > len(best):
            best = key
    return best


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (REPO / rel).with_suffix(".py").is_file() or \
        (REPO / rel / "__init__.py").is_file()


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, absolute module) of every import in a source file; `from P
    import name` counts as P.name where that is a module, else as P."""
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
            plain = False
            for alias in node.names:
                if _is_module(f"{target}.{alias.name}"):
                    yield node.lineno, f"{target}.{alias.name}"
                else:
                    plain = True
            if plain:
                yield node.lineno, target


def _sources(package: str):
    return sorted((REPO / package).rglob("*.py"))


def _graph() -> Dict[str, Set[str]]:
    """{module: the ivcloud modules it imports}."""
    modules = {_module_name(p) for p in _sources("ivcloud")}
    graph: Dict[str, Set[str]] = defaultdict(set)
    for path in _sources("ivcloud"):
        module = _module_name(path)
        for _, target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and target != "ivcloud":
                graph[module].add(target)
    return graph


def test_every_ivcloud_module_has_a_layer():
    missing = [_module_name(p) for p in _sources("ivcloud")
               if _module_name(p) != "ivcloud" and not _area(_module_name(p))]
    assert not missing, f"modules outside the layer map: {missing}"


def test_the_table_is_the_one_the_architecture_shows():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("\n## Layers\n", 1)[-1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")
            and "`ivcloud" in line]
    shown = [[m.strip("` ") for m in row.split("|")[2].split(",")]
             for row in rows]
    assert shown == [mods for _, mods in LAYERS][::-1], \
        "docs/ARCHITECTURE.md, \"Layers\", differs from LAYERS"


def test_imports_point_only_down():
    wrong = []
    for path in _sources("ivcloud"):
        module = _module_name(path)
        area = _area(module)
        if not area:
            continue
        for line, target in _imports(path):
            other = _area(target)
            if not target.startswith("ivcloud") or not other:
                continue
            if LEVEL[other] > LEVEL[area]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {module} "
                             f"({LAYERS[LEVEL[area]][0]}) imports {target} "
                             f"({LAYERS[LEVEL[other]][0]})")
    assert not wrong, "imports pointing up:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(v: str) -> None:        # Tarjan's strongly connected parts
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "modules importing each other in a circle: " + \
        "; ".join(" <-> ".join(c) for c in cycles)


def test_only_the_command_line_imports_the_cli():
    wrong = [f"{p.relative_to(REPO)}:{line}"
             for p in _sources("ivcloud")
             if LEVEL.get(_area(_module_name(p))) != CLI_LEVEL
             for line, target in _imports(p)
             if target == "ivcloud.cli" or target.startswith("ivcloud.cli.")]
    assert not wrong, f"library modules importing the CLI: {wrong}"


def test_the_command_line_only_parses_calls_and_maps():
    wrong = []
    for path in _sources("ivcloud/cli"):
        rel = path.relative_to(REPO)
        for line, target in _imports(path):
            if target.split(".")[0] in THIN_CLI_FORBIDS:
                wrong.append(f"{rel}:{line}: imports {target}")
        tree = ast.parse(path.read_text(), str(path))
        for f in ast.walk(tree):
            if not isinstance(f, ast.FunctionDef) or f.name == "register":
                continue
            n = sum(isinstance(x, ast.stmt) for x in ast.walk(f)) - 1
            if n > THIN_CLI_STATEMENTS:
                wrong.append(f"{rel}:{f.lineno}: {f.name} has {n} "
                             f"statements")
    assert not wrong, "logic in the command line:\n" + "\n".join(wrong)


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
        if LEVEL.get(_area(_module_name(path))) == CLI_LEVEL:
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
