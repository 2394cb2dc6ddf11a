"""A --basetemp of each pytest run's own, so that runs side by side never delete each other's.

pytest's default (/tmp/pytest-of-USER/pytest-N) keeps the 3 newest numbered folders and deletes
older ones when a run starts: a fourth run started beside a long one (another worktree, a CI job)
deleted the folders the first was still writing into. Here:

    <tmp>/ringattn-pytest-<uid>/
        run-20261206-064853-21285/        this run's basetemp (pytest's tmp_path lie inside)
        run-20261206-064853-21285.lock    flock'ed (exclusive) for as long as the run lives

A starting run takes its own lock, then deletes the folders of runs that ended (their lock can
be taken: the kernel drops a lock when its process ends, however it ends), all but the `keep`
newest, kept for a look after a failure. A live run's folder is never deleted.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from typing import IO

RUNS_DIR = os.path.join(tempfile.gettempdir(), f"ringattn-pytest-{os.getuid()}")
KEEP_ENDED = 3


def claim(runs_dir: str = RUNS_DIR, keep: int = KEEP_ENDED) -> tuple[str, IO]:
    """A new run folder's path under `runs_dir` (not created: pytest makes it) and its lock,
    held while the returned file stays open; ended runs beyond the `keep` newest are deleted."""
    os.makedirs(runs_dir, exist_ok=True)
    name = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    lock = open(os.path.join(runs_dir, name + ".lock"), "w")  # noqa: SIM115 - held by the caller
    fcntl.flock(lock, fcntl.LOCK_EX)
    remove_ended(runs_dir, keep)
    return os.path.join(runs_dir, name), lock


def remove_ended(runs_dir: str, keep: int) -> list[str]:
    """Delete the folders (and locks) of runs whose lock is free, all but the `keep` newest;
    return the folders deleted."""
    ended = []
    for entry in sorted(os.listdir(runs_dir)):  # names start with the start time: oldest first
        if not entry.endswith(".lock"):
            continue
        path = os.path.join(runs_dir, entry)
        with open(path, "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run holds it
        ended.append(path[: -len(".lock")])
    doomed = ended[: max(0, len(ended) - keep)]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            os.remove(folder + ".lock")
        except FileNotFoundError:
            pass
    return doomed
