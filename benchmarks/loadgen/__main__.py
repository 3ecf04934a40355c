"""`python -m benchmarks.loadgen`: the load generator's command line (runner.main)."""

from benchmarks.loadgen.runner import main

raise SystemExit(main())
