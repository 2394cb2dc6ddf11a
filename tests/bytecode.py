"""Compiled bytecode for ringattn's sources and the tests' helpers, written once per run.

The suite starts hundreds of Python processes: ranks under torchrun and our launcher, worker
pools, servers, CLI commands. Each imports ringattn (231 modules) and the tests' worker modules.
An installed package has its .pyc files (pip compiles them at install time), but a checkout has
none, and where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python never
writes them: every process compiled every module it imported from source again, about 0.7 s of
CPU per process.

`compile_tree` writes the missing or stale .pyc files up front (compileall checks each one's
source mtime and size, as the import system does). Writing them does not depend on
PYTHONDONTWRITEBYTECODE, which only stops the import system from writing; reading them is
always allowed. A stale .pyc is never used: the import system compares it with its source.
"""

from __future__ import annotations

import compileall
import os


def compile_tree(*roots: str) -> bool:
    """Byte-compile every .py under each root (skipping folders that cannot be written, e.g. a
    read-only checkout); True if every file compiled."""
    ok = True
    for root in roots:
        if os.path.isdir(root) and os.access(root, os.W_OK):
            ok = bool(compileall.compile_dir(root, quiet=2, workers=1)) and ok
    return ok
