"""libfabric's own conformance suite, fabtests, against the provider
`ivshm` (docs/provider.md, "Conformance").

fabtests 2.1.0 and the libfabric 2.1.0 it runs on are built from Debian
13's source package of libfabric by `make fabtests`
(tests/fabtests_build.sh: downloaded, its sha256 checked, cached outside
the clone; build/fabtests points at the build). Our provider is loaded
into that libfabric as a DL provider (`FI_PROVIDER_PATH=+FILE`,
`FI_PROVIDER=ivshm`), both processes of a case on one region, names
exchanged out of band (`-E`, as `runfabtests.sh -b` runs them).

- `make test`: a bounded set, one case for each capability the provider
  advertises, each run as runfabtests.sh runs it (the server, then the
  client once the server listens; both ENODATA or both ENOSYS is the
  suite's skip) with a deadline, and its outcome asserted: a pass, or
  the suite's skip where we do not offer what the case needs (the reason
  beside it).
- `make test-fabtests` (IVCLOUD_FABTESTS_ALL=1): runfabtests.sh's whole
  default set (`-t quick`: unit, functional, short), against the
  provider's ASan/UBSan build (IVCLOUD_FABTESTS_PROVIDER; a sanitizer
  report fails the run), in a PID and
  network namespace of its own (the script ends a failed case by
  killing every process whose name starts with `fi_`: there it reaches
  only its own; its out-of-band port is its own too). No case may fail
  but those in KNOWN_FAILURES, each with its reason, and the skipped
  ones are exactly SKIPS; the script's report stays in
  build/test-fabtests.log.

Every region and file a case makes is removed, on failure too.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from ivcloud.native import format_region, min_region_size

REPO = Path(__file__).resolve().parent.parent
FABTESTS = REPO / "build" / "fabtests"
PEERS = 16          # a case's endpoints (fi_multi_ep, fi_rdm_multi_client)
REGION_MIB = 64
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def fabtests() -> Path:
    if not (FABTESTS / "bin" / "runfabtests.sh").exists():
        pytest.fail(f"{FABTESTS} missing: `make fabtests` builds it",
                    pytrace=False)
    return FABTESTS.resolve()


@pytest.fixture
def region(unique):
    path = Path("/dev/shm") / f"ivcloud-fabtests-{unique}"
    format_region(path, max(min_region_size(PEERS), REGION_MIB << 20), PEERS)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def environment(fabtests: Path, provider: Path, region: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(FI_PROVIDER="ivshm", FI_PROVIDER_PATH=f"+{provider}",
               FI_IVSHM_REGION=str(region),
               LD_LIBRARY_PATH=str(fabtests / "lib"))
    return env


@pytest.fixture
def provider(native_dir) -> Path:
    """The provider under test: the native build's, or the one
    IVCLOUD_FABTESTS_PROVIDER names (`make test-fabtests`: the ASan/UBSan
    build's)."""
    named = os.environ.get("IVCLOUD_FABTESTS_PROVIDER")
    so = Path(named) if named else native_dir / "provider" / "libivshm-fi.so"
    assert so.exists(), f"{so} missing: `make build` (or `make asan`) builds it"
    return so.resolve()


def sanitizer_runtimes(so: Path) -> List[str]:
    """The sanitizer runtimes a sanitized provider needs loaded first
    (fabtests' programs are not built with them), by soname."""
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True,
                         text=True, check=True).stdout
    return [n for n in re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out)
            if re.match(r"lib(asan|ubsan)\.so", n)]


def program_dir(bin_dir: Path, preload: List[str], into: Path) -> Path:
    """bin_dir itself, or with a sanitized provider a directory of
    wrappers, one per fabtests program, that start it with the runtimes
    preloaded (in the programs alone, not in the script's own tools);
    leaks are not reported: fabtests' own would be among them."""
    if not preload:
        return bin_dir
    into.mkdir()
    for prog in bin_dir.glob("fi_*"):
        w = into / prog.name
        w.write_text("#!/bin/sh\n"
                     f"LD_PRELOAD={':'.join(preload)} ASAN_OPTIONS=detect_leaks=0 "
                     f"UBSAN_OPTIONS=print_stacktrace=1 exec {prog} \"$@\"\n")
        w.chmod(0o755)
    return into


