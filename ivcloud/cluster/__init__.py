"""The emulated cloud: servers and instances (namespaces or QEMU guests)
on one host, one ivshmem-server per emulated server, and MPI jobs
launched across the instances (`ivcloud cluster`). See docs/cluster.md;
docs/ARCHITECTURE.md maps its modules.
"""
