"""What crosses from the HTTP layer to the ranks, and back.

Request   one admitted request: prompt token ids, max_new_tokens, temperature, top_p, seed,
          stop strings. Rank 0's scheduler runs it; the ranks see only its token ids, in the
          step plans rank 0 broadcasts as JSON (comm.broadcast_json: data, never a pickle).
message   what rank 0 broadcasts each turn of the rank loop: {"op": "step", ...} (one step's
          plan: runner.py), {"op": "idle"} when no request came within IDLE_S (the collective
          keeps the idle ranks inside the process-group timeout), or {"op": "stop"}.
Job       rank 0 only: a request plus the asyncio queue of its events, filled from the
          worker thread with `loop.call_soon_threadsafe`:
              ("text", piece)                        streamed text
              ("done", finish_reason, usage dict)    the end ("stop" or "length")
              ("error", message, status)             the request failed: 400 (the ranks
                                                     refused it) or 500 (a server-side failure)
          and `cancelled`, set by the HTTP thread when the client has gone: the scheduler drops
          the job if it still waits, else ends its sequence on every rank at the next step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from ringattn.comm import GroupInfo, broadcast_json

__all__ = ["IDLE_S", "Job", "Request", "exchange"]

IDLE_S = 1.0  # how often rank 0 broadcasts "idle" while no request is waiting


@dataclass(frozen=True)
class Request:
    """One generation, as every rank runs it. `temperature == 0` decodes greedily."""

    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Request:
        return cls(**data)


def exchange(message: dict | None, info: GroupInfo) -> dict:
    """Rank 0's `message` on every rank (the others pass None)."""
    out = broadcast_json(message, info, src=0)
    assert isinstance(out, dict) and out.get("op") in ("step", "idle", "stop"), out
    return out


class Job:
    """A request waiting for, or being run by, the ranks; its events go to `loop`'s queue."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrived = time.monotonic()  # admission: time to first token counts from here
        self.cancelled = False  # set by the HTTP thread, read by the worker (a plain flag)

    def emit(self, *event: object) -> None:
        """Called from the worker thread: hand one event to the HTTP thread's loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed (the server is stopping): nobody listens
            pass
