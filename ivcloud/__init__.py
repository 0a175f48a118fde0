"""ivcloud: shared-memory message and RMA channels between processes and
VMs (libivshm), its ivshmem-server, and the tools around them.

The native library is reached through :mod:`ivcloud.native` (ctypes);
the command line is ``ivcloud`` (:mod:`ivcloud.cli`).
"""

__version__ = "0.1.0"
