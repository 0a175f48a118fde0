"""CPU lists in the kernel/libvirt syntax: "0-3,8,^2" <-> {0, 1, 3, 8}.

The same syntax is used by isolcpus=, nohz_full=, libvirt's cpuset
attributes, Nova's cpu_dedicated_set and /sys/devices/system/cpu/*, so
one parser and one formatter serve all of them.
"""

from __future__ import annotations

import re
from typing import Iterable, Set

# Far above any real machine; it keeps "0-99999999" from allocating a set
# of a hundred million ints on a typo.
MAX_CPU = 1 << 16

_ITEM = re.compile(r"^(\^)?(\d+)(?:-(\d+))?$")


def parse(text: str) -> Set[int]:
    """'0-3,^2,8' -> {0, 1, 3, 8}; ValueError on anything else.

    Exclusions ('^N') apply to the whole list, as in libvirt, whatever
    their position.
    """
    include: Set[int] = set()
    exclude: Set[int] = set()
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"bad CPU list '{text}' (expected e.g. 0-3,8)")
    for item in items:
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"bad CPU list item '{item}' in '{text}'")
        lo = int(m.group(2))
        hi = int(m.group(3)) if m.group(3) is not None else lo
        if hi < lo:
            raise ValueError(f"bad CPU range '{item}' (end before start)")
        if hi >= MAX_CPU:
            raise ValueError(f"CPU number {hi} is out of range")
        if m.group(1):
            if m.group(3) is not None:
                raise ValueError(f"bad CPU list item '{item}' (exclude "
                                 f"single CPUs: ^N)")
            exclude.add(lo)
        else:
            include.update(range(lo, hi + 1))
    result = include - exclude
    if not result:
        raise ValueError(f"CPU list '{text}' is empty")
    return result


def format(cpus: Iterable[int]) -> str:  # noqa: A001 - mirrors parse()
    """{0, 1, 3, 8, 9, 10} -> '0-1,3,8-10' ('' for no CPUs)."""
    ordered = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j
                     else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
