"""With --mpi openmpi5, mpich or impi (the PyPI MPIs, ivcloud.mpis, all
through libfabric): is our ivshm provider between two instances as fast
as that MPI's shared memory inside one?

mpi-osu built with the MPI's compiler, on 1 server x 2 instances, in
the configurations own-shm, shm, ivshmem and tcp, alternating in rounds
(BENCHMARKS.md, "MPI across MPIs").
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .. import mpis
from ..cluster.job import Job
from ..cluster.session import ClusterSession
from ..errors import BenchError, InvalidRequest
from ..mpis import provider
from .toolkit import (MIB, BenchResults, Target, check_transports,
                      cluster_job, compile_mpi, count, measure_rounds,
                      native_source, parse_records, print_grid, require_root,
                      run_benchmark, spread)

CONFIGS = ["own-shm", "shm", "ivshmem", "tcp"]
# where each configuration's two ranks run
ONE_INSTANCE = ("s0i0", "s0i0")
TWO_INSTANCES = ("s0i0", "s0i1")
HOSTS = {"own-shm": ONE_INSTANCE, "shm": ONE_INSTANCE,
         "ivshmem": TWO_INSTANCES, "tcp": TWO_INSTANCES}
WHERE = {"own-shm": "1 instance, the MPI's own shared memory",
         "shm": "1 instance, libfabric shm",
         "ivshmem": "2 instances, ivshm",
         "tcp": "2 instances, libfabric tcp"}
SIZES = [8, MIB]
KEYS = ("transport", "test", "ranks", "size", "latency_us",
        "bandwidth_MBps")
OSU_SOURCE = "bench/osu.c"


def covers(name: str) -> bool:
    """Whether this benchmark measures MPI `name` (one through
    libfabric); MpiFlavorError for an unknown name."""
    return isinstance(mpis.flavor(name), mpis.OfiFlavor)


@dataclass
class OfiSettings:
    mpi: str
    iters: int          # operations for 8 B
    budget: int         # bytes per size (caps the operations of 1 MiB)
    timeout_s: int      # per job
    configs: List[str]
    rounds: int = 3
    quick: bool = False

    @classmethod
    def make(cls, mpi_name: str, quick: bool = False,
             iters: Optional[int] = None,
             configs: Optional[Sequence[str]] = None,
             rounds: Optional[int] = None) -> "OfiSettings":
        flavor = mpis.flavor(mpi_name)
        if not covers(mpi_name):
            raise InvalidRequest(f"{flavor.title} does not go through "
                                 f"libfabric")
        return cls(mpi=mpi_name,
                   iters=count("operations", iters) or
                   (2000 if quick else 20000),
                   budget=(16 if quick else 512) * MIB,
                   timeout_s=60 if quick else 300,
                   configs=(check_transports(configs, CONFIGS) if configs
                            else [c for c in CONFIGS
                                  if c not in flavor.lacks]),
                   rounds=count("rounds", rounds) or (1 if quick else 3),
                   quick=quick)


# ---------------------------------------------------------------- program

def build_osu(flavor: mpis.Flavor) -> Path:
    """mpi-osu built by this MPI's compiler into its prefix (which the
    instances see), again whenever the source is newer."""
    out = flavor.prefix() / "ivcloud-bench" / "mpi-osu"
    if out.exists() and out.stat().st_mtime >= native_source(
            OSU_SOURCE).stat().st_mtime:
        return out
    out.parent.mkdir(exist_ok=True)
    return compile_mpi(flavor, OSU_SOURCE, out)


# ---------------------------------------------------------------- running

def run_config(session: ClusterSession, s: OfiSettings, osu: Path,
               config: str) -> List[Dict]:
    """One job of mpi-osu's latency and bw tests in `config`; ivshmem
    jobs must show both ranks' traffic in their fi_ivshm lines."""
    report = config == "ivshmem"
    argv = [str(osu), "--test", "latency,bw", "--sizes",
            ",".join(map(str, SIZES)), "--iters", str(s.iters), "--budget",
            str(s.budget), "--transport", config]
    origin = f"mpi-osu {s.mpi} {config}"

    # ivshmem: the job's own region on the server, as cluster mpirun
    stdout, stderr = cluster_job(session, Job(
        argv, 2, mpi=s.mpi, transport=config, hosts=HOSTS[config],
        report=report), s.timeout_s, origin)
    recs = parse_records(stdout, origin, KEYS)
    if report:
        lines = provider.parse_reports(stdout + stderr)
        busy = [p for p, c in lines.items()
                if c["sent"] and c["received"] and not c["delegated"]]
        if len(busy) < 2:
            raise BenchError(f"{origin}: the ranks' fi_ivshm lines do not "
                             f"show both ranks' traffic over the region: "
                             f"{sorted(lines.values(), key=str)}")
    for rec in recs:
        rec.update(mpi=s.mpi, where=WHERE[config])
        if rec["test"] == "bw":
            rec["msg_rate_M"] = 1.0 / rec["latency_us"]
    return recs


