"""Benchmarks of libivshm against reference transports. :mod:`.toolkit`
is what every benchmark shares, :mod:`.report` the plots and report.md
of the cloud benchmarks' documents (it reads documents, never the
benchmarks' code). Every other module is one benchmark, its docstring
what it measures: a settings dataclass (``make``: the defaults, full or
quick) and a ``run(settings, ...)`` returning the exit status.
"""
