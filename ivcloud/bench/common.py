"""What every benchmark's JSON document shares: the machine it ran on and
an all-or-nothing write."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, Optional


def machine_info(started: Optional[float] = None) -> Dict:
    return {"started": time.time() if started is None else started,
            "host": platform.node(), "cpus": os.cpu_count(),
            "kernel": platform.release()}


def write_doc(path: Path, doc: Dict) -> None:
    """Replace `path` whole (a reader never sees half a document)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
