"""Hierarchical placement of ranks: servers, then instances, then cores.

Each level is one balanced graph partition of the ranks it received (METIS
when the library is there), so the heaviest traffic stays inside an
instance (shared memory between processes), the next heaviest inside a
server (ivshmem between instances) and only the rest crosses the network.

Capacities are hard limits (one rank per `cpus_per_rank` vCPUs, never
oversubscribed); METIS treats balance as a target, so each level ends with
a repair step that moves the cheapest vertices until every part is within
its bounds, then moves single vertices while that strictly lowers the cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from .graph import Graph
from .metis import Metis, MetisError
from ..errors import PlacementError

FILLS = ("spread", "pack")
# METIS idx_t may be 32 bits: keep the sum of all edge weights, both
# directions, well below it so the objective value cannot overflow.
METIS_WEIGHT_LIMIT = 1 << 30


@dataclass(frozen=True)
class PlacementTopology:
    servers: int
    instances: int            # per server
    vcpus: int                # per instance
    hosts: Tuple[Tuple[str, ...], ...] = ()

    def __post_init__(self):
        for what, v in (("servers", self.servers),
                        ("instances per server", self.instances),
                        ("vcpus", self.vcpus)):
            if v < 1:
                raise PlacementError(f"{what} must be at least 1, not {v}")
        if not self.hosts:
            object.__setattr__(self, "hosts", tuple(
                tuple(f"s{s}i{i}" for i in range(self.instances))
                for s in range(self.servers)))

    @property
    def slots(self) -> int:
        return self.servers * self.instances * self.vcpus

    def describe(self) -> str:
        return (f"{self.servers} servers x {self.instances} instances x "
                f"{self.vcpus} vcpus ({self.slots} slots)")


@dataclass
class Placement:
    """Where every rank runs: server, instance within it, first core."""

    server: List[int]
    instance: List[int]
    slot: List[int]
    cpus_per_rank: int = 1

    def host(self, topo: PlacementTopology, rank: int) -> str:
        return topo.hosts[self.server[rank]][self.instance[rank]]

    def slots_of(self, rank: int) -> List[int]:
        first = self.slot[rank]
        return list(range(first, first + self.cpus_per_rank))

    def slot_text(self, rank: int) -> str:
        first = self.slot[rank]
        if self.cpus_per_rank == 1:
            return str(first)
        return f"{first}-{first + self.cpus_per_rank - 1}"

    def load(self, topo: PlacementTopology) -> List[List[int]]:
        """Ranks per instance, [server][instance]."""
        out = [[0] * topo.instances for _ in range(topo.servers)]
        for s, i in zip(self.server, self.instance):
            out[s][i] += 1
        return out


def cut_by_level(graph: Graph, placement: Placement) -> Dict[str, float]:
    """Edge weight crossing servers, crossing instances within a server,
    and staying inside one instance."""
    out = {"across_servers": 0, "across_instances": 0, "inside_instances": 0}
    srv, ins = placement.server, placement.instance
    for i, j, w in graph.edges():
        if srv[i] != srv[j]:
            out["across_servers"] += w
        elif ins[i] != ins[j]:
            out["across_instances"] += w
        else:
            out["inside_instances"] += w
    return out


# ------------------------------------------------------------ references

def round_robin(n: int, topo: PlacementTopology, cpus_per_rank: int = 1) -> Placement:
    """Open MPI's --map-by node over the instances in instance-major order
    (s0i0, s1i0, ..., s0i1, ...: consecutive ranks on different servers
    first), as `ivcloud cluster`'s round-robin hostfile lists them."""
    hosts = [(s, i) for i in range(topo.instances)
             for s in range(topo.servers)]
    used = [0] * len(hosts)
    srv, ins, slot = [], [], []
    for r in range(n):
        h = r % len(hosts)
        srv.append(hosts[h][0])
        ins.append(hosts[h][1])
        slot.append(used[h] * cpus_per_rank)
        used[h] += 1
    return Placement(srv, ins, slot, cpus_per_rank)


