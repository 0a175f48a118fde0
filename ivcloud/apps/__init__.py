"""Real applications as workloads: how to prepare their input, the
command that runs them under MPI, and how to read their results.

Each module is one application from Debian's archive:

- :mod:`hpcc` -- the HPC Challenge suite (HPL, PTRANS, MPIFFT,
  MPIRandomAccess, ring latency/bandwidth), as in seed 004;
- :mod:`openfoam` -- OpenFOAM's simpleFoam on the pitzDaily tutorial
  case, as in seed 002;
- :mod:`magbar` -- our micromagnetic solver (micromag) on the thesis's
  test problem, the Permalloy bar (examples/bar.toml);
- :mod:`mag` -- the solver on any problem file: a run on N ranks (under
  mpirun through ivcloud.mpis.local), the command line of one run, the
  convergence study (what `ivcloud mag run` and `converge` call).

They know nothing about where the ranks run: a benchmark (ivcloud.bench)
launches the command they give through a cluster or `ivcloud mpirun`
(:mod:`mag` alone starts ranks itself, on this host, as `ivcloud mag
run --np N` does).
"""
