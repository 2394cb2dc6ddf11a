"""The KV pool: every rank's cache budget in fixed-size blocks, and the prefix cache's index.

    --kv-cache-gb G per rank  ->  blocks = G / (block_size x bytes of one token's K/V on a rank)

An accounting pool (rank 0 keeps it for all ranks): a sequence holds the blocks that its
largest shard needs (`Shares.tokens`: the most rows any rank keeps of it), taken chunk by chunk
as its prompt prefills and one block at a time as it decodes; nothing is reserved for tokens
not yet computed. The tensors themselves grow in whole blocks of rows on each rank
(inference/cache.py's `granule`), so what a rank holds never exceeds what the pool counts.

Prefix cache: each full prompt chunk's K/V, kept under a content hash chained to the previous
chunk's (`chunk_hashes`: the hash of chunk c covers tokens [0, (c + 1) C), as vLLM and
nano-vllm chain their blocks'), holds blocks of its own, evicted least recently used first
(the last chunk of a chain before the earlier ones) when a sequence needs room. Rank 0 decides
what is kept and evicted and says so in the step's plan, so every rank's store holds the same
chunks. (An accounting pool: the prefix store holds a copy of each kept chunk, and a hit
copies it into the new sequence's cache, rather than sharing one paged tensor.)
"""

from __future__ import annotations

import hashlib

from ringattn.layout import get_layout
from ringattn.packing import place

__all__ = ["BlockPool", "Shares", "chunk_hashes"]


def chunk_hashes(ids: list[int], chunk: int) -> list[str]:
    """The chained content hash of each full `chunk`-token chunk of `ids` (a partial last chunk
    has none: its placement depends on its length)."""
    out, previous = [], b""
    for start in range(0, len(ids) - chunk + 1, chunk):
        data = previous + b"|" + ",".join(map(str, ids[start : start + chunk])).encode()
        previous = hashlib.sha256(data).digest()
        out.append(previous.hex()[:32])
    return out


class Shares:
    """How many of a sequence's tokens its fullest rank keeps (what its blocks must hold)."""

    def __init__(self, layout: str, world_size: int):
        self.layout, self.world_size = get_layout(layout), world_size
        self._rows: dict[int, int] = {}

    def chunk_rows(self, tokens: int) -> int:
        """The most real rows any rank gets of a chunk of `tokens` tokens placed alone."""
        if tokens not in self._rows:
            placement = place(self.layout, self.world_size, (0, tokens))
            self._rows[tokens] = max(
                int((placement.global_indices(r) >= 0).sum()) for r in range(self.world_size)
            )
        return self._rows[tokens]

    def tokens(self, prefilled: int, chunk: int, decoded: int) -> int:
        """Rows on the fullest rank after `prefilled` prompt tokens in chunks of `chunk` and
        `decoded` tokens round-robin."""
        full, rest = divmod(prefilled, chunk)
        rows = full * self.chunk_rows(chunk) + (self.chunk_rows(rest) if rest else 0)
        return rows + -(-decoded // self.world_size)


class BlockPool:
    """`n_blocks` blocks of `block_size` tokens (per rank); who holds how many."""

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.held: dict[int, int] = {}  # sequence -> blocks
        # prefix chunk hash -> [blocks, last use, depth in its chain]
        self.cached: dict[str, list[int]] = {}
        self.clock = 0  # counts lookups and keeps: the "last use" of a chunk
        self.evicted: list[str] = []  # hashes dropped since the last plan (every rank drops them)
        self.hits = self.hit_tokens = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def used(self) -> int:
        return sum(self.held.values())

    @property
    def cached_blocks(self) -> int:
        return sum(n for n, _, _ in self.cached.values())

    @property
    def free(self) -> int:
        return self.n_blocks - self.used - self.cached_blocks

    def _room(self, blocks: int, keep: tuple[str, ...] = ()) -> bool:
        """Evict cached prefix chunks (oldest use first, not those in `keep`) until `blocks`
        are free; False when even that is not enough (then nothing is evicted)."""
        spare = sum(n for h, (n, _, _) in self.cached.items() if h not in keep)
        if blocks > self.free + spare:
            return False
        # least recently used first; within a chain the last chunk first (the earlier ones
        # still serve every prefix that shares them)
        order = sorted((h for h in self.cached if h not in keep),
                       key=lambda h: (self.cached[h][1], -self.cached[h][2]))  # fmt: skip
        for h in order:
            if self.free >= blocks:
                break
            del self.cached[h]
            self.evicted.append(h)
        return True

    def grow(self, seq: int, tokens: int, keep: tuple[str, ...] = ()) -> bool:
        """Let `seq` hold `tokens` tokens per rank; False (nothing changes) if the pool is full."""
        need = self.blocks(tokens) - self.held.get(seq, 0)
        if need > 0 and not self._room(need, keep):
            return False
        self.held[seq] = max(self.held.get(seq, 0), self.blocks(tokens))
        return True

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)

    def lookup(self, hashes: list[str]) -> list[str]:
        """The leading chunks of `hashes` in the prefix cache (now the most recently used)."""
        found = []
        self.clock += 1
        for h in hashes:
            if h not in self.cached:
                break
            self.cached[h][1] = self.clock
            found.append(h)
        return found

    def forget(self, h: str) -> None:
        """Drop chunk `h` from the cache now (a failed step never stored it on every rank)."""
        if self.cached.pop(h, None) is not None:
            self.evicted.append(h)

    def keep(self, h: str, tokens: int, depth: int = 0) -> bool:
        """Cache chunk number `depth` of a prefix, `tokens` rows per rank, if the pool has room
        for it now (free blocks only: a prefix never evicts another); True when it is kept."""
        if h in self.cached or self.blocks(tokens) > self.free:
            return False
        self.clock += 1
        self.cached[h] = [self.blocks(tokens), self.clock, depth]
        return True
