"""How a training job ends: one exit code per reason, and the record of a run that stopped early.

    0    trained to its last step
    1    a rank failed (LaunchError names it)           2   a bad flag, before any process
    65   diverged: --max-bad-steps non-finite steps in a row (no update applied, no checkpoint)
    70   a peer stopped responding (heartbeat, runtime/heartbeat.py and peer_heartbeat.py)
    74   a checkpoint could not be written; the previous complete one is intact
    75   preempted (SIGTERM): the step was checkpointed; the same command resumes
    76   the ranks made different attention calls (one changed its arguments after they agreed:
         runtime/mismatch.py), named under torchrun
    143  a second SIGTERM or the grace period ran out: exited at once (128 + SIGTERM)

A run that stops early returns normally on every rank, with a `Stopped` in its summary, so the
same code path serves our launcher (the parent turns rank 0's summary into the exit code) and
torchrun (every rank's CLI exits with it; torchrun reports each rank's code).
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass

__all__ = ["EXIT_CHECKPOINT", "EXIT_DIVERGED", "EXIT_FROZEN_PEER", "EXIT_HARD", "EXIT_MISMATCH",
           "EXIT_PREEMPTED", "Stopped"]  # fmt: skip

EXIT_DIVERGED = 65
EXIT_FROZEN_PEER = 70
EXIT_CHECKPOINT = 74
EXIT_PREEMPTED = 75
EXIT_MISMATCH = 76
EXIT_HARD = 128 + signal.SIGTERM


@dataclass(frozen=True)
class Stopped:
    """Why a run ended before its last step: `reason` (preempted, diverged, checkpoint failed),
    the step it had reached, the process exit code, and the message for the user."""

    reason: str
    step: int
    exit_code: int
    message: str

    def as_dict(self) -> dict:
        return asdict(self)
