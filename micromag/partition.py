"""Node partitioning for the distributed FEM space: PT-Scotch through
PETSc's MatPartitioning (Debian's PETSc is built with it).

Why PETSc's partitioner rather than a METIS binding: petsc4py is already
the solver's foundation, so this adds no native library and no binding
of our own. The partition is computed collectively by the ranks that
will share the mesh (each hands in the adjacency rows of one slice of
the nodes); PT-Scotch does not finish when it is run on one rank of a
larger job.

Two things make the result reproducible: Scotch 7 runs its
multi-threaded phases on SCOTCH_PTHREAD_NUMBER threads, whose timing
changes the cut from run to run, so one thread is asked for while the
partition is computed; and the parts are numbered in the order of their
first node, so the rank a node lands on does not depend on how Scotch
labels them.

The PETSc options under the prefix ``fem_`` reach the partitioner, e.g.
``fem_mat_partitioning_ptscotch_imbalance = 0.02`` or
``fem_mat_partitioning_ptscotch_strategy = "quality"`` in a problem's
[petsc] table.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import SetupError
from .parallel import petsc

PARTITIONER = "ptscotch"
OPTIONS_PREFIX = "fem_"


def partition_nodes(graph, comm) -> np.ndarray:
    """Part (0..size-1) of every vertex of `graph` (a symmetric scipy CSR
    adjacency without diagonal, e.g. fem.node_graph, the same on every
    rank of the mpi4py communicator `comm`): one part per rank, balanced,
    with a small edge cut, numbered by their first vertex. Collective;
    every rank gets the whole array."""
    n = graph.shape[0]
    size, rank = comm.Get_size(), comm.Get_rank()
    if size <= 1:
        return np.zeros(n, dtype=np.int64)
    PETSc = petsc()
    pcomm = PETSc.Comm(comm)
    lo, hi = n * rank // size, n * (rank + 1) // size
    rows = graph[lo:hi]
    adj = PETSc.Mat().createAIJ(
        ((hi - lo, n), (hi - lo, n)),
        csr=(rows.indptr.astype(PETSc.IntType),
             rows.indices.astype(PETSc.IntType), np.ones(len(rows.indices))),
        comm=pcomm)
    adj.assemble()
    part = PETSc.MatPartitioning().create(comm=pcomm)
    saved = os.environ.get("SCOTCH_PTHREAD_NUMBER")
    os.environ["SCOTCH_PTHREAD_NUMBER"] = "1"
    try:
        part.setOptionsPrefix(OPTIONS_PREFIX)
        part.setAdjacency(adj)
        try:
            part.setType(PARTITIONER)
        except PETSc.Error:
            raise SetupError(f"PETSc has no '{PARTITIONER}' graph "
                             f"partitioner (build PETSc with PT-Scotch)"
                             ) from None
        part.setFromOptions()
        index_set = PETSc.IS()
        part.apply(index_set)
        mine = index_set.getIndices().astype(np.int64)
        index_set.destroy()
    finally:
        if saved is None:
            os.environ.pop("SCOTCH_PTHREAD_NUMBER", None)
        else:
            os.environ["SCOTCH_PTHREAD_NUMBER"] = saved
        part.destroy()
        adj.destroy()
    labels = np.concatenate(comm.allgather(mine))
    # canonical numbering: part k is the k-th to appear in vertex order
    used, first = np.unique(labels, return_index=True)
    rank_of = np.full(max(size, int(labels.max()) + 1), -1, dtype=np.int64)
    rank_of[used[np.argsort(first)]] = np.arange(len(used))
    return rank_of[labels]
