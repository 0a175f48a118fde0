"""The emulated cloud: servers and VM-like instances made of Linux
namespaces on one host, one ivshmem-server per emulated server, and Open
MPI jobs launched across the instances (`ivcloud cluster`, whose command
line is ivcloud/cli/cluster.py). See docs/cluster.md.

Modules: topology (the ClusterTopology of a request), state (the state
file), holder (the processes that hold a namespace instance), kinds (the
instance interface: namespaces or QEMU guests, vm_instance), network
(bridges, links), lifecycle (up/down/status), launch (entering
instances, mpirun command lines), jobs (a region per job), session (a
throw-away cluster).
"""
