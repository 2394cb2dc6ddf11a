"""One step on rank 0: the plan being built (`Step`), and what its results do (`Outcome`).

`Step` is the message every rank runs (runner.py's plan format) and the sequences behind its
entries, so that after the step each row of logits finds its sequence:

    message   {"op": "step", "open": [...], "decode": [...], "chunks": [...], "new": n}
    decode    the sequences of "decode", in order (one row each)
    chunks    (sequence, tokens) of "chunks", in order (each piece's last row)

A sequence preempted while the step is planned leaves it (`drop`, by the id it had), so a plan
never frees a sequence it also runs.

`Outcome` (nano-vllm's Scheduler.postprocess; the plan side is scheduler.py): after a step that
went through (`after`), each sequence of the step has one row of logits, a decode's or its
prompt piece's last row. Rows are shaped as their requests ask (logits.py), then the greedy
picks and whether each row is finite come to the host in one transfer:

    finite, the prompt in        the next token (greedy, or from its own generator), sent with
                                 its text; the sequence ends at a stop string, EOS or max_tokens
    finite, a piece before the   nothing to sample
    prompt's last
    non-finite, beside others    back first in line, to recompute alone (a NaN of one packed
                                 prompt reaches the others' rows: 0 x NaN in a masked kernel)
    non-finite, alone            fails (500); the server keeps serving

Non-finite rows may sit in the chunks the step kept in the prefix store: those are forgotten,
and a sane sequence that counted on one recomputes. A step that raised on every rank alike
(`failed`) sends its sequences back to recompute, each alone until a step of it succeeds; one
that fails alone fails (400 for a ValueError, else 500) and its step-mates go on.

A sequence leaves by `end` (done: stop or length), `fail` (an error with its status), `back`
(preempted: first in line, it recomputes its cache) or `cancelled` (its client has gone).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from ringattn.serve.allocation import BlockManager
from ringattn.serve.logits import shape_rows
from ringattn.serve.metrics import Metrics
from ringattn.serve.protocol import Job
from ringattn.serve.sequence import Seq

__all__ = ["Outcome", "Step"]


class Step:
    """One step's plan being built (module docstring: `Step`)."""

    def __init__(self):
        self.message: dict = {"op": "step", "open": [], "decode": [], "chunks": [], "new": 0}
        self.decode: list[Seq] = []
        self.chunks: list[tuple[Seq, int]] = []
        self.fresh = False  # it starts a sequence from scratch (Scheduler.packs)

    @property
    def sequences(self) -> list[Seq]:
        """Every sequence the step runs: the decodes, then the pieces' (in the rows' order)."""
        return self.decode + [seq for seq, _ in self.chunks]

    @property
    def empty(self) -> bool:
        return not (self.message["open"] or self.message["decode"] or self.message["chunks"])

    def add_decode(self, seq: Seq) -> None:
        """seq takes one token: the one it sampled last."""
        self.message["decode"].append([seq.id, seq.tokens[-1]])
        self.decode.append(seq)

    def add_chunk(self, seq: Seq, n: int, keep: list[int] | None, fresh: bool) -> None:
        """seq's next `n` prompt tokens, kept as prefix entry `keep` ([entry, chunk start]);
        `fresh`: its first piece, nothing cached before it."""
        self.message["chunks"].append([seq.id, seq.tokens[seq.done : seq.done + n], keep])
        if seq.logprobs.scoring:  # echo: this piece's prompt logprobs (scoring.py)
            self.message["chunks"][-1].append(seq.logprobs.prompt_k)
        self.fresh |= fresh
        self.chunks.append((seq, n))

    def add_open(self, seq: Seq, entries: list[int]) -> None:
        """seq is new to the ranks, starting from the rows of `entries` below `seq.done`."""
        self.message["open"].append([seq.id, entries, seq.done])
        self.message["new"] += not seq.started
        seq.started = True

    def drop(self, seq: Seq, sid: int) -> None:
        """Take `seq` (id `sid` when it was planned) out: its decode and its piece."""
        assert sid not in [s for s, _, _ in self.message["open"]], "a new one is never dropped"
        self.message["decode"] = [d for d in self.message["decode"] if d[0] != sid]
        self.decode = [s for s in self.decode if s is not seq]
        self.message["chunks"] = [c for c in self.message["chunks"] if c[0] != sid]
        self.chunks = [(s, n) for s, n in self.chunks if s is not seq]


