"""Benchmarks of libivshm against reference transports (the library
side; their command line is ivcloud/cli/bench.py, and ivcloud/cli/mag.py
for `ivcloud mag bench`).

:mod:`.toolkit` is what every benchmark shares, :mod:`.report` the
tables, plots and report.md of the cloud benchmarks' documents (it reads
documents, never the benchmarks' code). Every other module is one
benchmark, its docstring what it measures: a settings dataclass (a
``make`` gives the defaults, full or quick) and a ``run(settings, ...)``
that prints its table and returns the exit status; failures are
:class:`ivcloud.errors.BenchError`.
"""
