"""What every bench script under scripts/bench/ writes around its own figures: one block.

    {"command":  "python scripts/bench/memory.py --seq-len 32768",   what reruns it, from the
                                                                      repository root
     "date":     "2026-12-06T07:00:00+00:00",
     "machine":  {"platform", "processor", "cpus", "load_average"},  enough to compare runs,
                                                                      nothing identifying
     "versions": {"python", "torch", "transformers"...},             those the bench names
     ...the bench's own keys (config, rows, ...)}

`write(path, script, argv, result, packages)` puts the block in front of `result` and writes
it atomically (bench/common.write_json). A bench names the optional packages it imported
(transformers, triton); a package that is not installed is written as null. `ringattn bench`
has its own header (bench/common.header): its command is `ringattn bench ...`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from collections.abc import Sequence

import torch

from ringattn.bench.common import write_json

__all__ = ["header", "write"]


def _script_path(script: str) -> str:
    """`script` relative to the working directory (the repository root, as the docs run them)
    when it lies under it, else as given."""
    path = os.path.abspath(script)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def header(script: str, argv: Sequence[str] | None = None,
           packages: Sequence[str] = ()) -> dict:  # fmt: skip
    """The block: `script` is the bench's `__file__`, `argv` its arguments (sys.argv[1:] when
    None), `packages` the optional ones whose versions it records beside python and torch."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": shlex.join(["python", _script_path(script), *args]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "load_average": list(os.getloadavg())},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: _version(name) for name in packages}},
    }  # fmt: skip


def write(path: str, script: str, argv: Sequence[str] | None, result: dict,
          packages: Sequence[str] = ()) -> dict:  # fmt: skip
    """Write the block and then `result` to `path` (JSON, atomically); say where; return it."""
    data = {**header(script, argv, packages), **result}
    write_json(path, data)
    print(f"wrote {path}")
    return data
