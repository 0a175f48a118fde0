"""`ivcloud bench mpi --mpi NAME`: how its rounds become ratios against
the MPI's own shared memory (own-shm, the comparison that counts) and
libfabric's shm, the targets against own-shm, and what it prints. The
measuring itself runs in `make demo` (root, the wheels)."""

from __future__ import annotations

import io

import pytest

from ivcloud.bench import ofi
from ivcloud.bench.toolkit import MIB, BenchResults, summarize


def _runs(rnd, config, lat, rate, bw):
    """One round's records of one configuration, as run_config gives
    them: latency at 8 B, bw at 8 B (with its rate) and at 1 MiB."""
    return [{"round": rnd, "transport": config, "test": "latency",
             "size": 8, "latency_us": lat, "bandwidth_MBps": 8 / lat},
            {"round": rnd, "transport": config, "test": "bw", "size": 8,
             "latency_us": 1 / rate, "bandwidth_MBps": 8 * rate,
             "msg_rate_M": rate},
            {"round": rnd, "transport": config, "test": "bw", "size": MIB,
             "latency_us": MIB / bw, "bandwidth_MBps": bw}]


def _results(rounds):
    res = BenchResults()
    for rnd, figures in enumerate(rounds):
        for config, (lat, rate, bw) in figures.items():
            res.runs += _runs(rnd, config, lat, rate, bw)
    res.records = summarize(res.runs, ("transport", "test", "size"),
                            ("latency_us", "bandwidth_MBps", "msg_rate_M"))
    return res


# the machine twice as slow in round 1 for every configuration: the
# rounds' own ratios do not move, a ratio of medians across rounds would
ROUNDS = [{"own-shm": (0.20, 10.0, 8000), "shm": (0.25, 8.0, 7000),
           "ivshmem": (0.20, 9.8, 7600), "tcp": (6.0, 0.15, 2000)},
          {"own-shm": (0.40, 5.0, 4000), "shm": (0.50, 4.0, 3500),
           "ivshmem": (0.412, 4.5, 3200), "tcp": (12.0, 0.08, 1000)},
          {"own-shm": (0.20, 10.0, 8000), "shm": (0.25, 8.0, 7000),
           "ivshmem": (0.22, 9.0, 7000), "tcp": (6.0, 0.15, 2000)}]


def test_targets_are_the_rounds_ratios_against_own_shm():
    ts = {t.name: t for t in ofi.targets(_results(ROUNDS), "mpich")}
    lat = ts["mpich: 8 B latency ivshm / own-shm"]
    rate = ts["mpich: 8 B message rate ivshm / own-shm"]
    bw = ts["mpich: 1 MiB bandwidth ivshm / own-shm"]
    assert len(ts) == 3
    # rounds 1.0, 1.03, 1.1: the median meets <= 1.05
    assert lat.value == pytest.approx(1.03) and lat.op == "<="
    assert lat.threshold == 1.05 and lat.status == "PASS"
    assert lat.best == pytest.approx(1.0)
    # 0.98, 0.90, 0.90: missed, the best round would have met 0.95
    assert rate.value == pytest.approx(0.90) and rate.status == "MISS"
    assert rate.threshold == 0.95 and rate.within_spread
    # 0.95, 0.80, 0.875
    assert bw.value == pytest.approx(0.875) and bw.threshold == 0.9
    assert bw.best == pytest.approx(0.95) and bw.status == "MISS"


def test_ratios_against_own_shm_first_and_libfabric_shm_second():
    rs = ofi.ratios(_results(ROUNDS), ofi.CONFIGS)
    by = {(r["transport"], r["reference"], r["figure"]): r for r in rs}
    assert [r["reference"] for r in rs][:9] == ["own-shm"] * 9
    assert set(by) == {(c, ref, f) for ref in ofi.REFERENCES
                       for c in ofi.CONFIGS if c != ref
                       for f, *_ in ofi.FIGURES}
    assert by["ivshmem", "shm", "8 B latency"]["ratio"] == \
        pytest.approx(0.824)   # 0.8, 0.824, 0.88
    assert by["tcp", "own-shm", "8 B latency"]["ratio"] == \
        pytest.approx(30.0)
    assert by["own-shm", "shm", "8 B message rate"]["ratio"] == \
        pytest.approx(1.25)
    r = by["ivshmem", "own-shm", "1 MiB bandwidth"]
    assert (r["ratio_min"], r["ratio_max"], r["rounds"]) == \
        (pytest.approx(0.8), pytest.approx(0.95), 3)


def test_an_mpi_without_libfabric_shm_has_only_own_shm_ratios():
    rounds = [{c: f for c, f in rnd.items() if c != "shm"} for rnd in ROUNDS]
    configs = ["own-shm", "ivshmem", "tcp"]
    res = _results(rounds)
    rs = ofi.ratios(res, configs)
    assert all(r["ratio"] is None for r in rs if r["reference"] == "shm")
    assert all(r["ratio"] is not None for r in rs
               if r["reference"] == "own-shm")
    out = io.StringIO()
    ofi.print_table(res, configs, out)
    ofi.print_ratios(rs, configs, out)
    text = out.getvalue()
    assert "8 B lat / own-shm" in text and "8 B lat / shm" in text
    ivshm = next(ln for ln in text.splitlines()[5:]
                 if ln.lstrip().startswith("ivshmem"))
    # latency against own-shm, then '-' where shm was not measured
    assert ivshm.split()[1:3] == ["1.03", "(1.00..1.10)"]
    assert ivshm.split()[3] == "-"


def test_without_own_shm_the_targets_say_so():
    rounds = [{c: f for c, f in rnd.items() if c != "own-shm"}
              for rnd in ROUNDS]
    ts = ofi.targets(_results(rounds), "impi")
    assert [t.status for t in ts] == ["N/A"] * 3
    assert all(t.why_missing == "record missing" for t in ts)


def test_a_ratio_from_medians_where_no_round_holds_both():
    # records without their rounds (a document read back): the medians
    res = _results(ROUNDS)
    res.runs = []
    (lat, rate, bw) = ofi.targets(res, "impi")
    assert lat.value == pytest.approx(0.22 / 0.20) and lat.best is None
    assert rate.value == pytest.approx(9.0 / 10.0)
