"""A 4-rank job over the ivshm provider while one of its instances moves
to the other server and back: what each pair of ranks sees.

mpi-pairs (native/bench/pairs.c) on a VM cluster of 2 servers x 2
instances x 1 vCPU, one rank per instance, while the host moves s1i0
(rank 2) to s0 and back with `cluster migrate`'s code; the phases
(before, out, moved, back, after), the figures and the targets:
BENCHMARKS.md, "Migration under a job".
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpis
from ..cluster import kinds, vm_instance
from ..cluster.job import Job
from ..cluster.session import ClusterSession, VmOptions
from ..cluster.state import load
from ..errors import BenchError, InvalidRequest
from .report import guest_title
from .toolkit import (BenchResults, Target, attempt, compile_mpi, count,
                      parse_records, print_grid, require_root, run_benchmark,
                      summarize, tail)

MPIS = ("mpich", "impi")
HOSTS = ("s0i0", "s0i1", "s1i0", "s1i1")
MOVER, HOME, AWAY = "s1i0", "s1", "s0"
PHASES = ("before", "out", "moved", "back", "after")
# each rank's server per steady phase
SERVERS = {"before": (0, 0, 1, 1), "moved": (0, 0, 0, 1),
           "after": (0, 0, 1, 1)}
PAIRS = [(a, b) for a in range(4) for b in range(a + 1, 4)]
PHASE_FILE = "/tmp/ivcloud-bench-phase"
KEYS = ("tick", "t", "phase", "a", "b", "latency_us", "bandwidth_MBps")
SOURCE = "bench/pairs.c"
VM_MEMORY_MB = VmOptions.memory_mb
POLL_S = 2.0
# the ranks' nap after each tick (ms): a TCG guest whose rank never sleeps
# answers the migration's agent commands slowly
PAUSE_MS = 1000
# how long a job may go without a tick (its start; its end after "stop",
# before the cluster goes down under it): a tick on the core under TCG
# takes seconds
STOP_S = 300.0


@dataclass
class MigrateSettings:
    mpi: str
    vm: VmOptions
    ticks: int          # per steady phase
    lat_iters: int      # 8 B round trips per pair and tick
    timeout_s: int      # the whole job
    quick: bool = False

    @classmethod
    def make(cls, mpi_name: str, vm: Optional[VmOptions] = None,
             quick: bool = False, ticks: Optional[int] = None,
             iters: Optional[int] = None) -> "MigrateSettings":
        if mpi_name not in MPIS:
            raise InvalidRequest(f"bench migrate runs {' or '.join(MPIS)}, "
                                 f"not '{mpi_name}'")
        return cls(mpi=mpi_name, vm=vm or VmOptions(),
                   ticks=count("ticks", ticks) or (3 if quick else 10),
                   lat_iters=count("round trips", iters) or 20,
                   timeout_s=1800 if quick else 3600, quick=quick)


# ---------------------------------------------------------------- running

def _guest(session: ClusterSession, script: str) -> str:
    host = HOSTS[0]
    return vm_instance.guest_run(vm_instance.guest(session.state, host),
                                 host, script, 60)


def set_phase(session: ClusterSession, phase: str) -> None:
    """The phase rank 0 reads from its next tick on (whole: renamed)."""
    _guest(session, f"printf '{phase}\\n' > {PHASE_FILE}.new && chmod 644 "
                    f"{PHASE_FILE}.new && mv -f {PHASE_FILE}.new "
                    f"{PHASE_FILE}")


def wait_ticks(session: ClusterSession, n: int, job: threading.Thread
               ) -> None:
    """Until the job has done `n` more ticks (rank 0's count); a job
    that does none for STOP_S (its start included) is stuck."""
    def done() -> int:
        out = _guest(session, f"cat {PHASE_FILE}.ticks 2>/dev/null || "
                              f"echo 0").strip()
        return int(out) if out.isdigit() else 0
    last, since = done(), time.monotonic()
    goal = last + n
    while last < goal:
        if not job.is_alive():
            raise BenchError("the job ended before the migrations did")
        if time.monotonic() - since > STOP_S:
            raise BenchError(f"the job did no tick in {STOP_S:g} s")
        job.join(POLL_S)
        now = done()
        if now != last:
            last, since = now, time.monotonic()


def move(session: ClusterSession, to: str, log) -> Dict:
    """MOVER to server `to` (ivcloud.cluster.migrate); its report."""
    state = session.state
    report = kinds.of_state(state).migrate(
        session.sd, state, MOVER, to, None,
        log=lambda line: log.write(f"  {line}\n"))
    session.state = load(session.sd) or state
    return report


def measure(s: MigrateSettings, log=None) -> BenchResults:
    """The job and the moves under it; res.fields: the moves, the
    cluster, the guests' CPUs, the stalls (what the targets read)."""
    log = log or sys.stderr
    require_root("migrate")
    flavor = mpis.flavor(s.mpi)
    flavor.check("ivshmem", True)
    res = BenchResults()
    fields = res.fields
    fields["migrations"] = []
    with tempfile.TemporaryDirectory(prefix="ivcloud-bmig-") as tmp, \
            ClusterSession("bmig", 2, 2, 1, vm=s.vm, log=log) as session:
        prog = session.stage(compile_mpi(flavor, SOURCE,
                                         Path(tmp) / "mpi-pairs"))
        set_phase(session, PHASES[0])
        std, status = (Path(tmp) / "out", Path(tmp) / "err"), {}

        def job() -> None:
            # its output kept whatever its end: the ticks before a failure
            with std[0].open("w") as o, std[1].open("w") as e:
                try:
                    status["rc"] = session.run_job(Job(
                        [prog, "--phase-file", PHASE_FILE, "--lat-iters",
                         str(s.lat_iters), "--pause-ms", str(PAUSE_MS)],
                        len(HOSTS), mpi=s.mpi, transport="ivshmem",
                        hosts=HOSTS, report=True, timeout=s.timeout_s), o, e)
                except Exception as x:     # said by the main thread
                    status["error"] = x
        runner = threading.Thread(target=job, daemon=True)
        runner.start()

        def steps() -> None:
            wait_ticks(session, s.ticks, runner)
            for during, steady, to in (("out", "moved", AWAY),
                                       ("back", "after", HOME)):
                set_phase(session, during)
                fields["migrations"].append(
                    {"phase": during, **move(session, to, log)})
                set_phase(session, steady)
                wait_ticks(session, s.ticks, runner)
        attempt(res, "migrate", f"{MOVER} to {AWAY} and back under the job",
                steps, log)
        set_phase(session, "stop")
        runner.join(STOP_S)
        fields.update(cluster=session.describe(), cpus={
            h: session.state["instances"][h]["cpus"] for h in HOSTS})
        stdout, stderr = (p.read_text() for p in std)
    if status.get("rc") != 0:
        why = status.get("error") or (
            f"exit status {status['rc']}" if "rc" in status
            else f"no end {STOP_S:g} s after 'stop'")
        res.failed.append("job")
        res.notes.append(f"the job failed: {why}: {tail(stderr)}")
        fields["job_stderr"] = stderr[-4000:]
    try:
        res.runs = parse_records(stdout, "mpi-pairs", KEYS)
    except BenchError as e:
        res.notes.append(str(e))
    fields["transport_lines"] = re.findall(r"fi_ivshm: pid .*",
                                           stdout + stderr)
    for r in res.runs:
        r["pair"] = f"{r['a']}-{r['b']}"
    res.records = summarize(res.runs, ("pair", "phase"),
                            ("latency_us", "bandwidth_MBps", "t"))
    fields["stalls"] = stalls(res.runs, fields["migrations"])
    return res


# ---------------------------------------------------------------- figures

def stalls(runs: Sequence[Dict], migrations: Sequence[Dict]) -> List[Dict]:
    """Per move: the longest tick of the job while it ran and the median
    tick before it (s), from rank 0's clock."""
    ticks = sorted({(r["tick"], r["t"], r["phase"]) for r in runs})
    gaps = [(a[2], b[1] - a[1]) for a, b in zip(ticks, ticks[1:])]
    before = [g for p, g in gaps if p == "before"]
    out = []
    for m in migrations:
        during = [g for p, g in gaps if p == m["phase"]]
        if during and before:
            out.append({"phase": m["phase"], "longest_tick_s": max(during),
                        "median_tick_s": statistics.median(before),
                        "stall_s": max(during) - statistics.median(before)})
    return out


def shares_cpu(pair: Tuple[int, int], fields: Dict) -> bool:
    """Whether the pair's guests are pinned to a common host CPU (a move
    keeps a guest's pinning): then each of their messages waits for the
    host's scheduler, whatever the path."""
    cpus = fields.get("cpus", {})
    a, b = (set(cpus.get(HOSTS[r], ())) for r in pair)
    return bool(a & b)


def path(pair: Tuple[int, int], phase: str) -> str:
    servers = SERVERS[phase]
    return "region" if servers[pair[0]] == servers[pair[1]] else "core"


def targets(res: BenchResults, fields: Dict) -> List[Target]:
    def lat(pair, phase):
        r = res.find(pair=f"{pair[0]}-{pair[1]}", phase=phase)
        return r["latency_us"] if r else None
    ts = []
    core = [lat(p, "before") for p in PAIRS if path(p, "before") == "core"]
    core = [x for x in core if x]
    worst = [lat(p, ph) for p in PAIRS for ph in ("out", "back")]
    worst = [x for x in worst if x]
    ts.append(Target("during a move: worst pair 8 B latency / core path",
                     max(worst) / statistics.median(core)
                     if core and worst else None, "<=", 1.0,
                     "no figures during or before the moves"))
    for phase, new in (("moved", [(0, 2), (1, 2)]), ("after", [(2, 3)])):
        # like against like: a pair sharing a host CPU only against one
        # that does too (BENCHMARKS.md, "Migration under a job")
        same = [p for p in new
                if shares_cpu(p, fields) == shares_cpu((0, 1), fields)]
        ref, got = lat((0, 1), phase), [lat(p, phase) for p in same]
        ok = ref and got and all(got)
        ts.append(Target(f"{phase}: newly co-resident 8 B latency / "
                         f"always co-resident", max(got) / ref if ok
                         else None, "<=", 1.1, "record missing"))
    downtime = {m["phase"]: m.get("downtime_ms")
                for m in fields.get("migrations", [])}
    for st in fields.get("stalls", []):
        dt = downtime.get(st["phase"])
        ts.append(Target(f"{st['phase']}: job's stall / (QEMU downtime + "
                         f"1 s)", st["stall_s"] / (dt / 1e3 + 1)
                         if dt is not None else None, "<=", 1.0,
                         "QEMU reported no downtime"))
    return ts


# ---------------------------------------------------------------- output

def print_table(res: BenchResults, fields: Dict, out=None) -> None:
    """A row per pair: its path per steady phase, then its median 8 B
    latency (us) and 1 MiB bandwidth (MB/s) per phase; then the moves."""
    out = out or sys.stdout

    def cell(pair, phase, key, fmt):
        r = res.find(pair=pair, phase=phase)
        return fmt.format(r[key]) if r and r.get(key) else "-"
    rows = [[f"{a}-{b}" + ("*" if shares_cpu((a, b), fields) else ""),
             "/".join(path((a, b), ph) for ph in SERVERS)]
            + [cell(f"{a}-{b}", ph, "latency_us", "{:.0f}") for ph in PHASES]
            + [cell(f"{a}-{b}", ph, "bandwidth_MBps", "{:.0f}")
               for ph in PHASES] for a, b in PAIRS]
    print_grid(["pair", "path before/moved/after"]
               + [f"lat {ph}" for ph in PHASES]
               + [f"bw {ph}" for ph in PHASES], rows, out, left=(0, 1))
    out.write("*: the pair's guests share a host CPU\n")
    stall = {st["phase"]: st for st in fields.get("stalls", [])}
    for m in fields.get("migrations", []):
        st = stall.get(m["phase"], {})
        out.write(f"{m['phase']}: {MOVER} {m['from']} -> {m['to']} in "
                  f"{m.get('seconds')} s; QEMU: total {m.get('total_ms')} "
                  f"ms, downtime {m.get('downtime_ms')} ms; job's longest "
                  f"tick {st.get('longest_tick_s', 0):.2f} s (median "
                  f"before {st.get('median_tick_s', 0):.2f} s)\n")


def run(s: MigrateSettings, json_path: Optional[Path] = None, out=None,
        log=None) -> int:
    """run_benchmark of `s`, progress to `log`: 1 if a step failed."""
    def print_all(res: BenchResults, out) -> None:
        accel = res.fields.get("cluster", {}).get("accel")
        out.write(f"{mpis.flavor(s.mpi).title}, 4 ranks over ivshm, "
                  f"{s.ticks} ticks per steady phase; "
                  f"{guest_title(accel)}\n")
        print_table(res, res.fields, out)
    return run_benchmark(
        "migrate", s.quick, lambda: measure(s, log),
        lambda res: targets(res, res.fields), print_all, json_path, out,
        mpi=s.mpi, hosts=HOSTS, mover=MOVER, phases=PHASES, ticks=s.ticks,
        lat_iters=s.lat_iters)
