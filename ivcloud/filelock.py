"""A lock on a file, waited for up to a deadline: the one way the library
keeps two of its processes out of each other's way over something on
disk (an image cache entry being built, a guest's root ports being
handed out, a guest's agent kept quiet while its QEMU unplugs a device).

flock(2) locks go with the open file, so a holder killed with -9 lets
go at once; the file itself stays, empty, for the next holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from pathlib import Path
from typing import Callable, Iterator

POLL_S = 0.1


@contextlib.contextmanager
def held(path: Path, timeout: float,
         stuck: Callable[[], Exception], shared: bool = False
         ) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the
    block, or with `shared` one that only an exclusive holder keeps out.
    Waits at most `timeout` seconds for a holder in the way to let go,
    then raises stuck(), the caller's own domain error."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise stuck()
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
