"""`python -m gateway serve`: the engine core starts with `spawn`, hence the main guard."""

import sys

from gateway.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