# ------------------------------------------------------------ one case

@dataclass
class Outcome:
    result: str                 # "pass", "skip" or "fail", as the suite counts
    server_rc: int              # 124: killed at its deadline; < 0: a signal
    client_rc: Optional[int]    # None for a single-process case
    output: str
    seconds: float

    def explain(self) -> str:
        return (f"{self.result} (server/unit rc {self.server_rc}, client rc "
                f"{self.client_rc}, {self.seconds:.1f} s)\n{self.output}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    want = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 3 and (f[1] + " ").endswith(want) and f[3] == "0A":
                return True
    return False


class _Proc:
    """A case's process in a session of its own: ended with whatever it
    started at its deadline and on every way out."""

    def __init__(self, argv: List[str], env: Dict[str, str], out: Path):
        self.fh = open(out, "w+b")
        self.p = subprocess.Popen(argv, env=env, stdout=self.fh,
                                  stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL,
                                  start_new_session=True)

    def wait(self, deadline: float) -> int:
        try:
            return self.p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return 124

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()

    def output(self) -> str:
        self.fh.seek(0)
        return self.fh.read().decode(errors="replace")

    def close(self) -> None:
        # only while the leader is not reaped: its pid, the group's id,
        # is then still ours
        if self.p.returncode is None:
            self.kill()
        self.fh.close()


def _skip_codes(*rcs: int) -> bool:
    return (all(rc == errno.ENODATA for rc in rcs)
            or all(rc == errno.ENOSYS for rc in rcs))


def run_case(case: str, env: Dict[str, str], bin_dir: Path, tmp: Path,
             timeout: float, two_sided: bool = True,
             negative: bool = False) -> Outcome:
    """One case as runfabtests.sh runs it with -b: a unit case alone, a
    client-server case as a server and then a client; the result counted
    as the script counts it."""
    args = case.split()
    argv = [str(bin_dir / args[0])] + args[1:] + ["-p", "ivshm"]
    start = time.monotonic()
    deadline = start + timeout
    if not two_sided:
        proc = _Proc(argv, env, tmp / "unit.out")
        try:
            rc = proc.wait(deadline)
            out = proc.output()
        finally:
            proc.close()
        if negative:        # refused for the address asked for, or failed
            result = "pass" if rc == errno.ENODATA else "fail"
        else:
            result = ("skip" if _skip_codes(rc) else "fail" if rc else "pass")
        return Outcome(result, rc, None, out, time.monotonic() - start)

    port = _free_port()
    server = _Proc(argv + [f"-E={port}"], env, tmp / "server.out")
    client = None
    try:
        # the client connects once; runfabtests waits 1 s, we until the
        # server listens (or has ended, or 5 s)
        while (time.monotonic() < start + 5 and server.p.poll() is None
               and not _listening(port)):
            time.sleep(0.02)
        client = _Proc(argv + [f"-E={port}", HOST], env, tmp / "client.out")
        c_rc = client.wait(deadline)
        if c_rc != 0 and server.p.poll() is None:
            # as the script: a failed client's server gets 2 s, then ends
            s_rc = server.wait(min(deadline, time.monotonic() + 2))
        else:
            s_rc = server.wait(deadline)
        out = ("--- server\n" + server.output() + "--- client\n"
               + client.output())
    finally:
        server.close()
        if client is not None:
            client.close()
    result = ("skip" if _skip_codes(s_rc, c_rc)
              else "fail" if s_rc or c_rc else "pass")
    return Outcome(result, s_rc, c_rc, out, time.monotonic() - start)


# ------------------------------------------------------- the bounded set

SERVER = f"-s {HOST}"
# (case, kind, what it covers); kind: "unit", "neg" (must end ENODATA) or
# "cs" (client-server)
BOUNDED = [
    (f"fi_getinfo_test {SERVER} {HOST}", "unit", "getinfo"),
    ("fi_dom_test -n 2", "unit", "domains"),
    ("fi_eq_test", "unit", "EQ"),
    ("fi_cq_test", "unit", "CQ"),
    ("fi_mr_test", "unit", "memory registration"),
    ("fi_cntr_test", "unit", "counters"),
    ("fi_rdm g00n13s", "neg", "a node that does not resolve"),
    ("fi_rdm", "cs", "rdm untagged"),
    ("fi_rdm_tagged_pingpong -I 5", "cs", "rdm tagged"),
    ("fi_av_xfer -e rdm", "cs", "AV: insert, remove, transfer"),
    ("fi_inject_test -N -A inject -v", "cs", "inject"),
    ("fi_cq_data -e rdm -o senddata", "cs", "CQ data"),
    ("fi_multi_recv -e rdm -I 5", "cs", "multi-receive"),
    ("fi_rma_bw -e rdm -o read -I 5", "cs", "RMA read"),
    ("fi_rma_bw -e rdm -o writedata -I 5", "cs", "RMA write with data"),
    ("fi_rdm_rma_event", "cs", "RMA write with remote events"),
    ("fi_rdm_rma_trigger", "cs", "triggered RMA write through an alias"),
    ("fi_rdm_atomic -I 5 -o all", "cs", "atomics"),
    ("fi_rdm_cntr_pingpong -I 5", "cs", "counters on the data path"),
]

# The suite's skips in the bounded set: what the case needs, which we do
# not advertise (docs/provider.md, "Conformance").
BOUNDED_SKIPS = {
    f"fi_av_test -g {HOST} -n 1 {SERVER} -e rdm":
        "FI_SOCKADDR addresses: our names are region slots",
}

CASE_TIMEOUT = 30.0


def _bounded_params():
    for case, kind, what in BOUNDED:
        yield pytest.param(case, kind, None, id=f"{what}: {case}")
    for case, why in BOUNDED_SKIPS.items():
        yield pytest.param(case, "unit", why, id=f"skip: {case}")


@pytest.mark.parametrize("case,kind,skip_reason", list(_bounded_params()))
def test_case(case, kind, skip_reason, fabtests, provider, region, tmp_path):
    env = environment(fabtests, provider, region)
    outcome = run_case(case, env, fabtests / "bin", tmp_path, CASE_TIMEOUT,
                       two_sided=kind == "cs", negative=kind == "neg")
    want = "skip" if skip_reason else "pass"
    assert outcome.result == want, f"{case}: {outcome.explain()}"
    if skip_reason:     # refused where it asked for what we lack
        assert "fi_getinfo" in outcome.output, outcome.explain()
    assert outcome.seconds < CASE_TIMEOUT


# --------------------------------------------------------- the whole set

# runfabtests.sh -t quick's cases the suite skips (both sides end
# -FI_ENODATA or -FI_ENOSYS), each for what it needs that we do not
# advertise (docs/provider.md, "Conformance"), with the refusal its
# output must show: fi_getinfo's -FI_ENODATA, or for shared contexts the
# call's -FI_ENOSYS.
_GETINFO = r"fi_getinfo\(\): .*ret=-61 \(No data available\)"
_NO_MSG = ("an FI_EP_MSG endpoint (connection management): RDM and "
           "datagram only", _GETINFO)
SKIPS: Dict[str, tuple] = {
    **{c: _NO_MSG for c in (
        "fi_cm_data", "fi_msg", "fi_msg_epoll",
        "fi_msg_bw -I 5", "fi_msg_bw -I 5 -v",
        "fi_msg_pingpong -I 5", "fi_msg_pingpong -I 5 -v",
        "fi_cq_data -e msg -o senddata", "fi_cq_data -e msg -o writedata",
        "fi_multi_ep -e msg -v -A", "fi_multi_ep -e msg -v -Q",
        "fi_multi_ep -e msg -v -A -Q",
        "fi_multi_ep -e msg -v --threading completion",
        "fi_multi_ep -e msg -v -A --threading completion",
        "fi_multi_ep -e msg -v -Q --threading completion",
        "fi_multi_ep -e msg -v -A -Q --threading completion",
        "fi_multi_mr -e msg -V", "fi_multi_recv -e msg -I 5",
        "fi_rma_bw -e msg -o read -I 5", "fi_rma_bw -e msg -o write -I 5",
        "fi_rma_bw -e msg -o writedata -I 5",
        "fi_shared_ctx -e msg", "fi_shared_ctx -e msg --no-rx-shared-ctx",
        "fi_shared_ctx -e msg --no-tx-shared-ctx",
        "fi_unexpected_msg -e msg -I 10 -v",
    )},
    **{f"fi_av_test -g {HOST} -n 1 -s {HOST} -e {e}":
       ("FI_SOCKADDR addresses: our names are region slots", _GETINFO)
       for e in ("rdm", "dgram")},
    **{c: ("shared transmit and receive contexts",
           r"fi_(stx|srx)_context\(\): .*ret=-38 \(Function not implemented\)")
       for c in (
        "fi_shared_ctx", "fi_shared_ctx --no-rx-shared-ctx",
        "fi_shared_ctx --no-tx-shared-ctx", "fi_shared_ctx -e dgram",
        "fi_shared_ctx -e dgram --no-rx-shared-ctx",
        "fi_shared_ctx -e dgram --no-tx-shared-ctx",
    )},
    "fi_scalable_ep": ("scalable endpoints (FI_NAMED_RX_CTX)", _GETINFO),
    "fi_rdm_shared_av": ("named, shared AVs (FI_SHARED_AV)", _GETINFO),
}

# Cases the script counts failed for any provider that answers as we do
# (the test's own defect, or a capability we refuse answered in a way
# the script does not count as a skip), as libfabric's own providers list
# such cases in their exclude files: each with its reason
# (docs/provider.md, "Conformance") and the output it must show, so that
# no other failure hides behind it.
_ONE_SIDED_REFUSAL = (
    "the server's fi_getinfo ends with -FI_ENODATA, but the client waits "
    "on the out-of-band socket before its own and ends with -ENOTCONN: the "
    "script counts a skip only when both sides end -FI_ENODATA")
_ENOTCONN = r"ret=-61 \(No data available\)(.|\n)*ret=-107 \(Transport endpoint is not connected\)"
KNOWN_FAILURES: Dict[str, tuple] = {
    "fi_cq_data -e dgram -o writedata": (
        "asks for FI_RMA on a datagram endpoint, which we refuse; "
        + _ONE_SIDED_REFUSAL, _ENOTCONN),
    "fi_msg_sockets": (
        "requires -s, which -b does not pass: both sides exit before asking "
        "anything", r"Source address \(-s\) is required for this test"),
    "fi_flood -e msg -v -T 1": (
        "asks for FI_EP_MSG, which we do not offer: after its failed "
        "connect the client reads the info it never got (fabtests' "
        "ft_init_fabric_cm) and dies of SIGSEGV, for any provider without "
        "FI_EP_MSG (a provider name that does not exist does the same)",
        r"ret=-61 \(No data available\)(.|\n)*(Segmentation fault|"
        r"AddressSanitizer: SEGV(.|\n)*in ft_init_fabric_cm )"),
    "fi_multi_mr -e rdm -V": (
        "writes at address 0 with keys it requested although the answer "
        "kept FI_MR_VIRT_ADDR and FI_MR_PROV_KEY, which it offered: our "
        "target refuses the address (-FI_EACCES) and the server's wait on "
        "its counter times out (libfabric's tcp, rxm, shm and verbs list "
        "it in their exclude files)",
        r"cq_readerr 13 \(Permission denied\)"),
}

FULL_TIMEOUT = 60          # runfabtests.sh -T: per process


def parse_results(text: str) -> Dict[str, tuple]:
    """runfabtests.sh -vv's records, `- name: CASE -p "ivshm"`, then
    `result: R` and the output: {CASE: (R, the record's text)}."""
    results: Dict[str, tuple] = {}
    records = re.split(r"^(?=- name:)", text, flags=re.M)
    for rec in records:
        m = re.match(r'- name:\s+(.*?)\s+-p\s+"?ivshm"?\s*$', rec, re.M)
        r = re.search(r"^\s+result:\s+(\S+)", rec, re.M)
        if m and r:
            results[m.group(1)] = (r.group(1), rec)
    return results


@pytest.mark.skipif(os.environ.get("IVCLOUD_FABTESTS_ALL") != "1",
                    reason="the whole set: make test-fabtests "
                           "(IVCLOUD_FABTESTS_ALL=1)")
@pytest.mark.skipif(os.geteuid() != 0,
                    reason="needs root (PID and network namespaces)")
def test_default_set(fabtests, provider, region, tmp_path):
    env = environment(fabtests, provider, region)
    bin_dir = fabtests / "bin"
    progs = program_dir(bin_dir, sanitizer_runtimes(provider), tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    script = (f'ip link set lo up && cd "{work}" && exec '
              f'"{bin_dir}/runfabtests.sh" -b -vv -T {FULL_TIMEOUT} '
              f'-p "{progs}" -g {HOST} -s {HOST} -c {HOST} ivshm')
    log = REPO / "build" / "test-fabtests.log"      # kept for a look after
    start = time.monotonic()
    with open(log, "w") as fh:
        # --kill-child: should the run pass its hour and be killed, its
        # namespace goes with it (the namespace's first process, killed,
        # takes every other one)
        subprocess.run(["unshare", "--pid", "--kill-child", "--mount-proc",
                        "--net", "bash", "-c", script],
                       env=env, stdout=fh, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, timeout=3600)
    text = log.read_text(errors="replace")
    results = parse_results(text)
    counts = {r: sum(1 for v, _ in results.values() if v == r)
              for r in sorted({v for v, _ in results.values()})}
    print(f"fabtests 2.1.0, runfabtests.sh -t quick, {provider}: {counts}, "
          f"{time.monotonic() - start:.0f} s")
    for name, (r, _) in sorted(results.items()):
        print(f"  {r:8s} {name}")
    assert len(results) > 90, f"too few results:\n{text[-4000:]}"
    failed = {n for n, (r, _) in results.items() if r.startswith("Fail")}
    skipped = {n for n, (r, _) in results.items() if r == "Notrun"}
    unexpected = failed - set(KNOWN_FAILURES)
    assert not unexpected, "failed: " + "\n".join(
        results[n][1] for n in sorted(unexpected))
    for name in failed:
        reason, signature = KNOWN_FAILURES[name]
        assert re.search(signature, results[name][1]), \
            f"{name} failed otherwise than known ({reason}):\n{results[name][1]}"
    assert failed == set(KNOWN_FAILURES), \
        f"listed as failing but passed: {sorted(set(KNOWN_FAILURES) - failed)}"
    # with a sanitized provider: no report but the test's own crash
    reports = [rec for n, (_, rec) in results.items()
               if re.search(r"ERROR: AddressSanitizer|runtime error:", rec)
               and n != "fi_flood -e msg -v -T 1"]
    assert not reports, "sanitizer reports:\n" + "\n".join(reports)
    assert skipped == set(SKIPS), (
        f"skipped, not listed: {sorted(skipped - set(SKIPS))}; "
        f"listed, not skipped: {sorted(set(SKIPS) - skipped)}")
    for name in skipped:
        reason, signature = SKIPS[name]
        assert re.search(signature, results[name][1]), \
            f"{name} skipped otherwise than for {reason}:\n{results[name][1]}"
