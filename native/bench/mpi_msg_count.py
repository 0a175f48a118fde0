#!/usr/bin/env python3
"""Instructions per 8-byte message under an MPI, by component, counted.

Runs mpi_msg_count.c (osu bw's shape: windows of 64 MPI_Isend against
64 posted MPI_Irecv) on two ranks of this host, both under valgrind's
callgrind with only the loop collected, and divides each rank's count
by the messages. Each rank waits by sleeping PACE_US between tests, so
almost every poll finds work; the tests that found nothing ("misses",
counted by the program) are taken out at the cost of an empty MPI_Test,
measured by a second run (`idle`). What is left is the messages' own
cost, the same on every run up to a few instructions (docs/fast-path.md,
"Open MPI 5 over the provider, counted"):

  mpi_msg_count.py [--mpi openmpi5|mpich|openmpi4] [--transport ivshm|own]
                   [--shape bw|latency] [--windows N] [--pace US]
                   [--idle TESTS] [--provider DIR] [--functions K]
                   [--keep DIR]

--shape latency is osu latency's instead (blocking MPI_Send/MPI_Recv,
--windows round trips): each rank is counted in a run of its own where
it sleeps --pace us before each receive, so that its message is there
(the other rank spins); the polls that still found nothing are
opal_progress's calls beyond one per receive, taken out at the cost of
one poll, which the same rank's spinning run gives. Open MPI only.

openmpi5 over ivshm: pml cm + mtl ofi over the provider, as ivcloud
launches it (ivcloud/mpis/openmpi5.py); openmpi5 own: pml ob1 + btl
self,sm. openmpi4 (Debian's, on PATH) over ivshm: pml ob1 + btl
self,ivshmem, our BTL from build/native/btl, as `ivcloud mpirun` launches
it; openmpi4 own: btl self,vader. mpich over ivshm: ch4:ofi with FI_PROVIDER=ivshm. One region
(16 KiB slots) for both ranks. Needs valgrind and the MPI wheels under
build/mpi (`make`). Bad arguments: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SOURCE = Path(__file__).with_name("mpi_msg_count.c")
WINDOW = 64
TRIES = 4
SLOT = 16384 + 64


def fail(msg: str) -> None:
    print(f"mpi_msg_count.py: {msg}", file=sys.stderr)
    sys.exit(2)


def load(path: Path, calls: collections.Counter = None) -> collections.Counter:
    """Self cost (Ir) per (object, function) of one callgrind file; the
    calls made to each function added to `calls`."""
    names = {"ob": {}, "fn": {}}
    ob = fn = cfn = None
    skip = False
    costs: collections.Counter = collections.Counter()

    def name(kind: str, s: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?$", s)
        if not m:
            return s
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind][m.group(1)]

    for line in path.read_text().splitlines():
        if line.startswith("ob="):
            ob = name("ob", line[3:])
        elif line.startswith("fn="):
            fn = name("fn", line[3:])
        elif line.startswith("cob="):
            name("ob", line[4:])
        elif line.startswith("cfn="):
            cfn = name("fn", line[4:])
        elif line.startswith("calls="):
            skip = True  # the next cost line is the call's inclusive cost
            if calls is not None:
                calls[cfn] += int(line[6:].split()[0])
        elif line[:1].isdigit() or line[:1] in "+-*":
            if skip:
                skip = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                costs[(os.path.basename(ob or "?"), fn or "?")] += int(parts[1])
    return costs


def ranks(log: str, out: Path) -> dict:
    """{rank: (costs, misses)} of one run, from the program's lines."""
    found = {}
    for m in re.finditer(r"^mpi-msg-count: pid (\d+) rank (\d+) "
                         r"(?:windows \d+ misses (\d+)|idle \d+|"
                         r"pingpong \d+|spin \d+)$", log, re.M):
        pid, rank = m.group(1), int(m.group(2))
        calls: collections.Counter = collections.Counter()
        path = out.with_name(f"{out.name}.{pid}")
        # the loop's own dump (zeroed before it), where the program makes one
        dumped = path.with_name(path.name + ".1")
        costs = load(dumped if dumped.exists() else path, calls)
        # latency's shape: the polls past one per receive found nothing
        found[rank] = (costs, int(m.group(3) or 0), calls["opal_progress"])
    if set(found) != {0, 1}:
        raise SystemExit(f"mpi_msg_count.py: a run printed no line for "
                         f"both ranks:\n{log}")
    return found


