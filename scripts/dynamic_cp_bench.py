"""Issue 50's name for the dynamic-CP bench: scripts/bench/dynamic_cp.py, the same program.

.venv/bin/python scripts/dynamic_cp_bench.py                          # one host
sudo .venv/bin/python scripts/dynamic_cp_bench.py --hosts 2 --rate 100mbit
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench", "dynamic_cp.py")
    sys.argv[0] = bench  # its record names the script that ran
    runpy.run_path(bench, run_name="__main__")
