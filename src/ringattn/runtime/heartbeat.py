"""Heartbeats: a rank that stops making progress is named within seconds, and the job stops.

A dead rank is seen at once by the elastic agent (its process exits). A *frozen* one (stopped by a
signal, a hung driver, a swapped-out machine) is not: its peers wait in their next collective until
the process-group timeout, and the error then blames whichever rank timed out first. So each rank
of a local launch runs a small daemon thread that rewrites its heartbeat file every
`BEAT_S` seconds, with the last progress its main thread reported:

    child rank r                                   parent (launch)
    ------------                                   ---------------
    init_distributed() starts the beat thread      watchdog thread, every second:
    report_progress(step=60, phase="forward")        any heartbeat older than stall_s?
      -> rank-r.json {pid, step, phase, time}          -> SIGKILL that rank, remember why
                                                   the agent sees the rank die, stops the job;
                                                   LaunchError: "rank 1 stopped responding for
                                                   10 s at step 60 (forward)"

The thread beats while the main thread computes or waits in a collective, so a slow step or a rank
waiting on a frozen peer is not mistaken for a frozen rank: only a process that stops running is.
The files live in the launch's private run directory (mode 0700). Under an external `torchrun`
there is no run directory: the ranks watch each other through torchrun's store instead
(peer_heartbeat.py), and `report_progress` feeds both.

Each beat also carries the rank's attention calls (ringattn/inflight.py), so the watchdog sees a
rank that changed its attention arguments after the ranks agreed (it waits in a new agreement
while its peers wait in the call for it: runtime/mismatch.py), kills the ranks and names it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from typing_extensions import Self

from ringattn.inflight import snapshot
from ringattn.runtime.mismatch import MismatchWatch
from ringattn.runtime.peer_heartbeat import report_peer_progress

RUN_DIR_ENV = "RINGATTN_RUN_DIR"
BEAT_S = 1.0
STALL_S = 10.0


@dataclass
class _Beat:
    """This process's heartbeat: its file and the progress the main thread last reported."""

    path: str
    rank: int
    progress: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # new progress to write

    def write(self) -> None:
        if self.stopped.is_set():
            return
        with self.lock:
            record = {"pid": os.getpid(), "rank": self.rank, "time": time.time(), **self.progress,
                      "attention": snapshot()}  # fmt: skip
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)  # the watchdog never reads half a file


# one heartbeat per process, as there is one process group per process
_BEAT: _Beat | None = None


def start_beating(rank: int) -> None:
    """Start this rank's heartbeat thread if it runs under `launch` (idempotent)."""
    global _BEAT
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir is None or _BEAT is not None:
        return
    _BEAT = _Beat(os.path.join(run_dir, f"rank-{rank}.json"), rank)
    _BEAT.write()

    def beat(beat: _Beat = _BEAT) -> None:
        while not beat.stopped.is_set():
            beat.wake.wait(BEAT_S)
            beat.wake.clear()
            try:
                beat.write()
            except OSError:
                return  # the run directory is gone: the launch has ended

    threading.Thread(target=beat, name="ringattn-heartbeat", daemon=True).start()


def stop_beating() -> None:
    """End this rank's heartbeat and remove its file (the rank has finished its work)."""
    global _BEAT
    beat, _BEAT = _BEAT, None
    if beat is not None:
        beat.stopped.set()
        beat.wake.set()
        try:
            os.remove(beat.path)
        except OSError:
            pass


def report_progress(**progress: object) -> None:
    """Record where this rank is (say step=60, phase="forward"); named if it freezes there.

    Under torchrun it goes into the rank's store heartbeat instead (peer_heartbeat.py). Cheap: a
    dict update under a lock; the beat thread does the writing, at once.
    """
    if _BEAT is not None:
        with _BEAT.lock:
            _BEAT.progress = dict(progress)
        _BEAT.wake.set()
    report_peer_progress(**progress)


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a finished rank not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def kill_ranks(run_dir: str) -> list[int]:
    """SIGKILL every rank of a launch that is still running; their ranks, sorted."""
    killed = []
    for record in _records(run_dir):
        if _running(record["pid"]):
            try:
                os.kill(record["pid"], signal.SIGKILL)
                killed.append(record["rank"])
            except ProcessLookupError:
                pass
    return sorted(killed)


def _records(run_dir: str) -> list[dict]:
    """The heartbeat records of a launch's ranks (each rank's last beat)."""
    records = []
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(run_dir, name)) as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue  # being replaced right now; read it next time
    return records


class Watchdog:
    """The parent's side: kill a rank whose heartbeat is older than `stall_s`, say which."""

    def __init__(self, run_dir: str, stall_s: float = STALL_S):
        self.run_dir, self.stall_s = run_dir, stall_s
        self.verdicts: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ringattn-watchdog", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        killed: set[int] = set()
        mismatch = MismatchWatch()
        while not self._stop.wait(BEAT_S):
            now = time.time()
            records = _records(self.run_dir)
            live = [r for r in records if r["pid"] not in killed and _running(r["pid"])]
            found = mismatch.observe({r["rank"]: r.get("attention", []) for r in live})
            if found is not None:
                # every rank is stuck (the changed one in its agreement, the others in the call)
                self.verdicts.append(found[1] + "; the ranks were killed to end the job")
                killed.update(r["pid"] for r in records)
                kill_ranks(self.run_dir)
                continue
            for record in records:
                silent = now - record["time"]
                if silent < self.stall_s or record["pid"] in killed or not _running(record["pid"]):
                    continue
                where = ", ".join(
                    f"{k} {v}"
                    for k, v in record.items()
                    if k not in ("pid", "rank", "time", "attention")
                )
                self.verdicts.append(
                    f"rank {record['rank']} (pid {record['pid']}) stopped responding: no "
                    f"heartbeat for {silent:.0f} s" + (f", last at {where}" if where else "")
                    + "; it was killed to end the job"
                )  # fmt: skip
                killed.add(record["pid"])
                try:
                    os.kill(record["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