def measure(s: OfiSettings, log=None) -> BenchResults:
    """Every configuration in rounds; res.fields: the cluster and the
    ratios."""
    log = log or sys.stderr
    require_root("mpi")
    flavor = mpis.flavor(s.mpi)
    for config in s.configs:
        flavor.check(config)
    osu = build_osu(flavor)
    res = BenchResults()
    with ClusterSession("bm", 1, 2, 2, log=log) as session:
        measure_rounds(res, f"mpi {s.mpi}", s.rounds,
                       [(c, functools.partial(run_config, session, s, osu, c))
                        for c in s.configs], log,
                       ("transport", "test", "size"),
                       ("latency_us", "bandwidth_MBps", "msg_rate_M"))
        res.fields["cluster"] = session.describe()
    res.fields["ratios"] = ratios(res, s.configs)
    for why in (f"{c}: {flavor.lacks[c]}" for c in CONFIGS
                if c in flavor.lacks):
        res.notes.append(f"not measured: {why}")
    return res


# ---------------------------------------------------------------- ratios

# The figures a ratio compares: (name, test, size, field, the better
# direction of ivshm / reference: "<=" for a time, ">=" for a rate, the
# goal of the MPI across two instances over ivshm against its own shared
# memory in one (docs/mpi.md, "bench mpi"), the name in a column head)
FIGURES = [("8 B latency", "latency", 8, "latency_us", "<=", 1.05, "8 B lat"),
           ("8 B message rate", "bw", 8, "msg_rate_M", ">=", 0.95,
            "8 B rate"),
           ("1 MiB bandwidth", "bw", MIB, "bandwidth_MBps", ">=", 0.9,
            "1 MiB bw")]
# the reference of every ratio first, libfabric's shm second
REFERENCES = ["own-shm", "shm"]


def ratio(res: BenchResults, config: str, reference: str, test: str,
          size: int, key: str) -> Optional[Dict]:
    """config's figure over reference's: `ratio` the median of the
    rounds' own ratios (both measured in the same round, so that a state
    of the machine that lasts a round divides out) with their min and
    max, and the `rounds`; the ratio of the medians (rounds 0) where no
    round holds both. None without both figures."""
    def figures(cfg):
        return {r["round"]: r[key] for r in res.runs
                if r.get("transport") == cfg and r.get("test") == test
                and r.get("size") == size and r.get(key)
                and "round" in r}
    num, den = figures(config), figures(reference)
    per_round = [num[k] / den[k] for k in sorted(num) if k in den]
    if per_round:
        return {"ratio": statistics.median(per_round),
                "ratio_min": min(per_round), "ratio_max": max(per_round),
                "rounds": len(per_round)}
    a = res.find(transport=config, test=test, size=size)
    b = res.find(transport=reference, test=test, size=size)
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return {"ratio": a[key] / b[key], "rounds": 0}


