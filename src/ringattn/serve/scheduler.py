"""Rank 0's step scheduler: continuous batching with chunked prefill over a KV block pool.

Each step (nano-vllm's scheduler, vLLM's chunked prefill):

    1. cancelled sequences (their client gone) end now: their blocks are freed
    2. decodes first: every sequence whose prompt is in takes one token
    3. prefill chunks of the sequences still prefilling, oldest first, then admissions from the
       queue, while the step's prefill budget (--max-batch-tokens) and free blocks last; a
       request that could never fit the pool is refused (400, with the numbers), one that does
       not fit now waits (at the head of the line: first come, first served). A running
       sequence that finds no blocks for its token or its piece preempts the newest running
       ones, itself last (allocation.py's BlockManager: the oldest always goes on)
    4. the short lane: a head of the line that still waits is admitted anyway when the rest of
       its prompt (after the prefix cache) is at most a quarter of the budget, all in this step
       (as vLLM's partial prefills): a chat does not wait out a long prompt's whole prefill

A prompt goes in chunks at fixed multiples of C = --max-batch-tokens (DESIGN.md §12): chunk c
holds tokens [cC, (c + 1)C), placed by the layout within itself, so the K/V a rank holds of a
prefix never depends on what follows it. A request starts from the longest prefix of its own that
the prefix store holds (pool.py), and every chunk with a full block of B = --kv-block-size tokens
is kept there. The scheduler decides what runs; its BlockManager (allocation.py) holds the
running sequences' blocks: their sizes, the prefix they share, who is preempted. The plan
(runner.py, built as a Step: step.py) goes to every rank as one message; after the step rank 0
samples every sequence's next token (step.py: greedy or seeded, from logits shaped as its
request asks) and the next plan carries those tokens. Each answer is the one its request gets
alone: a sequence's tokens depend on its own cache and its own generator only.
"""

from __future__ import annotations

import queue
import time
from collections import deque

import torch

from ringattn.serve.allocation import BlockManager, Grant
from ringattn.serve.pool import BlockPool
from ringattn.serve.protocol import IDLE_S, Job
from ringattn.serve.sequence import Seq
from ringattn.serve.shares import Shares
from ringattn.serve.step import Outcome, Step

__all__ = ["SHORT_LANE", "Scheduler", "Seq"]  # Seq: from sequence.py

# beyond --max-batch-tokens, a step admits a prompt of <= chunk / SHORT_LANE tokens (doc, item 4)
SHORT_LANE = 4


