"""Communication graphs between MPI ranks: reading them and generating the
common patterns.

A graph is undirected: the weight between two ranks is all the traffic
between them, whichever way it flows, so [i, j, w] and [j, i, v] add up
to one edge of weight w + v. Self edges carry no traffic between
placements and are dropped.
"""

from __future__ import annotations

import json
import math
import re
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..errors import PlacementError


class GraphError(PlacementError):
    """The graph given is malformed or inconsistent (one-line message)."""


MAX_RANKS = 1 << 20   # far beyond any job; bounds memory on a typo


class Graph:
    """n ranks and symmetric weighted adjacency (no self loops, w > 0)."""

    def __init__(self, n: int, edges: Iterable[Tuple[int, int, float]]):
        if n < 1 or n > MAX_RANKS:
            raise GraphError(f"number of ranks must be 1..{MAX_RANKS}, "
                             f"got {n}")
        self.n = n
        self.adj: List[Dict[int, float]] = [dict() for _ in range(n)]
        for i, j, w in edges:
            if i == j or w == 0:
                continue
            self.adj[i][j] = self.adj[i].get(j, 0) + w
            self.adj[j][i] = self.adj[j].get(i, 0) + w

    def edges(self) -> Iterator[Tuple[int, int, float]]:
        """Each undirected edge once, as (i, j, w) with i < j."""
        for i, nbrs in enumerate(self.adj):
            for j, w in nbrs.items():
                if i < j:
                    yield i, j, w

    @property
    def total_weight(self) -> float:
        return sum(w for _, _, w in self.edges())

    @property
    def edge_count(self) -> int:
        return sum(len(a) for a in self.adj) // 2

    def integer_adjacency(self, limit: int) -> List[Dict[int, int]]:
        """Positive integer weights for METIS whose grand total (each edge
        counted from both ends) stays under `limit`: measured traffic may
        be fractional or exceed idx_t. Already-integral small weights are
        kept exactly; otherwise they are scaled, every edge keeping >= 1 so
        none vanishes from the partitioner's view."""
        weights = [w for nbrs in self.adj for w in nbrs.values()]
        total = sum(weights)
        exact = all(float(w).is_integer() for w in weights) and total < limit
        scale = 1.0 if exact or total == 0 else (limit - len(weights)) / total
        return [{j: max(1, int(round(w * scale))) for j, w in nbrs.items()}
                for nbrs in self.adj]


def _weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where}: weight must be a number, got "
                         f"{json.dumps(value)}")
    if not math.isfinite(value):
        raise GraphError(f"{where}: weight must be finite, got {value}")
    if value < 0:
        raise GraphError(f"{where}: negative weight {value}")
    return value


