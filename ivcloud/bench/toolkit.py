"""What every benchmark shares (the shape of a benchmark module:
ivcloud/bench/__init__.py): running the native benchmark programs,
their JSON records, the step loop that survives a failed step, targets
as ratios, tables, the machine's load and the JSON document.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import (Callable, Dict, Iterable, List, Optional, Sequence,
                    Tuple, TypeVar)

from ..mpis import local, openmpi
from ..errors import (BenchError, ClusterError, InvalidRequest, IvcloudError,
                      JobTimeout)
from ..native import native_file

MIB = 1 << 20

# What one failed step of a benchmark may raise without stopping the rest:
# BenchError, every area's domain error, a program that could not run.
STEP_ERRORS = (IvcloudError, OSError, subprocess.SubprocessError)

T = TypeVar("T")


# ---------------------------------------------------------------- programs

def program(name: str) -> Path:
    """The native benchmark program `name` (native/bench), absolute, so
    that it can be run from inside a cluster's instances too."""
    return native_file(name, BenchError, program=True).resolve()


def native_source(name: str) -> Path:
    """A source file of native/ (`bench/osu.c`), absolute."""
    return Path(__file__).resolve().parent.parent.parent / "native" / name


def compile_mpi(flavor, name: str, out: Path) -> Path:
    """native/`name` built by MPI `flavor`'s compiler (an ivcloud.mpis
    Flavor) as `out`, whole or not at all; `out`."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    try:
        proc = subprocess.run(flavor.compile_command(native_source(name),
                                                     tmp, ["-O2"]),
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise BenchError(f"cannot build {name} for {flavor.title}: {e}")
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BenchError(f"cannot build {name} for {flavor.title}: "
                         f"{proc.stderr.strip()[-300:]}")
    tmp.replace(out)
    return out


def csv(values: Iterable[int]) -> str:
    """A program's list argument: '8,4096,1048576'."""
    return ",".join(str(v) for v in values)


# Open MPI's chatter on stderr (btl_base_verbose, the rsh launcher's
# setpgid warning in a namespace, banner rules): never why a job failed.
_CHATTER_RE = re.compile(r"^(---|\[[^\]]+\] (mca: |btl:|plm:rsh: Warning))")


def tail(text: Optional[str]) -> str:
    """The last line of a failed program's stderr that says something."""
    lines = [ln.strip() for ln in (text or "").splitlines()
             if ln.strip() and not _CHATTER_RE.match(ln)]
    return lines[-1] if lines else "no message"


def parse_records(text: str, origin: str,
                  keys: Sequence[str]) -> List[Dict]:
    """The JSON records (one object a line) a benchmark program printed,
    each checked for `keys`; other lines are skipped. At least one."""
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise BenchError(f"{origin}: unparsable output line: "
                             f"{line[:120]}")
        for key in keys:
            if key not in rec:
                raise BenchError(f"{origin}: record without '{key}'")
        records.append(rec)
    if not records:
        raise BenchError(f"{origin}: produced no records")
    return records


def checked_run(start: Callable[..., int], timeout_s: float,
                origin: str) -> Tuple[str, str]:
    """(stdout, stderr) of one program run that must succeed:
    ``start(timeout=, stdout=, stderr=)`` runs it to its exit status, or
    tears it down at the timeout, raising subprocess.TimeoutExpired or
    JobTimeout. Output goes to files: a chatty job cannot block on a
    full pipe."""
    with tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        try:
            status = start(timeout=timeout_s, stdout=out, stderr=err)
        except (subprocess.TimeoutExpired, JobTimeout):
            raise BenchError(f"{origin}: no result within {timeout_s:g} s")
        except IvcloudError as e:
            if isinstance(e, BenchError):
                raise
            raise BenchError(f"{origin}: {e}") from e
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if status != 0:
        raise BenchError(f"{origin}: exit status {status}: {tail(stderr)}")
    return stdout, stderr


