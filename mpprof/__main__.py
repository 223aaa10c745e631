"""`python -m mpprof ...`: the `mpprof` command."""

import sys

from mpprof.cli import main

sys.exit(main())
