"""Rank 0's allocation policy: who gets blocks, who is preempted, who may never enter.

Preempt on any failed allocation (vLLM's rule, DESIGN.md §13): a running sequence that cannot
get the blocks for its next decode token *or its next prefill piece* preempts the newest
running sequence (its blocks freed; it goes back first in line and recomputes its prompt and
the tokens it has made), then the next newest, until it fits; when it is the newest itself, it
is the one that goes back. So the oldest running sequence always makes progress:

    pool of 13 blocks; A, B share a cached 12-token prefix; both admitted in one step
    A: [####----]  B: [####]      A's next chunk needs 2 more blocks, 1 is free
    only decodes preempting:  nothing decodes, B waits behind A, A waits for blocks: forever
    here:                     B (newest) is preempted, A goes on and ends, then B comes back

A request in line never preempts a running one: it waits at the head of the line, and it fits
once the running ones end, because a request that could never fit the pool alone is refused
(400, with the numbers) before it is admitted. The one exception is a sequence that must run
alone after a failed step (the scheduler's `only`): nothing else may run meanwhile, so it
preempts what holds the blocks or the running slots it needs.

A preempted sequence is taken out of the step being planned (its decode or piece, and any
chunk it was to keep), so a plan never frees a sequence it also runs.
"""

from __future__ import annotations

from ringattn.serve.pool import prefix_hashes, truncate

__all__ = ["Allocation"]


