"""What this process's attention calls are doing now: read by the heartbeat threads.

The ranks agree on an attention call's arguments once per new signature (validate.agree); after
that a repeated call is a set lookup, with no communication. So a rank that *changes* its
arguments later (another sequence length, one rank's local error) enters a new agreement, an
all-gather, while its peers, on the fast path, are already inside the call's collectives waiting
for it: each side waits for the other until the process-group timeout. Nothing on the main
threads can see that; the heartbeat threads, which beat while the main thread waits, can, if each
rank publishes where its attention calls are:

    per group (its name), this rank's
      calls       forward attention calls started on it (1, 2, 3, ...: every rank of a correct
                  program makes the same calls, so the same count at the same call)
      state       "idle", "agreeing" (call n's agreement, before any collective of the call),
                  "forward" or "backward" (inside a call's collectives)
      call        the call the state belongs to
      signature   what the call passes (the agreement's (name, value) pairs), and its local error

Rank b agreeing on call n while another rank of the group has started call n or later (and is not
in that agreement) is a certain mismatch, never a slow peer: that rank passed call n's agreement
without b, so it took the fast path with arguments b does not have, and waits inside the call for
b. runtime/mismatch.py turns the published states into the error that names rank b.

The bookkeeping is one counter increment and two tuple assignments per call; nothing is tracked
for a single process (there is nobody to wait for). The state is per process, as the process
groups are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from ringattn.comm import GroupInfo

__all__ = ["agreeing", "readable", "resync", "running", "snapshot", "start_call"]

_IDLE = ("idle", 0, 0.0, None, None)


class _Group:
    """One group's calls: `now` is replaced whole (one assignment), so a reader on another
    thread never sees half a state."""

    __slots__ = ("calls", "now")

    def __init__(self) -> None:
        self.calls = 0
        self.now: tuple = _IDLE  # (state, call, since (monotonic), signature, error)


_GROUPS: dict[str, _Group] = {}


def _group(info: GroupInfo) -> _Group | None:
    if info.world_size == 1:
        return None
    group = _GROUPS.get(info.key)
    if group is None:
        group = _GROUPS[info.key] = _Group()
    return group


def start_call(info: GroupInfo) -> int | None:
    """Count a new forward attention call on `info`'s group; its number (None alone)."""
    group = _group(info)
    if group is None:
        return None
    group.calls += 1
    return group.calls


def resync(info: GroupInfo, calls: int) -> None:
    """After an agreement: the group's highest count (every rank was at the same call)."""
    group = _group(info)
    if group is not None and calls > group.calls:
        group.calls = calls


@contextmanager
def agreeing(
    info: GroupInfo, call: int | None, signature: tuple | None, error: Exception | None
) -> Iterator[None]:
    """Mark the agreement of call `call` (with this rank's signature and local error) as under
    way for the duration of the block."""
    group = None if call is None else _group(info)
    if group is None:
        yield
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    group.now = ("agreeing", call, time.monotonic(), signature, message)
    try:
        yield
    finally:
        group.now = ("idle", call, time.monotonic(), signature, None)


@contextmanager
def running(info: GroupInfo, phase: str, signature: tuple) -> Iterator[None]:
    """Mark this rank as inside the collectives of its latest call ("forward"/"backward")."""
    group = _group(info)
    if group is None:
        yield
        return
    group.now = (phase, group.calls, time.monotonic(), signature, None)
    try:
        yield
    finally:
        group.now = ("idle", group.calls, time.monotonic(), signature, None)


def snapshot() -> list[dict]:
    """Every group's state as JSON-ready dicts (called from the heartbeat threads)."""
    now = time.monotonic()
    entries = []
    for key, group in list(_GROUPS.items()):
        state, call, since, signature, error = group.now
        entries.append({
            "group": key, "calls": group.calls, "state": state, "call": call,
            "for_s": round(now - since, 2) if since else 0.0,
            "signature": None if signature is None else readable(signature), "error": error,
        })  # fmt: skip
    return entries


def readable(signature: tuple) -> list[list]:
    """(name, value) pairs as JSON: tuples become lists, other objects their text."""
    return [[name, _jsonable(value)] for name, value in signature]


def _jsonable(value: object) -> object:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return str(value)
