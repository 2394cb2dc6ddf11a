"""How many rows of a sequence its fullest rank holds: the pool's counts, in closed form.

A prompt goes in chunks placed by the layout within themselves (DESIGN.md §12), each computed
in one or more *pieces* `(offset in the chunk, tokens placed, tokens kept)`; decoded tokens go
round-robin. A piece of n tokens placed alone gives each rank a few arithmetic runs of global
indices (`Layout.split`: zigzag two, contiguous and striped one), so the rows a rank holds below
a cut are counted in O(W) without listing any index:

    zigzag, W = 2, n = 8:   rank 0: 0 1 | 6 7    rank 1: 2 3 | 4 5
    rows below 5:           rank 0: 2            rank 1: 3           -> the fullest: 3

That keeps rank 0's step planning and the start-up pool check (`most`: every split of the
served context into prompt and completion) independent of the context's length.
"""

from __future__ import annotations

from ringattn.layout import get_layout

__all__ = ["Piece", "Shares"]

Piece = tuple[int, int, int]  # (offset in the chunk, tokens placed, tokens kept)


def _below(pieces, kept: int) -> int:
    """Tokens below `kept` in a rank's pieces (arithmetic runs `global_offset + i x stride`)."""
    return sum(min(p.count, -(-(kept - p.global_offset) // p.stride))
               for p in pieces if p.count and kept > p.global_offset)  # fmt: skip


class Shares:
    """How many of a sequence's tokens its fullest rank keeps (what its blocks must hold), in
    O(W) per piece (module docstring)."""

    def __init__(self, layout: str, world_size: int):
        self.name, self.layout, self.world_size = layout, get_layout(layout), world_size

    def _counts(self, tokens: int, kept: int) -> list[int]:
        """Each rank's rows among the first `kept` tokens of `tokens` placed alone (the ranks
        in split order: `place` rotates them per document, the multiset is the same)."""
        _, pieces = self.layout.split(tokens, self.world_size)
        return [_below(rank, kept) for rank in pieces]

    def piece_rows(self, tokens: int, kept: int) -> int:
        """The most rows any rank holds of the first `kept` tokens of `tokens` placed alone."""
        return max(self._counts(tokens, kept)) if tokens > 0 and kept > 0 else 0

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

    def cut(self, pieces: list[Piece], block: int) -> bool:
        """Whether some rank's rows of `pieces` may end inside a block of `block` rows: unless
        every piece gives every rank a multiple of `block` rows (a step's packed first pieces
        may land on other ranks than alone: only the counts are known, not whose)."""
        return any(rows % block for _, n, kept in pieces if n > 0 and kept > 0
                   for rows in self._counts(n, kept))  # fmt: skip

    def blocks(self, prefilled: int, chunk: int, decoded: int, block: int) -> int:
        """Blocks of `block` rows a sequence holds alone on its fullest rank, by region (module
        docstring): each prompt chunk's rows, then its decoded ones, each from a new block."""
        full, rest = divmod(prefilled, chunk)
        blocks = full * -(-self.chunk_rows(chunk) // block)
        blocks += -(-self.chunk_rows(rest) // block) if rest else 0
        rows = -(-decoded // self.world_size)  # round-robin: the fullest rank's share
        return blocks + -(-rows // block)

    def most(self, context: int, chunk: int, block: int) -> tuple[int, int]:
        """(rows, blocks) of one sequence of `context` tokens on its fullest rank, the most
        over every split into prompt and completion (`tokens`, `blocks` of p prompt tokens
        and context - p decoded, p = 1 .. context): a chunk's rows are computed once per
        size (at most `chunk` sizes), then each split is a few integer operations."""
        w, whole = self.world_size, self.chunk_rows(chunk)
        whole_blocks = -(-whole // block)
        rest_rows = [0] + [self.chunk_rows(r) for r in range(1, min(chunk, context + 1))]
        rest_blocks = [-(-r // block) for r in rest_rows]
        rows = blocks = 0
        for p in range(1, context + 1):
            full, rest = divmod(p, chunk)
            decoded = -(-(context - p) // w)
            rows = max(rows, full * whole + rest_rows[rest] + decoded)
            blocks = max(blocks, full * whole_blocks + rest_blocks[rest] + -(-decoded // block))
        return rows, blocks