def run_closed(argv: Sequence[str], env: Optional[Dict[str, str]] = None,
               timeout: Optional[float] = None, stdout=None,
               stderr=None) -> int:
    """A checked_run `start` of a plain command, its stdin closed (an
    mpirun below would forward ours to rank 0)."""
    return subprocess.run(list(argv), env=env, timeout=timeout, stdout=stdout,
                          stderr=stderr, stdin=subprocess.DEVNULL).returncode


def cluster_job(session, job, timeout_s: float, origin: str
                ) -> Tuple[str, str]:
    """(stdout, stderr) of one job on a ClusterSession that must succeed
    (checked_run of ivcloud.cluster.job's pipeline)."""
    def start(timeout, stdout, stderr) -> int:
        return session.run_job(replace(job, timeout=timeout), stdout, stderr)
    return checked_run(start, timeout_s, origin)


def require_root(bench: str) -> None:
    """A benchmark that brings up an emulated cluster refuses early."""
    if os.geteuid() != 0:
        raise ClusterError(f"bench {bench} needs root (it brings up an "
                           f"`ivcloud cluster`)")


def count(what: str, value: Optional[int]) -> Optional[int]:
    """A setting that counts something (None: the default): at least 1."""
    if value is not None and value < 1:
        raise InvalidRequest(f"the number of {what} must be at least 1, "
                             f"not {value}")
    return value


# ---------------------------------------------------------------- results

def find_record(records: Iterable[Dict], **match) -> Optional[Dict]:
    """The first record whose fields equal `match` (None: any value)."""
    for r in records:
        if all(v is None or r.get(k) == v for k, v in match.items()):
            return r
    return None


@dataclass
class BenchResults:
    """What a benchmark run gathered: its records (with rounds, the
    medians of `runs`), notes for the reader, the steps that failed
    (any failure makes the exit status 1), and the document's fields
    that only measuring learns (the cluster it ran on)."""
    records: List[Dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)
    runs: List[Dict] = field(default_factory=list)
    fields: Dict = field(default_factory=dict)

    def find(self, **match) -> Optional[Dict]:
        return find_record(self.records, **match)

    @property
    def exit_status(self) -> int:
        return 1 if self.failed else 0


def attempt(res: BenchResults, bench: str, what: str, fn: Callable[[], T],
            log=None) -> Optional[T]:
    """fn()'s result, or None after noting its failure in `res`: one
    failed step does not stop the others."""
    log = log or sys.stderr
    log.write(f"bench {bench}: {what} ...\n")
    log.flush()
    t0 = time.monotonic()
    try:
        out = fn()
    except STEP_ERRORS as e:
        res.failed.append(what)
        res.notes.append(f"{what} failed: {e}")
        log.write(f"bench {bench}: {what} failed: {e}\n")
        return None
    log.write(f"bench {bench}: {what} done in "
              f"{time.monotonic() - t0:.1f} s\n")
    return out


def measure_rounds(res: BenchResults, bench: str, rounds: int,
                   steps: Sequence[Tuple[str, Callable[[], List[Dict]]]],
                   log=None, by: Sequence[str] = (),
                   medians: Sequence[str] = ()) -> BenchResults:
    """Every step once per round, the steps alternating within a round
    (one run on a shared machine is not a measurement: what disturbs one
    configuration then disturbs the others too), in reverse order every
    second round (A B C, C B A, ...), so that a machine state drifting in
    time favours no step. Each record, tagged with its `round`, goes to
    res.runs; a failed step is noted and the rest go on. With `by`,
    res.records become the runs summarized by those keys (the medians of
    `medians`); `res`."""
    for rnd in range(rounds):
        for name, fn in (steps if rnd % 2 == 0 else steps[::-1]):
            what = name if rounds == 1 else f"{name} (round {rnd + 1})"
            for rec in attempt(res, bench, what, fn, log) or []:
                rec["round"] = rnd
                res.runs.append(rec)
    if by:
        res.records = summarize(res.runs, by, medians)
    return res