class Allocation:
    """The Scheduler's allocation half (module docstring): growing, preempting, sizing a
    request against the pool and its prefix hit. Mixed into scheduler.Scheduler, whose
    `pool`, `shares`, `chunk`, `running`, `waiting` and `step_*` lists it uses."""

    def preempt(self, seq) -> None:
        """Free seq's blocks; it comes back first in line and recomputes its cache."""
        self._drop(seq)
        seq.restart()
        seq.target = 0
        self.waiting.appendleft(seq)
        if self.metrics is not None:
            self.metrics.preemptions += 1

    def allocate(self, plan: dict, seq, rows: int) -> bool:
        """Let running `seq` hold `rows` rows per rank, preempting the newest running sequences
        (out of `plan`) until it fits; False when `seq` was the newest and went back itself."""
        while not self.pool.grow(seq.id, rows):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:  # alone, it never fits: no livelock
                self._unplan(plan, seq)
                self.fail(seq, self._alone_too_large(seq, rows), 400)
                return False
            self._unplan(plan, victim)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _alone_too_large(self, seq, rows: int) -> str:
        """A sequence that alone cannot grow: a preempted one recomputes the tokens it made as
        prompt, in chunks, which can take more rows than decoding them did (only a pool
        smaller than one sequence of the served context allows it: worker.check_pool)."""
        return (f"this request's {len(seq.tokens)} tokens ({len(seq.request.ids)} prompt + "
                f"{len(seq.out)} made, recomputed after a preemption) need {rows} rows on the "
                f"fullest of {self.shares.world_size} ranks, more than the pool's "
                f"{self.pool.n_blocks} blocks of {self.pool.block_size} tokens per rank hold; "
                f"lower max_tokens or the prompt, or start the server with a larger "
                f"--kv-cache-gb")  # fmt: skip

    def _unplan(self, plan: dict, seq) -> None:
        """Take `seq` out of the step being planned (its decode, its piece and what it kept)."""
        assert seq.id not in [s for s, _, _ in plan["open"]], "a new sequence is never preempted"
        plan["decode"] = [d for d in plan["decode"] if d[0] != seq.id]
        self.step_decode = [s for s in self.step_decode if s is not seq]
        for _, _, keep in [c for c in plan["chunks"] if c[0] == seq.id and c[2] is not None]:
            self.step_kept.remove(keep[0])
            self.pool.forget(keep[0])
        plan["chunks"] = [c for c in plan["chunks"] if c[0] != seq.id]
        self.step_chunks = [(s, n) for s, n in self.step_chunks if s is not seq]

    def admit_alone(self, plan: dict, seq, budget: int) -> None:
        """Admit `seq`, which must run alone (a failed step's), from the head of the line,
        preempting the newest running sequences while it does not fit (module docstring)."""
        while seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting.appendleft(seq)  # first in line, before those it preempted
            self._admit(plan, budget, 1)
            if seq in self.running or seq not in self.waiting or not self.running:
                return  # in; or gone (cancelled meanwhile: another may have been admitted)
            victim = self.running[-1]
            self._unplan(plan, victim)
            self.preempt(victim)

    def never_fits(self, seq) -> str | None:
        """Why `seq` could never fit the pool alone (its prompt and max_tokens), or None."""
        r = self.request_rows(len(seq.request.ids), seq.request.max_new_tokens)
        blocks = self.shares.blocks(len(seq.request.ids), self.chunk,
                                    seq.request.max_new_tokens, self.pool.block_size)  # fmt: skip
        if blocks <= self.pool.n_blocks:
            return None
        most = self.pool.n_blocks * self.pool.block_size
        return (f"this request needs {blocks} KV blocks of {self.pool.block_size} tokens per rank "
                f"({len(seq.request.ids)} prompt + {seq.request.max_new_tokens} completion "
                f"tokens: {r} on the fullest of {self.shares.world_size} ranks), but the pool "
                f"holds {self.pool.n_blocks} blocks ({most} tokens) per rank; lower max_tokens "
                f"or the prompt, or start the server with a larger --kv-cache-gb")  # fmt: skip

    def request_rows(self, prompt: int, new: int) -> int:
        return self.shares.tokens(prompt, self.chunk, new)

    def hashes(self, seq) -> list:
        """seq's prefix hash points (pool.prefix_hashes), computed once per token list: again
        only when a preempted sequence comes back with the tokens it made."""
        if seq.hashed != len(seq.tokens):
            seq.hashes = prefix_hashes(seq.tokens, self.chunk, self.pool.block_size)
            seq.hashed = len(seq.tokens)
        return seq.hashes

    def reuse(self, seq) -> list[tuple[int, int]]:
        """The cached prefix seq starts from (pool.lookup, at least one token left to compute),
        pinned, with seq's progress, rows and pieces set to it; [] when none would fit."""
        if not self.prefix_cache or seq.logprobs.scoring:  # a cached prefix is not scored
            return []
        found = self.pool.lookup(self.hashes(seq), seq.target - 1)
        if not found:
            return []
        rows, pieces, copies = 0, [], 0
        for entry, k in found:
            pieces = truncate(self.pool.cached[entry].pieces, k)
            rows += self.shares.rows(pieces)
            copies += int(self.shares.cut(pieces, self.pool.block_size))
        seq.done = (len(found) - 1) * self.chunk + found[-1][1]
        seq.rows, seq.pieces = rows, pieces if found[-1][1] < self.chunk else []
        seq.adopted = list(seq.pieces)  # shared but for a cut block, copied (paged.py)
        seq.base = found[-1][0] if seq.adopted else None
        seq.cow = int(self.shares.cut(seq.adopted, self.pool.block_size))
        seq.private = copies - seq.cow  # whole chunks' copied last blocks are seq's own
        # the pieces may need more rows than an all-fresh prefill: still within the pool?
        first = min(self.chunk - seq.done % self.chunk, seq.target - seq.done)
        new = seq.request.max_new_tokens - len(seq.out)
        most = self.pool.blocks(self.shares.chunk_rows(first)) + copies
        most += self.shares.blocks(seq.target - seq.done - first, self.chunk, new,
                                   self.pool.block_size)  # fmt: skip
        if most > self.pool.n_blocks:
            seq.restart()
            return []
        self.pool.pinned |= {entry for entry, _ in found}
        return found
