"""Benchmarks of libivshm against reference transports (the library
side; their command line is ivcloud/cli/bench.py).

- :mod:`.toolkit`: what every benchmark shares (native programs, records,
  the step loop, targets, tables, the machine's load before and after,
  the JSON document);
- :mod:`.report`: tables, plots and report.md from the cloud benchmarks'
  documents (it reads documents, never the benchmarks' code), and what
  they may say (strong scaling without oversubscription, a warning for
  a busy machine);
- :mod:`.p2p`, :mod:`.mpi`: single-host point-to-point and MPI;
- :mod:`.scaling`: many ranks in one region, ivshmem against vader;
- :mod:`.hierarchy`, :mod:`.halo`: on an emulated cloud
  (ivcloud.cluster.session).

Each benchmark has a settings dataclass (``P2pSettings``,
``MpiSettings``, ``HierarchySettings``, ``HaloSettings``,
``ScalingSettings``) and a
``run(settings, ...)`` that prints its table and returns the exit
status; failures are :class:`ivcloud.errors.BenchError`.
"""
