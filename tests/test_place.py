"""`ivcloud place`: graphs with known optimal placements, balance limits,
determinism, the rankfile format, and bad input (one line, exit 2)."""

from __future__ import annotations

import ctypes
import json
import random
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest

from ivcloud.place import graph as graphs, planner
from ivcloud.place.metis import Metis
from ivcloud.place.rankfile import choose_partitioner

RANK_LINE = re.compile(r"^rank (\d+)=(s(\d+)i(\d+)) slot=(\d+)(?:-(\d+))?$")


def ivcloud(*args, stdin=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ivcloud", *map(str, args)],
                          input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ivcloud place: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def metis() -> Metis:
    lib = Metis.load()
    assert lib is not None, "METIS missing: apt-get install libmetis5"
    return lib


def topo(s, i, v) -> planner.PlacementTopology:
    return planner.PlacementTopology(s, i, v)


def place(g, t, metis, **kw) -> planner.Placement:
    return planner.place(g, t, planner.Partitioner(metis, seed=1), **kw)


def cliques(size: int, heavy: float, light: float) -> graphs.Graph:
    """Two cliques of `size` ranks, joined by one light edge."""
    edges = [(a + off, b + off, heavy) for off in (0, size)
             for a in range(size) for b in range(a + 1, size)]
    edges.append((size - 1, size, light))
    return graphs.Graph(2 * size, edges)


def check_valid(g, t, p, cpus_per_rank=1):
    """Each rank exactly once, cores inside the instance, no core twice."""
    assert len(p.server) == len(p.instance) == len(p.slot) == g.n
    used = Counter()
    for r in range(g.n):
        assert 0 <= p.server[r] < t.servers
        assert 0 <= p.instance[r] < t.instances
        for core in p.slots_of(r):
            assert 0 <= core < t.vcpus
            used[(p.server[r], p.instance[r], core)] += 1
    assert all(c == 1 for c in used.values()), used


# ------------------------------------------------------- known optima

def test_two_cliques_split_across_servers_at_the_light_edge(metis):
    g = cliques(4, heavy=10, light=1)
    t = topo(2, 2, 2)
    p = place(g, t, metis)
    check_valid(g, t, p)
    assert {p.server[r] for r in range(4)} == {0}
    assert {p.server[r] for r in range(4, 8)} == {1}
    cut = planner.cut_by_level(g, p)
    assert cut["across_servers"] == 1
    # 4 ranks in 2 instances of 2: the best any split can do is 2x2 inside
    assert cut["inside_instances"] == 4 * 10


def test_two_cliques_fit_each_in_one_instance(metis):
    g = cliques(8, heavy=5, light=1)
    t = topo(2, 1, 8)
    p = place(g, t, metis)
    cut = planner.cut_by_level(g, p)
    assert cut == {"across_servers": 1, "across_instances": 0,
                   "inside_instances": 2 * 28 * 5}


def test_ring_of_8_cuts_two_edges_per_level(metis):
    g = graphs.pattern("ring", 8)
    t = topo(2, 2, 2)
    p = place(g, t, metis)
    check_valid(g, t, p)
    assert planner.cut_by_level(g, p) == {
        "across_servers": 2, "across_instances": 2, "inside_instances": 4}
    # servers hold contiguous arcs of the ring
    for s in range(2):
        ranks = sorted(r for r in range(8) if p.server[r] == s)
        assert len(ranks) == 4
        assert sum(1 for a in ranks if (a + 1) % 8 in ranks) == 3


def test_halo2d_4x4_on_two_servers_is_cut_by_a_straight_line(metis):
    g = graphs.pattern("halo2d:4x4", None)
    t = topo(2, 2, 4)
    p = place(g, t, metis)
    check_valid(g, t, p)
    cut = planner.cut_by_level(g, p)
    assert cut["across_servers"] == 4
    assert cut["across_instances"] == 4      # 2x2 blocks on each server
    assert cut["inside_instances"] == 16
    half = {r for r in range(16) if p.server[r] == 0}
    rows01 = {r for r in range(16) if r // 4 < 2}
    cols01 = {r for r in range(16) if r % 4 < 2}
    assert half in (rows01, cols01), sorted(half)
    assert [sum(row) for row in p.load(t)] == [8, 8]


def test_halo3d_cube_halves(metis):
    g = graphs.pattern("halo3d:4x4x4", None)
    t = topo(2, 2, 16)
    p = place(g, t, metis)
    cut = planner.cut_by_level(g, p)
    assert cut["across_servers"] == 16       # one 4x4 face
    # each 4x4x2 half split into two 4x2x2 quarters: a 4x2 face each
    assert cut["across_instances"] == 2 * 8


def test_metis_never_worse_than_round_robin_or_block(metis):
    for spec, shape in (("halo2d:8x8", (4, 2, 8)), ("halo3d:4x4x4", (4, 4, 4)),
                        ("ring", (3, 2, 4))):
        g = graphs.pattern(spec, 24 if spec == "ring" else None)
        t = topo(*shape)
        ours = planner.cut_by_level(g, place(g, t, metis))
        for ref in (planner.round_robin(g.n, t), planner.block(g.n, t)):
            theirs = planner.cut_by_level(g, ref)
            assert ours["across_servers"] <= theirs["across_servers"], spec


# ------------------------------------------------------- balance

def random_graph(rng, n, p=0.3):
    return graphs.Graph(n, [(i, j, rng.randint(1, 100)) for i in range(n)
                            for j in range(i + 1, n) if rng.random() < p])


@pytest.mark.parametrize("partitioner", ["metis", "spectral"])
def test_balance_and_capacity_on_random_graphs(metis, partitioner):
    rng = random.Random(7)
    lib = metis if partitioner == "metis" else None
    for _ in range(25):
        s, i, v = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)
        t = topo(s, i, v)
        n = rng.randint(1, t.slots)
        g = random_graph(rng, n)
        p = planner.place(g, t, planner.Partitioner(lib))
        check_valid(g, t, p)
        load = p.load(t)
        per_server = [sum(row) for row in load]
        assert max(per_server) - min(per_server) <= 1, (s, i, v, n, load)
        for row in load:
            assert max(row) - min(row) <= 1, (s, i, v, n, load)
            assert max(row) <= v


def test_pack_uses_as_few_servers_and_instances_as_hold_the_ranks(metis):
    g = graphs.pattern("halo2d:3x4", None)
    t = topo(4, 2, 4)
    p = place(g, t, metis, fill="pack")
    check_valid(g, t, p)
    load = p.load(t)
    assert [sum(row) for row in load] == [6, 6, 0, 0]
    assert load[0] == [3, 3] and load[1] == [3, 3]


def test_imbalance_allows_uneven_parts_within_the_tolerance(metis):
    assert planner.bounds(16, 2, 8, Fraction(0)) == (8, 8)
    assert planner.bounds(7, 2, 8, Fraction(0)) == (3, 4)
    assert planner.bounds(10, 2, 8, Fraction(20)) == (4, 6)
    assert planner.bounds(10, 2, 5, Fraction(20)) == (4, 5)  # capacity wins
    # a chain of 3 tight pairs joined by light edges: 0 % must split a pair
    # to give 3/3, 50 % may keep both pairs of one side whole
    g = graphs.Graph(6, [(0, 1, 9), (2, 3, 9), (4, 5, 9), (1, 2, 1),
                         (3, 4, 1)])
    t = topo(2, 1, 6)
    strict = planner.cut_by_level(g, place(g, t, metis))
    loose = planner.cut_by_level(g, place(g, t, metis,
                                          imbalance_pct=Fraction(50)))
    assert strict["across_servers"] == 9
    assert loose["across_servers"] == 1


def test_cpus_per_rank_gives_core_ranges(metis):
    g = graphs.pattern("ring", 6)
    t = topo(2, 2, 4)
    p = place(g, t, metis, cpus_per_rank=2)
    check_valid(g, t, p, cpus_per_rank=2)
    assert all(max(row) <= 2 for row in p.load(t))
    assert {p.slot_text(r) for r in range(6)} <= {"0-1", "2-3"}


def test_too_many_ranks_refused(metis):
    with pytest.raises(planner.PlacementError, match="do not fit"):
        place(graphs.pattern("ring", 9), topo(2, 2, 2), metis)
    with pytest.raises(planner.PlacementError, match="do not fit"):
        place(graphs.pattern("ring", 5), topo(2, 2, 2), metis,
              cpus_per_rank=2)


def test_rebalance_repairs_overfull_parts_cheaply():
    # path 0-1-2-3-4-5, all in part 0 of 2 parts of at most 3
    adj = [dict() for _ in range(6)]
    for a in range(5):
        adj[a][a + 1] = adj[a + 1][a] = 1
    part = planner.rebalance(adj, [0] * 6, 2, 3, 3)
    assert Counter(part) == {0: 3, 1: 3}
    assert sum(1 for a in range(5) if part[a] != part[a + 1]) == 1


# ------------------------------------------------------- graphs & METIS

def test_metis_binding_partitions(metis):
    assert metis.idx_t in (ctypes.c_int32, ctypes.c_int64)
    g = cliques(5, 3, 1)
    adj = g.integer_adjacency(planner.METIS_WEIGHT_LIMIT)
    for method in Metis.METHODS:
        part = metis.partition(adj, 2, method, ufactor=1, seed=1)
        assert len(part) == 10 and set(part) == {0, 1}
        assert len(set(part[:5])) == 1 and len(set(part[5:])) == 1


def test_matrix_is_symmetrised_and_diagonal_ignored():
    g = graphs.parse("# traffic\n5 1 0\n3, 7, 2\n0 0 9\n")
    assert g.n == 3
    assert dict(((i, j), w) for i, j, w in g.edges()) == {(0, 1): 4,
                                                          (1, 2): 2}


def test_json_edges_add_up_and_default_weight():
    g = graphs.parse(json.dumps({"ranks": 3, "edges": [[0, 1, 2], [1, 0, 3],
                                                       [1, 2], [2, 2, 5]]}))
    assert sorted(g.edges()) == [(0, 1, 5), (1, 2, 1)]
    m = graphs.parse(json.dumps({"matrix": [[0, 2], [1, 0]]}))
    assert list(m.edges()) == [(0, 1, 3)]


def test_fractional_and_huge_weights_scaled_for_metis():
    g = graphs.Graph(3, [(0, 1, 0.25), (1, 2, 0.75)])
    adj = g.integer_adjacency(1 << 20)
    assert abs(adj[1][2] / adj[0][1] - 3) < 1e-4
    assert sum(w for a in adj for w in a.values()) <= 1 << 20
    big = graphs.Graph(3, [(0, 1, 3e12), (1, 2, 1)])
    adj = big.integer_adjacency(planner.METIS_WEIGHT_LIMIT)
    total = sum(w for a in adj for w in a.values())
    assert total <= planner.METIS_WEIGHT_LIMIT
    assert adj[1][2] >= 1
    exact = graphs.Graph(2, [(0, 1, 7)]).integer_adjacency(1000)
    assert exact == [{1: 7}, {0: 7}]


def test_patterns():
    assert graphs.dims_create(16, 2) == [4, 4]
    assert graphs.dims_create(12, 2) == [4, 3]
    assert graphs.dims_create(64, 3) == [4, 4, 4]
    assert graphs.dims_create(7, 2) == [7, 1]
    assert graphs.pattern("ring", 8).edge_count == 8
    assert graphs.pattern("ring", 2).edge_count == 1
    assert graphs.pattern("alltoall", 6).edge_count == 15
    assert graphs.pattern("halo2d:4x4", None).edge_count == 24
    assert graphs.pattern("halo2d", 16).edge_count == 24
    assert graphs.pattern("halo3d:2x3x4", None).edge_count == \
        1 * 3 * 4 + 2 * 2 * 4 + 2 * 3 * 3
    # MPI_Cart_create order: last dimension fastest
    h = graphs.pattern("halo2d:2x3", None)
    assert sorted((i, j) for i, j, _ in h.edges()) == [
        (0, 1), (0, 3), (1, 2), (1, 4), (2, 5), (3, 4), (4, 5)]


def test_auto_falls_back_to_spectral(monkeypatch):
    monkeypatch.setattr(Metis, "load", classmethod(lambda cls: None))
    part = choose_partitioner("auto", 1)
    assert part.metis is None and part.name == "spectral"
    with pytest.raises(planner.PlacementError,
                       match="METIS library not found"):
        choose_partitioner("metis", 1)


def test_cli_warns_when_it_falls_back(tmp_path):
    # a process whose METIS cannot be loaded: the command says what it
    # planned with instead
    code = ("import sys\n"
            "from ivcloud.place.metis import Metis\n"
            "Metis.load = classmethod(lambda cls: None)\n"
            "from ivcloud.cli import main\n"
            "sys.exit(main(['place', '--pattern', 'ring', '--ranks', '4',"
            " '--servers', '1', '--instances-per-server', '2',"
            " '--vcpus', '2']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "falling back to spectral bisection" in proc.stderr
    assert "spectral bisection (no METIS)" in proc.stdout


@pytest.mark.parametrize("spec,shape,across", [("ring", (2, 2, 2), 2),
                                               ("halo2d:4x4", (2, 2, 4), 4)])
def test_spectral_fallback_finds_the_easy_optima(spec, shape, across):
    g = graphs.pattern(spec, 8 if spec == "ring" else None)
    t = topo(*shape)
    p = planner.place(g, t, planner.Partitioner(None))
    check_valid(g, t, p)
    assert planner.cut_by_level(g, p)["across_servers"] == across
    g = cliques(4, 10, 1)
    p = planner.place(g, topo(2, 2, 2), planner.Partitioner(None))
    assert planner.cut_by_level(g, p)["across_servers"] == 1


def _eigh_in_another_basis(seed):
    """numpy's eigh, but every multiple eigenvalue's eigenvectors turned by
    a random rotation: what another LAPACK build or CPU may return."""
    import numpy as np
    orig = np.linalg.eigh
    rng = np.random.default_rng(seed)

    def eigh(a):
        vals, vecs = orig(a)
        vecs = vecs.copy()
        i = 0
        while i < len(vals):
            j = i
            while j + 1 < len(vals) and abs(vals[j + 1] - vals[i]) < 1e-9:
                j += 1
            if j > i:
                q, _ = np.linalg.qr(rng.standard_normal((j - i + 1,) * 2))
                vecs[:, i:j + 1] = vecs[:, i:j + 1] @ q
            i = j + 1
        return vals, vecs
    return eigh


@pytest.mark.parametrize("spec,shape,across", [
    ("ring", (2, 2, 2), 2), ("halo2d:4x4", (2, 2, 4), 4),
    ("halo2d:8x8", (4, 2, 8), 16), ("halo3d:4x4x4", (2, 2, 16), 16)])
def test_spectral_cut_does_not_depend_on_the_eigenvector_basis(
        monkeypatch, spec, shape, across):
    # The Fiedler eigenvalue of these graphs is multiple: any basis of its
    # eigenspace is a correct answer of LAPACK, and each must give the
    # same, optimal placement.
    import numpy as np
    g = graphs.pattern(spec, 8 if spec == "ring" else None)
    t = topo(*shape)
    seen = set()
    for seed in range(4):
        monkeypatch.setattr(np.linalg, "eigh", _eigh_in_another_basis(seed))
        p = planner.place(g, t, planner.Partitioner(None))
        check_valid(g, t, p)
        assert planner.cut_by_level(g, p)["across_servers"] == across
        seen.add(repr(p))
    assert len(seen) == 1


# ------------------------------------------------------- command line

SHAPE = ["--servers", 2, "--instances-per-server", 2, "--vcpus", 4]


def parse_rankfile(text):
    ranks = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = RANK_LINE.match(line)
        assert m, line
        r = int(m.group(1))
        assert r not in ranks, f"rank {r} twice"
        first = int(m.group(5))
        last = int(m.group(6)) if m.group(6) else first
        ranks[r] = (m.group(2), list(range(first, last + 1)))
    return ranks


def test_cli_rankfile_valid_and_deterministic(tmp_path):
    out = tmp_path / "rankfile"
    args = ["place", "--pattern", "halo2d:4x4", *SHAPE, "--compare"]
    first = ivcloud(*args, "--out", out)
    assert first.returncode == 0, first.stderr
    text = out.read_text()
    ranks = parse_rankfile(text)
    assert sorted(ranks) == list(range(16))
    cores = Counter((h, c) for h, cs in ranks.values() for c in cs)
    assert all(n == 1 for n in cores.values())
    assert all(0 <= c < 4 for _, c in cores)
    assert {h for h, _ in ranks.values()} == {"s0i0", "s0i1", "s1i0",
                                              "s1i1"}
    assert "round-robin" in first.stdout and "block" in first.stdout
    assert re.search(r"^metis\s+4 ", first.stdout, re.M), first.stdout
    for _ in range(2):
        again = ivcloud(*args)
        assert again.returncode == 0
        assert again.stdout == text            # stdout: the same rankfile


def test_cli_json_graph_file_and_stdin(tmp_path):
    g = {"ranks": 8, "edges": [[a + o, b + o, 10] for o in (0, 4)
                               for a in range(4) for b in range(a + 1, 4)]
         + [[3, 4, 1]]}
    f = tmp_path / "g.json"
    f.write_text(json.dumps(g))
    proc = ivcloud("place", "--graph", f, *SHAPE, "--json", "--compare")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["partitioner"] == "metis"
    assert doc["cut"]["across_servers"] == 1
    assert set(doc["compare"]) == {"round-robin", "block"}
    assert [p["rank"] for p in doc["placement"]] == list(range(8))
    servers = [p["server"] for p in doc["placement"]]
    assert len(set(servers[:4])) == 1 and len(set(servers[4:])) == 1
    matrix = "\n".join(" ".join("1" if abs(i - j) == 1 else "0"
                                for j in range(4)) for i in range(4))
    proc = ivcloud("place", "--graph", "-", "--servers", 2,
                   "--instances-per-server", 1, "--vcpus", 2, "--json",
                   stdin=matrix)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cut"]["across_servers"] == 2


def test_cli_cluster_state(tmp_path):
    d = tmp_path / "run" / "cluster-c1"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({
        "version": 1, "topology": {"name": "c1", "servers": 2,
                                   "instances_per_server": 2, "vcpus": 2,
                                   "host_cpus": [0, 1]}}))
    proc = ivcloud("place", "--pattern", "ring", "--ranks", 8, "--cluster",
                   "c1", "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert len(parse_rankfile(proc.stdout)) == 8
    err = assert_one_line_error(ivcloud(
        "place", "--pattern", "ring", "--ranks", 8, "--cluster", "nope",
        "--run-dir", tmp_path / "run"))
    assert "no cluster 'nope'" in err


@pytest.mark.parametrize("content,args,message", [
    (None, ["--pattern", "mesh", "--ranks", 4], "unknown pattern"),
    (None, ["--pattern", "ring", "--ranks", 17], "do not fit"),
    (None, ["--pattern", "ring"], "needs a number of ranks [--ranks]"),
    (None, ["--pattern", "halo2d:4x"], "bad dimensions"),
    (None, ["--pattern", "halo2d:2x2", "--ranks", 5], "does not match"),
    ('{"ranks": 3, "edges": [[0, 1, 2],', [], "invalid JSON"),
    ('{"ranks": 3, "edges": [[0, 1, -2]]}', [], "negative weight"),
    ('{"ranks": 3, "edges": [[0, 1, NaN]]}', [], "finite"),
    ('{"ranks": 3, "edges": [[0, 3, 1]]}', [], "out of range"),
    ('{"ranks": 3, "edges": [[0, 1, "x"]]}', [], "must be a number"),
    ('{"ranks": 3, "edges": [[0]]}', [], "expected [i, j]"),
    ('{"ranks": 0}', [], "positive integer"),
    ('[1, 2]', [], "list of rows"),
    ('[[0, 1], [1]]', [], "must be 2x2"),
    ('"text"', [], "not a number"),
    ('{"ranks": 2, "edges": [], "weights": []}', [], "unknown key"),
    ("0 1\n-1 0\n", [], "negative weight"),
    ("0 1 2\n1 0\n", [], "must be 2x2"),
    ("0 x\n1 0\n", [], "not a number"),
    ("", [], "empty matrix"),
    ('{"ranks": 4}', ["--ranks", 5], "5 ranks asked for"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, content, args, message):
    argv = ["place", *SHAPE, *args]
    if content is not None:
        f = tmp_path / "graph"
        f.write_text(content)
        argv += ["--graph", f]
    err = assert_one_line_error(ivcloud(*argv))
    assert message in err, err


@pytest.mark.parametrize("argv,message", [
    (["--graph", "/nonexistent/g.json", *SHAPE], "cannot read graph"),
    (["--pattern", "ring", "--ranks", 4], "need --servers"),
    (["--pattern", "ring", "--ranks", 4, *SHAPE, "--vcpus", 0],
     "at least 1"),
    (["--pattern", "ring", "--ranks", 4, *SHAPE, "--cpus-per-rank", 5],
     "do not fit"),
    (["--pattern", "ring", "--ranks", 4, *SHAPE, "--imbalance", "-1"],
     "imbalance"),
    (["--pattern", "ring", "--ranks", 4, *SHAPE, "--cluster", "c"],
     "not both"),
    (["--pattern", "ring", "--graph", "g", *SHAPE], "not allowed"),
    (["--pattern", "ring", "--ranks", 4, *SHAPE, "--out",
      "/nonexistent/dir/rf"], "cannot write"),
    ([*SHAPE], "required"),
])
def test_cli_bad_options_one_line_exit_2(argv, message):
    err = assert_one_line_error(ivcloud("place", *argv))
    assert message in err, err
