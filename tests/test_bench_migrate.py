"""`ivcloud bench migrate`'s figures from a job's records (no cluster):
the stall of each move and the targets (ivcloud/bench/migrate.py)."""

from ivcloud.bench import migrate
from ivcloud.bench.toolkit import BenchResults, summarize


def _runs():
    """Ticks 2 s apart but one of 7 s while moving out; the pair 2-3 at
    the core's latency while 2 is away, 1-2 on the region when moved."""
    out, t = [], 0.0
    for tick, phase in enumerate(["before"] * 3 + ["out"] * 2 +
                                 ["moved"] * 3 + ["back"] * 2 +
                                 ["after"] * 3):
        for a, b in migrate.PAIRS:
            here = migrate.SERVERS.get(phase)
            region = here is not None and here[a] == here[b]
            out.append({"tick": tick, "t": t, "phase": phase, "a": a,
                        "b": b, "pair": f"{a}-{b}",
                        "latency_us": 10.0 if region else 100.0,
                        "bandwidth_MBps": 1000.0 if region else 10.0})
        t += 7.0 if tick == 3 else 2.0
    return out


def test_stall_is_the_longest_tick_of_a_move_less_the_median_before():
    moves = [{"phase": "out", "downtime_ms": 1000},
             {"phase": "back", "downtime_ms": 500}]
    st = migrate.stalls(_runs(), moves)
    assert [(s["phase"], s["stall_s"]) for s in st] == [("out", 5.0),
                                                         ("back", 0.0)]
    res = BenchResults(runs=_runs())
    res.records = summarize(res.runs, ("pair", "phase"), ("latency_us",))
    ts = migrate.targets(res, {"migrations": moves, "stalls": st})
    # the core pairs as slow as before while moving, the new neighbours
    # as fast as the old ones
    assert [t.value for t in ts[:3]] == [1.0, 1.0, 1.0]
    # 5 s of stall against 1 s of downtime plus 1 s
    assert [t.status for t in ts[3:]] == ["MISS", "PASS"]
    assert ts[3].value == 2.5


def test_a_pair_sharing_a_host_cpu_is_judged_only_against_its_like():
    """Round-robin pinning on 2 host CPUs: ranks 0 and 2 share CPU 0, so
    pair 0-2 waits for the host's scheduler while moved (here 100x);
    0-1 shares none, so 0-2 is left out of the comparison with it and
    marked in the table."""
    runs = _runs()
    for r in runs:
        if r["pair"] == "0-2" and r["phase"] == "moved":
            r["latency_us"] = 1000.0
    res = BenchResults(runs=runs)
    res.records = summarize(res.runs, ("pair", "phase"), ("latency_us",))
    cpus = {"s0i0": [0], "s0i1": [1], "s1i0": [0], "s1i1": [1]}
    fields = {"migrations": [], "stalls": [], "cpus": cpus}
    assert migrate.shares_cpu((0, 2), fields)
    assert not migrate.shares_cpu((0, 1), fields)
    assert [t.value for t in migrate.targets(res, fields)[1:3]] == [1.0, 1.0]
    unpinned = {"migrations": [], "stalls": []}
    assert migrate.targets(res, unpinned)[1].value == 100.0
