"""`ringattn plan --max-seq` and the memory levers' prices: search.py (the longest sequence each
plan trains), report.py (the command's flags and printing), levers.py (the levers' time and
refusals, used by cost.py and search.py; this package imports nothing eagerly, so they can)."""
