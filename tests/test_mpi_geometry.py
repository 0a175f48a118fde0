"""The rings of MPI regions (ivcloud.mpis.regions.mpi_geometry): receive areas
within the budget, and slots large enough that every BTL fragment is
exactly one slot (packed and delivered in place) for as many ranks as
the budget allows, not only for the first shape."""

from __future__ import annotations

from ivcloud.mpis import regions
from ivcloud.native import min_region_size

# native/btl/btl_ivshmem_component.c, size_fragments: max_send_size is
# 32768 // payload whole slots (at least one), payload = slot_size - 32
FRAGMENT_TARGET = 32768
SLOT_HDR = 32


def test_shapes_fit_the_budget_and_keep_one_slot_fragments():
    last = regions.MPI_RING_SHAPES[-1]
    seen = set()
    for peers in range(2, regions.MAX_PEERS_LIMIT + 1):
        g = regions.mpi_geometry(peers)
        shape = (g["ring_slots"], g["slot_size"])
        seen.add(shape)
        if shape != last:
            assert min_region_size(peers, **g) <= regions.PRIVATE_RING_BUDGET
            payload = shape[1] - SLOT_HDR
            assert FRAGMENT_TARGET // payload == 1, (peers, shape)
    # every shape is used for some job size, in order
    assert seen == set(regions.MPI_RING_SHAPES)
