"""The cluster's state directory and its state file (docs/cluster.md
lists the files). state.json holds everything `up` created, rewritten
atomically after every step, so `down` finds it all even when `up` was
killed halfway. Creating the directory is the lock: a second `up` of the
same name fails on mkdir, and the directory only goes away when `down`
removed the rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ..errors import ClusterError
from ..server import below, run_root

STATE_VERSION = 1


@dataclass(frozen=True)
class StateDir:
    name: str
    run_dir: Path

    @property
    def dir(self) -> Path:
        return self.run_dir / f"cluster-{self.name}"

    state = below("dir", "state.json")
    hosts = below("dir", "hosts")
    agent = below("dir", "agent")
    servers = below("dir", "servers")   # ivcloud.server's run dir

    @classmethod
    def of(cls, path: Path) -> "StateDir":
        """The StateDir whose `dir` is `path`."""
        return cls(path.name[len("cluster-"):], path.parent)


def state_dir(name: str, run_dir: Optional[str] = None) -> StateDir:
    return StateDir(name, run_root(run_dir))


def save(sd: StateDir, state: Dict) -> None:
    """Replace state.json atomically (a reader, or `down` after a SIGKILL,
    sees the old or the new file, never half of one)."""
    state["version"] = STATE_VERSION
    tmp = sd.dir / f".state.json.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, sd.state)


def load(sd: StateDir) -> Optional[Dict]:
    """The state, or None when there is no state file (no cluster, or an
    `up` killed before its first save)."""
    try:
        text = sd.state.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ClusterError(f"cannot read {sd.state}: {e.strerror}")
    try:
        state = json.loads(text)
    except ValueError:
        raise ClusterError(f"{sd.state} is not valid JSON (remove "
                           f"{sd.dir} by hand after checking what runs)")
    if state.get("version") != STATE_VERSION:
        raise ClusterError(f"{sd.state}: unknown state version "
                           f"{state.get('version')!r}")
    return state
