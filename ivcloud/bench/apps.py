"""Real applications on the emulated cloud, as the papers judge it.

HPCC, OpenFOAM's simpleFoam on pitzDaily and our solver's bar
(ivcloud.apps), 2 ranks in the configurations

  one      both ranks in ONE instance (vader): the bare-metal reference
  tcp      one rank in each of two instances, over TCP on the bridge
  ivshmem  one rank in each of two instances, over our BTL

(and HPCC's one-twocopy), alternating in rounds, as speeds relative to
`one`; then a strong-scaling series on the 3-level cluster
(BENCHMARKS.md, "Applications" and "Strong scaling"; on QEMU guests:
docs/demo.md, "On QEMU guests").
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..apps import hpcc, magbar, openfoam
from ..cluster.job import Job
from ..cluster.session import ClusterSession, VmOptions
from ..errors import InvalidRequest
from ..vm.debian import SOLVER_PACKAGE
from . import report
from .toolkit import (BenchResults, Target, check_ivshmem_used, cluster_job,
                      count, measure_rounds, print_grid, require_root,
                      run_benchmark)
from .toolkit import summarize as toolkit_summarize

APPS = ("hpcc", "openfoam", "micromag")
CONFIGS = ("one", "tcp", "ivshmem")
# one server, two instances of two vCPUs: `one` gets an instance with
# as many vCPUs as the other configurations have in two instances
PAIR_SHAPE = (1, 2, 2)
# `one` with two copies per message, as between VMs (module docstring);
# HPCC only: its bandwidth figures are where the copies count
TWO_COPY = "one-twocopy"
TWO_COPY_APPS = ("hpcc",)
TWO_COPY_MCA = (("btl_vader_single_copy_mechanism", "none"),)
PAIR_HOSTS = {"one": ("s0i0", "s0i0"), TWO_COPY: ("s0i0", "s0i0"),
              "tcp": ("s0i0", "s0i1"), "ivshmem": ("s0i0", "s0i1")}
SCALING_SHAPE = (2, 2, 1)
JOB_TIMEOUT_S = 600.0
# QEMU guests: under TCG a run takes tens of times longer
VM_JOB_TIMEOUT_S = 3600.0
VM_MEMORY_MB = 1024            # two solver ranks share one guest in `one`
# --quick on guests: HPCC's kernels over virtio-net under TCG take minutes
# at N = 400 (RandomAccess's table and PTRANS grow with N^2), and the
# bar's setup (its 3,040-node boundary matrix) a minute per run: a
# smaller N and 6 nm cells (about 700 nodes) instead of 3 nm
VM_QUICK_HPCC_N = 200
VM_QUICK_MAG_CELL_NM = 6.0
VM_NO_SCALING = ("the scaling series was not run: on a VM cluster it "
                 "boots 4 more guests (2 servers x 2 x 1 vCPU); it runs "
                 "when its rank counts are given")
MAG_QUICK_S = 5e-12            # the bar relaxes 300 ps; plumbing: 5 ps

# (app, metric): (label, unit, higher is better) of what the tables show
METRICS: Dict[Tuple[str, str], Tuple[str, str, bool]] = {
    **{("hpcc", key): (label, unit, up)
       for key, label, unit, up in hpcc.METRICS},
    ("openfoam", "solver_s"): ("simpleFoam time", "s", False),
    ("micromag", "time_s"): ("bar: time to solution", "s", False),
    ("micromag", "solve_s"): ("bar: solve time", "s", False),
}
# the figure a scaling series follows, per application
SCALING_METRIC = {"hpcc": "HPL_Tflops", "openfoam": "solver_s",
                  "micromag": "time_s"}


def _refuse_unknown(what: str, given: Sequence[str],
                    known: Sequence[str], setting: str) -> None:
    unknown = [g for g in given if g not in known]
    if unknown:
        raise InvalidRequest(f"unknown {what}(s) {', '.join(unknown)} "
                             f"(choose from {', '.join(known)})",
                             setting=setting)


@dataclass(frozen=True)
class AppsSettings:
    quick: bool
    apps: Tuple[str, ...]
    rounds: int
    hpcc_n: int
    foam_iterations: int
    scaling_ranks: Tuple[int, ...]
    # the bar's mesh cells (nm); None: its own (examples/bar.toml)
    mag_cell_nm: Optional[float] = None
    # run TWO_COPY for TWO_COPY_APPS
    two_copy: bool = True
    # the CONFIGS to run (always "one", the reference of every ratio)
    pair_configs: Tuple[str, ...] = CONFIGS

    @classmethod
    def make(cls, quick: bool = False, apps: Optional[Sequence[str]] = None,
             rounds: Optional[int] = None, hpcc_n: Optional[int] = None,
             foam_iterations: Optional[int] = None,
             scaling_ranks: Optional[Sequence[int]] = None,
             vm: bool = False,
             configs: Optional[Sequence[str]] = None) -> "AppsSettings":
        """`vm`: for a VM cluster, whose scaling series (4 more guests)
        runs only when rank counts are given. `configs`: a subset of
        CONFIGS that includes "one"."""
        apps = tuple(apps) if apps else APPS
        _refuse_unknown("application", apps, APPS, "apps")
        wanted = set(configs) if configs else set(CONFIGS)
        _refuse_unknown("configuration", sorted(wanted), CONFIGS, "configs")
        if "one" not in wanted:
            raise InvalidRequest("the configurations must include one: it "
                                 "is the reference of every ratio",
                                 setting="configs")
        most = SCALING_SHAPE[0] * SCALING_SHAPE[1] * SCALING_SHAPE[2]
        # by default as many ranks as the host has CPUs (powers of two):
        # more would measure the oversubscription, not the scaling
        cpus = len(os.sched_getaffinity(0))
        if scaling_ranks is not None:
            ranks = tuple(scaling_ranks)
        elif vm:
            ranks = ()
        else:
            ranks = tuple(p for p in (1, 2, 4)
                          if p <= max(1, min(most, cpus)))
        if any(not 1 <= p <= most for p in ranks):
            raise InvalidRequest(f"scaling ranks must be 1..{most} (the "
                                 f"3-level cluster's vCPUs)",
                                 setting="ranks")
        # a quick run on guests (under TCG tens of times slower): smaller
        # still, so that a plumbing check stays a few minutes
        vm_quick = quick and vm
        return cls(quick=quick, apps=apps,
                   rounds=count("rounds", rounds) or (1 if quick else 3),
                   hpcc_n=count("HPCC problem size", hpcc_n)
                   or (VM_QUICK_HPCC_N if vm_quick else
                       400 if quick else 2000),
                   mag_cell_nm=VM_QUICK_MAG_CELL_NM if vm_quick else None,
                   foam_iterations=count("OpenFOAM iterations",
                                         foam_iterations)
                   or (5 if quick else 200),
                   scaling_ranks=tuple(sorted(set(ranks))),
                   two_copy=not vm_quick,
                   pair_configs=tuple(c for c in CONFIGS if c in wanted))

    def configs(self, app: str) -> Tuple[str, ...]:
        """The pair configurations `app` runs in, in their order."""
        if self.two_copy and app in TWO_COPY_APPS:
            return (self.pair_configs[0], TWO_COPY) + self.pair_configs[1:]
        return self.pair_configs


# ---------------------------------------------------------------- jobs

class Workloads:
    """Inputs of every application, made on this host once per cluster
    and rank count, staged where the instances see them at the same path
    (not /tmp: an instance's is private); guests mesh the OpenFOAM case
    themselves, as copying a mesh over their serial line takes minutes."""

    def __init__(self, s: AppsSettings, timeout_s: float = JOB_TIMEOUT_S):
        self.s = s
        self.timeout_s = timeout_s
        self.root = Path(tempfile.mkdtemp(prefix="ivcloud-apps-",
                                          dir="/var/tmp"))
        self._made: Dict[Tuple[str, str, int], Path] = {}
        self._runs = 0

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _input(self, cluster: ClusterSession, app: str, ranks: int,
               make: Callable[[Path], Path]) -> Path:
        """make(dir) once per (cluster, app, ranks), in a directory of its
        own that is then staged into the cluster's instances."""
        key = (cluster.name, app, ranks)
        if key not in self._made:
            d = self.root / f"{cluster.name}-{app}-{ranks}"
            made = make(d)
            cluster.stage_dir(d)
            self._made[key] = made
        return self._made[key]

    def job(self, cluster: ClusterSession, app: str, ranks: int
            ) -> Tuple[List[str], Callable[[str], Dict[str, float]]]:
        """(argv, parse(stdout) -> {metric: value}) of one run."""
        self._runs += 1
        # the instances' own solver package where they have one (guests),
        # else this checkout's solver, which they see
        packaged = any(p.startswith(f"{SOLVER_PACKAGE}_")
                       for p in cluster.guest_packages)
        if app == "micromag":
            problem = self._input(cluster, app, 0, lambda d: magbar.prepare(
                d, MAG_QUICK_S if self.s.quick else None,
                self.s.mag_cell_nm))
            # rank 0 makes it, in the staged directory (the job user's)
            out = problem.parent / f"out-{self._runs}"
            argv = (magbar.packaged_command(problem, out) if packaged
                    else magbar.command(problem, out))
            return argv, lambda stdout: magbar.results_of(
                cluster.read_file(out / magbar.SUMMARY), out)
        if app == "hpcc":
            work = self._input(cluster, app, ranks, lambda d: hpcc.prepare(
                d, ranks, self.s.hpcc_n))
            # hpcc reads and writes its files in its working directory;
            # rank 0 appends to the output file, so it goes when read
            argv = ["/usr/bin/env", "-C", str(work)] + \
                [f"{k}={v}" for k, v in hpcc.ENV.items()] + hpcc.command()
            return argv, lambda stdout: hpcc.results_of(cluster.read_file(
                work / hpcc.OUTPUT, remove=True))
        case = self._input(cluster, app, ranks, lambda d: openfoam.write_case(
            d, ranks, self.s.foam_iterations))
        if (cluster.name, "mesh", ranks) not in self._made:
            for cmd in openfoam.mesh_commands(case, ranks):
                cluster.run_everywhere(cmd, openfoam.ENV)
            self._made[(cluster.name, "mesh", ranks)] = case
        return (openfoam.command(case, ranks),
                lambda out: {"solver_s": openfoam.execution_time(out)})


def run_app(cluster: ClusterSession, work: Workloads, app: str,
            config: str, hosts: Sequence[str], transport: str,
            metrics: Optional[Sequence[str]] = None) -> List[Dict]:
    """One run of `app` with rank r on hosts[r]; its records (one per
    metric, or per metric of `metrics`)."""
    argv, parse = work.job(cluster, app, len(hosts))
    origin = f"{app} {config} ({len(hosts)} ranks)"
    if cluster.topo.vcpus > 1:
        kw = {"hosts": list(hosts)}
    else:
        # a one-slot rankfile would pin every rank to host CPU 0; block
        # placement over one-vCPU instances puts rank r on instance r
        instances = [i.hostname for i in cluster.topo.instance_list()]
        if list(hosts) != instances[:len(hosts)]:
            raise InvalidRequest(f"{origin}: ranks on {hosts} need a "
                                 f"rankfile; instances have one vCPU")
        kw = {"placement": "block"}
    # the pair's ivshmem configuration must really go through the BTL:
    # its counters say so (printed at finalize, on stderr)
    check = config == "ivshmem"
    mca = list(TWO_COPY_MCA) if config == TWO_COPY else []
    if check:
        mca.append(("btl_ivshmem_verbose", "1"))
    t0 = time.monotonic()
    stdout, stderr = cluster_job(cluster, Job(
        argv, len(hosts), transport=transport, options=mca, **kw),
        work.timeout_s, origin)
    wall = time.monotonic() - t0
    counters = check_ivshmem_used(stderr, len(hosts), origin) \
        if check else None
    values = parse(stdout)
    recs = [{"app": app, "config": config, "ranks": len(hosts),
             "transport": transport, "hosts": list(hosts),
             "instance_kind": cluster.kind,
             "metric": metric, "value": value,
             "unit": METRICS[(app, metric)][1], "wall_s": wall}
            for metric, value in values.items()
            if metrics is None or metric in metrics]
    for r in recs:
        if config == TWO_COPY:
            r["mca"] = dict(TWO_COPY_MCA)
        if cluster.accel:
            r["accel"] = cluster.accel
        if counters is not None:
            r["ivshmem_btl"] = {str(k): v for k, v in counters.items()}
    return recs


# ---------------------------------------------------------------- summary

SUMMARY_KEYS = ("app", "config", "ranks", "metric")


def summarize(records: Sequence[Dict]) -> List[Dict]:
    """Every (app, config, ranks, metric): `value` (and `wall_s`) the
    median of its rounds, with value_min, value_max and runs."""
    return sorted(toolkit_summarize(records, SUMMARY_KEYS,
                                    ("value", "wall_s")),
                  key=lambda r: tuple(r[k] for k in SUMMARY_KEYS))


def speed(app: str, metric: str, value: float, reference: float
          ) -> Optional[float]:
    """`value` as a speed relative to `reference` (1.0: as fast)."""
    if not value or not reference:
        return None
    higher_better = METRICS[(app, metric)][2]
    return value / reference if higher_better else reference / value


# (key in `relative`, configuration, reference configuration)
RATIOS = (("tcp_vs_one", "tcp", "one"), ("ivshmem_vs_one", "ivshmem", "one"),
          ("ivshmem_vs_tcp", "ivshmem", "tcp"),
          ("ivshmem_vs_one_twocopy", "ivshmem", TWO_COPY))


def relative(summary: Sequence[Dict]) -> List[Dict]:
    """Per app and metric: tcp and ivshmem medians as speeds relative to
    one, ivshmem relative to tcp and (where it ran) to one-twocopy; with
    each, as KEY_best, the most favourable speed the runs' spreads allow
    (our best run against the reference's worst), and as KEY_worst the
    least favourable: a ratio that misses its target while KEY_best
    meets it is not told apart from the noise by this many rounds."""
    by = {(r["app"], r["config"], r["metric"]): r
          for r in summary if r["config"] in PAIR_HOSTS}
    rows = []
    for (app, metric) in METRICS:
        if (app, "one", metric) not in by:
            continue
        row = {"app": app, "metric": metric}
        for key, ours, ref in RATIOS:
            a, b = by.get((app, ours, metric)), by.get((app, ref, metric))
            row[key] = row[f"{key}_best"] = row[f"{key}_worst"] = None
            if a and b and a["value"] and b["value"]:
                row[key], row[f"{key}_best"], row[f"{key}_worst"] = \
                    _speeds(app, metric, a, b)
        rows.append(row)
    return rows


def _speeds(app: str, metric: str, rec: Dict, ref: Dict
            ) -> Tuple[Optional[float], ...]:
    """Summarized record `rec` as a speed relative to `ref`: (of the
    medians, the most favourable and the least favourable the runs'
    extremes allow)."""
    def extreme(r: Dict, highest: bool) -> float:
        return r.get("value_max" if highest else "value_min", r["value"])
    up = METRICS[(app, metric)][2]
    return (speed(app, metric, rec["value"], ref["value"]),
            speed(app, metric, extreme(rec, up), extreme(ref, not up)),
            speed(app, metric, extreme(rec, not up), extreme(ref, up)))


def scaling(summary: Sequence[Dict], cpus: int) -> List[Dict]:
    """T/S/E rows per app (medians; the speed-up's extremes from the
    rounds' extremes), each row marked `oversubscribed` when it ran more
    ranks than the `cpus` the host gave this process, and Amdahl's
    serial fraction where report.scaling_view allows a fit (else None,
    and `fit_note` says why)."""
    out = []
    for app, metric in SCALING_METRIC.items():
        pts = {r["ranks"]: r for r in summary
               if r["app"] == app and r["config"] == "scaling"
               and r["metric"] == metric}
        if 1 not in pts:
            continue
        one = pts[1]
        rows = []
        for p in sorted(pts):
            r = pts[p]
            s, s_max, s_min = _speeds(app, metric, r, one)
            rows.append({
                "ranks": p, "value": r["value"],
                "value_min": r.get("value_min"),
                "value_max": r.get("value_max"), "speedup": s,
                "speedup_min": s_min, "speedup_max": s_max,
                "efficiency": s / p if s else None,
                "oversubscribed": p > cpus})
        series = {"app": app, "metric": metric,
                  "label": METRICS[(app, metric)][0],
                  "unit": METRICS[(app, metric)][1], "rows": rows}
        view = report.scaling_view(series, cpus)
        series["amdahl_serial_fraction"] = view["fit"]
        series["fit_note"] = "; ".join(view["notes"])
        out.append(series)
    return out


def targets(rel: Sequence[Dict], s: AppsSettings) -> List[Target]:
    """The targets of docs/demo.md, section 3, as speeds relative to one
    instance; for HPCC also relative to one instance with two copies per
    message."""
    ts = []
    for r in rel:
        name = f"{r['app']} {METRICS[(r['app'], r['metric'])][0]}"
        def goal(what: str, key: str, threshold: float) -> Target:
            return Target(f"{name}: ivshmem vs {what}", r[key], ">=",
                          threshold, "not measured", best=r[f"{key}_best"])

        ran = s.configs(r["app"])
        if "ivshmem" not in ran:
            continue
        if r["app"] == "hpcc":
            ts.append(goal("one", "ivshmem_vs_one", 0.9))
            if TWO_COPY in ran:
                ts.append(goal("one with two copies",
                               "ivshmem_vs_one_twocopy", 0.9))
        else:
            # within 1.05x of one instance's time
            ts.append(goal("one", "ivshmem_vs_one", round(1 / 1.05, 3)))
        if "tcp" in ran:
            ts.append(goal("tcp", "ivshmem_vs_tcp", 1.0))
    return ts


# ---------------------------------------------------------------- output

def print_tables(res: BenchResults, out) -> None:
    """The tables of run_benchmark's `res`, under a line saying what the
    instances are when they are QEMU guests."""
    doc = {"records": res.records, **res.fields}
    if doc["cluster"].get("instance_kind") == "vm":
        out.write(f"\n{report.guest_title(doc['cluster'].get('accel'))}\n")
    header, rows = report.apps_table(doc)
    if rows:
        out.write("\nApplications, 2 ranks (median of rounds, "
                  "min..max; speed relative to one instance)\n")
        print_grid(header, rows, out)
    for series in doc["scaling"]:
        header, rows, notes = report.scaling_table(series,
                                                   doc["scaling_cpus"])
        out.write(f"\nStrong scaling, {series['app']} (ivshmem, 3-level "
                  f"cluster)\n")
        if rows:
            print_grid(header, rows, out)
        for note in notes:
            out.write(f"{note}\n")


def run(s: AppsSettings, out_dir: Path, json_path: Optional[Path] = None,
        keep_cluster: bool = False, out=None, log=None,
        vm: Optional[VmOptions] = None) -> int:
    """Every application in every configuration, then the scaling
    series (run_benchmark), then report.publish; 1 if a run or the
    report failed. `vm`: the instances are QEMU guests (the inputs
    copied in, the solver from its package)."""
    require_root("apps")
    log = log or sys.stderr
    # both clusters refuse (no QEMU, no guest package, memory) before
    # anything is made
    pair = ClusterSession("apps", *PAIR_SHAPE, keep=keep_cluster, log=log,
                          vm=vm)
    scale = ClusterSession("scal", *SCALING_SHAPE, keep=keep_cluster,
                           log=log, vm=vm) if s.scaling_ranks else None
    if vm is not None and "micromag" in s.apps and not any(
            p.startswith(f"{SOLVER_PACKAGE}_") for p in pair.guest_packages):
        raise InvalidRequest(f"the guests would have no {SOLVER_PACKAGE} "
                             f"package: it is looked for beside the guest "
                             f"package (`make deb` builds both)",
                             setting="guest_deb")
    if vm is not None and not s.scaling_ranks:
        log.write(f"note: {VM_NO_SCALING}\n")

    def measure() -> BenchResults:
        res = BenchResults(fields={"scaling_cluster": None})
        work = Workloads(s, JOB_TIMEOUT_S if vm is None else VM_JOB_TIMEOUT_S)
        try:
            with pair:
                # an application's configurations run back to back: the
                # machine's state changes over seconds to minutes
                # (BENCHMARKS.md), and the ratios compare runs of one app
                measure_rounds(res, "apps", s.rounds, [
                    (f"{app} {config}", functools.partial(
                        run_app, pair, work, app, config, PAIR_HOSTS[config],
                        "ivshmem" if config == "ivshmem" else "tcp"))
                    for app in s.apps for config in s.configs(app)], log)
                res.fields["cluster"] = pair.describe()
            if scale is not None:
                with scale:
                    hosts = [i.hostname for i in scale.topo.instance_list()]
                    measure_rounds(res, "apps", s.rounds, [
                        (f"{app} scaling {p} ranks", functools.partial(
                            run_app, scale, work, app, "scaling", hosts[:p],
                            "ivshmem", (SCALING_METRIC[app],)))
                        for p in s.scaling_ranks for app in s.apps], log)
                    res.fields["scaling_cluster"] = scale.describe()
        finally:
            work.close()
        # as in every benchmark: records are the medians, runs every round's
        summary = res.records = summarize(res.runs)
        if vm is None:
            res.notes.append("instances are namespaces, not VMs")
        else:
            res.notes.append(
                f"instances are QEMU guests "
                f"({str(res.fields['cluster'].get('accel')).upper()}): tcp "
                f"is virtio-net through a tap in the server's bridge, "
                f"ivshmem the ivshmem-doorbell device on the server's "
                f"standing region; the inputs were copied into the guests "
                f"and the OpenFOAM case meshed there, the bar ran on the "
                f"{SOLVER_PACKAGE} package")
            if not s.scaling_ranks:
                res.notes.append(VM_NO_SCALING)
        skipped = [c for c in CONFIGS if c not in s.pair_configs]
        if skipped:
            res.notes.append(f"configuration(s) left out on request: "
                             f"{', '.join(skipped)}")
        if s.mag_cell_nm is not None:
            res.notes.append(f"the bar ran on a coarser mesh than the "
                             f"thesis's (cells of {s.mag_cell_nm:g} nm, not "
                             f"3 nm): a plumbing check")
        cpus = len(os.sched_getaffinity(0))
        res.fields.update(
            relative=relative(summary), scaling=scaling(summary, cpus),
            scaling_cpus=cpus,
            metrics={f"{a}:{m}": {"label": v[0], "unit": v[1],
                                  "higher_is_better": v[2]}
                     for (a, m), v in METRICS.items()})
        return res
    return run_benchmark(
        "apps", s.quick, measure,
        lambda res: targets(res.fields["relative"], s), print_tables,
        out=out, publish=functools.partial(
            report.publish, "apps", out=out_dir, json_path=json_path,
            stdout=out),
        configs={c: list(PAIR_HOSTS[c]) for c in PAIR_HOSTS},
        rounds=s.rounds, hpcc_n=s.hpcc_n,
        foam_iterations=s.foam_iterations, mag_cell_nm=s.mag_cell_nm)
