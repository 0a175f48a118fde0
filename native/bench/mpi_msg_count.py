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
                   [--shape windows|pingpong] [--windows N] [--rounds N]
                   [--pace US] [--idle TESTS] [--wait MS]
                   [--provider DIR] [--functions K] [--keep DIR]

--shape pingpong (Open MPI, 5 or 4) counts osu latency's shape instead:
round trips of a blocking MPI_Send and MPI_Recv, each rank posting its
receive once its peer's send has returned (told through a shared file,
waited for uncounted), so that a receive is its post and the one poll
that finds the message; polls that found nothing anyway (calls of
opal_progress beyond one a receive) are taken out at the cost of a
blocking receive's empty poll, which a second run (`wait`, one receive
waiting WAIT ms for its message) measures ("The ping-pong, counted").

openmpi5 over ivshm: pml cm + mtl ofi over the provider, as ivcloud
launches it (ivcloud/mpis/openmpi5.py); openmpi5 own: pml ob1 + btl
self,sm. openmpi4 (Debian's, on PATH) over ivshm: pml ob1 + btl
self,ivshmem, our BTL from build/native/btl in a region of its own, as
`ivcloud mpirun` launches it; openmpi4 own: btl self,vader. mpich over
ivshm: ch4:ofi with FI_PROVIDER=ivshm. One region (16 KiB slots) for both
ranks. Needs valgrind and the MPI wheels under build/mpi (`make`), or
for openmpi4 Debian's Open MPI. Bad arguments: one line on stderr,
exit 2.
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
PROG = "mpi-msg-count"
POLL = "opal_progress"  # one call a poll of a blocking receive, Open MPI's
SLOT = 16384 + 64


def fail(msg: str) -> None:
    print(f"mpi_msg_count.py: {msg}", file=sys.stderr)
    sys.exit(2)


class Profile(collections.Counter):
    """Self cost (Ir) per (object, function) of one callgrind file, with
    `calls` (how often each function was called, by name) and `incl` (the
    inclusive cost of the calls the program itself made, by callee)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.incl: collections.Counter = collections.Counter()


def load(path: Path) -> Profile:
    names = {"ob": {}, "fn": {}}
    ob = fn = cfn = None
    skip = False
    costs = Profile()

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
            costs.calls[cfn] += int(line[6:].split()[0])
        elif line[:1].isdigit() or line[:1] in "+-*":
            if skip:
                skip = False
                parts = line.split()
                if len(parts) >= 2 and os.path.basename(ob or "") == PROG:
                    costs.incl[cfn] += int(parts[1])
                continue
            parts = line.split()
            if len(parts) >= 2:
                costs[(os.path.basename(ob or "?"), fn or "?")] += int(parts[1])
    return costs


def counted(path: Path) -> Profile:
    """The counted part of a rank's run: the whole file, or where the
    program dumped before and after it, the second dump (PATH.2)."""
    second = path.with_name(f"{path.name}.2")
    return load(second if second.exists() else path)


def ranks(log: str, out: Path) -> dict:
    """{rank: (costs, misses)} of one run, from the program's lines."""
    found = {}
    for m in re.finditer(r"^mpi-msg-count: pid (\d+) rank (\d+) "
                         r"(?:windows \d+ misses (\d+)|idle \d+|rounds \d+|"
                         r"wait \d+)$", log, re.M):
        pid, rank = m.group(1), int(m.group(2))
        found[rank] = (counted(out.with_name(f"{out.name}.{pid}")),
                       int(m.group(3) or 0))
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
    ap.add_argument("--shape", default="windows")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--wait", type=int, default=300)
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
    if a.transport not in ("ivshm", "own"):
        fail(f"--transport: ivshm or own, not {a.transport!r}")
    if a.shape not in ("windows", "pingpong"):
        fail(f"--shape: windows or pingpong, not {a.shape!r}")
    if a.shape == "pingpong" and a.mpi == "mpich":
        fail("--shape pingpong counts Open MPI's polls (opal_progress): "
             "--mpi openmpi5 or openmpi4")
    if (a.windows < 1 or a.rounds < 1 or a.wait < 1 or a.pace < 1 or
            a.idle < 1 or a.functions < 0):
        fail("--windows, --rounds, --wait, --pace and --idle must be at "
             "least 1, --functions at least 0")
    prefix = REPO / "build" / "mpi" / a.mpi
    if a.mpi == "openmpi4":
        mpicc = shutil.which("mpicc")
        if not mpicc:
            fail("no mpicc on PATH (Debian's Open MPI 4: libopenmpi-dev)")
        prefix = Path(mpicc).resolve().parents[1]
        if a.transport == "ivshm" and not (
                REPO / "build" / "native" / "btl" /
                "mca_btl_ivshmem.so").exists():
            fail("no build/native/btl/mca_btl_ivshmem.so "
                 "(`make build` builds it)")
    elif not (prefix / "bin" / "mpicc").exists():
        fail(f"no {prefix / 'bin' / 'mpicc'} (`make` installs the MPI wheels)")
    elif a.transport == "ivshm" and not (
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
        runs = {}
        if a.shape == "pingpong":
            words = work / "words"
            words.write_bytes(bytes(16))
            shape = (("loop", ["pingpong", str(a.rounds), str(words)]),
                     ("idle", ["wait", str(a.wait)]))
        else:
            shape = (("loop", [str(a.windows), str(a.pace)]),
                     ("idle", ["idle", str(a.idle)]))
        for label, args in shape:
            out = work / label
            vg = ["valgrind", "--tool=callgrind",
                  f"--collect-atstart={'yes' if a.shape == 'pingpong' else 'no'}",
                  f"--callgrind-out-file={out}.%p"]
            cmd, env = command(a.mpi, a.transport, prefix, prog,
                               a.provider.resolve(), region, vg, args)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"mpi_msg_count.py: the {label} run failed "
                                 f"({p.returncode}):\n{p.stdout}{p.stderr}")
            runs[label] = ranks(p.stdout, out)
        (report_pingpong if a.shape == "pingpong" else report)(a, runs)
    finally:
        cleanup.close()
        region.unlink(missing_ok=True)
        if a.keep:
            shutil.copytree(work, a.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def print_by_object(per, functions: int) -> collections.Counter:
    """Print `per` ({(object, function): instructions}) summed by object,
    then its `functions` costliest functions; return the sums."""
    byob: collections.Counter = collections.Counter()
    for (ob, _), v in per.items():
        byob[ob] += v
    for ob, v in byob.most_common():
        if abs(v) >= 0.5:
            print(f"  {v:8.1f}  {ob}")
    for (ob, fn), v in sorted(per.items(), key=lambda kv: -kv[1])[:functions]:
        print(f"      {v:8.1f}  {ob}: {fn}")
    return byob


def report(a, runs) -> None:
    idle_costs = runs["idle"][1][0]
    per_test = {k: v / a.idle for k, v in idle_costs.items()}
    msgs = a.windows * WINDOW
    print(f"{a.mpi} over {a.transport}: {a.windows} windows of {WINDOW} "
          f"8-byte messages; an empty MPI_Test "
          f"{sum(per_test.values()):.1f} instructions")
    both: collections.Counter = collections.Counter()
    for rank, role in ((0, "sender"), (1, "receiver")):
        costs, misses = runs["loop"][rank]
        per = {k: (v - misses * per_test.get(k, 0)) / msgs
               for k, v in costs.items()}
        print(f"rank {rank} ({role}): {sum(per.values()):.1f} per message "
              f"({misses} misses taken out)")
        both.update(print_by_object(per, a.functions))
    print(f"both ranks: {sum(both.values()):.1f} per message")


def report_pingpong(a, runs) -> None:
    """Per round trip and rank (one MPI_Send, one MPI_Recv): each
    receive's last poll is its message's, the others found nothing and
    are taken out at the cost of a blocking receive's empty poll (the
    `wait` run's count over its polls)."""
    waited = runs["idle"][1][0]
    polls = waited.calls[POLL]
    if polls < 100:
        raise SystemExit(f"mpi_msg_count.py: the wait run polled {polls} "
                         f"times; too few to cost a poll (--wait longer)")
    per_poll = {k: v / polls for k, v in waited.items()}
    empty = sum(per_poll.values())
    print(f"{a.mpi} over {a.transport}: {a.rounds} round trips of 8 B "
          f"(MPI_Send, MPI_Recv); a blocking receive's empty poll "
          f"{empty:.1f} instructions ({polls} polls in {a.wait} ms)")
    both: collections.Counter = collections.Counter()
    for rank in (0, 1):
        costs = runs["loop"][rank][0]
        misses = costs.calls[POLL] - a.rounds
        per = {k: (v - misses * per_poll.get(k, 0)) / a.rounds
               for k, v in costs.items()}
        calls = {re.sub(r"^P", "", k): v for k, v in costs.incl.items()
                 if re.fullmatch(r"P?MPI_(Send|Recv)", k or "")}
        send = calls.get("MPI_Send", 0) / a.rounds
        recv = (calls.get("MPI_Recv", 0) - misses * empty) / a.rounds
        print(f"rank {rank}: {sum(per.values()):.1f} per round trip "
              f"({misses} empty polls taken out); MPI_Send {send:.1f}, "
              f"MPI_Recv {recv:.1f} (its one poll included; "
              f"{recv - empty:.1f} beyond an empty poll)")
        both.update(print_by_object(per, a.functions))
    print(f"both ranks: {sum(both.values()):.1f} per round trip")
    if a.functions:
        print("a blocking receive's empty poll:")
        for (ob, fn), v in sorted(per_poll.items(), key=lambda kv: -kv[1])[:a.functions]:
            print(f"      {v:8.1f}  {ob}: {fn}")


if __name__ == "__main__":
    main()
