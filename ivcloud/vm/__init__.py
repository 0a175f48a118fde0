"""`ivcloud vm` (QEMU guests on an ivshmem-server) and `ivcloud pin`
(vCPU threads to host cores): image.py builds the guest, qemu.py starts
it and speaks QMP, agent.py runs commands inside it, cli.py is the
command line and the VM life cycle."""

from .cli import register

__all__ = ["register"]
