"""MPI latency and bandwidth at the three levels of the cloud hierarchy.

Brings up an emulated cluster (`ivcloud cluster`: 2 servers x 2
instances x 2 vCPUs, under a unique name) and runs mpi-osu's 2-rank
latency and bandwidth tests, 4 B .. 1 MiB, with the two ranks

  level 1  inside one instance (s0i0, s0i0): Open MPI's vader,
  level 2  on two instances of one server (s0i0, s0i1),
  level 3  on two servers (s0i0, s1i0), through both uplinks,

each level once with --transport tcp and once with --transport ivshmem
(BTL lists self,vader,tcp and self,vader,ivshmem,tcp), placed by a
rankfile. Open MPI's own report of the BTL each pair used is recorded
and checked: with ivshmem, level 1 still uses vader, level 2 ivshmem and
level 3 tcp, because a region is shared only by one server's instances.
Uplinks are unshaped unless --uplink-rate is given. The cluster is taken
down at the end, also after an error or a signal (unless
--keep-cluster).

Prints one table and the targets as ratios measured in this run, writes
the records as JSON, and into --out the plots and report.md
(ivcloud.report).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import mpi as ompi
from ..cli import CliError, positive_int
from ..native import native_dir
from .mpi import (BenchError, _fmt_size, _parse_records, _ratio,
                  _tail)
from .common import machine_info, write_doc
from .p2p import Target, print_targets

MIB = 1 << 20
FULL_SIZES = [4, 8, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, MIB]
QUICK_SIZES = [8, 4096, MIB]
TRANSPORTS = ["tcp", "ivshmem"]
DEFAULT_OUT = "build/demo"


@dataclass(frozen=True)
class Level:
    number: int
    name: str
    hosts: Tuple[str, str]     # where ranks 0 and 1 run
    what: str

    def expected_btl(self, transport: str) -> str:
        """The BTL Open MPI must pick for the pair: what the level is
        about, so a silent fallback cannot pass for a measurement."""
        if self.number == 1:
            return "vader"
        if self.number == 2 and transport == "ivshmem":
            return "ivshmem"
        return "tcp"


LEVELS = [
    Level(1, "intra-instance", ("s0i0", "s0i0"),
          "both ranks in one instance"),
    Level(2, "inter-instance", ("s0i0", "s0i1"),
          "two instances of one server"),
    Level(3, "inter-server", ("s0i0", "s1i0"),
          "instances on two servers"),
]


# ---------------------------------------------------------------- cluster

class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP during a benchmark: unwinds like Ctrl-C (the running
    job is torn down, the cluster taken down, the CLI exits 130)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


BML_RE = re.compile(r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send "
                    r"to \[\[\d+,\d+\],(\d+)\] on node (\S+)")


def btls_used(stderr: str) -> Dict[Tuple[str, int], set]:
    """{(sending host, receiving rank): {btl, ...}} from the
    btl_base_verbose lines of a job (self left out)."""
    out: Dict[Tuple[str, int], set] = {}
    for host, btl, rank, _node in BML_RE.findall(stderr):
        if btl != "self":
            out.setdefault((host, int(rank)), set()).add(btl)
    return out


# Open MPI's chatter (btl_base_verbose, the rsh launcher's setpgid warning
# in a namespace), to be skipped when looking for why a job failed
_VERBOSE_RE = re.compile(r"^\[[^\]]+\] (mca: |btl:|plm:rsh: Warning).*\n?",
                         re.MULTILINE)


class ClusterSession:
    """An emulated cluster for one benchmark run: up on entry, down on
    exit whatever happened (an error, Ctrl-C, SIGTERM/SIGHUP), unless
    `keep`. Jobs run through ivcloud.cluster's launcher, as `ivcloud
    cluster mpirun` runs them."""

    def __init__(self, prefix: str, servers: int, instances: int,
                 vcpus: int, uplink_rate: Optional[str] = None,
                 keep: bool = False, log=sys.stderr):
        from ..cluster.topology import plan
        # unique, and short enough for the socket paths (24 characters)
        self.name = f"{prefix}{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
        self.topo = plan(self.name, servers, instances, vcpus, uplink_rate,
                         oversubscribe=True)
        self.uplink_rate = uplink_rate
        self.keep = keep
        self.log = log
        self.state: Optional[Dict] = None
        self._old_handlers: Dict = {}

    def describe(self) -> Dict:
        t = self.topo
        return {"name": self.name, "servers": t.servers,
                "instances_per_server": t.instances_per_server,
                "vcpus": t.vcpus, "host_cpus": len(t.host_cpus),
                "uplink_rate": self.uplink_rate}

    def __enter__(self) -> "ClusterSession":
        from ..cluster import lifecycle
        from ..cluster.state import state_dir
        self.sd = state_dir(self.name)
        self._old_handlers = {s: signal.signal(s, _raise_interrupted)
                              for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            # up() rolls back by itself when it fails or is interrupted
            lifecycle.up(self.topo, self.sd, log=lambda line: None)
            self.state = lifecycle.load_up(self.sd)
        except BaseException:
            self._restore()
            raise
        self.log.write(f"cluster '{self.name}' up: {self.topo.describe()}"
                       f"\n")
        return self

    def _restore(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}

    def __exit__(self, *exc) -> None:
        from ..cluster import lifecycle
        try:
            if self.keep:
                self.log.write(f"cluster '{self.name}' kept (remove it with "
                               f"`ivcloud cluster down --name {self.name}`)\n")
                return
            # a second Ctrl-C must not leave half a cluster: finish down
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                lifecycle.down(self.sd)
            finally:
                signal.signal(signal.SIGINT, old_int)
            self.log.write(f"cluster '{self.name}' down\n")
        finally:
            self._restore()

    def mpirun(self, program: Sequence[str], np: int, transport: str,
               timeout_s: float, origin: str, placement: str = "block",
               rankfile: Optional[Sequence[str]] = None,
               extra_mca: Sequence[Tuple[str, str]] = ()) -> Tuple[str, str]:
        """Run one job on the head node; (stdout, stderr). rankfile: its
        lines ("rank R=HOST slot=K"), else --placement mapping."""
        from ..cluster.launch import LaunchError, enter_command, mpirun_command
        path = None
        if rankfile is not None:
            # in the state directory: the head node sees it (not /tmp)
            path = self.sd.dir / f"rankfile.{uuid.uuid4().hex[:8]}"
            path.write_text("\n".join(rankfile) + "\n")
        try:
            cmd = mpirun_command(self.state, self.sd, list(program), np,
                                 transport=transport, placement=placement,
                                 extra_mca=list(extra_mca), rankfile=path)
            full, env, _ = enter_command(self.state, "head", cmd)
            with tempfile.TemporaryFile("w+") as out, \
                    tempfile.TemporaryFile("w+") as err:
                try:
                    status = ompi.run_command(full, timeout_s, env=env,
                                              stdout=out, stderr=err)
                except subprocess.TimeoutExpired:
                    raise BenchError(f"{origin}: no result within "
                                     f"{timeout_s:g} s")
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
        except (LaunchError, CliError) as e:
            raise BenchError(f"{origin}: {e}")
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
        if status != 0:
            raise BenchError(f"{origin}: exit status {status}: "
                             f"{_tail(_VERBOSE_RE.sub('', stderr))}")
        return stdout, stderr


def floating_rankfile(hosts: Sequence[str], vcpus: int) -> List[str]:
    """Rankfile lines putting rank r on hosts[r], free to run on any of
    its instance's vCPUs. Open MPI binds a rankfile's rank to its slot
    even under --bind-to none, so slot=0 on every instance would pin the
    ranks of all instances to one host CPU; the whole range keeps them
    floating like `--bind-to none` placements do."""
    slots = "0" if vcpus == 1 else f"0-{vcpus - 1}"
    return [f"rank {r}={host} slot={slots}" for r, host in enumerate(hosts)]


def program(name: str) -> str:
    path = native_dir() / name
    if not os.access(path, os.X_OK):
        raise CliError(f"{path} not found (run `make build` or set "
                       f"IVCLOUD_NATIVE_DIR)")
    return str(path.resolve())


# ---------------------------------------------------------------- settings

@dataclass
class Settings:
    sizes: List[int]
    iters: int          # round trips (latency) per small size
    budget: int         # bytes per size: caps the operations of big ones
    timeout_s: int      # per job
    uplink_rate: Optional[str]
    quick: bool

    @classmethod
    def from_args(cls, args) -> "Settings":
        quick = args.quick
        return cls(sizes=QUICK_SIZES if quick else FULL_SIZES,
                   iters=args.iters or (200 if quick else 2000),
                   budget=(8 if quick else 64) * MIB,
                   timeout_s=90 if quick else 300,
                   uplink_rate=args.uplink_rate, quick=quick)


@dataclass
class Results:
    records: List[Dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)


def find(records: Sequence[Dict], level: int, transport: str, test: str,
         size: int) -> Optional[Dict]:
    for r in records:
        if (r["level"] == level and r["transport"] == transport
                and r["test"] == test and r["size"] == size):
            return r
    return None


# ---------------------------------------------------------------- running

def run_level(cluster: ClusterSession, level: Level, transport: str,
              s: Settings) -> List[Dict]:
    origin = f"level {level.number} ({level.name}) {transport}"
    rankfile = floating_rankfile(level.hosts, cluster.topo.vcpus)
    # The sweep starts with a throw-away round of its first size: early
    # in a job both ranks may still share one CPU (until the scheduler
    # spreads them) and connections open lazily, which the first size
    # would pay for, and would pay more for on a loaded machine.
    sizes = [s.sizes[0]] + s.sizes
    argv = [program("mpi-osu"), "--test", "latency,bw", "--sizes",
            ",".join(map(str, sizes)), "--iters", str(s.iters),
            "--budget", str(s.budget), "--transport", transport]
    stdout, stderr = cluster.mpirun(
        argv, 2, transport, s.timeout_s, origin, rankfile=rankfile,
        # Open MPI names the BTL it picked for each peer (bml lines)
        extra_mca=[("btl_base_verbose", "10")])
    recs, warmed = [], set()
    for rec in _parse_records(stdout, origin):
        if rec["test"] in warmed:
            recs.append(rec)
        else:
            warmed.add(rec["test"])  # a test's first record: the warm-up
    if len(recs) != 2 * len(s.sizes):
        raise BenchError(f"{origin}: {len(recs)} records, expected "
                         f"{2 * len(s.sizes)}")
    used = btls_used(stderr)
    forward = used.get((level.hosts[0], 1), set())
    backward = used.get((level.hosts[1], 0), set())
    want = level.expected_btl(transport)
    if forward != {want} or backward != {want}:
        raise BenchError(f"{origin}: Open MPI used {sorted(forward) or '?'} "
                         f"/ {sorted(backward) or '?'} between the ranks, "
                         f"expected {want}")
    for rec in recs:
        rec.update(level=level.number, level_name=level.name,
                   hosts=list(level.hosts), btl=want)
    return recs


def attempt(res: Results, bench: str, what: str, fn, log=sys.stderr):
    """fn()'s result, or None after noting its failure in `res`: one
    failed job does not stop the others."""
    log.write(f"bench {bench}: {what} ...\n")
    log.flush()
    t0 = time.monotonic()
    try:
        out = fn()
    except (BenchError, OSError, subprocess.SubprocessError) as e:
        res.failed.append(what)
        res.notes.append(f"{what} failed: {e}")
        log.write(f"bench {bench}: {what} failed: {e}\n")
        return None
    log.write(f"bench {bench}: {what} done in "
              f"{time.monotonic() - t0:.1f} s\n")
    return out


def measure(cluster: ClusterSession, s: Settings,
            log=sys.stderr) -> Results:
    res = Results()
    for level in LEVELS:
        for transport in TRANSPORTS:
            recs = attempt(res, "hierarchy",
                           f"level {level.number} {transport}",
                           lambda: run_level(cluster, level, transport, s),
                           log)
            res.records += recs or []
    return res


# ---------------------------------------------------------------- targets

def targets(records: Sequence[Dict]) -> List[Target]:
    return [
        # "better latency" as a factor: the slower one over the faster
        _ratio(find(records, 2, "tcp", "latency", 8),
               find(records, 2, "ivshmem", "latency", 8), "latency_us",
               "level 2, 8 B latency tcp / ivshmem", ">=", 50.0),
        # seed 000 (fig. 29-32): ivshmem about twice TCP's best at 1 MB
        _ratio(find(records, 2, "ivshmem", "bw", MIB),
               find(records, 2, "tcp", "bw", MIB), "bandwidth_MBps",
               "level 2, 1 MiB bandwidth ivshmem / tcp", ">=", 2.0),
    ]


# ---------------------------------------------------------------- output

def columns(records: Sequence[Dict]) -> List[Tuple[int, str]]:
    have = {(r["level"], r["transport"]) for r in records}
    return [(lv.number, t) for lv in LEVELS for t in TRANSPORTS
            if (lv.number, t) in have]


def table(records: Sequence[Dict], test: str) -> Tuple[List[str],
                                                       List[List[str]]]:
    """(header, rows) of one test: a row per size, a column per (level,
    transport); latency in us, bandwidth in MB/s. Shared with the
    markdown report."""
    cols = columns(records)
    key, fmt = (("latency_us", "{:.2f}") if test == "latency"
                else ("bandwidth_MBps", "{:.1f}"))
    header = ["size"] + [f"L{lv} {t}" for lv, t in cols]
    sizes = sorted({r["size"] for r in records if r["test"] == test})
    rows = []
    for size in sizes:
        row = [_fmt_size(size)]
        for lv, t in cols:
            r = find(records, lv, t, test, size)
            row.append(fmt.format(r[key]) if r else "-")
        rows.append(row)
    btl_row = ["BTL used"]
    for lv, t in cols:
        r = next(x for x in records if x["level"] == lv
                 and x["transport"] == t)
        btl_row.append(r["btl"])
    rows.append(btl_row)
    return header, rows


def print_table(records: Sequence[Dict], out=sys.stdout) -> None:
    if not records:
        out.write("no records\n")
        return
    for lv in LEVELS:
        out.write(f"L{lv.number} = {lv.name}: {lv.what} "
                  f"({' + '.join(lv.hosts)})\n")
    for test, title in (("latency", "one-way latency (us)"),
                        ("bw", "bandwidth (MB/s)")):
        header, rows = table(records, test)
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        out.write(f"\n{title}\n")
        line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
        out.write(line + "\n" + "-" * len(line) + "\n")
        for row in rows:
            out.write("  ".join(c.rjust(w) for c, w in zip(row, widths))
                      + "\n")


# ---------------------------------------------------------------- driver

def common_arguments(p: argparse.ArgumentParser, name: str,
                     quick: str) -> None:
    """The options every cluster benchmark has (hierarchy, halo)."""
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the records and targets as JSON here")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                   help=f"where {name}.json, the plots and report.md go "
                        f"(default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--keep-cluster", action="store_true",
                   help="leave the cluster up afterwards (for inspection)")


def check_root(bench: str) -> None:
    if os.geteuid() != 0:
        raise CliError(f"bench {bench} needs root (it brings up an "
                       f"`ivcloud cluster`)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_arguments(p, "hierarchy",
                     "three sizes, few iterations (plumbing check)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="round trips per small size (big sizes use fewer)")
    p.add_argument("--uplink-rate", default=None, metavar="RATE",
                   help="shape the servers' uplinks (e.g. 1gbit; default "
                        "unshaped)")


def run(args) -> int:
    check_root("hierarchy")
    s = Settings.from_args(args)
    program("mpi-osu")  # refuse before building anything
    info = machine_info()
    with ClusterSession("hier", 2, 2, 2, s.uplink_rate,
                        keep=args.keep_cluster) as cluster:
        res = measure(cluster, s)
    res.notes.append("instances are namespaces, not VMs: TCP between "
                     "them has no virtio/vhost path and Open MPI's tcp BTL "
                     "busy-polls, so it is a few us, not the tens of us "
                     "of TCP between VMs")
    if not s.uplink_rate:
        res.notes.append("uplinks unshaped: level 3 crosses two veth pairs "
                         "and three bridges at memory speed, with no "
                         "latency added (the kernel has no netem)")
    ts = targets(res.records)
    print_table(res.records)
    print_targets(ts)
    for note in res.notes:
        print(f"note: {note}")
    doc = {"benchmark": "hierarchy", "quick": s.quick, **info,
           "cluster": cluster.describe(),
           "levels": [{"level": lv.number, "name": lv.name,
                       "hosts": list(lv.hosts), "what": lv.what}
                      for lv in LEVELS],
           "transports": TRANSPORTS, "sizes": s.sizes,
           "records": res.records,
           "targets": [t.to_json() for t in ts], "notes": res.notes}
    return finish("hierarchy", doc, args, failed=bool(res.failed))


def finish(name: str, doc: Dict, args, failed: bool) -> int:
    """Write the JSON (--json and DIR/<name>.json) and the report from
    every document in DIR; the exit status."""
    from .. import report
    out = Path(args.out)
    paths = {out / f"{name}.json"}
    if args.json:
        paths.add(Path(args.json))
    for path in sorted(paths):
        write_doc(path, doc)
        print(f"wrote {len(doc['records'])} records to {path}")
    try:
        md = report.write(out)
    except report.ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    print(f"report: {md}")
    return 1 if failed else 0
