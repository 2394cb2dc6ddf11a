"""Waiting on other processes without a deadline that load can beat: a hang is no CPU time.

A multi-process test (torchrun jobs, two hosts) used to wait with a fixed timeout: 180 s for a job
that takes 25 s alone. In a full run beside other CPU-heavy work the same job took over 180 s,
and the test failed although nothing was wrong. Here a wait fails only when the processes stop
making progress, where progress is CPU time: the sum of user and system time of the given
processes and all their descendants (/proc/PID/stat, in clock ticks, children reaped counted
through cutime/cstime). A job slowed down by load still accrues CPU time, however slowly; a job
blocked for good (a deadlock, a collective whose peer is gone and no timeout) accrues none. An
overall cap (`cap_s`, 30 min by default) still ends a job that spins forever.

    wait_until(lambda: all(p.poll() is not None for p in procs), lambda: [p.pid for p in procs],
               "the two torchrun nodes to end")
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

__all__ = ["cpu_ticks", "wait_until"]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and its reaped children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, utime + stime + cutime + cstime


def cpu_ticks(pids: Iterable[int]) -> int:
    """CPU clock ticks used so far by `pids` and every descendant still alive."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            table[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, seen, todo = 0, set(), [p for p in pids if p in table]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo += children.get(pid, [])
    return total


def wait_until(
    done: Callable[[], bool],
    pids: Callable[[], Iterable[int]],
    what: str,
    idle_s: float = 180.0,
    cap_s: float = 1800.0,
    poll_s: float = 0.5,
) -> float:
    """Poll `done()` until it is true; return the seconds waited. AssertionError when the
    processes `pids()` (and their descendants) use no CPU time for `idle_s` seconds in a row (a
    hang), or after `cap_s` seconds in all."""
    start = last_change = time.monotonic()
    last = cpu_ticks(pids())
    while not done():
        now = time.monotonic()
        ticks = cpu_ticks(pids())
        if ticks != last:
            last, last_change = ticks, now
        if now - last_change > idle_s:
            raise AssertionError(f"waiting for {what}: no CPU time used for {idle_s:g} s (hung)")
        if now - start > cap_s:
            raise AssertionError(f"waiting for {what}: still running after {cap_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - start
