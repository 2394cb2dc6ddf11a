"""Rank 0's block manager: the sequences that hold the ranks' KV blocks, how many each needs,
who is preempted, and who may never enter (nano-vllm's block_manager.py, over the accounting
of pool.py's BlockPool: each sequence's own blocks, the prefix cache's entries, their users).

    the head of the line   open (the next id; `reuse`: a cached prefix, pinned) -> grow -> keep
                           -> admit; or unopen (it waits: nothing held, nothing pinned)
    a running sequence     allocate / append (preempting the newest if need be) -> keep
    after the step         computed (the piece's rows), forget_kept (a failed or NaN step)
    leaving                free (ended), preempt (back in line, recomputes); take_freed (plan)

Preempt on any failed allocation (vLLM's rule, DESIGN.md §13): a running sequence that cannot
get the blocks for its next decode token *or its next prefill piece* preempts the newest
running sequence (its blocks freed; it goes back first in line and recomputes its prompt and
the tokens it has made), then the next newest, until it fits; when it is the newest itself, it
is the one that goes back. So the oldest running sequence always makes progress:

    pool of 13 blocks; A, B share a cached 12-token prefix; both admitted in one step
    A: [####----]  B: [####]      A's next chunk needs 2 more blocks, 1 is free
    only decodes preempting:  nothing decodes, B waits behind A, A waits for blocks: forever
    here:                     B (newest) is preempted, A goes on and ends, then B comes back

A request in line never preempts a running one (`grow`): it waits at the head of the line, and
it fits once the running ones end, because a request that could never fit the pool alone is
refused (400, with the numbers: `never_fits`) before it is admitted. The scheduler's one
exception is a sequence that must run alone after a failed step: it preempts what holds the
blocks or the running slots it needs (Scheduler.admit_alone). A preempted sequence's chunks
kept this step are forgotten with it; the scheduler takes it out of the step being planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringattn.serve.pool import BlockPool, prefix_hashes, truncate
from ringattn.serve.sequence import Seq
from ringattn.serve.shares import Shares

__all__ = ["BlockManager", "Grant"]


@dataclass
class Grant:
    """What `allocate` did. `ok`: the sequence holds its rows. `preempted`: (sequence, the id
    it had) for each one sent back, newest first (the sequence itself last when it went back).
    `refusal`: running alone it never fits (why, with the numbers); it still runs, to be
    failed."""

    ok: bool
    preempted: list[tuple[Seq, int]] = field(default_factory=list)
    refusal: str | None = None


class BlockManager:
    """The running sequences' blocks (module docstring). Rows are counted on the fullest rank
    and rounded to whole blocks by region (`rows`); the pool's counts are `counts()`."""

    def __init__(self, pool: BlockPool, shares: Shares, chunk: int, prefix_cache: bool = True):
        self.pool: BlockPool = pool
        self.shares: Shares = shares
        self.chunk: int = chunk  # prompt tokens per chunk (--max-batch-tokens)
        self.prefix_cache: bool = prefix_cache
        self.running: list[Seq] = []  # admission order: the newest (last) is preempted first
        self.freed: list[int] = []  # ids released since the last plan (every rank frees them)
        self.next_id: int = 0  # the next admitted sequence's id (every rank opens them in order)
        self.kept: dict[int, Seq] = {}  # entries the step being planned stores -> their keeper
        self._pinned: set[int] = set()  # the pool's pins before the sequence being opened

    def counts(self) -> dict[str, int]:
        """The pool's {"used", "cached", "shared", "free"} blocks (BlockPool.counts)."""
        return self.pool.counts()

    def start_step(self) -> None:
        """A new step is being planned: nothing kept or pinned by it yet."""
        self.kept = {}
        self.pool.start_step()

    # ---- sizes ----

    def rows(self, seq: Seq, piece: int = 0, decode: int = 0) -> int:
        """Rows (whole blocks) seq holds alone on the fullest rank once a prompt piece of
        `piece` tokens and `decode` more decoded tokens are in, by region (pool.py): the
        earlier chunks no entry holds (`Seq.private`), the chunk being filled, the decoded."""
        block = self.pool.block_size
        blocks = seq.private + self.pool.blocks(self._own(seq, piece))
        decoded = -(-(max(0, seq.done - seq.target) + decode) // self.shares.world_size)
        return block * (blocks + self.pool.blocks(decoded))

    def _own(self, seq: Seq, piece: int = 0) -> int:
        """Rows (whole blocks) of the chunk being filled that seq holds alone once a piece of
        `piece` tokens is in: its computed pieces' (an upper bound over the ranks), and one
        block when an adopted prefix ends inside a block (copied on write: paged.py); the
        adopted whole blocks are the entry's."""
        computed = self.shares.rows(seq.pieces[len(seq.adopted) :])
        computed += self.shares.chunk_rows(piece) if piece else 0
        return (self.pool.blocks(computed) + seq.cow) * self.pool.block_size

    def never_fits(self, seq: Seq) -> str | None:
        """Why `seq` could never fit the pool alone (its prompt and max_tokens), or None."""
        prompt, new = len(seq.request.ids), seq.request.max_new_tokens
        blocks = self.shares.blocks(prompt, self.chunk, new, self.pool.block_size)
        if blocks <= self.pool.n_blocks:
            return None
        rows, most = self.shares.tokens(prompt, self.chunk, new), self.pool.n_blocks
        return (f"this request needs {blocks} KV blocks of {self.pool.block_size} tokens per rank "
                f"({prompt} prompt + {new} completion tokens: {rows} on the fullest of "
                f"{self.shares.world_size} ranks), but the pool holds {most} blocks "
                f"({most * self.pool.block_size} tokens) per rank; lower max_tokens or the "
                f"prompt, or start the server with a larger --kv-cache-gb")  # fmt: skip

    def _too_large(self, seq: Seq, rows: int) -> str:
        """A sequence that alone cannot grow: a preempted one recomputes the tokens it made as
        prompt, in chunks, which can take more rows than decoding them did (only a pool
        smaller than one sequence of the served context allows it: worker.check_pool)."""
        return (f"this request's {len(seq.tokens)} tokens ({len(seq.request.ids)} prompt + "
                f"{len(seq.out)} made, recomputed after a preemption) need {rows} rows on the "
                f"fullest of {self.shares.world_size} ranks, more than the pool's "
                f"{self.pool.n_blocks} blocks of {self.pool.block_size} tokens per rank hold; "
                f"lower max_tokens or the prompt, or start the server with a larger "
                f"--kv-cache-gb")  # fmt: skip

    # ---- holding blocks ----

    def can_allocate(self, seq: Seq, rows: int) -> bool:
        """Whether `seq` could hold `rows` rows now, evicting idle cached entries but
        preempting nothing (nothing changes)."""
        return self.pool.fits(seq.id, rows)

    def can_append(self, seq: Seq) -> bool:
        """Whether running `seq` could take its next decoded token now (`can_allocate`)."""
        return self.can_allocate(seq, self.rows(seq, decode=1))

    def grow(self, seq: Seq, rows: int) -> bool:
        """Let `seq` (opened, in line) hold `rows` rows, preempting nothing; False if full."""
        return self.pool.grow(seq.id, rows)

    def allocate(self, seq: Seq, rows: int) -> Grant:
        """Let running `seq` hold `rows` rows per rank, preempting the newest running
        sequences until it fits (module docstring)."""
        grant = Grant(False)
        while not self.pool.grow(seq.id, rows):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:  # alone, it never fits: no livelock
                self._unkeep(seq)
                grant.refusal = self._too_large(seq, rows)
                return grant
            grant.preempted.append((victim, victim.id))
            self.preempt(victim)
            if victim is seq:
                return grant
        grant.ok = True
        return grant

    def append(self, seq: Seq) -> Grant:
        """`allocate` the rows of running `seq`'s next decoded token."""
        return self.allocate(seq, self.rows(seq, decode=1))

    def free(self, seq: Seq) -> None:
        """`seq` holds nothing now (ended, failed or preempted): its id goes with the next plan."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.id >= 0:
            self.pool.release(seq.id)
            self.freed.append(seq.id)
            seq.id = -1

    def preempt(self, seq: Seq) -> None:
        """Free `seq` and forget what it keeps this step; it recomputes from scratch."""
        self._unkeep(seq)
        self.free(seq)
        seq.restart()
        seq.target = 0

    def _unkeep(self, seq: Seq) -> None:
        for entry in [e for e, keeper in self.kept.items() if keeper is seq]:
            del self.kept[entry]
            self.pool.forget(entry)

    def forget_kept(self) -> set[int]:
        """Forget every entry the step stores (it failed, or gave non-finite rows): the ids
        of the sequences that counted on them (BlockPool.forget)."""
        users: set[int] = set()
        for entry in self.kept:
            users |= self.pool.forget(entry)
        self.kept = {}
        return users

    def take_freed(self) -> list[int]:
        """The ids freed since the last call (the next plan's "free")."""
        freed, self.freed = self.freed, []
        return freed

    # ---- admission and the prefix cache ----

    def open(self, seq: Seq) -> list[tuple[int, int]]:
        """Give `seq`, at the head of the line, the next id and the cached prefix it starts
        from (`reuse`): [(entry, tokens)], pinned. `unopen` or `admit` follows."""
        seq.target = len(seq.tokens)
        seq.id, self._pinned = self.next_id, set(self.pool.pinned)
        return self.reuse(seq)

    def drop_reuse(self, seq: Seq) -> None:
        """`seq` computes its whole prompt instead of the prefix `open` found (the copies do
        not fit beside their originals); an entry pinned by another stays pinned."""
        self.pool.pinned = self._pinned
        seq.restart()

    def unopen(self, seq: Seq) -> None:
        """`seq` waits at the head of the line after all: nothing held, nothing pinned."""
        self.pool.pinned = self._pinned
        self.pool.release(seq.id)
        seq.id = -1
        seq.restart()

    def admit(self, seq: Seq, reuse: list[tuple[int, int]]) -> None:
        """`seq`, opened and grown for its first piece, runs: it shares `reuse`'s blocks."""
        self.next_id += 1
        self.running.append(seq)
        self.pool.use(seq.id, [entry for entry, _ in reuse])
        if reuse:
            self.pool.hits += 1
            self.pool.hit_tokens += seq.done

    def hashes(self, seq: Seq) -> list:
        """seq's prefix hash points (pool.prefix_hashes), computed once per token list: again
        only when a preempted sequence comes back with the tokens it made."""
        if seq.hashed != len(seq.tokens):
            seq.hashes = prefix_hashes(seq.tokens, self.chunk, self.pool.block_size)
            seq.hashed = len(seq.tokens)
        return seq.hashes

    def reuse(self, seq: Seq) -> list[tuple[int, int]]:
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

    def keep(self, seq: Seq, n: int) -> list[int] | None:
        """Keep the chunk that seq's next piece of `n` tokens completes (or ends its prompt
        in) as a prefix entry, if it adds one (BlockPool.keep): [entry, its chunk's first
        position], else None. Grown for the piece first: its blocks move to the entry."""
        c, at = divmod(seq.done, self.chunk)
        end = at + n  # tokens of chunk c in the cache after this piece
        entry = None
        if self.prefix_cache and (end == self.chunk or seq.done + n == seq.target):
            points = [p for p in seq.hashes[c] if p[0] <= end] if c < len(seq.hashes) else []
            pieces = [*seq.pieces, (at, n, n)]
            moved = self.pool.blocks(self._own(seq, n))  # seq's count of the chunk: the entry's
            base = seq.base if seq.adopted else None  # the entry seq shares blocks of
            entry = self.pool.keep(c, points, pieces, self.shares.rows(pieces), seq.id, moved,
                                   base)  # fmt: skip
        seq.keeping = entry is not None
        if entry is None:
            return None
        self.kept[entry] = seq
        return [entry, c * self.chunk]

    def computed(self, seq: Seq, n: int) -> None:
        """seq's piece of `n` prompt tokens is in every rank's cache: count its rows; once its
        chunk is complete, what it holds of it alone joins `Seq.private` (unless kept)."""
        seq.rows += self.shares.chunk_rows(n)
        at = seq.done % self.chunk
        seq.pieces = [*seq.pieces, (at, n, n)]
        seq.done += n
        if at + n == self.chunk or seq.done == seq.target:  # its region is complete:
            if not seq.keeping:  # held by an entry, or by seq alone from now on
                seq.private += self.pool.blocks(self._own(seq))
            seq.pieces, seq.adopted, seq.cow, seq.base = [], [], 0, None
