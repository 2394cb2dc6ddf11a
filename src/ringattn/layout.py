r"""Layouts: which global token each rank holds, and which attention blocks a rank computes.

A layout is a permutation of the S global tokens into W equal shards. Within a shard, tokens are
kept in increasing global order, so "causal over local indices" and "causal over global positions"
agree whenever queries and keys are the same shard.

    contiguous  rank r holds chunk r of W                      (causal work unbalanced)
    zigzag      rank r holds chunks r and 2W-1-r of 2W         (causal work balanced)
    striped     rank r holds tokens r, r+W, r+2W, ...          (causal work balanced)

Zigzag, W = 2, causal: rows are rank r's queries, columns the key chunks 0..3 (# = visible).

    rank 0 holds chunks 0, 3       rank 1 holds chunks 1, 2
             k0 k1 k2 k3                    k0 k1 k2 k3
       q0    \.  .  .  .             q1     ## \.  .  .
       q3    ## ## ## \.             q2     ## ## \.  .

The block schedule is a pure function: for rank r and the K/V shard of rank `src` it lists the
(query rows, key rows, mask) blocks to compute. Every visible (query, key) pair appears in exactly
one block of exactly one (r, src) schedule; invisible pairs appear in none (tested without
processes).
A strategy iterates the schedule and never branches on a layout's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One attention call: local query rows [q_start, q_stop) against the source's key rows
    [kv_start, kv_stop), either full or causal.

    A causal block is square and top-left aligned: key j of the block is visible to query i of the
    block iff j <= i. Masks shifted by one (striped, key shard from a higher rank: key j visible iff
    j < i) are expressed as a causal block that drops the first query row and the last key row, so
    every kernel only ever needs "full" or "causal". Blocks are never empty.

    `band = (lo, hi)` marks a banded block (sliding windows): key j is visible to query i iff
    lo <= j - i <= hi, block-local, and every query row of the block sees at least one key.

    `tiles` marks a tiled block (many short packed documents): the block's rows are covered by
    disjoint tiles, each one kernel call with the mask `Tiles.mask` gives; rows outside every
    tile, and rows that see no key, get out = 0 and lse = -inf.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool = False
    band: tuple[int, int] | None = None
    tiles: Tiles | None = None


@dataclass(frozen=True, eq=False)
class Tiles:
    """The tiles of one tiled block and what their masks are made of.

    spans: (q0, q1, k0, k1) per tile, rows relative to the block's q_start / kv_start, disjoint
    and increasing on both sides. q_pos, q_doc (k_pos, k_doc): global token index and document
    of each of the block's query (key) rows, -1 for padding. Key j is visible to query i iff
    both are real tokens of the same document, causal and window allowing (global offsets).
    Compared and hashed by identity.
    """

    spans: tuple[tuple[int, int, int, int], ...]
    q_pos: torch.Tensor
    q_doc: torch.Tensor
    k_pos: torch.Tensor
    k_doc: torch.Tensor
    causal: bool
    window: tuple[int, int] | None

    def mask(self, tile: int) -> torch.Tensor:
        """(q1 - q0, k1 - k0) bool: True where the tile's key j is visible to its query i."""
        q0, q1, k0, k1 = self.spans[tile]
        q_doc = self.q_doc[q0:q1].unsqueeze(1)
        visible = (q_doc == self.k_doc[k0:k1].unsqueeze(0)) & (q_doc >= 0)
        offset = self.k_pos[k0:k1].unsqueeze(0) - self.q_pos[q0:q1].unsqueeze(1)
        if self.causal:
            visible &= offset <= 0
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                visible &= offset >= -left
            if right >= 0:
                visible &= offset <= right
        return visible

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs over all tiles: the attention work actually needed."""
        return sum(int(self.mask(t).sum()) for t in range(len(self.spans)))


@dataclass(frozen=True)
class Piece:
    """Part of a segment on one rank: `count` real tokens at local offset `local_offset`, holding
    segment tokens global_offset, global_offset + stride, ... (the rest of the piece is padding)."""

    local_offset: int
    global_offset: int
    count: int
    stride: int


class Layout:
    """Base class: subclasses define `name`, `chunks_per_rank`, `split` and `schedule`."""

    name: str = ""
    #: the global length must be divisible by world_size * chunks_per_rank
    chunks_per_rank: int = 1
    #: with packed documents, split each document on its own (True) or the whole sequence (False)
    per_document: bool = True

    def split(self, length: int, world_size: int) -> tuple[int, list[list[Piece]]]:
        """Split a segment of `length` tokens: (tokens per rank, padding included; pieces per rank).

        Padding goes at the end of the segment, so on every rank the real tokens of a segment are
        a prefix of each piece.
        """
        raise NotImplementedError

    def check_seq_len(self, seq_len: int, world_size: int) -> None:
        """Raise ValueError unless a global length of `seq_len` splits evenly for this layout."""
        multiple = world_size * self.chunks_per_rank
        if seq_len % multiple:
            padded = -(-seq_len // multiple) * multiple
            rule = (
                f"{self.chunks_per_rank}*world_size={multiple}"
                if self.chunks_per_rank > 1
                else f"world_size={multiple}"
            )
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {rule} ({self.name} layout); "
                f"pad the sequence to {padded} tokens, or pass cu_seqlens=[0, {seq_len}] and "
                f"ringattn pads internally"
            )

    def check_local_len(self, local_len: int) -> None:
        """Raise ValueError unless a shard of `local_len` tokens is valid for this layout."""
        if local_len % self.chunks_per_rank:
            raise ValueError(
                f"local sequence length {local_len} must be a multiple of {self.chunks_per_rank} "
                f"for the {self.name} layout (rank r holds {self.chunks_per_rank} equal chunks); "
                f"pad the global sequence to a multiple of {self.chunks_per_rank}*world_size"
            )

    def global_indices(self, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
        """Increasing global token indices held by `rank`, a LongTensor of seq_len/world_size."""
        _, pieces = self.split(seq_len, world_size)
        return torch.cat(
            [
                torch.arange(p.count, device="cpu") * p.stride + p.global_offset
                for p in sorted(pieces[rank], key=lambda p: p.local_offset)
            ]
        )

    def schedule(
        self, rank: int, src: int, world_size: int, local_len: int, causal: bool
    ) -> list[Block]:
        """Blocks that rank `rank`'s queries compute against the K/V shard of rank `src`."""
        raise NotImplementedError

    def permutation(self, seq_len: int, world_size: int) -> torch.Tensor:
        """Global indices of all ranks' shards laid end to end (rank 0's first)."""
        return torch.cat([self.global_indices(seq_len, world_size, r) for r in range(world_size)])


