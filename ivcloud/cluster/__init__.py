"""`ivcloud cluster`: servers and VM-like instances emulated with Linux
namespaces on one host, one ivshmem-server per emulated server, and Open
MPI jobs launched across the instances. See docs/cluster.md."""

from __future__ import annotations


def register(sub) -> None:
    from .cli import register as _register
    _register(sub)
