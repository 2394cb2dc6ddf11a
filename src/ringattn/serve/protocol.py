"""What crosses from the HTTP layer to the ranks, and back.

Request   one admitted request: prompt token ids, max_new_tokens, temperature, top_p, seed,
          stop strings, logprobs asked (of its tokens, of its prompt), and how rank 0 shapes
          its logits before sampling (penalties, logit_bias, top_k, min_p, a compiled grammar:
          serve/logits.py). Rank 0's scheduler runs it; the ranks see only its token ids,
          in the step plans rank 0 broadcasts as JSON (comm.broadcast_json: data, never a
          pickle).
message   what rank 0 broadcasts each turn of the rank loop: {"op": "step", ...} (one step's
          plan: runner.py), {"op": "idle"} when no request came within IDLE_S (the collective
          keeps the idle ranks inside the process-group timeout), or {"op": "stop"}.
Job       rank 0 only: a request plus the asyncio queue of its events, filled from the
          worker thread with `loop.call_soon_threadsafe`:
              ("prompt", [entry or None, ...])       the prompt's logprobs (echo), first
              ("logprobs", [entry])                  a token's logprob, before its text
              ("text", piece)                        streamed text
              ("done", finish_reason, usage dict)    the end ("stop" or "length")
          (each prefixed with the job's choice index)
              ("error", message, status)             the request failed: 400 (the ranks
                                                     refused it) or 500 (a server-side failure)
          and `cancelled`, set by the HTTP thread when the client has gone: the scheduler drops
          the job if it still waits, else ends its sequence on every rank at the next step.
Verdict   every rank: whether a step that raised here raised on every rank (a request's own
          failure: the step's sequences recompute) or here alone (the server ends, at once).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch

from ringattn.comm import GroupInfo, all_gather_ints, broadcast_json, group_cache, resolve_group

__all__ = ["AGREE_S", "IDLE_S", "Job", "Request", "Verdict", "exchange"]

IDLE_S = 1.0  # how often rank 0 broadcasts "idle" while no request is waiting
AGREE_S = 30.0  # how long a rank whose step raised waits to hear that every rank's step did


@dataclass(frozen=True)
class Request:
    """One generation, as every rank runs it. `temperature == 0` decodes greedily."""

    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # each token's logprob and this many alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo)
    top_k: int = 0  # 0: all
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias
    grammar: object | None = field(default=None, compare=False, repr=False)
    """An llguidance LLMatcher compiled at admission (api/grammar.py); each choice's sequence
    decodes with its own copy. Rank 0's alone: not part of to_json."""

    @property
    def shaped(self) -> bool:
        """Whether rank 0 changes its logits before sampling (serve/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1 or self.grammar is not None)  # fmt: skip

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "grammar"}

    @classmethod
    def from_json(cls, data: dict) -> Request:
        return cls(**data)


def exchange(message: dict | None, info: GroupInfo) -> dict:
    """Rank 0's `message` on every rank (the others pass None)."""
    out = broadcast_json(message, info, src=0)
    assert isinstance(out, dict) and out.get("op") in ("step", "idle", "stop"), out
    return out


class Verdict:
    """Whether a step that raised on this rank raised on every rank.

    A failure alike on every rank (an OOM at the same layer everywhere, which the same work on
    every rank makes the usual case; non-finite logits) belongs to the step's requests: every
    rank drops the step and its sequences recompute (worker.py). A failure on one rank alone
    cannot be handled so: the other ranks are inside the step's collectives, waiting for this
    one, or have finished a step whose rows this rank lacks, so their caches no longer agree.
    So a rank whose step raised joins one all-gather of the step's number over a side gloo
    group whose timeout is `timeout_s`. Every rank joins it: the failure was alike. Not
    every rank within `timeout_s`: this rank raises, naming itself and its error, and the
    launcher ends the server naming it (runtime/launch.py), instead of every rank waiting out
    the process-group timeout (300 s) in the step's collective. A step that succeeded costs
    nothing: only a rank whose step raised communicates here.

    The side group is made once per process and timeout (comm/group_cache.py): a server
    started again in the same process (a notebook, a test pool) reuses it instead of leaving
    the earlier one's gloo threads behind. A gloo group's timeout is fixed when it is made,
    so another `timeout_s` is another group.
    """

    def __init__(self, info: GroupInfo, timeout_s: float = AGREE_S):
        self.side, self.timeout_s = info, timeout_s
        if info.world_size > 1:  # every rank, in the same order (torch's rule for new_group)
            timeout = timedelta(seconds=timeout_s)
            self.side = resolve_group(group_cache.new_group(backend="gloo", timeout=timeout))

    def check(self, step: int, err: BaseException) -> None:
        """Return if step number `step`, which raised `err` here, raised on every rank."""
        if self.side.world_size == 1:
            return
        try:
            steps = [row[0] for row in all_gather_ints([step], self.side, torch.device("cpu"))]
        except Exception as gather:  # noqa: BLE001 - a timeout or a dead peer: not alike
            steps = f"not every rank answered within {self.timeout_s:g} s ({gather})"
        if steps == [step] * self.side.world_size:
            return
        raise RuntimeError(
            f"rank {self.side.rank}: step {step} of the server raised on this rank "
            f"({type(err).__name__}: {err}) but not on every rank: {steps}. One rank's failure "
            f"leaves the ranks' caches apart and the others waiting in the step's collectives, "
            f"so the server ends here (a failure alike on every rank, such as an OOM on each, "
            f"fails its requests alone)"
        ) from err


class Job:
    """A request waiting for, or being run by, the ranks; its events go to `loop`'s queue as
    (index, *event). The choices of one HTTP request share one queue (`events`), each job with
    its choice's `index`."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop,
                 events: asyncio.Queue | None = None, index: int = 0):  # fmt: skip
        self.request, self.loop, self.index = request, loop, index
        self.events: asyncio.Queue = asyncio.Queue() if events is None else events
        self.arrived = time.monotonic()  # admission: time to first token counts from here
        self.cancelled = False  # set by the HTTP thread, read by the worker (a plain flag)

    def emit(self, *event: object) -> None:
        """Called from the worker thread: hand one event to the HTTP thread's loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))
        except RuntimeError:  # the loop has closed (the server is stopping): nobody listens
            pass