class Scheduler:
    """Rank 0's view of every sequence and of the ranks' pool (module docstring): `blocks`
    holds the running sequences' blocks (allocation.py), `step` is the step being planned and
    `outcome` what its results and a sequence's end do (step.py)."""

    def __init__(self, jobs: queue.Queue, http, tokenizer, eos: list[int], pool: BlockPool,
                 shares: Shares, chunk: int, max_running: int, prefix_cache: bool = True,
                 metrics=None, make_sink=None):  # fmt: skip
        self.jobs, self.http, self.tokenizer = jobs, http, tokenizer
        self.blocks = BlockManager(pool, shares, chunk, prefix_cache)
        self.chunk, self.max_running, self.metrics = chunk, max_running, metrics
        self.make_sink = make_sink
        self.waiting: deque[Seq | Job] = deque()  # preempted sequences, then a held job
        self.step = Step()  # the step being planned, then run
        self.outcome = Outcome(self.blocks, self.waiting, set(eos), metrics)  # after a step
        # the engine packs the first pieces of a step's new sequences as documents of one
        # placement; a layout that splits the whole packed sequence (contiguous), not each
        # document, could put a whole piece on one rank, beyond what `rows` counts: there
        # a step starts one new sequence from scratch, whose piece is then placed alone
        self.packs = shares.world_size > 1 and not shares.layout.per_document

    @property
    def pool(self) -> BlockPool:
        return self.blocks.pool

    @property
    def running(self) -> list[Seq]:
        """The running sequences, oldest first (the block manager's)."""
        return self.blocks.running

    @property
    def freed(self) -> list[int]:
        """Sequence ids freed since the last plan."""
        return self.blocks.freed

    @property
    def step_decode(self) -> list[Seq]:
        return self.step.decode

    @property
    def step_chunks(self) -> list[tuple[Seq, int]]:
        return self.step.chunks

    @property
    def held(self) -> int:
        """Requests out of the queue but not running (preempted or waiting for blocks)."""
        return len(self.waiting)

    def _granted(self, seq: Seq, grant: Grant) -> bool:
        """Act on what the block manager did for `seq`: those it preempted leave the step;
        one that never fits alone fails (400). Whether `seq` holds its rows."""
        for victim, sid in grant.preempted:
            self.step.drop(victim, sid)
            self.outcome.back(victim)
        if grant.refusal is not None:
            self.step.drop(seq, seq.id)
            self.outcome.fail(seq, grant.refusal, 400)
        return grant.ok

    def admit_alone(self, seq: Seq, budget: int) -> None:
        """Admit `seq`, which must run alone (a failed step's), from the head of the line,
        preempting the newest running sequences while it does not fit (allocation.py)."""
        while seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting.appendleft(seq)  # first in line, before those it preempted
            self._admit(budget, 1)
            if seq in self.running or seq not in self.waiting or not self.running:
                return  # in; or gone (cancelled meanwhile: another may have been admitted)
            victim = self.running[-1]
            sid = victim.id
            self.blocks.preempt(victim)
            self.step.drop(victim, sid)
            self.outcome.back(victim)

    # ---- the plan ----

    def plan(self) -> dict:
        """The next step's plan (runner.py), "idle" when nothing runs, "stop" at the end."""
        self.step = Step()
        self.blocks.start_step()
        if not self.running and not self.waiting:
            try:
                self.waiting.append(self.jobs.get(timeout=IDLE_S))
            except queue.Empty:
                return self._flush({"op": "idle" if self.http.is_alive() else "stop"})
        for seq in [s for s in self.running if s.job.cancelled]:
            self.outcome.end(seq, "stop")
        for item in [i for i in self.waiting if isinstance(i, Seq) and i.job.cancelled]:
            self.waiting.remove(item)  # preempted, or held for blocks: its client has gone
            self.outcome.cancelled(item)
        # a sequence whose step failed runs alone until a step of it succeeds: a failure that
        # is its own then fails it alone, and its step-mates go on (Scheduler.failed)
        suspect = [s for s in (*self.running, *self.waiting) if isinstance(s, Seq) and s.failures]
        only = suspect[0] if suspect else None
        self._decodes(only)
        budget = self._prefills(self.chunk, only)
        if only is None:
            self._admit(budget, self.max_running)
        elif only not in self.running:
            self.admit_alone(only, budget)
        if only is None:  # the short lane: a short prompt does not wait out a long prefill
            self._admit(self.chunk // SHORT_LANE, self.max_running, whole=True)
        self.outcome.gauges()
        if self.step.empty:
            time.sleep(0.01)  # only a held request waits (for blocks): do not spin
            return self._flush({"op": "idle"})
        return self._flush(self.step.message)

    def _flush(self, plan: dict) -> dict:
        """Frees and evictions ride on whatever goes out next."""
        if plan["op"] in ("step", "idle") and (self.freed or self.pool.evicted):
            plan = {"op": "step", "open": [], "decode": [], "chunks": [], **plan}
            plan["op"] = "step"
        if plan["op"] == "step":
            plan["free"], plan["evict"] = self.blocks.take_freed(), self.pool.evicted
            self.pool.evicted = []
        return plan

    def _decodes(self, only: Seq | None) -> None:
        for seq in list(self.running) if only is None else [only]:
            ok = not seq.prefilling and seq in self.running  # (not preempted meanwhile)
            if ok and self._granted(seq, self.blocks.append(seq)):
                self.step.add_decode(seq)

    def _chunk(self, seq: Seq, budget: int) -> int:
        """Schedule seq's next prefill piece (the rest of its chunk) if `budget` and the pool
        allow, kept in the prefix store when it completes the chunk; tokens used."""
        n = min(self.chunk - seq.done % self.chunk, seq.target - seq.done)
        fresh = seq not in self.running and seq.done == 0
        if n > budget or (fresh and self.packs and self.step.fresh):
            return 0  # (a second packed first piece would not be placed alone: __init__)
        rows = self.blocks.rows(seq, piece=n)
        if seq in self.running:  # preempting the newest running ones if need be
            if not self._granted(seq, self.blocks.allocate(seq, rows)):
                return 0
        elif not self.blocks.grow(seq, rows):  # a request in line waits for blocks
            return 0
        keep = self.blocks.keep(seq, n)  # kept in the prefix store if it completes a chunk
        self.step.add_chunk(seq, n, keep, fresh)
        return n

    def _prefills(self, budget: int, only: Seq | None) -> int:
        for seq in [s for s in self.running if s.prefilling and only in (None, s)]:
            if seq not in self.running:
                continue  # preempted by an older one's piece
            used = self._chunk(seq, budget)
            if not used:
                break  # first come, first served: a later prompt does not overtake
            budget -= used
        return budget

    def _next(self) -> Seq | None:
        """The next request in line (a preempted sequence first), cancelled ones dropped."""
        while True:
            if not self.waiting:
                try:
                    self.waiting.append(self.jobs.get_nowait())
                except queue.Empty:
                    return None
            item = self.waiting[0]
            seq = item if isinstance(item, Seq) else Seq(item, self.make_sink(item), self.tokenizer)
            self.waiting[0] = seq
            if not seq.job.cancelled:
                refusal = self.blocks.never_fits(seq)
                if refusal is None:
                    return seq
                self.waiting.popleft()
                self.outcome.fail(seq, refusal, 400)
                continue
            self.waiting.popleft()
            self.outcome.cancelled(seq)

    def _admit(self, budget: int, most: int, whole: bool = False) -> None:
        """Admit requests from the head of the line (at most `most`) while they fit; `whole`:
        only one whose prompt, after what the prefix cache holds, goes in all at once."""
        while budget > 0 and len(self.running) < self.max_running and most > 0:
            most -= 1
            seq = self._next()
            if seq is None:
                return
            reuse = self.blocks.open(seq)
            if whole and seq.target - seq.done > budget:  # it waits at the head of the line
                self.blocks.unopen(seq)
                return
            if reuse and not self._chunk(seq, budget):
                reuse = []  # the copies do not fit beside their originals: compute it all
                self.blocks.drop_reuse(seq)
            if not reuse and not self._chunk(seq, budget):
                self.blocks.unopen(seq)
                return  # it waits for blocks (or the next step's budget) at the head of the line
            budget -= self.step.chunks[-1][1]
            self.waiting.popleft()
            self.step.add_open(seq, [entry for entry, _ in reuse])
            self.blocks.admit(seq, reuse)  # (reuse's blocks: shared)

    # ---- after the step (step.py's Outcome) ----

    def after(self, decoded: torch.Tensor | None, chunks: list[torch.Tensor],
              scores: dict | None = None) -> None:  # fmt: skip
        """Sample each sequence's next token from the step's logits; end the finished ones.
        `scores`: the prompt logprobs of the chunks that asked (Runner.scores)."""
        self.outcome.after(self.step, decoded, chunks, scores)

    def failed(self, err: Exception) -> None:
        """The step raised on every rank alike: its sequences recompute or fail (step.py)."""
        self.outcome.failed(self.step, err)
        self.step = Step()
