"""The emulated cloud: servers and instances (namespaces or QEMU guests)
on one host, one ivshmem-server per emulated server, and MPI jobs
launched across the instances (`ivcloud cluster`, whose command line is
ivcloud/cli/cluster.py). See docs/cluster.md.

Modules: topology (the ClusterTopology of a request), state (the state
file), holder (the processes that hold a namespace instance), kinds (the
instance interface: namespaces, or QEMU guests of vm_instance), network
(bridges, links), lifecycle (up/down/status), launch (entering
instances), regions (a region per job), job (the job pipeline), migrate
(moving a guest), session (a throw-away cluster), slurm (its Slurm).
"""