class Outcome:
    """What a step's results and a sequence's end do (module docstring: `Outcome`)."""

    def __init__(self, blocks: BlockManager, waiting: deque[Seq | Job], eos: set[int],
                 metrics: Metrics | None = None):  # fmt: skip
        self.blocks: BlockManager = blocks
        self.waiting: deque[Seq | Job] = waiting  # the scheduler's line (a preempted one: first)
        self.eos: set[int] = eos
        self.metrics: Metrics | None = metrics

    def gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running = len(self.blocks.running)
            self.metrics.pool(self.blocks.pool)

    # ---- leaving ----

    def _drop(self, seq: Seq) -> None:
        ran = seq in self.blocks.running
        self.blocks.free(seq)
        if ran:  # the gauges move before its client hears the end
            self.gauges()

    def end(self, seq: Seq, finish: str) -> None:
        """Finish `seq`: its last text and ("done", finish, usage)."""
        self._drop(seq)
        seq.finish(finish)

    def fail(self, seq: Seq, message: str, status: int) -> None:
        self._drop(seq)
        seq.sink("error", message, status)

    def back(self, seq: Seq) -> None:
        """`seq`, preempted (BlockManager.preempt), comes back first in line."""
        self.waiting.appendleft(seq)
        if self.metrics is not None:
            self.metrics.preemptions += 1

    def preempt(self, seq: Seq) -> None:
        """Free seq's blocks; it comes back first in line and recomputes its cache."""
        self.blocks.preempt(seq)
        self.back(seq)

    def cancelled(self, seq: Seq) -> None:
        """A waiting request whose client has gone: ended, counted once."""
        if seq.out:
            self.end(seq, "stop")
        elif self.metrics is not None:
            self.metrics.ended("cancelled", latency_s=time.monotonic() - seq.job.arrived)

    # ---- after the step ----

    def after(self, step: Step, decoded: torch.Tensor | None, chunks: list[torch.Tensor],
              scores: dict | None = None) -> None:  # fmt: skip
        """Sample each sequence's next token from `step`'s logits; end the finished ones.
        `scores`: the prompt logprobs of the chunks that asked (Runner.scores)."""
        rows: list[tuple[Seq, torch.Tensor]] = []
        for seq in step.sequences:
            seq.failures = 0  # its step went through
        for j, seq in enumerate(step.decode):
            seq.done += 1
            rows.append((seq, decoded[j]))
        for j, ((seq, n), logits) in enumerate(zip(step.chunks, chunks)):
            seq.logprobs.piece(seq.done, n, (scores or {}).get(j), logits)
            self.blocks.computed(seq, n)
            rows.append((seq, logits))  # every piece's last row: a NaN anywhere is seen
        if rows:
            self._sample(rows, shared=len(step.sequences) > 1)
        self.gauges()

    def _sample(self, rows: list[tuple[Seq, torch.Tensor]], shared: bool) -> None:
        logits = torch.stack([row for _, row in rows])  # (L, vocab)
        shapers = [None if s.prefilling else s.shaper for s, _ in rows]  # logits.py; logprobs
        shaped = logits if shapers.count(None) == len(shapers) else shape_rows(logits, shapers)
        checks = torch.stack([shaped.argmax(-1), torch.isfinite(logits).all(-1).long()])
        greedy, finite = checks.tolist()  # one host sync for the step
        users = set()  # of the entries forgotten: they counted on them (pool.forget)
        if not all(finite):  # the chunks this step kept may hold the NaN's rows: forgotten
            users = self.blocks.forget_kept()
        for j, (seq, row) in enumerate(rows):
            if not finite[j] and shared:  # (after() reset failures: this step went through)
                seq.failures = 1  # recomputed alone, a sane sequence comes out clean
                self.preempt(seq)
                continue
            if finite[j] and seq.id in users:  # sane, but its kept chunk went: recompute
                self.preempt(seq)
                continue
            if not finite[j]:
                self.fail(seq, "the server failed while generating this request (non-finite "
                               "logits); the server keeps serving, retry or change the request",
                          500)  # fmt: skip
                continue
            if seq.prefilling:
                continue  # a piece before the prompt's last: nothing to sample yet
            if seq.request.max_new_tokens == 0:  # echo's prompt logprobs only
                ended = seq.emit(None, None, self.eos)
            else:
                ended = seq.emit(seq.choose(shaped[j], greedy[j]), row, self.eos)
            if ended is not None and ended[0] == "done":
                self.end(seq, ended[1])
            elif ended is not None:
                self.fail(seq, ended[1], 500)

    def failed(self, step: Step, err: Exception) -> None:
        """`step` raised (on every rank alike): its sequences recompute, each alone until a step
        of it succeeds; one failing alone fails (400 for a ValueError, else 500), the others go
        on. The chunks it was to keep are forgotten on every rank (it may have stopped midway)."""
        users = self.blocks.forget_kept()
        stepped = step.sequences
        for seq in [s for s in self.blocks.running if s.id in users and s not in stepped]:
            self.preempt(seq)  # (a user outside the step: none today, but it counted on them)
        for seq in {id(s): s for s in stepped}.values():
            seq.failures += 1
            if seq.failures < 2 and len(stepped) > 1:
                self.preempt(seq)
            elif isinstance(err, (ValueError, TypeError)):
                self.fail(seq, str(err), 400)
            else:
                self.fail(seq, f"the server failed while generating this request "
                               f"({type(err).__name__}); the server keeps serving, retry or "
                               f"change the request", 500)  # fmt: skip
        self.gauges()
