"""`ivcloud libvirt`: libvirt domain XML with ivshmem devices and host
tuning, hot-attach through the libvirt API, and the matching Nova flavor.

Modules: cpuset (CPU-list syntax), domain (XML generation, validation),
attach (libvirt API: attach/detach/watch; needs python3-libvirt), nova
(flavor extra specs), cli (the subcommands).
"""

from .cli import register

__all__ = ["register"]
