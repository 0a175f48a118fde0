"""`python -m ivcloud.report DIR`: redo the plots and report.md of the
cloud benchmarks from the JSON in DIR (ivcloud.bench.report; its command
line is in ivcloud.cli.bench). The name stays because `make demo`'s
report and docs/demo.md point at it."""

import sys

from .cli.bench import report_main

if __name__ == "__main__":
    sys.exit(report_main())
