"""The KV pool: every rank's cache budget in fixed-size blocks, and the prefix cache's index.

    --kv-cache-gb G per rank  ->  blocks = G / (block_size x bytes of one token's K/V on a rank)

An accounting pool (rank 0 keeps it for all ranks): a sequence holds the blocks that its
largest shard needs (the most rows any rank keeps of it), taken piece by piece as its prompt
prefills and as it decodes. A sequence that grows takes up to an eighth more than it needs
(`HEADROOM`), from free blocks only, and the plan tells every rank its new holding (`room`);
each rank's tensors grow to that holding (inference/cache.py's `granule` and `room`), so what
a rank holds never exceeds what the pool counts, and a long sequence's contiguous buffers are
copied O(log n) times as it grows, not once per block (a 100k-token context decoding 2k tokens
would otherwise copy its whole cache 125 times per layer).

Prefix cache, block-granular (vLLM's and nano-vllm's chained block hashes, over the chunks of
DESIGN.md §12). A prompt goes in chunks of C tokens; every chunk with at least one full block
of B tokens, full or partial (a prompt's last), is kept in every rank's store as one *entry*.
Its hash points are the ends of its full blocks (and its own end when the chunk is full):

    chunk c:  |B|B|B|B|B|B|.. tail   point (c, k) hashes tokens [0, cC + k), chained from
               ^ ^ ^ ^ ^ ^            the point before it (the previous chunk's last point
                                      for k = B), so one hash names a whole prefix

`index` maps each point's hash to the entries holding it. A lookup walks the request's chunks:
whole chunks while an entry holds the chunk's last point, then, within the next chunk, the
furthest point any entry holds (an entry starts at its chunk's start, so holding point k means
holding every point before it too). The hit is that many tokens, a multiple of B.

Why truncating a stored chunk is exact: every rank keeps its rows in increasing position order,
and the K/V at position p depend on tokens <= p only. So the rows of an entry with position
< cC + k, on every rank, are exactly that prefix's cache, whatever placement the chunk had.

An entry's rows were computed in *pieces*, each placed by the layout over its own tokens (a
chunk that started from a truncated entry has two): `(offset in the chunk, tokens placed,
tokens kept)`. Its fullest rank holds at most the sum over pieces of the most rows any rank
holds of the piece (`Shares.piece_rows`), which is what its blocks count (and, truncated, what
a sequence that adopts it counts). Entries take free blocks only (a prefix never evicts
another), are evicted least recently used (a chain's last chunk first; before all, one whose
every point a newer entry holds, e.g. a turn's last chunk that the next turn completed), and
`pinned` ones (read or written by the step being planned) are not evicted. Rank 0 decides what
is kept and evicted and says so in the step's plan, so every rank's store holds the same
entries. (An accounting pool: an entry holds a copy of its chunk, and a hit copies it into the
new sequence's cache, rather than sharing one paged tensor.)
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
from dataclasses import dataclass

from ringattn.layout import get_layout
from ringattn.packing import place

__all__ = ["HEADROOM", "BlockPool", "Entry", "Shares", "prefix_hashes", "truncate"]

HEADROOM = 8  # a growing sequence takes up to 1/HEADROOM more blocks than it needs, when free

Point = tuple[int, str]  # (tokens into the chunk, hash of the prefix that ends there)
Piece = tuple[int, int, int]  # (offset in the chunk, tokens placed, tokens kept)


def prefix_hashes(ids: list[int], chunk: int, block: int) -> list[list[Point]]:
    """Each chunk's hash points (module docstring): per `chunk`-token chunk of `ids`, the end of
    each full `block`-token block in it, and the chunk's end when it is full; each hash covers
    every token before its point, chained. A partial tail of < `block` tokens has none."""
    out: list[list[Point]] = []
    data = array.array("q", ids).tobytes()  # 8 bytes a token: no text on rank 0's loop
    previous = b""
    for start in range(0, len(ids), chunk):
        size = min(chunk, len(ids) - start)
        ends = list(range(block, size + 1, block))
        if size == chunk and (not ends or ends[-1] != chunk):
            ends.append(chunk)  # a full chunk's tail still chains into the next chunk
        points, at = [], start
        for end in ends:
            previous = hashlib.sha256(previous + data[8 * at : 8 * (start + end)]).digest()
            points.append((end, previous.hex()[:32]))
            at = start + end
        out.append(points)
    return out


def truncate(pieces: list[Piece], tokens: int) -> list[Piece]:
    """The pieces of a chunk cut to its first `tokens` tokens (each keeps its placement)."""
    return [(at, n, min(kept, tokens - at)) for at, n, kept in pieces if at < tokens]


@functools.lru_cache(maxsize=4096)
def _alone(layout: str, world_size: int, tokens: int) -> tuple[list[int], ...]:
    """Each rank's global indices (sorted, no padding) of `tokens` tokens placed alone."""
    placement = place(get_layout(layout), world_size, (0, tokens))
    ranks = (placement.global_indices(r).tolist() for r in range(world_size))
    return tuple(sorted(g for g in rows if g >= 0) for rows in ranks)