def _real(capacity: int, global_offset: int, length: int) -> int:
    """Real tokens in a chunk of `capacity` starting at `global_offset` of a `length` segment."""
    return max(0, min(capacity, length - global_offset))


class Contiguous(Layout):
    name = "contiguous"
    chunks_per_rank = 1
    per_document = False  # documents fall where they fall; a short one lies on a single rank

    def split(self, length, world_size):
        n = -(-length // world_size)
        return n, [[Piece(0, r * n, _real(n, r * n, length), 1)] for r in range(world_size)]

    def schedule(
        self, rank: int, src: int, world_size: int, local_len: int, causal: bool
    ) -> list[Block]:
        n = local_len
        if not causal or src < rank:
            return [Block(0, n, 0, n)]
        if src == rank:
            return [Block(0, n, 0, n, causal=True)]
        return []  # a later chunk is wholly in the future


class Zigzag(Layout):
    name = "zigzag"
    chunks_per_rank = 2

    def split(self, length, world_size):
        c = -(-length // (2 * world_size))
        pieces = []
        for r in range(world_size):
            late = 2 * world_size - 1 - r
            early_piece = Piece(0, r * c, _real(c, r * c, length), 1)
            pieces.append([early_piece, Piece(c, late * c, _real(c, late * c, length), 1)])
        return 2 * c, pieces

    def schedule(
        self, rank: int, src: int, world_size: int, local_len: int, causal: bool
    ) -> list[Block]:
        n, half = local_len, local_len // 2
        if not causal:
            return [Block(0, n, 0, n)]
        if src == rank:
            # both halves are in increasing global order, so causal over local indices is exact
            return [Block(0, n, 0, n, causal=True)]
        if src < rank:
            # chunk src precedes both of ours; chunk 2W-1-src follows both
            return [Block(0, n, 0, half)]
        # chunk 2W-1-r (our late half) follows both of src's chunks; our early half sees neither
        return [Block(half, n, 0, n)]


class Striped(Layout):
    name = "striped"
    chunks_per_rank = 1

    def split(self, length, world_size):
        n = -(-length // world_size)
        return n, [
            [Piece(0, r, max(0, -(-(length - r) // world_size)), world_size)]
            for r in range(world_size)
        ]

    def schedule(
        self, rank: int, src: int, world_size: int, local_len: int, causal: bool
    ) -> list[Block]:
        n = local_len
        if not causal:
            return [Block(0, n, 0, n)]
        # query i holds token r + W*i, key j holds token src + W*j: visible iff j <= i + (r-src)/W,
        # i.e. j <= i when src <= r and j < i when src > r (query i' = i-1 against keys [0, n-1))
        if src <= rank:
            return [Block(0, n, 0, n, causal=True)]
        return [Block(1, n, 0, n - 1, causal=True)] if n > 1 else []


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (Contiguous(), Zigzag(), Striped())}


def get_layout(name: str) -> Layout:
    """The layout registered under `name`; ValueError listing the choices otherwise."""
    if not isinstance(name, str) or name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {sorted(LAYOUTS)}")
    return LAYOUTS[name]
