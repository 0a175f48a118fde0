"""`python -m ivcloud ...` is the same as the `ivcloud` command."""

import sys

from .cli import main

sys.exit(main())