def ratios(res: BenchResults, configs: Sequence[str]) -> List[Dict]:
    """Every configuration's figures against own-shm (the MPI's own
    shared memory in one instance, the comparison that counts) and
    against libfabric's shm: one entry per configuration, reference and
    figure (None where either was not measured)."""
    out = []
    for ref in REFERENCES:
        for config in configs:
            if config == ref:
                continue
            for name, test, size, key, *_ in FIGURES:
                out.append({"transport": config, "reference": ref,
                            "figure": name, "field": key, "ratio": None,
                            **(ratio(res, config, ref, test, size, key)
                               or {"rounds": 0})})
    return out


# ---------------------------------------------------------------- targets

def targets(res: BenchResults, mpi_name: str) -> List[Target]:
    """FIGURES' goals of ivshm against own-shm: the median of the rounds'
    ratios, `best` the most favourable round."""
    ts = []
    for name, test, size, key, op, goal, _ in FIGURES:
        what = f"{mpi_name}: {name} ivshm / own-shm"
        r = ratio(res, "ivshmem", "own-shm", test, size, key)
        if r is None:
            ts.append(Target(what, None, op, goal, "record missing"))
            continue
        best = r.get("ratio_min" if op == "<=" else "ratio_max")
        ts.append(Target(what, r["ratio"], op, goal, best=best))
    return ts


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, configs: Sequence[str], out) -> None:
    """One row per configuration: 8 B latency, 8 B message rate, 1 MiB
    bandwidth, each median with the rounds' spread."""
    def cell(config, test, size, key, fmt):
        r = res.find(transport=config, test=test, size=size)
        if r is None or r.get(key) is None:
            return "-"
        sp = spread(r, key, fmt)
        return fmt.format(r[key]) + (f" ({sp})" if sp else "")

    rows = [[c, WHERE[c],
             cell(c, "latency", 8, "latency_us", "{:.2f}"),
             cell(c, "bw", 8, "msg_rate_M", "{:.2f}"),
             cell(c, "bw", MIB, "bandwidth_MBps", "{:.0f}")]
            for c in configs]
    print_grid(["config", "where", "8 B latency us", "8 B rate M/s",
                "1 MiB MB/s"], rows, out)


def print_ratios(rs: Sequence[Dict], configs: Sequence[str],
                 out) -> None:
    """Each configuration against own-shm (first) and against libfabric's
    shm (second), figure by figure: the median of the rounds' ratios."""
    def cell(config, ref, figure):
        r = next((x for x in rs if x["transport"] == config
                  and x["reference"] == ref and x["figure"] == figure),
                 None)
        if r is None or r["ratio"] is None:
            return "-"
        return f"{r['ratio']:.2f}" + (
            f" ({r['ratio_min']:.2f}..{r['ratio_max']:.2f})"
            if r["rounds"] > 1 else "")

    rows = [[c] + [cell(c, ref, name) for name, *_ in FIGURES
                   for ref in REFERENCES]
            for c in configs if c != "own-shm"]
    out.write("\nRatios, median of the rounds' (min..max): "
              "against own-shm, then against libfabric shm\n")
    print_grid(["config"] + [f"{short} / {ref}" for *_, short in FIGURES
                             for ref in REFERENCES], rows, out)


def run(s: OfiSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`: 1 if a configuration failed."""
    flavor = mpis.flavor(s.mpi)

    def print_tables(res: BenchResults, out) -> None:
        cluster = res.fields["cluster"]
        out.write(f"{flavor.title}, 2 ranks; cluster "
                  f"{cluster['servers']} x {cluster['instances_per_server']} "
                  f"instances x {cluster['vcpus']} vCPUs on "
                  f"{os.cpu_count()} host CPUs\n")
        print_table(res, s.configs, out)
        print_ratios(res.fields["ratios"], s.configs, out)
    return run_benchmark(
        "mpi-ofi", s.quick, lambda: measure(s, log),
        lambda res: targets(res, s.mpi), print_tables, json_path, out,
        mpi=s.mpi, title=flavor.title,
        provider=str(provider.library()) if "ivshmem" in s.configs
        else None, rounds=s.rounds, sizes=SIZES, reference="own-shm")