def command(mpi: str, transport: str, prefix: Path, prog: Path,
            provider: Path, region: Path, vg: list, args: list):
    env = dict(os.environ)
    if mpi == "openmpi4":
        from ivcloud.mpis import local
        cmd = local.mpirun_command(
            vg + [str(prog)] + args, 2,
            transport="ivshmem" if transport == "ivshm" else "vader",
            region=region if transport == "ivshm" else None,
            tcp_fallback=transport != "ivshm",
            extra_mca=[("hwloc_base_binding_policy", "none")]
            + ([] if transport == "ivshm" else [("btl", "self,vader")]))
        return cmd, env
    if mpi == "openmpi5":
        cmd = [str(prefix / "bin" / "mpiexec"), "--oversubscribe",
               "--bind-to", "none", "-n", "2"]
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
        if transport == "own":
            mca = [("pml", "ob1"), ("btl", "self,sm")]
        else:
            env["FI_PROVIDER_PATH"] = str(provider)
            mca = [("pml", "cm"), ("mtl", "ofi"),
                   ("mtl_ofi_provider_include", "ivshm"), ("osc", "rdma"),
                   ("btl", "self,ofi"), ("btl_ofi_provider_include", "ivshm")]
            cmd += ["-x", f"FI_IVSHM_REGION={region}"]
        for k, v in mca:
            cmd += ["--mca", k, v]
    else:
        cmd = [str(prefix / "bin" / "mpiexec"), "-n", "2"]
        if transport == "ivshm":
            env.update(FI_PROVIDER_PATH=str(provider), FI_PROVIDER="ivshm",
                       MPIR_CVAR_CH4_NETMOD="ofi", MPIR_CVAR_NOLOCAL="1",
                       FI_IVSHM_REGION=str(region))
    return cmd + vg + [str(prog)] + args, env


