"""Rank placement: an Open MPI rankfile that keeps heavy traffic local.

From a communication graph (weights between ranks: a JSON edge list, a
dense traffic matrix, or a generated pattern) and the cluster's shape
(servers x instances x vCPUs, a PlacementTopology), partition the ranks with METIS level by
level (see planner.py) and write `rank R=HOST slot=K` lines, with the
traffic left crossing servers / instances / inside instances, optionally
against round-robin and block placements (rankfile.py: the request of
`ivcloud place` from its graph, shape and partitioner to the file).

Library use:

    from ivcloud.place import graph, planner
    from ivcloud.place.metis import Metis
    g = graph.pattern("halo2d:4x4", None)
    topo = planner.PlacementTopology(2, 2, 4)
    p = planner.place(g, topo, planner.Partitioner(Metis.load()))
"""

from ..errors import PlacementError
from .graph import Graph, GraphError
from .metis import Metis, MetisError
from .planner import (FILLS, Partitioner, Placement, PlacementTopology,
                      block, cut_by_level, place, rankfile_lines,
                      round_robin)

__all__ = ["FILLS", "Graph", "GraphError", "Metis", "MetisError",
           "Partitioner", "Placement", "PlacementError", "PlacementTopology",
           "block", "cut_by_level", "place", "rankfile_lines", "round_robin"]