def block(n: int, topo: PlacementTopology, cpus_per_rank: int = 1) -> Placement:
    """Open MPI's --map-by slot over the instances server-major (s0i0,
    s0i1, ..., s1i0): fill each instance in rank order."""
    per = topo.vcpus // cpus_per_rank
    srv, ins, slot = [], [], []
    for r in range(n):
        h = r // per
        srv.append(h // topo.instances)
        ins.append(h % topo.instances)
        slot.append((r % per) * cpus_per_rank)
    return Placement(srv, ins, slot, cpus_per_rank)


# ------------------------------------------------------------ partitioning

def _cut(adj: Sequence[Dict[int, int]], part: Sequence[int]) -> int:
    return sum(w for v, nbrs in enumerate(adj) for u, w in nbrs.items()
               if u > v and part[u] != part[v])


def _connections(adj, part, v) -> Dict[int, int]:
    """Edge weight from v into each part."""
    conn: Dict[int, int] = {}
    for u, w in adj[v].items():
        conn[part[u]] = conn.get(part[u], 0) + w
    return conn


def rebalance(adj: Sequence[Dict[int, int]], part: List[int], k: int,
              lo: int, hi: int) -> List[int]:
    """Make every part size lo..hi with the least cut increase, then apply
    strictly improving single moves that keep the bounds. Deterministic:
    ties go to the lowest vertex, then the lowest part."""
    n = len(adj)
    part = list(part)
    size = [0] * k
    for p in part:
        size[p] += 1
    # Each forced move lowers the total bound violation by one.
    while True:
        over = [p for p in range(k) if size[p] > hi]
        under = [p for p in range(k) if size[p] < lo]
        if not over and not under:
            break
        best = None
        for v in range(n):
            src = part[v]
            if over:
                if src != over[0]:
                    continue
                targets = [q for q in range(k) if q != src and size[q] < hi]
            else:
                if size[src] <= lo:
                    continue
                targets = [under[0]]
            conn = _connections(adj, part, v)
            for q in targets:
                key = (conn.get(src, 0) - conn.get(q, 0), v, q)
                if best is None or key < best:
                    best = key
        _, v, q = best
        size[part[v]] -= 1
        size[q] += 1
        part[v] = q
    # Polish: every move strictly lowers the cut, so this ends; the bound
    # on rounds only caps the cost on huge graphs.
    for _ in range(2 * n):
        best = None
        for v in range(n):
            src = part[v]
            if size[src] <= lo:
                continue
            conn = _connections(adj, part, v)
            for q, w in conn.items():
                if q == src or size[q] >= hi:
                    continue
                key = (conn.get(src, 0) - w, v, q)
                if key[0] < 0 and (best is None or key < best):
                    best = key
        if best is None:
            break
        _, v, q = best
        size[part[v]] -= 1
        size[q] += 1
        part[v] = q
    return part


# Vertices whose spectral coordinates are paired up to make sweep
# directions: all of them on small graphs, the outermost on large ones.
_PAIRED_VERTICES = 48


def _spectral_bisect(adj: Sequence[Dict[int, int]], verts: List[int],
                     n1: int) -> List[int]:
    """The n1 vertices of `verts` that a spectral sweep puts on one side.

    The Fiedler eigenvalue is often multiple (a square grid, a ring), and
    then LAPACK may hand back any basis of its eigenspace: which vector is
    "the" Fiedler vector depends on the build and the CPU. So the sweep
    does not use one eigenvector but many directions inside the whole
    eigenspace, chosen so that the set of directions does not depend on
    the basis: each vertex's own spectral coordinates, and the differences
    of the coordinates of two vertices (the direction that separates them
    most, e.g. two corners of a grid side give the cut along that axis).
    The direction whose sweep cuts the least edge weight wins; cuts are
    integers and ties go to the lexicographically smallest side, so the
    result is the same on every machine.
    """
    import numpy as np
    n = len(verts)
    index = {v: a for a, v in enumerate(verts)}
    lap = np.zeros((n, n))
    us, vs, ws = [], [], []
    for v in verts:
        a = index[v]
        for u, w in adj[v].items():
            b = index.get(u)
            if b is not None:
                lap[a, b] -= w
                lap[a, a] += w
                if b > a:
                    us.append(a)
                    vs.append(b)
                    ws.append(w)
    vals, vecs = np.linalg.eigh(lap)
    scale = max(1.0, float(abs(vals[-1])))
    # Eigenvectors of eigenvalues within round-off of the Fiedler value
    # span its eigenspace; rows of `coords` are the vertices' coordinates
    # in it (unique up to a rotation, which the directions below undo).
    same = np.flatnonzero(np.abs(vals - vals[1]) <= 1e-8 * scale)
    coords = vecs[:, same]
    norms = np.round(np.linalg.norm(coords, axis=1), 9)
    outer = sorted(range(n), key=lambda a: (-norms[a], a))[:_PAIRED_VERTICES]
    pairs = [(i, j) for x, i in enumerate(outer) for j in outer[x + 1:]]
    dirs = [coords[a] for a in range(n)]
    dirs += [coords[i] - coords[j] for i, j in pairs]
    proj = np.round(coords @ np.array(dirs).T, 9)       # n x directions
    ids = np.arange(n)
    best = None
    for c in range(proj.shape[1]):
        for sign in (1, -1):
            # ties along a direction go to the lower vertex: deterministic
            order = np.lexsort((ids, sign * proj[:, c]))
            side = np.zeros(n, dtype=bool)
            side[order[:n1]] = True
            cut = int(np.dot(ws, side[us] != side[vs])) if ws else 0
            key = (cut, tuple(np.flatnonzero(side)))
            if best is None or key < best:
                best = key
    return [verts[a] for a in best[1]]


def spectral_partition(adj: Sequence[Dict[int, int]], k: int) -> List[int]:
    """Recursive spectral bisection: the fallback when METIS is missing."""
    part = [0] * len(adj)

    def split(verts: List[int], k: int, base: int) -> None:
        if k == 1:
            for v in verts:
                part[v] = base
            return
        k1 = k // 2
        n1 = round(len(verts) * k1 / k)
        if len(verts) < 2:
            first = verts[:n1]
        else:
            first = _spectral_bisect(adj, verts, n1)
        chosen = set(first)
        split(first, k1, base)
        split([v for v in verts if v not in chosen], k - k1, base + k1)

    split(list(range(len(adj))), k, 0)
    return part


def bounds(n: int, k: int, capacity: int, imbalance_pct: Fraction
           ) -> Tuple[int, int]:
    """Smallest and largest allowed part when n ranks go to k parts of
    `capacity` ranks each: within imbalance_pct of the average, widened to
    the nearest integers around it when the tolerance is narrower than
    that. Exact arithmetic: 16 ranks on 2 parts at 0 % is 8..8, 7 on 2 is
    3..4."""
    avg = Fraction(n, k)
    tol = imbalance_pct / 100
    hi = min(capacity, max(math.ceil(avg), math.floor(avg * (1 + tol))))
    lo = min(math.floor(avg), math.ceil(avg * (1 - tol)))
    return lo, hi


@dataclass
class Partitioner:
    """Splits a set of ranks into k balanced groups of low cut."""

    metis: Optional[Metis]          # None: spectral fallback
    seed: int = 1
    # how often each METIS method gave the lower cut (reported in JSON)
    methods_used: Dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "metis" if self.metis else "spectral"

    def split(self, adj: Sequence[Dict[int, int]], verts: Sequence[int],
              k: int, lo: int, hi: int) -> List[List[int]]:
        """Groups of `verts` (global rank ids), ordered by their lowest
        rank, each group sorted; len == k, sizes within lo..hi."""
        verts = sorted(verts)
        if k == 1:
            return [verts]
        index = {v: a for a, v in enumerate(verts)}
        local = [{index[u]: w for u, w in adj[v].items() if u in index}
                 for v in verts]
        if not any(local):
            # No traffic to keep together: consecutive blocks, balanced.
            part = [min(a * k // len(verts), k - 1) for a in range(len(verts))]
            part = rebalance(local, part, k, lo, hi)
        elif self.metis is None:
            part = rebalance(local, spectral_partition(local, k), k, lo, hi)
        else:
            part = self._metis(local, k, lo, hi)
        groups: List[List[int]] = [[] for _ in range(k)]
        for a, p in enumerate(part):
            groups[p].append(verts[a])
        return sorted(groups, key=lambda g: g[0] if g else len(adj) + 1)

    def _metis(self, local, k, lo, hi) -> List[int]:
        n = len(local)
        # UFACTOR is the allowed excess over the average, in 1/1000.
        ufactor = max(1, math.floor((Fraction(hi * k, n) - 1) * 1000))
        best: Optional[Tuple[int, str, List[int]]] = None
        for method in Metis.METHODS:
            try:
                raw = self.metis.partition(local, k, method, ufactor,
                                           self.seed)
            except MetisError:
                continue
            part = rebalance(local, raw, k, lo, hi)
            cut = _cut(local, part)
            if best is None or cut < best[0]:
                best = (cut, method, part)
        if best is None:
            raise PlacementError("METIS failed on every method")
        self.methods_used[best[1]] = self.methods_used.get(best[1], 0) + 1
        return best[2]


def place(graph: Graph, topo: PlacementTopology, partitioner: Partitioner,
          fill: str = "spread", imbalance_pct: Fraction = Fraction(0),
          cpus_per_rank: int = 1) -> Placement:
    """Ranks to servers, each server's ranks to its instances, then cores
    in rank order (all cores of an instance are equally close)."""
    if fill not in FILLS:
        raise PlacementError(f"unknown fill '{fill}' (expected "
                             f"{' or '.join(FILLS)})")
    if cpus_per_rank < 1:
        raise PlacementError("cpus per rank must be at least 1")
    per_instance = topo.vcpus // cpus_per_rank
    if per_instance == 0:
        raise PlacementError(f"{cpus_per_rank} cpus per rank do not fit in "
                             f"an instance of {topo.vcpus} vcpus")
    per_server = per_instance * topo.instances
    n = graph.n
    if n > per_server * topo.servers:
        what = (f"{n} ranks" if cpus_per_rank == 1
                else f"{n} ranks of {cpus_per_rank} cpus")
        raise PlacementError(f"{what} do not fit on {topo.describe()}: at "
                             f"most {per_server * topo.servers} ranks")
    adj = graph.integer_adjacency(METIS_WEIGHT_LIMIT)

    def parts(m: int, count: int, capacity: int) -> int:
        return min(count, m) if fill == "spread" else math.ceil(m / capacity)

    server = [0] * n
    instance = [0] * n
    slot = [0] * n
    k1 = parts(n, topo.servers, per_server)
    lo, hi = bounds(n, k1, per_server, imbalance_pct)
    for s, ranks in enumerate(partitioner.split(adj, range(n), k1, lo, hi)):
        if not ranks:
            continue
        k2 = parts(len(ranks), topo.instances, per_instance)
        lo2, hi2 = bounds(len(ranks), k2, per_instance, imbalance_pct)
        for i, members in enumerate(partitioner.split(adj, ranks, k2,
                                                      lo2, hi2)):
            for c, r in enumerate(members):
                server[r], instance[r], slot[r] = s, i, c * cpus_per_rank
    return Placement(server, instance, slot, cpus_per_rank)


def rankfile_lines(topo: PlacementTopology, placement: Placement) -> List[str]:
    return [f"rank {r}={placement.host(topo, r)} "
            f"slot={placement.slot_text(r)}"
            for r in range(len(placement.server))]
