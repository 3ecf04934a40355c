"""`python -m benchmarks.loadgen`: the load generator's command line (runner.main)."""

import sys

from benchmarks.loadgen.runner import main

sys.exit(main())
