"""`python -m benchmarks.loadgen`: runs the load generator's command line."""

import sys

from benchmarks.loadgen import main

sys.exit(main())
