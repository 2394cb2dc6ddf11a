"""Preemption: SIGTERM asks every rank to finish its step, checkpoint it and exit; the grace
period running out exits at once.

Schedulers preempt a job with SIGTERM and a grace period (Kubernetes: 30 s by default, SLURM:
KillWait). The signal reaches the launcher (our `launch` or `torchrun`), whose elastic agent
forwards one SIGTERM to every rank and SIGKILLs what is left 30 s later; SLURM signals every
process of the step at once; an operator may signal one rank. So each rank handles SIGTERM itself:

    SIGTERM #1  ->  stop requested (this rank); the step in flight finishes; at its end one small
                    all-reduce (loop.py, with the step's health flags) tells every rank that some
                    rank asked: all checkpoint that step together and return `stopped: preempted`
                    -> exit code 75 (EX_TEMPFAIL: "try again", outcome.py). The same command
                    resumes from that checkpoint.
    SIGTERM #2, #3 ...
                -> the same request: nothing more.
    grace_s after #1
                -> os._exit(143) at once. Checkpoints are atomic (checkpoint/), so the
                    newest complete one is intact; a half-written `.tmp-step-N` is never read.

Why later SIGTERMs never end the rank: one preemption reaches a rank through several layers, each
sending its own copy, and how far apart they arrive depends on the machine's load, not on anyone's
intent. Slurm's `scancel --signal=TERM --full` (what preemption with a grace time sends) signals
every process of the job: the rank directly, and torchrun's agent, which forwards a copy when its
Python handler gets to run, on a loaded node seconds later. An earlier rule (a
SIGTERM more than 2 s after the first exits at once) turned that second copy into a hard exit and
the preemption into a run without its checkpoint. The grace period is the bound; an operator who
wants a rank gone now sends SIGKILL.

Why a thread and `signal.set_wakeup_fd`: a Python signal handler runs only when the main thread
returns to the interpreter, and a rank blocked in a collective (its peer is gone) may never do so.
The C-level handler writes the signal number to the wakeup pipe at once, and a watcher thread
reading the pipe reacts whatever the main thread is doing; the Python-level handler does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from typing_extensions import Self

from ringattn.runtime.outcome import EXIT_HARD

__all__ = ["DEBOUNCE_S", "GRACE_S", "SigtermForwarder", "StopRequest", "install"]

GRACE_S = 25.0
"""Default time from the first SIGTERM to a hard exit: inside the agents' and Kubernetes' 30 s."""
DEBOUNCE_S = 2.0
"""The launcher's window (SigtermForwarder): SIGTERMs to it within this of the first are forwarded;
a later one SIGKILLs the ranks."""

_PIPE: tuple[int, int] | None = None  # this process's wakeup pipe (read end, write end)


class StopRequest:
    """This process's SIGTERM state, set by the watcher thread, read by the training loop."""

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s = grace_s
        self.first: float | None = None  # time.monotonic() of the first SIGTERM
        self.signals = 0
        self._lock = threading.Lock()
        self._done = threading.Event()  # the run has finished: no grace deadline any more

    @property
    def requested(self) -> bool:
        return self.first is not None

    def on_signal(self, signum: int) -> None:
        """The watcher thread's reaction to one signal (callable directly in tests)."""
        if signum != signal.SIGTERM:
            return
        with self._lock:
            now = time.monotonic()
            self.signals += 1
            if self.first is None:
                self.first = now
                _say(f"SIGTERM: finishing this step, then checkpointing and exiting (after "
                     f"{self.grace_s:g} s, at once; SIGKILL ends it now)")  # fmt: skip
                threading.Thread(target=self._deadline, name="ringattn-grace", daemon=True).start()
            # else: another layer's copy of the same request (see the module docstring)

    def finished(self) -> None:
        """The rank is done (its checkpoint is written): the grace deadline no longer applies."""
        self._done.set()

    def hard_exit(self, why: str) -> None:
        _say(f"{why}: exiting at once (exit code {EXIT_HARD}); the newest complete checkpoint "
             f"is intact")  # fmt: skip
        os._exit(EXIT_HARD)

    def _deadline(self) -> None:
        if not self._done.wait(self.grace_s):
            self.hard_exit(f"the {self.grace_s:g} s grace period after SIGTERM ran out")


def _say(text: str) -> None:
    who = f"rank {os.environ['RANK']}" if "RANK" in os.environ else "launcher"
    try:
        os.write(sys.stderr.fileno(), f"[{who}] {text}\n".encode())
    except (OSError, ValueError):
        pass


def install(grace_s: float = GRACE_S) -> StopRequest:
    """Handle SIGTERM in this process from now on (main thread only); return its state.

    Installing again replaces the previous request (one run per process at a time).
    """
    request = StopRequest(grace_s)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a signal never blocks
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher thread acts
    global _PIPE
    old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if _PIPE is not None and old == _PIPE[1]:  # our previous pipe: its watcher sees EOF and ends
        os.close(_PIPE[1])
    _PIPE = (read_fd, write_fd)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                request.on_signal(signum)

    threading.Thread(target=watch, name="ringattn-sigterm", daemon=True).start()
    return request


class SigtermForwarder:
    """The launcher's side (our `launch`): SIGTERM to the parent goes to every rank, once.

    torch's elastic agent would forward it too, but then stops collecting the ranks' results
    and waits for them to exit, which spawned ranks do only once their result is collected:
    they would sit until its 30 s SIGKILL. So `launch` leaves SIGTERM to this handler: the first
    SIGTERM (and any within DEBOUNCE_S of it) is sent on to the ranks, which checkpoint and
    return normally, results and all; a later one SIGKILLs them (`hard`), the newest complete
    checkpoint intact. Used as a context manager around the launch, in the main thread.
    """

    def __init__(self, ranks: Callable[[], list[int]]):
        self.ranks = ranks  # pids of the rank processes, asked at signal time
        self.first: float | None = None
        self.hard = False
        self._previous: object = None

    def __enter__(self) -> Self:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.first is None or now - self.first <= DEBOUNCE_S:
            self.first = self.first or now
            self._send(signal.SIGTERM)
        else:
            self.hard = True
            _say("a second SIGTERM to the launcher: killing the ranks at once")
            self._send(signal.SIGKILL)

    def _send(self, sig: int) -> None:
        for pid in self.ranks():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