def _rank(value, n: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GraphError(f"{where}: rank must be an integer, got "
                         f"{json.dumps(value)}")
    if not 0 <= value < n:
        raise GraphError(f"{where}: rank {value} out of range 0..{n - 1}")
    return value


def _from_matrix(rows: Sequence[Sequence], where: str) -> Graph:
    n = len(rows)
    if n == 0:
        raise GraphError(f"{where}: empty matrix")
    edges = []
    for i, row in enumerate(rows):
        if len(row) != n:
            raise GraphError(f"{where}: row {i} has {len(row)} entries, the "
                             f"matrix must be {n}x{n}")
        for j, value in enumerate(row):
            w = _weight(value, f"{where} row {i} column {j}")
            if j != i and w:
                edges.append((i, j, w))
    return Graph(n, edges)


def parse_json(text: str, where: str = "graph") -> Graph:
    """{"ranks": N, "edges": [[i, j, w], [i, j], ...]}, or
    {"matrix": [[...], ...]} or just [[...], ...] (matrix[i][j] = traffic
    from i to j)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphError(f"{where}: invalid JSON: {e.msg} at line {e.lineno} "
                         f"column {e.colno}") from None
    if isinstance(doc, list):
        doc = {"matrix": doc}
    if not isinstance(doc, dict):
        raise GraphError(f"{where}: expected a JSON object with 'ranks' and "
                         f"'edges', or 'matrix'")
    unknown = set(doc) - {"ranks", "edges", "matrix", "comment"}
    if unknown:
        raise GraphError(f"{where}: unknown key(s) "
                         f"{', '.join(sorted(unknown))}")
    if "matrix" in doc:
        if "edges" in doc:
            raise GraphError(f"{where}: give either 'edges' or 'matrix', "
                             f"not both")
        matrix = doc["matrix"]
        if not isinstance(matrix, list) or not all(isinstance(r, list)
                                                   for r in matrix):
            raise GraphError(f"{where}: 'matrix' must be a list of rows")
        graph = _from_matrix(matrix, where)
        if "ranks" in doc and doc["ranks"] != graph.n:
            raise GraphError(f"{where}: 'ranks' is {doc['ranks']} but the "
                             f"matrix is {graph.n}x{graph.n}")
        return graph
    n = doc.get("ranks")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GraphError(f"{where}: 'ranks' must be a positive integer")
    if n > MAX_RANKS:
        raise GraphError(f"{where}: 'ranks' {n} exceeds {MAX_RANKS}")
    raw = doc.get("edges", [])
    if not isinstance(raw, list):
        raise GraphError(f"{where}: 'edges' must be a list of [i, j, w]")
    edges = []
    for k, e in enumerate(raw):
        at = f"{where} edge {k}"
        if not isinstance(e, list) or len(e) not in (2, 3):
            raise GraphError(f"{at}: expected [i, j] or [i, j, weight], got "
                             f"{json.dumps(e)[:40]}")
        w = _weight(e[2], at) if len(e) == 3 else 1
        edges.append((_rank(e[0], n, at), _rank(e[1], n, at), w))
    return Graph(n, edges)


_NUMBER_SPLIT = re.compile(r"[\s,;]+")


def parse_matrix_text(text: str, where: str = "graph") -> Graph:
    """Dense N x N traffic matrix: numbers separated by blanks or commas,
    one row a line; '#' starts a comment."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        row = []
        for tok in _NUMBER_SPLIT.split(line):
            if not tok:
                continue
            try:
                value = float(tok)
            except ValueError:
                raise GraphError(f"{where} line {lineno}: not a number: "
                                 f"{tok[:20]!r}") from None
            row.append(int(value) if value.is_integer() else value)
        rows.append(row)
    return _from_matrix(rows, where)


def parse(text: str, where: str = "graph") -> Graph:
    """JSON if the text is an object or array, a dense matrix otherwise."""
    if text.lstrip()[:1] in ("{", "["):
        return parse_json(text, where)
    return parse_matrix_text(text, where)


# ---------------------------------------------------------------- patterns

PATTERNS = ("ring", "halo2d", "halo3d", "alltoall")


def dims_create(n: int, ndims: int) -> List[int]:
    """Split n into ndims factors as equal as possible, largest first (what
    MPI_Dims_create gives): greedy assignment of prime factors, biggest
    first, to the currently smallest dimension."""
    factors, rest, p = [], n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    if rest > 1:
        factors.append(rest)
    dims = [1] * ndims
    for f in sorted(factors, reverse=True):
        dims[dims.index(min(dims))] *= f
    return sorted(dims, reverse=True)


def _halo(dims: Sequence[int]) -> Graph:
    """Nearest-neighbour exchange on a non-periodic grid. Ranks are numbered
    like MPI_Cart_create: row-major, the last dimension varying fastest."""
    n = math.prod(dims)
    strides = [math.prod(dims[d + 1:]) for d in range(len(dims))]
    edges = []
    for r in range(n):
        for d, stride in enumerate(strides):
            if (r // stride) % dims[d] + 1 < dims[d]:
                edges.append((r, r + stride, 1))
    return Graph(n, edges)


def pattern(spec: str, ranks: Optional[int]) -> Graph:
    """ring | alltoall (need ranks), halo2d[:PXxPY], halo3d[:PXxPYxPZ]
    (dims from ranks if not given)."""
    name, _, arg = spec.partition(":")
    if name not in PATTERNS:
        raise GraphError(f"unknown pattern '{spec}' (expected one of "
                         f"{', '.join(PATTERNS)})")
    if name in ("ring", "alltoall"):
        if arg:
            raise GraphError(f"pattern '{name}' takes no dimensions, only a "
                             f"number of ranks")
        if ranks is None:
            raise GraphError(f"pattern '{name}' needs a number of ranks")
        if ranks < 1 or ranks > MAX_RANKS:
            raise GraphError(f"the number of ranks must be 1..{MAX_RANKS}")
        if name == "ring":
            # two ranks share one link, not two
            edges = ([(r, (r + 1) % ranks, 1) for r in range(ranks)]
                     if ranks > 2 else [(0, 1, 1)] if ranks == 2 else [])
        else:
            edges = [(i, j, 1) for i in range(ranks)
                     for j in range(i + 1, ranks)]
        return Graph(ranks, edges)
    ndims = 2 if name == "halo2d" else 3
    if arg:
        parts = arg.lower().split("x")
        if len(parts) != ndims or not all(p.isdigit() and int(p) > 0
                                          for p in parts):
            example = "x".join(["4"] * ndims)
            raise GraphError(f"bad dimensions '{arg}' for {name} (expected "
                             f"e.g. {name}:{example})")
        dims = [int(p) for p in parts]
        if math.prod(dims) > MAX_RANKS:
            raise GraphError(f"{name}:{arg} exceeds {MAX_RANKS} ranks")
        if ranks is not None and ranks != math.prod(dims):
            raise GraphError(f"{ranks} ranks does not match {name}:{arg} "
                             f"({math.prod(dims)} ranks)")
    else:
        if ranks is None:
            raise GraphError(f"pattern '{name}' needs a number of ranks or "
                             f"dimensions "
                             f"({name}:" + "x".join(["4"] * ndims) + ")")
        if ranks < 1 or ranks > MAX_RANKS:
            raise GraphError(f"the number of ranks must be 1..{MAX_RANKS}")
        dims = dims_create(ranks, ndims)
    return _halo(dims)