def main() -> None:
    ap = argparse.ArgumentParser(add_help=True)
    ap.add_argument("--mpi", default="openmpi5")
    ap.add_argument("--transport", default="ivshm")
    ap.add_argument("--shape", default="bw")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--pace", type=int, default=2000)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--provider", type=Path,
                    default=REPO / "build" / "native" / "provider")
    ap.add_argument("--functions", type=int, default=0)
    ap.add_argument("--keep", type=Path)
    try:
        a = ap.parse_args()
    except SystemExit as e:
        sys.exit(0 if e.code == 0 else 2)
    if a.mpi not in ("openmpi5", "mpich", "openmpi4"):
        fail(f"--mpi: openmpi5, mpich or openmpi4, not {a.mpi!r}")
    if a.shape not in ("bw", "latency"):
        fail(f"--shape: bw or latency, not {a.shape!r}")
    if a.shape == "latency" and a.mpi == "mpich":
        fail("--shape latency counts opal_progress's polls: Open MPI only")
    if a.transport not in ("ivshm", "own"):
        fail(f"--transport: ivshm or own, not {a.transport!r}")
    if a.windows < 1 or a.pace < 1 or a.idle < 1 or a.functions < 0:
        fail("--windows, --pace and --idle must be at least 1, "
             "--functions at least 0")
    prefix = REPO / "build" / "mpi" / a.mpi
    if a.mpi == "openmpi4":
        mpicc = shutil.which("mpicc")
        prefix = Path(mpicc).resolve().parents[1] if mpicc else prefix
        if not mpicc:
            fail("no mpicc on PATH (Debian's Open MPI 4: libopenmpi-dev)")
    elif not (prefix / "bin" / "mpicc").exists():
        fail(f"no {prefix / 'bin' / 'mpicc'} (`make` installs the MPI wheels)")
    if a.mpi == "openmpi4" and a.transport == "ivshm" and not (
            REPO / "build" / "native" / "btl" / "mca_btl_ivshmem.so").exists():
        fail("no build/native/btl/mca_btl_ivshmem.so (`make build` builds it)")
    if a.mpi != "openmpi4" and a.transport == "ivshm" and not (
            a.provider / "libivshm-fi.so").exists():
        fail(f"no {a.provider / 'libivshm-fi.so'} (`make build` builds it)")
    if not shutil.which("valgrind"):
        fail("valgrind is not installed")
    from ivcloud.native import format_region, min_region_size

    work = Path(tempfile.mkdtemp(prefix="mpi-msg-count-"))
    region = Path("/dev/shm") / f"ivcloud-msg-count-{os.getpid()}"
    cleanup = contextlib.ExitStack()
    try:
        prog = work / "mpi-msg-count"
        subprocess.run([str(prefix / "bin" / "mpicc"), "-O2", "-o", str(prog),
                        str(SOURCE)], check=True)
        if a.mpi == "openmpi4":
            # formatted as `ivcloud mpirun` formats a job's own region
            from ivcloud.mpis.regions import private_region
            cleanup.enter_context(private_region(2, region))
        else:
            format_region(region, min_region_size(8, slot_size=SLOT), 8,
                          slot_size=SLOT)
        shapes = {"bw": (("loop", [str(a.windows), str(a.pace)]),
                         ("idle", ["idle", str(a.idle)])),
                  "latency": tuple(
                      (f"loop{r}", ["pingpong", str(a.windows), str(a.pace),
                                    str(r)]) for r in (0, 1))}
        runs = {}
        for label, args in shapes[a.shape]:
            # latency: the paced rank's run again (at most TRIES in all)
            # while a busy machine kept its peer from answering in time
            for attempt in range(TRIES if a.shape == "latency" else 1):
                out = work / f"{label}.{attempt}"
                vg = ["valgrind", "--tool=callgrind", "--collect-atstart=no",
                      f"--callgrind-out-file={out}.%p"]
                cmd, env = command(a.mpi, a.transport, prefix, prog,
                                   a.provider.resolve(), region, vg, args)
                p = subprocess.run(cmd, env=env, capture_output=True,
                                   text=True, timeout=1800)
                if p.returncode != 0:
                    raise SystemExit(f"mpi_msg_count.py: the {label} run "
                                     f"failed ({p.returncode}):\n"
                                     f"{p.stdout}{p.stderr}")
                got = ranks(p.stdout, out)
                if a.shape == "latency":
                    paced = int(label[-1])
                    empty = got[paced][2] - a.windows
                    if label in runs and \
                            runs[label][paced][2] - a.windows <= empty:
                        continue
                    runs[label] = got
                    if empty <= a.windows // 50:
                        break
                else:
                    runs[label] = got
        report(a, runs)
    finally:
        cleanup.close()
        region.unlink(missing_ok=True)
        if a.keep:
            shutil.copytree(work, a.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


# what the paced rank's usleep costs (libc): the harness's, not a message's
SLEEP = {"usleep", "nanosleep", "clock_nanosleep@@GLIBC_2.17",
         "__pthread_enable_asynccancel", "__pthread_disable_asynccancel"}


def report_latency(a, runs) -> None:
    """Per round trip of osu latency's shape, each rank's own cost with
    its empty polls taken out, and one empty poll's cost, by object.
    Each rank ran twice: paced (its message there when it receives, few
    empty polls) and spinning (while the other rank sleeps, many); the
    difference over the difference in polls is the poll's cost, in the
    state the loop leaves it in."""
    both: collections.Counter = collections.Counter()
    polls: collections.Counter = collections.Counter()
    lines = []
    for rank in (0, 1):
        clean, _, calls = runs[f"loop{rank}"][rank]
        busy, _, busy_calls = runs[f"loop{1 - rank}"][rank]
        empty, busy_empty = calls - a.windows, busy_calls - a.windows
        if busy_empty - empty < 100 * a.windows:
            raise SystemExit(f"mpi_msg_count.py: rank {rank} spun too little "
                             f"({busy_empty} polls against {empty}) to "
                             f"tell a poll's cost: a longer --pace")
        keys = (set(clean) | set(busy)) - {k for k in set(clean) | set(busy)
                                            if k[1] in SLEEP}
        per_poll = {k: (busy.get(k, 0) - clean.get(k, 0)) /
                    (busy_empty - empty) for k in keys}
        per = {k: (clean.get(k, 0) - empty * per_poll[k]) / a.windows
               for k in keys}
        for k, v in per_poll.items():
            polls[k[0]] += v / 2
        byob = collections.Counter()
        for (ob, _), v in per.items():
            byob[ob] += v
        both.update(byob)
        lines.append(f"rank {rank}: {sum(per.values()):.1f} per round trip "
                     f"(one send, one receive; {empty} empty polls taken "
                     f"out, {sum(per_poll.values()):.1f} each)")
        lines += [f"  {v:8.1f}  {ob}" for ob, v in byob.most_common()
                  if abs(v) >= 0.5]
        lines += [f"      {v:8.1f}  {ob}: {fn}" for (ob, fn), v in
                  sorted(per.items(), key=lambda kv: -kv[1])[:a.functions]]
        lines.append(f"  an empty poll, rank {rank}'s, by function:")
        lines += [f"      {v:8.1f}  {ob}: {fn}" for (ob, fn), v in
                  sorted(per_poll.items(), key=lambda kv: -kv[1])
                  [:a.functions] if abs(v) >= 0.05]
    print(f"{a.mpi} over {a.transport}: {a.windows} round trips of 8 bytes "
          f"(blocking MPI_Send/MPI_Recv); an empty poll of a receiver "
          f"spinning in MPI_Recv {sum(polls.values()):.1f} instructions")
    for ob, v in polls.most_common():
        if abs(v) >= 0.05:
            print(f"  {v:8.1f}  {ob}")
    print("\n".join(lines))
    print(f"both ranks: {sum(both.values()):.1f} per round trip")
    for ob, v in both.most_common():
        if abs(v) >= 0.5:
            print(f"  {v:8.1f}  {ob}")


def report(a, runs) -> None:
    if a.shape == "latency":
        return report_latency(a, runs)
    idle_costs = runs["idle"][1][0]
    per_test = {k: v / a.idle for k, v in idle_costs.items()}
    msgs = a.windows * WINDOW
    print(f"{a.mpi} over {a.transport}: {a.windows} windows of {WINDOW} "
          f"8-byte messages; an empty MPI_Test "
          f"{sum(per_test.values()):.1f} instructions")
    both: collections.Counter = collections.Counter()
    for rank, role in ((0, "sender"), (1, "receiver")):
        costs, misses, _ = runs["loop"][rank]
        per = {k: (v - misses * per_test.get(k, 0)) / msgs
               for k, v in costs.items()}
        byob: collections.Counter = collections.Counter()
        for (ob, _), v in per.items():
            byob[ob] += v
        both.update(byob)
        print(f"rank {rank} ({role}): {sum(per.values()):.1f} per message "
              f"({misses} misses taken out)")
        for ob, v in byob.most_common():
            if abs(v) >= 0.5:
                print(f"  {v:8.1f}  {ob}")
        for (ob, fn), v in sorted(per.items(), key=lambda kv: -kv[1])[:a.functions]:
            print(f"      {v:8.1f}  {ob}: {fn}")
    print(f"both ranks: {sum(both.values()):.1f} per message")


if __name__ == "__main__":
    main()
