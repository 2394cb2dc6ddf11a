"""The `ringattn` command line: `main.py` parses, each subcommand lives in its own module."""
