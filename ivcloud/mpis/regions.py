"""Regions for MPI jobs: their geometry, and a private one per job.

An MPI job's region (its own, a server's standing one, or a private
file for `ivcloud mpirun` on this host alone) is shaped for the BTL's
fragments and the provider's messages: mpi_geometry. A job on one host
with no region named gets a private file, formatted for it and removed
afterwards: private_region.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

from ..errors import MpiError, MpiSetupError
from ..server import MAX_PEERS

MIB = 1 << 20
MAX_PEERS_LIMIT = MAX_PEERS   # ivshm_geometry.max_peers upper bound
PRIVATE_MIN_PEERS = 8         # room for a few ranks more than asked
PRIVATE_MIN_SIZE = 64 * MIB
PRIVATE_HEAP = 32 * MIB       # on top of the receive areas: windows, big messages
# Receive areas of MPI regions (one per rank, linear in ranks): a queue of
# MPI_QUEUE_SLOTS cells every sender appends to, and MPI_FAST_CHANNELS
# rings for the busiest senders, of the first of MPI_RING_SHAPES (slots,
# slot size) that fits the budget. A slot of 16 KiB + 64 holds one whole
# BTL fragment, delivered in place; 64 of them rather than 16 of 64 KiB
# keep more fragments in flight. Many ranks get shorter rings, from about
# 100 on 4 KiB slots (docs/mpi.md, "The exact mpirun settings").
MPI_RING_SHAPES = ((64, 16 * 1024 + 64), (32, 16 * 1024 + 64),
                   (16, 16 * 1024 + 64), (16, 4096))
MPI_QUEUE_SLOTS = 64
MPI_FAST_CHANNELS = 8
PRIVATE_RING_BUDGET = 300 * MIB


def mpi_geometry(max_peers: int) -> Dict[str, int]:
    """Geometry of an MPI region for `max_peers` peers (keyword arguments
    of format_region / min_region_size besides max_peers): the first
    ring shape whose receive areas fit PRIVATE_RING_BUDGET. The region grows
    linearly with max_peers, so beyond the budget (some hundreds of
    ranks) it keeps the smallest slot and grows past it."""
    from ..native import min_region_size
    geometry = {}
    for ring_slots, slot_size in MPI_RING_SHAPES:
        geometry = dict(ring_slots=ring_slots, slot_size=slot_size,
                        queue_slots=MPI_QUEUE_SLOTS,
                        fast_channels=MPI_FAST_CHANNELS)
        if min_region_size(max_peers, **geometry) <= PRIVATE_RING_BUDGET:
            break
    return geometry


def private_geometry(np: int) -> Tuple[int, int]:
    """(max_peers, size in bytes) of a private region for `np` ranks
    (receive areas shaped by mpi_geometry(max_peers))."""
    from ..native import min_region_size
    if np > MAX_PEERS_LIMIT:
        raise MpiError(f"a region holds at most {MAX_PEERS_LIMIT} ranks, "
                       f"not {np}")
    max_peers = max(PRIVATE_MIN_PEERS, np)
    need = min_region_size(max_peers, **mpi_geometry(max_peers)) + PRIVATE_HEAP
    size = max(PRIVATE_MIN_SIZE, (need + MIB - 1) // MIB * MIB)
    return max_peers, size


def private_region_path() -> Path:
    return Path("/dev/shm") / f"ivcloud-mpi-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def private_region(np: int, path: Optional[Path] = None) -> Iterator[Path]:
    """A freshly formatted region file for one job (mode 0600), removed
    when the block ends, also on an exception or KeyboardInterrupt."""
    from ..native import IvshmError, format_region
    max_peers, size = private_geometry(np)
    geometry = mpi_geometry(max_peers)
    path = Path(path) if path else private_region_path()
    try:
        # O_EXCL: never adopt (and later delete) somebody else's file
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        raise MpiSetupError(f"cannot create {path}: {e.strerror}")
    os.close(fd)
    try:
        try:
            format_region(path, size, max_peers=max_peers, mode=0o600,
                          **geometry)
        except (IvshmError, OSError) as e:
            raise MpiSetupError(f"cannot format {path}: {e}")
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
