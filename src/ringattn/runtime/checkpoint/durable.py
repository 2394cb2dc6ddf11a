"""Durable publishing: a directory appears complete under its final name, or not at all.

Used by the training checkpoints (steps.py), the token cache (train/hf/corpus.py) and --export:

    write into TMP/              files written and fsync'ed (`write_synced`; `fsync_tree` for
                                 files another library wrote), then TMP/ itself (`fsync_path`)
    [FINAL -> .replaced-FINAL]   an existing version set aside ("write aside")
    TMP -> FINAL                 the commit point: a rename is atomic
    fsync(parent)                the rename itself is durable
    [rm -r .replaced-FINAL]      the old version goes only after the commit

A rename is atomic but says nothing of the renamed files' data: only the fsyncs before it do, so a
crash or a power loss at any moment leaves the old version or the new one, never a FINAL with
missing or truncated files. A crash between the two renames leaves the old version aside and
nothing at FINAL: `recover` (the next writer) renames it back; readers count it meanwhile
(checkpoint/steps.py's complete_checkpoints). `publish_into` is for a directory the user names
(an export), which may hold other files: renamed whole only when it is new or empty, else file by
file (each file atomic).

`sweep` removes what a crash left that is never read: `.tmp-<stem>*` (a write cut short) and
`.pruned-<stem>*` (a deletion cut short: a folder is renamed to `.pruned-` before it is deleted,
so a half-deleted one never keeps a complete one's name).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import IO

__all__ = ["ASIDE_PREFIX", "PRUNED_PREFIX", "TMP_PREFIX", "fsync_path", "fsync_tree", "publish",
           "publish_into", "recover", "sweep", "write_synced"]  # fmt: skip

ASIDE_PREFIX = ".replaced-"
"""FINAL's old version while a new FINAL replaces it (`publish`)."""
TMP_PREFIX = ".tmp-"
"""A version being written: never read, removed by `sweep`."""
PRUNED_PREFIX = ".pruned-"
"""A version being deleted: never read, removed by `sweep`."""


def _no_fault(point: str) -> None:
    del point


def fsync_path(path: str) -> None:
    """fsync a file, or a directory (the names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, write: Callable[[IO], None], mode: str = "wb") -> None:
    """Create `path` with `write(f)`, then flush and fsync it."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: str) -> None:
    """fsync every file under `root` (written by another library), then every folder, deepest
    first."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def _aside_of(final: str) -> str:
    parent, name = os.path.split(os.path.normpath(final))
    return os.path.join(parent, ASIDE_PREFIX + name)


def recover(final: str) -> None:
    """An aside version whose `final` is missing goes back; one whose `final` exists goes."""
    aside = _aside_of(final)
    if not os.path.isdir(aside):
        return
    if os.path.exists(final):
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(aside, final)
        fsync_path(os.path.dirname(aside) or ".")


def sweep(root: str | None, stem: str, aside: bool = False) -> None:
    """Remove the `.tmp-<stem>*` and `.pruned-<stem>*` folders under `root` (a write or a deletion
    cut short); with `aside`, also finish interrupted replacements of `<stem>*` (`recover`). A
    writer sweeps before it writes; a reader must not recover (another process may be reading the
    aside version then)."""
    for name in os.listdir(root) if root and os.path.isdir(root) else []:
        if name.startswith((TMP_PREFIX + stem, PRUNED_PREFIX + stem)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        elif aside and name.startswith(ASIDE_PREFIX + stem):
            recover(os.path.join(root, name[len(ASIDE_PREFIX) :]))


def publish(tmp: str, final: str, fault: Callable[[str], None] | None = None) -> None:
    """Rename the finished, fsync'ed directory `tmp` to `final`, an existing `final` renamed aside
    first and deleted only after the commit. `fault(point)` is called at "aside", "committed" and
    "synced" (the fault-injection tests kill the process there)."""
    fault = fault or _no_fault
    aside = _aside_of(final)
    recover(final)
    if os.path.exists(final):
        os.rename(final, aside)
        fault("aside")
    try:
        os.rename(tmp, final)  # the commit point
    except BaseException:
        if os.path.isdir(aside) and not os.path.exists(final):
            os.rename(aside, final)
        raise
    fault("committed")
    fsync_path(os.path.dirname(os.path.normpath(final)) or ".")
    fault("synced")
    shutil.rmtree(aside, ignore_errors=True)


def publish_into(tmp: str, final: str) -> None:
    """Publish the finished directory `tmp` (fsync'ed here) as `final`: renamed whole when `final`
    is new or empty, else file by file into it (a user's other files stay); `tmp` is consumed."""
    fsync_tree(tmp)
    if not os.path.isdir(final) or not os.listdir(final):
        if os.path.isdir(final):
            os.rmdir(final)
        publish(tmp, final)
        return
    for folder, _, names in os.walk(tmp):
        target = os.path.join(final, os.path.relpath(folder, tmp))
        os.makedirs(target, exist_ok=True)
        for name in names:
            os.replace(os.path.join(folder, name), os.path.join(target, name))
        fsync_path(target)
    shutil.rmtree(tmp, ignore_errors=True)
