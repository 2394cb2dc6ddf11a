"""`python -m ringattn` is the `ringattn` command."""

import sys

from ringattn.cli.main import main

# The guard matters: ranks are spawned, and a spawned child re-imports the parent's main module.
if __name__ == "__main__":
    sys.exit(main())
