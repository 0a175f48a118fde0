"""The libfabric provider `ivshm` (native/provider): where its build is,
the variables it reads (FI_IVSHM_SOCKET, an ivshmem-server socket, or
FI_IVSHM_REGION, a region file or a guest device's BAR file) and the
line every process prints at exit with FI_IVSHM_REPORT=1
(docs/mpi.md, "Other MPIs"):

    fi_ivshm: pid P sent S received R delegated D
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict

from ..errors import MpiFlavorError
from ..native import native_dir

NAME = "ivshm"
FILE = "libivshm-fi.so"
SOCKET_ENV = "FI_IVSHM_SOCKET"
REPORT_ENV = "FI_IVSHM_REPORT"
# a drain's deadline for the ranks in our guests (docs/migration.md,
# "Deadline"): a TCG guest takes seconds to finish a large message in
# flight, past the provider's own 5 s; within the 60 s the host waits
# for their acknowledgement (cluster/migrate.py, DRAIN_ACK_S)
DRAIN_ENV = "FI_IVSHM_DRAIN_MS"
GUEST_DRAIN_MS = 40000
# where the guest package installs it (packaging/mkdeb.sh): Debian's
# libfabric directory, which holds no other provider
INSTALLED = Path("/usr/lib/x86_64-linux-gnu/libfabric") / FILE

_REPORT_RE = re.compile(r"fi_ivshm: pid (\d+) sent (\d+) received (\d+) "
                        r"delegated (\d+)")


def library() -> Path:
    """The provider's build (<native build>/provider/libivshm-fi.so),
    absolute; MpiFlavorError if it was not built."""
    path = native_dir() / "provider" / FILE
    if not path.is_file():
        raise MpiFlavorError(f"the libfabric provider '{NAME}' is not built "
                             f"(no {path}; `make build` builds it)")
    return path.resolve()


def parse_reports(text: str) -> Dict[int, Dict[str, int]]:
    """The processes' exit lines in `text`: {pid: {sent, received,
    delegated}}. A process missing here printed none (it never opened
    the provider, or did not exit normally)."""
    out: Dict[int, Dict[str, int]] = {}
    for m in _REPORT_RE.finditer(text):
        pid, sent, received, delegated = (int(g) for g in m.groups())
        out[pid] = {"sent": sent, "received": received,
                    "delegated": delegated}
    return out
