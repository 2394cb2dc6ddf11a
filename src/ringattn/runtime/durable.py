"""Durable publishing: what a rename makes visible is on disk, whole, before the rename.

A rename within one file system is atomic, but it says nothing of the renamed files' contents:
after a power loss, a directory renamed into place can hold files whose data the kernel never
wrote back (empty or truncated), under a name every reader trusts. So every directory that is
published by a rename (checkpoints, token caches) goes through the same steps:

    write the files into TMP/          each one fsync'ed (write_synced, fsync_tree)
    fsync TMP/ and its sub-folders     their entries are on disk
    [rename FINAL -> .replaced-FINAL]  replacing: the old version stays whole, under another name
    rename TMP -> FINAL                the commit point
    fsync the parent                   the rename itself is on disk
    [rmtree .replaced-FINAL]           only now is the old version deleted

A crash between the two renames leaves the old version aside and nothing at FINAL: `recover`
(called by the next writer) renames it back, and readers that list versions (checkpoint.py)
count an aside directory whose FINAL is missing as the complete version it is.

An export (`publish_into`) goes into a directory the user names, which may hold other files: it
is renamed whole only when that directory is new or empty, else file by file (each one atomic).

`fault(point)`, where given, is called at each named point (tests kill or fill the disk there).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import IO

__all__ = ["aside_of", "fsync_dir", "fsync_tree", "publish", "publish_into", "recover",
           "write_synced"]  # fmt: skip

Fault = Callable[[str], None]
ASIDE_PREFIX = ".replaced-"


def _no_fault(point: str) -> None:
    del point


def fsync_dir(path: str) -> None:
    """fsync a directory: the names created, renamed or removed in it are on disk."""
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
    """fsync every file under `root` (written by another library, say), then every folder,
    deepest first."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def aside_of(final: str) -> str:
    """Where the old version of `final` waits while a new one replaces it."""
    parent, name = os.path.split(os.path.normpath(final))
    return os.path.join(parent, ASIDE_PREFIX + name)


def recover(final: str) -> None:
    """Finish what a crash interrupted: an aside version whose `final` is missing goes back; one
    whose `final` was committed is deleted."""
    aside = aside_of(final)
    if not os.path.isdir(aside):
        return
    if os.path.exists(final):
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(aside, final)
        fsync_dir(os.path.dirname(aside) or ".")


def publish(tmp: str, final: str, fault: Fault | None = None) -> None:
    """Rename the finished (already fsync'ed) directory `tmp` to `final`, replacing an existing
    `final` without ever deleting it before the new one is committed."""
    fault = fault or _no_fault
    parent = os.path.dirname(os.path.normpath(final)) or "."
    aside = aside_of(final)
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
    fsync_dir(parent)
    fault("synced")
    if os.path.isdir(aside):
        shutil.rmtree(aside, ignore_errors=True)


def publish_into(tmp: str, final: str) -> None:
    """Publish the finished directory `tmp` as `final` (fsync'ed first): renamed whole when `final`
    does not exist or is empty; else file by file into it (each file replaced atomically, the
    others in `final` left alone: a user's directory is never deleted), then `tmp` removed."""
    fsync_tree(tmp)
    if not os.path.isdir(final) or not os.listdir(final):
        if os.path.isdir(final):
            os.rmdir(final)
        publish(tmp, final)
        return
    for folder, dirs, names in os.walk(tmp):
        target = os.path.join(final, os.path.relpath(folder, tmp))
        os.makedirs(target, exist_ok=True)
        for name in names:
            os.replace(os.path.join(folder, name), os.path.join(target, name))
        fsync_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