class Shares:
    """How many of a sequence's tokens its fullest rank keeps (what its blocks must hold)."""

    def __init__(self, layout: str, world_size: int):
        self.name, self.layout, self.world_size = layout, get_layout(layout), world_size

    def piece_rows(self, tokens: int, kept: int) -> int:
        """The most rows any rank holds of the first `kept` tokens of `tokens` placed alone."""
        return max(bisect.bisect_left(g, kept) for g in _alone(self.name, self.world_size, tokens))

    def chunk_rows(self, tokens: int) -> int:
        """The most real rows any rank gets of a chunk of `tokens` tokens placed alone."""
        return self.piece_rows(tokens, tokens)

    def rows(self, pieces: list[Piece]) -> int:
        """An upper bound on the rows the fullest rank holds of `pieces` (sum of each's most)."""
        return sum(self.piece_rows(n, kept) for _, n, kept in pieces if kept > 0)

    def tokens(self, prefilled: int, chunk: int, decoded: int) -> int:
        """Rows on the fullest rank after `prefilled` prompt tokens in chunks of `chunk` and
        `decoded` tokens round-robin."""
        full, rest = divmod(prefilled, chunk)
        rows = full * self.chunk_rows(chunk) + (self.chunk_rows(rest) if rest else 0)
        return rows + -(-decoded // self.world_size)


@dataclass
class Entry:
    """One kept chunk: chunk number, hash points, pieces, blocks and last use."""

    chunk: int
    points: list[Point]
    pieces: list[Piece]
    blocks: int
    last: int


class BlockPool:
    """`n_blocks` blocks of `block_size` tokens (per rank); who holds how many."""

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.held: dict[int, int] = {}  # sequence -> blocks
        self.grown: dict[int, int] = {}  # sequence -> blocks, changed since the last plan
        self.cached: dict[int, Entry] = {}  # entry id -> the kept chunk
        self.index: dict[str, dict[int, None]] = {}  # point hash -> entries (an ordered set)
        self.pinned: set[int] = set()  # entries the step being planned reads or writes
        self.planned: set[int] = set()  # entries the step being planned stores
        self.clock = 0  # counts lookups and keeps: the "last use" of an entry
        self.next_entry = 0
        self.evicted: list[int] = []  # entries dropped since the last plan (every rank drops them)
        self.hits = self.hit_tokens = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def used(self) -> int:
        return sum(self.held.values())

    @property
    def cached_blocks(self) -> int:
        return sum(e.blocks for e in self.cached.values())

    @property
    def free(self) -> int:
        return self.n_blocks - self.used - self.cached_blocks

    def _room(self, blocks: int) -> bool:
        """Evict entries (oldest use first, not pinned ones) until `blocks` are free; False when
        even that is not enough (then nothing is evicted)."""
        spare = sum(e.blocks for i, e in self.cached.items() if i not in self.pinned)
        if blocks > self.free + spare:
            return False
        # least recently used first; within a chain the last chunk first (the earlier ones
        # still serve every prefix that shares them)
        order = sorted((i for i in self.cached if i not in self.pinned),
                       key=lambda i: (self.cached[i].last, -self.cached[i].chunk))  # fmt: skip
        for i in order:
            if self.free >= blocks:
                break
            self.forget(i)
        return True

    def grow(self, seq: int, tokens: int) -> bool:
        """Let `seq` hold `tokens` tokens per rank; False (nothing changes) if the pool is full.
        Growing, it takes up to held / HEADROOM blocks more from the free ones (module doc)."""
        held = self.held.get(seq, 0)
        need = self.blocks(tokens) - held
        if need <= 0:
            return True
        if not self._room(need):
            return False
        spare = max(0, min(held // HEADROOM, self.free - need))
        self.held[seq] = self.grown[seq] = held + need + spare
        return True

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)
        self.grown.pop(seq, None)

    def room(self) -> list[list[int]]:
        """[sequence, rows per rank] of every holding changed since the last call (the plan's
        `room`: each rank's buffers of that sequence may grow to it)."""
        out = [[seq, blocks * self.block_size] for seq, blocks in self.grown.items()]
        self.grown = {}
        return out

    def lookup(self, hashes: list[list[Point]], limit: int) -> list[tuple[int, int]]:
        """The longest prefix of a request (`prefix_hashes` of it) of at most `limit` tokens
        that the cache holds: [(entry, tokens of its chunk to take)], whole chunks and then
        one cut at a block (module docstring). The entries are now the most recently used."""
        found: list[tuple[int, int]] = []
        self.clock += 1
        chunk_start = 0
        for points in hashes:
            best = None
            for k, h in points:
                holders = self.index.get(h)
                if chunk_start + k > limit or not holders:
                    break
                # an entry stored before this step first: one this step stores makes the
                # adopting piece wait for a second forward (runner.py); the rows are the same
                best = (max(holders, key=lambda i: (i not in self.planned, self.cached[i].last)),
                        k)  # fmt: skip
            if best is None:
                break
            self.cached[best[0]].last = self.clock
            found.append(best)
            if best[1] != points[-1][0]:
                break  # cut within this chunk: nothing after it can follow
            chunk_start += best[1]
        return found

    def forget(self, entry: int) -> None:
        """Drop `entry` from the cache now (evicted, or a failed step never stored it on every
        rank); every rank drops it with the next plan."""
        gone = self.cached.pop(entry, None)
        if gone is None:
            return
        for _, h in gone.points:
            holders = self.index[h]
            del holders[entry]
            if not holders:
                del self.index[h]
        self.pinned.discard(entry)
        self.planned.discard(entry)
        self.evicted.append(entry)

    def keep(self, chunk: int, points: list[Point], pieces: list[Piece], rows: int) -> int | None:
        """Keep chunk number `chunk` (its hash `points` and `pieces`, `rows` on the fullest rank)
        if it adds a prefix the cache lacks and the free blocks hold it (a prefix never evicts
        another); its entry id (pinned for this step), else None."""
        if not points or points[-1][1] in self.index or self.blocks(rows) > self.free:
            return None
        self.clock += 1
        entry, self.next_entry = self.next_entry, self.next_entry + 1
        self.cached[entry] = Entry(chunk, list(points), list(pieces), self.blocks(rows), self.clock)
        for _, h in points:
            for other in self.index.get(h, ()):
                if self.cached[other].points[-1][1] == h:  # all it holds, this one holds too:
                    self.cached[other].last = 0  # evicted first when room is needed
            self.index.setdefault(h, {})[entry] = None
        self.pinned.add(entry)
        self.planned.add(entry)
        return entry

    def start_step(self) -> None:
        """A new step is being planned: nothing pinned, nothing stored by it yet."""
        self.pinned, self.planned = set(), set()
