"""OpenFOAM (Debian's `openfoam`): simpleFoam on the pitzDaily tutorial.

The case comes from openfoam-examples. We shorten it to a fixed number of
iterations, write no intermediate time steps, drop its streamline
function object, mesh it (blockMesh) and split it for N ranks with the
`simple` method (Debian's scotch decomposition is a stub). Debian's
OpenFOAM finds its configuration through WM_PROJECT_DIR / FOAM_ETC (its
bashrc calls a missing foamEtcFile), so every command gets those.
The result is simpleFoam's own final ExecutionTime (CPU seconds of
rank 0) and the wall time the caller measures.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import InvalidRequest, OperationFailed

TUTORIAL = Path("/usr/share/doc/openfoam-examples/examples/incompressible/"
                "simpleFoam/pitzDaily")
PROJECT_DIR = Path("/usr/share/openfoam")
ENV = {"WM_PROJECT_DIR": str(PROJECT_DIR),
       "FOAM_ETC": str(PROJECT_DIR / "etc")}
SOLVER = "simpleFoam"

_EXEC_RE = re.compile(r"^ExecutionTime = ([0-9.eE+-]+) s\s+ClockTime = "
                      r"([0-9.eE+-]+) s", re.M)


def split(ranks: int) -> Tuple[int, int]:
    """Subdomains along x and y for `simple` decomposition: the channel
    is long in x, so x gets the larger factor."""
    if ranks < 1:
        raise InvalidRequest(f"ranks must be at least 1, not {ranks}")
    y = 1
    for f in range(int(ranks ** 0.5), 0, -1):
        if ranks % f == 0:
            y = f
            break
    return ranks // y, y


def _set_entry(text: str, key: str, value: str) -> str:
    pattern = re.compile(rf"^{key}\s+[^;]*;", re.M)
    if not pattern.search(text):
        raise OperationFailed(f"controlDict has no '{key}' entry")
    return pattern.sub(f"{key} {value};", text, count=1)


def _run(cmd: List[str], case: Path, env: Dict[str, str]) -> None:
    log = case / f"log.{Path(cmd[0]).name}"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f,
                              stderr=subprocess.STDOUT, env=env,
                              timeout=600)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise OperationFailed(f"{cmd[0]} failed: {' '.join(tail)}")


def prepare(case: Path, ranks: int, iterations: int,
            base_env: Dict[str, str]) -> Path:
    """A fresh pitzDaily case in `case`, meshed and decomposed for
    `ranks` ranks; returns it."""
    for tool in ("blockMesh", "decomposePar", SOLVER):
        if shutil.which(tool) is None:
            raise OperationFailed(f"{tool} not found (apt-get install "
                                  f"openfoam)")
    write_case(case, ranks, iterations)
    env = dict(base_env, **ENV)
    for cmd in mesh_commands(case, ranks):
        _run(cmd, case, env)
    return case


def write_case(case: Path, ranks: int, iterations: int) -> Path:
    """A fresh pitzDaily case in `case`, shortened to `iterations` and
    set up to be split for `ranks` ranks, not yet meshed: its text files
    only (a few tens of KB), to be meshed where it runs
    (mesh_commands); returns it."""
    if iterations < 1:
        raise InvalidRequest(f"iterations must be at least 1, not "
                             f"{iterations}")
    if not (TUTORIAL / "system" / "controlDict").exists():
        raise OperationFailed(f"{TUTORIAL} missing (apt-get install "
                              f"openfoam openfoam-examples)")
    if case.exists():
        shutil.rmtree(case)
    shutil.copytree(TUTORIAL, case)
    control = case / "system" / "controlDict"
    text = control.read_text()
    text = _set_entry(text, "endTime", str(iterations))
    text = _set_entry(text, "writeInterval", str(iterations))
    text = re.sub(r"^\s*#includeFunc\s+streamlines\s*$", "", text,
                  flags=re.M)
    control.write_text(text)
    nx, ny = split(ranks)
    (case / "system" / "decomposeParDict").write_text(
        "FoamFile { version 2.0; format ascii; class dictionary; "
        "object decomposeParDict; }\n"
        f"numberOfSubdomains {ranks};\n"
        "method simple;\n"
        f"coeffs {{ n ({nx} {ny} 1); }}\n")
    return case


def mesh_commands(case: Path, ranks: int) -> List[List[str]]:
    """The commands (run with ENV) that mesh a written case and split it
    for `ranks` ranks, in order."""
    cmds = [["blockMesh"]]
    if ranks > 1:
        cmds.append(["decomposePar", "-force"])
    return [c + ["-case", str(case)] for c in cmds]


def command(case: Path, ranks: int) -> List[str]:
    """The solver's argv for `ranks` ranks, environment included (through
    env(1), so that any launcher passes it to every rank)."""
    argv = ["/usr/bin/env"] + [f"{k}={v}" for k, v in ENV.items()]
    argv += [shutil.which(SOLVER) or SOLVER, "-case", str(case)]
    return argv + (["-parallel"] if ranks > 1 else [])


def execution_time(log_text: str) -> float:
    """simpleFoam's last ExecutionTime (CPU seconds on rank 0)."""
    found = _EXEC_RE.findall(log_text)
    if not found:
        raise OperationFailed("no ExecutionTime in simpleFoam's output "
                              "(did it run?)")
    if "\nEnd\n" not in log_text and not log_text.rstrip().endswith("End"):
        raise OperationFailed("simpleFoam did not reach its End")
    return float(found[-1][0])