def summarize(runs: Sequence[Dict], keys: Sequence[str],
              fields: Sequence[str], middle: Sequence[str] = ()
              ) -> List[Dict]:
    """One record per group of equal `keys`: each of `fields` is the
    median over the group (with FIELD_min, FIELD_max) and `runs` its
    size; each of `middle` (what has no median: a vector, a flag) the
    value of the middle one of the group's runs that have it; the other
    fields come from the group's first record."""
    groups: Dict[Tuple, List[Dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for recs in groups.values():
        rec = {k: v for k, v in recs[0].items() if k != "round"}
        for f in fields:
            vals = [r[f] for r in recs if r.get(f) is not None]
            if vals:
                rec[f] = statistics.median(vals)
                rec[f"{f}_min"], rec[f"{f}_max"] = min(vals), max(vals)
        for f in middle:
            vals = [r[f] for r in recs if f in r]
            if vals:
                rec[f] = vals[len(vals) // 2]
        rec["runs"] = len(recs)
        out.append(rec)
    return out


def spread(rec: Dict, f: str, fmt: str = "{:.3g}", unit: float = 1.0) -> str:
    """'min..max' of a summarized field (in `unit`s), '' for a single
    run."""
    if rec.get("runs", 1) < 2 or f"{f}_min" not in rec:
        return ""
    return (f"{fmt.format(rec[f + '_min'] / unit)}.."
            f"{fmt.format(rec[f + '_max'] / unit)}")


# ---------------------------------------------------------------- targets

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt}


@dataclass
class Target:
    """A goal stated as a ratio measured within one run (informational:
    the machine is small and shared)."""
    name: str
    value: Optional[float]
    op: str
    threshold: float
    why_missing: str = ""
    # the most favourable value the runs' spread allows, where known
    best: Optional[float] = None

    def _meets(self, v: float) -> bool:
        return OPS[self.op](v, self.threshold)

    @property
    def status(self) -> str:
        if self.value is None:
            return "N/A"
        return "PASS" if self._meets(self.value) else "MISS"

    @property
    def within_spread(self) -> bool:
        """A miss that the runs' spread still reaches: these rounds do
        not tell it from the noise."""
        return (self.status == "MISS" and self.best is not None
                and self._meets(self.best))

    def to_json(self) -> Dict:
        return {"name": self.name, "value": self.value, "op": self.op,
                "threshold": self.threshold, "status": self.status,
                **({"missing": self.why_missing} if self.value is None
                   else {}),
                **({"best": self.best, "within_spread": self.within_spread}
                   if self.best is not None else {})}


def ratio_target(name: str, num: Optional[Dict], den: Optional[Dict],
                 key: str, op: str, threshold: float,
                 missing: str = "record missing") -> Target:
    """num[key] / den[key] against `threshold`; N/A (saying `missing`)
    without both records."""
    if num is None or den is None:
        return Target(name, None, op, threshold, missing)
    if not den[key]:
        return Target(name, None, op, threshold, "zero denominator")
    return Target(name, num[key] / den[key], op, threshold)


def spread_note(best: float) -> str:
    """What a miss within the runs' spread (Target.within_spread) says."""
    return f"within the runs' spread: up to {best:.3g}"


def print_targets(ts: Sequence[Target], out) -> None:
    out.write("\nTargets (ratios from this run; informational):\n")
    for t in ts:
        val = "n/a" if t.value is None else (
            f"{100 * t.value:.2f}%" if "fraction" in t.name
            else f"{t.value:.3g}")
        thr = (f"{100 * t.threshold:g}%" if "fraction" in t.name
               else f"{t.threshold:g}")
        why = f"  ({t.why_missing})" if t.value is None else ""
        if t.within_spread:
            why = f"  ({spread_note(t.best)})"
        out.write(f"  {t.status:<4}  {t.name:<44} {val:>9} {t.op} {thr}"
                  f"{why}\n")


# ---------------------------------------------------------------- output

def fmt_size(n: int) -> str:
    """8 -> '8 B', 4096 -> '4 KiB', 1048576 -> '1 MiB'."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_grid(header: Sequence[str], rows: Sequence[Sequence[str]],
               out, left: Sequence[int] = ()) -> None:
    """A table of strings, a rule under the header; the columns
    right-aligned but those numbered in `left` (names, notes)."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w)
                         in enumerate(zip(cells, widths))).rstrip()
    head = line(header)
    out.write(head + "\n" + "-" * len(head) + "\n")
    for row in rows:
        out.write(line(row) + "\n")


# ---------------------------------------------------------------- load
# docs/demo.md, "The machine's load": sampled before and after, judged
# on the shares of CPU time, not on the lagging load averages.

LOAD_SAMPLE_S = 1.0
# the CPU time others used while the sampling process slept, and what
# the hypervisor took (steal), as shares of all CPUs' time
BUSY_CPU_SHARE = 0.25
BUSY_STEAL_SHARE = 0.05


def _cpu_ticks(proc: Path) -> List[int]:
    """The first line of /proc/stat: user nice system idle iowait irq
    softirq steal ... (guest time is already in user)."""
    first = (proc / "stat").read_text().splitlines()[0].split()
    if first[0] != "cpu":
        raise OSError(f"{proc / 'stat'}: no 'cpu' line first")
    return [int(x) for x in first[1:9]] + [0] * max(0, 9 - len(first))


def load_sample(seconds: float = LOAD_SAMPLE_S,
                proc: Path = Path("/proc")) -> Dict:
    """The machine's load while this process sleeps `seconds`: the load
    averages and runnable tasks of /proc/loadavg, and from /proc/stat the
    shares of all CPUs' time that was used (neither idle nor waiting for
    I/O nor stolen) and stolen by the hypervisor."""
    before = _cpu_ticks(proc)
    time.sleep(seconds)
    after = _cpu_ticks(proc)
    fields = (proc / "loadavg").read_text().split()
    delta = [b - a for a, b in zip(before, after)]
    total, idle, steal = sum(delta), delta[3] + delta[4], delta[7]
    return {"seconds": seconds, "cpus": os.cpu_count(),
            "loadavg": [float(x) for x in fields[:3]],
            "runnable": int(fields[3].split("/")[0]),
            # no tick in the window (a tiny one): nothing was seen
            "cpu_share": round((total - idle - steal) / total, 4)
            if total else 0.0,
            "steal_share": round(steal / total, 4) if total else 0.0}


def busy_reasons(load: Optional[Dict]) -> List[str]:
    """Why the machine of a run was busy, from its document's `load`
    ({"before": sample, "after": sample}, either may be missing); [] for
    a quiet machine or a document without samples."""
    reasons = []
    for when in ("before", "after"):
        s = (load or {}).get(when)
        if not s:
            continue
        if s["cpu_share"] >= BUSY_CPU_SHARE:
            reasons.append(
                f"{when} the run, other processes used "
                f"{100 * s['cpu_share']:.0f} % of the {s['cpus']} CPUs' "
                f"time (load average {s['loadavg'][0]:.2f})")
        if s["steal_share"] >= BUSY_STEAL_SHARE:
            reasons.append(
                f"{when} the run, the hypervisor took "
                f"{100 * s['steal_share']:.0f} % of the CPUs' time (steal)")
    return reasons


def busy_warning(reasons: Sequence[str]) -> str:
    """One sentence for a run on a busy machine ('' when quiet)."""
    if not reasons:
        return ""
    return ("the machine was busy (" + "; ".join(reasons) + "): this "
            "run's figures measure the other work as much as the "
            "transports, so read ratios with their spread and compare "
            "nothing across runs")


def machine_info() -> Dict:
    """Where and when a run happened (part of every document), and the
    load just before it measures (a second's sleep)."""
    return {"started": time.time(), "host": platform.node(),
            "cpus": os.cpu_count(), "kernel": platform.release(),
            "load": {"before": load_sample()}}


def conclude(bench: str, quick: bool, info: Dict, res: BenchResults,
             ts: Sequence[Target], out, **fields) -> Dict:
    """Print the targets and notes that follow a benchmark's table, and
    a warning if the machine was busy (the load sampled now and by
    machine_info); the run's JSON document (its own `fields` after the
    machine's)."""
    print_targets(ts, out)
    for note in res.notes:
        out.write(f"note: {note}\n")
    info = dict(info)
    if "load" in info:
        load = dict(info["load"], after=load_sample())
        load["reasons"] = busy_reasons(load)
        load["busy"] = bool(load["reasons"])
        info["load"] = load
        if load["busy"]:
            out.write(f"warning: {busy_warning(load['reasons'])}\n")
    doc = {"benchmark": bench, "quick": bool(quick), **info, **fields,
           "records": res.records, "targets": [t.to_json() for t in ts],
           "notes": res.notes}
    if res.runs:
        doc["runs"] = res.runs
    return doc


def write_docs(doc: Dict, paths: Iterable[Path], out=None) -> None:
    """`doc` to each of `paths`, each replaced whole (a reader never sees
    half a document)."""
    out = out or sys.stdout
    for path in map(Path, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
        out.write(f"wrote {len(doc['records'])} records to {path}\n")


def run_benchmark(bench: str, quick: bool,
                  measure: Callable[[], BenchResults],
                  targets: Callable[[BenchResults], List[Target]],
                  print_table: Callable[[BenchResults, object], None],
                  json_path: Optional[Path] = None, out=None,
                  publish: Optional[Callable[..., int]] = None,
                  **fields) -> int:
    """A benchmark from start to end: measure, print the table, targets
    and notes to `out`, write the document (its own `fields`, then the
    measure's res.fields) to `json_path`; 1 if a step failed. A cloud
    benchmark's `publish` (report.publish, all but the document and
    `failed` given) writes the document instead and says the status."""
    out = out or sys.stdout
    info = machine_info()
    res = measure()
    ts = targets(res)
    print_table(res, out)
    doc = conclude(bench, quick, info, res, ts, out, **fields, **res.fields)
    if publish:
        return publish(doc, failed=bool(res.failed))
    if json_path:
        write_docs(doc, [Path(json_path)], out)
    return res.exit_status


def check_transports(names: Optional[Sequence[str]],
                     allowed: Sequence[str]) -> List[str]:
    """`names`, if they are a subset of `allowed`; none given: all."""
    names = list(names or allowed)
    if not names or any(t not in allowed for t in names):
        raise InvalidRequest(f"transports are a comma-separated subset of "
                             f"{','.join(allowed)}")
    return names


def check_ivshmem_used(stderr: str, ranks: int, origin: str
                       ) -> Dict[int, Dict[str, int]]:
    """The BTL's counters of every rank (btl_ivshmem_verbose, printed at
    finalize); BenchError unless each rank sent and received through the
    region: a job that fell back to another transport is no figure of
    ours."""
    counters = openmpi.parse_btl_counters(stderr)
    idle = [r for r in range(ranks)
            if not counters.get(r, {}).get("sent_msgs")
            or not counters.get(r, {}).get("recv_msgs")]
    if idle:
        raise BenchError(f"{origin}: rank(s) {idle[:8]} carried no message "
                         f"over the ivshmem BTL")
    return counters


def mpi_job(transport: str, np: int, argv: Sequence[str], timeout_s: int,
            origin: str, keys: Sequence[str],
            osc: Optional[str] = None,
            components: Optional[Path] = None) -> Tuple[List[Dict], Dict]:
    """One mpirun job over `transport`: its records (each with `keys`) and
    the BTL counters, which for ivshmem (a private region) must show
    every rank's traffic; `components`: another build's BTL directory."""
    kwargs = dict(transport=transport, osc=osc, components=components)
    if transport == "ivshmem":
        kwargs.update(tcp_fallback=False, verbose_btl=True)
    # a region of the job's own, whatever this process's environment names
    env = {k: v for k, v in os.environ.items()
           if k not in ("IVSHM_SOCKET", "IVSHM_REGION")}
    stdout, stderr = checked_run(functools.partial(
        local.run, argv, np, env=env, **kwargs), timeout_s, origin)
    recs = parse_records(stdout, origin, keys)
    counters = (check_ivshmem_used(stderr, np, origin)
                if transport == "ivshmem" else openmpi.parse_btl_counters(stderr))
    for rec in recs:
        rec["btl"] = openmpi.btl_list(transport, tcp_fallback=False)
    return recs, counters
