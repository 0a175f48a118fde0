"""HPC Challenge (Debian's `hpcc`): input file and summary parser.

hpcc reads ``hpccinf.txt`` from its working directory and rank 0 writes
``hpccoutf.txt`` there; the file ends with a summary section of
``key=value`` lines, which is all we read. HPL with OpenBLAS must run one
thread per rank (``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``), or ranks
that share an instance oversubscribe its vCPUs.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import InvalidRequest, OperationFailed

BINARY = "hpcc"
INPUT = "hpccinf.txt"
OUTPUT = "hpccoutf.txt"
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

# The summary keys the benchmark tables report: (key, label, unit, higher
# is better). Latency is the one where lower is better.
METRICS: List[Tuple[str, str, str, bool]] = [
    ("HPL_Tflops", "HPL", "Tflop/s", True),
    ("PTRANS_GBs", "PTRANS", "GB/s", True),
    ("MPIFFT_Gflops", "MPIFFT", "Gflop/s", True),
    ("MPIRandomAccess_GUPs", "MPIRandomAccess", "GUP/s", True),
    ("StarSTREAM_Triad", "StarSTREAM Triad", "GB/s", True),
    ("RandomlyOrderedRingBandwidth_GBytes", "ring bandwidth", "GB/s", True),
    ("RandomlyOrderedRingLatency_usec", "ring latency", "us", False),
]


def grid(ranks: int) -> Tuple[int, int]:
    """The most square P x Q process grid with P <= Q (HPL's advice)."""
    if ranks < 1:
        raise InvalidRequest(f"ranks must be at least 1, not {ranks}")
    p = int(math.isqrt(ranks))
    while ranks % p:
        p -= 1
    return p, ranks // p


def input_text(ranks: int, n: int, nb: int = 80) -> str:
    """hpccinf.txt for one HPL problem of order n on `ranks` ranks (PTRANS
    and the other kernels size themselves from it)."""
    if n < nb or nb < 1:
        raise InvalidRequest(f"problem size {n} must be at least the "
                             f"block size {nb}")
    p, q = grid(ranks)
    rows = [
        ("HPLinpack benchmark input file", None),
        ("Innovative Computing Laboratory, University of Tennessee", None),
        ("HPL.out", "output file name (if any)"),
        ("8", "device out (6=stdout,7=stderr,file)"),
        ("1", "# of problems sizes (N)"),
        (str(n), "Ns"),
        ("1", "# of NBs"),
        (str(nb), "NBs"),
        ("0", "PMAP process mapping (0=Row-,1=Column-major)"),
        ("1", "# of process grids (P x Q)"),
        (str(p), "Ps"),
        (str(q), "Qs"),
        ("16.0", "threshold"),
        ("1", "# of panel fact"),
        ("2", "PFACTs (0=left, 1=Crout, 2=Right)"),
        ("1", "# of recursive stopping criterium"),
        ("4", "NBMINs (>= 1)"),
        ("1", "# of panels in recursion"),
        ("2", "NDIVs"),
        ("1", "# of recursive panel fact."),
        ("1", "RFACTs (0=left, 1=Crout, 2=Right)"),
        ("1", "# of broadcast"),
        ("1", "BCASTs (0=1rg,1=1rM,2=2rg,3=2rM,4=Lng,5=LnM)"),
        ("1", "# of lookahead depth"),
        ("1", "DEPTHs (>=0)"),
        ("2", "SWAP (0=bin-exch,1=long,2=mix)"),
        ("64", "swapping threshold"),
        ("0", "L1 in (0=transposed,1=no-transposed) form"),
        ("0", "U  in (0=transposed,1=no-transposed) form"),
        ("1", "Equilibration (0=no,1=yes)"),
        ("8", "memory alignment in double (> 0)"),
        # hpcc ignores line 32 and reads its own PTRANS sizes after it
        ("##### This line (no. 32) is ignored (it serves as a separator). "
         "######", None),
        ("0", "Number of additional problem sizes for PTRANS"),
        (str(n), "values of N"),
        ("0", "number of additional blocking sizes for PTRANS"),
        (str(nb), "values of NB"),
    ]
    return "".join(f"{value:<13}{what}\n" if what else f"{value}\n"
                   for value, what in rows)


def prepare(workdir: Path, ranks: int, n: int) -> Path:
    """A working directory with the input file; returns it."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / INPUT).write_text(input_text(ranks, n))
    out = workdir / OUTPUT
    if out.exists():
        out.unlink()   # hpcc appends to an existing one
    return workdir


def command() -> List[str]:
    path = shutil.which(BINARY)
    if path is None:
        raise OperationFailed("hpcc not found (apt-get install hpcc)")
    return [path]


def parse_summary(text: str) -> Dict[str, float]:
    """The numeric key=value pairs of hpccoutf.txt's summary section."""
    begin = text.rfind("Begin of Summary section.")
    end = text.find("End of Summary section.", begin)
    if begin < 0 or end < 0:
        raise OperationFailed("hpcc output has no summary section (did it "
                              "finish?)")
    values: Dict[str, float] = {}
    for line in text[begin:end].splitlines()[1:]:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            values[key.strip()] = float(value)
        except ValueError:
            pass   # text fields (LANG=C, HPL_ctop=...)
    if values.get("Success") != 1.0:
        raise OperationFailed("hpcc reports a failed run (Success != 1)")
    return values


def results(workdir: Path) -> Dict[str, float]:
    """The metrics of METRICS from a finished run's output file."""
    try:
        text = (workdir / OUTPUT).read_text(errors="replace")
    except OSError as e:
        raise OperationFailed(f"cannot read hpcc output: {e.strerror}")
    return results_of(text)


def results_of(text: str) -> Dict[str, float]:
    """The metrics of METRICS from the text of an output file (read
    wherever rank 0 wrote it)."""
    summary = parse_summary(text)
    missing = [k for k, *_ in METRICS if k not in summary]
    if missing:
        raise OperationFailed(f"hpcc summary lacks {', '.join(missing)}")
    return {k: summary[k] for k, *_ in METRICS}
