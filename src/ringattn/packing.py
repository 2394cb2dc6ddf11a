"""Packed documents, sliding windows and any sequence length: placement and block masks.

Placement. Documents of any length (0 and 1 included) are packed along one sequence, bounded by
`cu_seqlens = [0, e1, e2, ..., S]`. The layout splits each document on its own (zigzag, striped:
that keeps causal work balanced for any mix of lengths) or the whole sequence (contiguous), padding
each split up to a multiple of what the layout needs; document d's split is rotated by d ranks so
that short documents, which fill only the first chunks, spread over the ranks instead of piling
onto rank 0. Padding sits at the end of every split, so on each rank a document's real tokens
form the prefix of each of its pieces. What a rank holds is then
a list of runs: local rows [local_start, local_start + length) hold the global tokens
global_start, global_start + stride, ... of one document. Local rows outside every run are padding.

    zigzag, W = 2, documents of 5 and 3 tokens (a0..a4, b0..b2), p = padding:
        doc a, chunks of 2:  [a0 a1][a2 a3][a4 p ][p  p ]
        doc b, chunks of 1:  [b0][b1][b2][p]        (rotated by one rank: document 1)
        rank 0 holds  a0 a1 p  p  | b1 b2       rank 1 holds  a2 a3 a4 p | b0 p

Masks. For a query run and a key run of the same document and stride s, global offsets satisfy
j_g - i_g = (k_start - q_start) + s * (j - i). Causality (j_g <= i_g) and a window
(-left <= j_g - i_g <= right) therefore become a band lo <= j - i <= hi in local indices. A block is
cut to the rows and keys the band touches, then classified: full, causal (square, top-left) or a
general band. Runs of different documents never meet, and padding is in no run, so it is never
attended to, never attends, and gets out = 0 and zero gradients.

Cost. Each rank's runs are indexed by document (`Placement.doc_spans`), so the blocks of a
(rank, src) pair come from the documents both hold, never from all pairs of runs; everything
derived from a placement is memoised on it under small keys, never under the placement's hash.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import torch

from ringattn.layout import Block, Layout

# one document on one rank: runs[first:stop] of that rank, real local rows [lo, hi), global
# tokens gmin..gmax (runs of a document are consecutive and in order on every rank)
Span = tuple[int, int, int, int, int, int]


class Run(NamedTuple):
    """Real tokens of one document on one rank (see module docstring). A named tuple: placements
    of thousands of documents make tens of thousands of runs."""

    local_start: int
    length: int
    global_start: int
    stride: int
    doc: int


@dataclass(frozen=True)
class Placement:
    """Where every global token of a packed sequence lives, for one layout and world size.

    `memo` holds what is derived from the placement (per-rank tables, step plans), keyed by small
    tuples: a lookup never hashes the placement itself.
    """

    bounds: tuple[int, ...]  # cu_seqlens
    world_size: int
    local_len: int
    runs: tuple[tuple[Run, ...], ...]  # per rank
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def seq_len(self) -> int:
        return self.bounds[-1]

    def rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(global index, document) of each local row as (local_len,) int64, -1 for padding.

        Built once per rank, vectorised over the runs; callers must not write into them.
        """
        key = ("rows", rank)
        if key not in self.memo:
            index, doc = [-1] * self.local_len, [-1] * self.local_len
            for run in self.runs[rank]:
                stop = run.local_start + run.length
                index[run.local_start : stop] = range(
                    run.global_start, run.global_start + run.length * run.stride, run.stride
                )
                doc[run.local_start : stop] = [run.doc] * run.length
            # via array: ~8x faster than torch.tensor on a list; cloned, so nothing aliases it
            self.memo[key] = tuple(
                torch.frombuffer(array("q", x), dtype=torch.int64).clone() for x in (index, doc)
            )
        return self.memo[key]

    def global_indices(self, rank: int) -> torch.Tensor:
        """(local_len,) int64: each local row's global token index, -1 for padding."""
        return self.rows(rank)[0].clone()

    def doc_spans(self, rank: int) -> dict[int, Span]:
        """Document -> its Span on `rank`, in local order (the index steps are planned from)."""
        key = ("spans", rank)
        if key not in self.memo:
            spans: dict[int, Span] = {}
            for i, run in enumerate(self.runs[rank]):
                last = run.global_start + (run.length - 1) * run.stride
                stop = run.local_start + run.length
                hit = spans.get(run.doc)
                if hit is None:
                    spans[run.doc] = (i, i + 1, run.local_start, stop, run.global_start, last)
                else:
                    spans[run.doc] = (hit[0], i + 1, hit[2], stop, hit[4], max(hit[5], last))
            self.memo[key] = spans
        return self.memo[key]

    @property
    def has_padding(self) -> bool:
        return (
            sum(run.length for runs in self.runs for run in runs) < self.world_size * self.local_len
        )


def check_cu_seqlens(cu_seqlens: object) -> tuple[int, ...]:
    """Validate document boundaries; return them as a tuple of ints."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor, got dtype {cu_seqlens.dtype} and shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        bounds = tuple(int(x) for x in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(x, int) for x in cu_seqlens):
        bounds = tuple(cu_seqlens)
    else:
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens)}"
        )
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least [0, S], got {list(bounds)}")
    steps = [(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if b < a]
    if steps:
        i, a, b = steps[0]
        raise ValueError(
            f"cu_seqlens must be non-decreasing, but entry {i + 1} ({b}) is below entry {i} ({a})"
        )
    if bounds[-1] == 0:
        raise ValueError("cu_seqlens describes an empty sequence (it ends at 0)")
    return bounds


def check_window(window: object) -> tuple[int, int] | None:
    """Validate `window = (left, right)`; -1 means unbounded on that side."""
    if window is None:
        return None
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window)
    ):
        raise ValueError(
            f"window must be (left, right) with ints >= -1 (-1 = unbounded), got {window!r}"
        )
    return (int(window[0]), int(window[1]))


@lru_cache(maxsize=64)
def place(layout: Layout, world_size: int, bounds: tuple[int, ...]) -> Placement:
    """The placement of the packed sequence `bounds` (cu_seqlens) for `layout` on `world_size`."""
    seq_len = bounds[-1]
    segments = list(itertools.pairwise(bounds)) if layout.per_document else [(0, seq_len)]
    runs: list[list[Run]] = [[] for _ in range(world_size)]
    offset = 0  # local offset of the current segment, the same on every rank
    for index, (seg_start, seg_stop) in enumerate(segments):
        if seg_stop == seg_start:
            continue
        n, pieces = _split(layout, seg_stop - seg_start, world_size)
        for part, rank_pieces in enumerate(pieces):
            # rotate by document: the early (often the only real) pieces of short documents
            # land on different ranks instead of always on rank 0
            held = runs[(part + index) % world_size]
            for piece in rank_pieces:
                if not piece.count:
                    continue
                local, first = offset + piece.local_offset, seg_start + piece.global_offset
                if layout.per_document:  # a piece of one document: its run as it is
                    held.append(Run(local, piece.count, first, piece.stride, index))
                else:
                    held.extend(_cut_at_documents(local, first, piece.count, piece.stride, bounds))
        offset += n
    return Placement(bounds, world_size, offset, tuple(tuple(r) for r in runs))


@lru_cache(maxsize=4096)
def _split(layout: Layout, length: int, world_size: int):
    """layout.split, memoised: packed batches repeat document lengths."""
    return layout.split(length, world_size)


def _cut_at_documents(local_start, global_start, count, stride, bounds) -> list[Run]:
    """Split a run of consecutive tokens where documents end (stride-1 runs only cross them)."""
    result = []
    while count:
        doc = _doc_of(global_start, bounds)
        last = global_start + (count - 1) * stride
        take = count if last < bounds[doc + 1] else -(-(bounds[doc + 1] - global_start) // stride)
        result.append(Run(local_start, take, global_start, stride, doc))
        local_start, global_start, count = (
            local_start + take,
            global_start + take * stride,
            count - take,
        )
    return result


def _doc_of(token: int, bounds: tuple[int, ...]) -> int:
    """Index of the document holding global token `token` (documents of length 0 hold none)."""
    lo, hi = 0, len(bounds) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bounds[mid] <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _floordiv(a: float, b: int) -> float:
    return a if a in (float("inf"), float("-inf")) else a // b


def _ceildiv(a: float, b: int) -> float:
    return a if a in (float("inf"), float("-inf")) else -(-a // b)


def run_pair_blocks(
    q_run: Run, k_run: Run, causal: bool, window: tuple[int, int] | None
) -> list[Block]:
    """Blocks of query run `q_run` against key run `k_run` (see module docstring)."""
    if q_run.doc != k_run.doc or q_run.stride != k_run.stride:
        return []
    lo_g, hi_g = _global_band(causal, window)
    shift, stride = k_run.global_start - q_run.global_start, q_run.stride
    lo = _ceildiv(lo_g - shift, stride)  # band on local indices: lo <= j - i <= hi
    hi = _floordiv(hi_g - shift, stride)
    if lo > hi:  # the window falls between two keys of this stride
        return []
    m, n = q_run.length, k_run.length
    i0, i1 = int(max(0, -hi)), int(min(m - 1, n - 1 - lo))  # rows that see some key
    j0, j1 = int(max(0, lo)), int(min(n - 1, m - 1 + hi))  # keys that some row sees
    if i0 > i1 or j0 > j1:
        return []
    rows, cols = i1 - i0 + 1, j1 - j0 + 1
    lo, hi = lo - (j0 - i0), hi - (j0 - i0)  # band after trimming
    q0, k0 = q_run.local_start + i0, k_run.local_start + j0
    if lo <= -(rows - 1) and hi >= cols - 1:
        return [Block(q0, q0 + rows, k0, k0 + cols)]
    if hi == 0 and lo <= -(rows - 1):
        # top-left causal; trimming made cols <= rows: a square causal part, then full rows
        blocks = [Block(q0, q0 + cols, k0, k0 + cols, causal=True)]
        if rows > cols:
            blocks.append(Block(q0 + cols, q0 + rows, k0, k0 + cols))
        return blocks
    return [Block(q0, q0 + rows, k0, k0 + cols, band=(int(max(lo, -rows)), int(min(hi, cols))))]


def placement_blocks(
    placement: Placement, rank: int, src: int, causal: bool, window: tuple[int, int] | None
) -> tuple[Block, ...]:
    """Exact blocks of rank `rank`'s queries against rank `src`'s keys: one per piece of every
    document the two ranks share (full, causal or banded). Linear in the documents they hold."""
    key = ("exact", rank, src, causal, window)
    if key not in placement.memo:
        q_runs, k_runs = placement.runs[rank], placement.runs[src]
        k_spans = placement.doc_spans(src)
        blocks: list[Block] = []
        for doc, qs in placement.doc_spans(rank).items():
            ks = k_spans.get(doc)
            if ks is not None and may_meet(qs, ks, causal, window):
                for q_run in q_runs[qs[0] : qs[1]]:
                    for k_run in k_runs[ks[0] : ks[1]]:
                        blocks.extend(run_pair_blocks(q_run, k_run, causal, window))
        placement.memo[key] = tuple(blocks)
    return placement.memo[key]


def may_meet(qs: Span, ks: Span, causal: bool, window: tuple[int, int] | None) -> bool:
    """Whether a document's queries on one rank may see its keys on another (Spans). Exact
    without a window (some key at or before the last query); with one, the global ranges of
    the two within the window (a superset, narrowed by the run-level test)."""
    lo_g, hi_g = _global_band(causal, window)
    return ks[4] <= qs[5] + hi_g and ks[5] >= qs[4] + lo_g


@lru_cache(maxsize=64)
def _global_band(causal: bool, window: tuple[int, int] | None) -> tuple[float, float]:
    """(lo, hi): key g_k visible to query g_q of the same document iff lo <= g_k - g_q <= hi."""
    inf = float("inf")
    lo_g, hi_g = -inf, inf
    if window is not None:
        lo_g = -inf if window[0] < 0 else -window[0]
        hi_g = inf if window[1] < 0 else window[1]
    return lo_g, (min(hi_g, 0) if causal else hi_g)


def meeting_pairs(
    placement: Placement, causal: bool, window: tuple[int, int] | None
) -> frozenset[tuple[int, int]]:
    """(rank, src) pairs of ranks whose blocks are not empty: how far the ring must go.

    Computed once per placement from the documents' Spans: a pair already found is never tested
    again, and the search stops once every pair is found (the usual case without a window), so
    the cost is about linear in the documents. Windows narrow by the run-level test.
    """
    key = ("pairs", causal, window)
    if key in placement.memo:
        return placement.memo[key]
    world_size = placement.world_size
    spans = [placement.doc_spans(r) for r in range(world_size)]
    holders: dict[int, list[int]] = {}
    for rank in range(world_size):
        for doc in spans[rank]:
            holders.setdefault(doc, []).append(rank)
    pairs: set[tuple[int, int]] = set()
    for doc, ranks in holders.items():
        for rank in ranks:
            qs = spans[rank][doc]
            for src in ranks:
                ks = spans[src][doc]
                if (rank, src) in pairs or not may_meet(qs, ks, causal, window):
                    continue
                if window is None or _runs_meet(placement, rank, qs, src, ks, causal, window):
                    pairs.add((rank, src))
        if len(pairs) == world_size * world_size:
            break
    placement.memo[key] = frozenset(pairs)
    return placement.memo[key]


def _runs_meet(placement, rank, qs, src, ks, causal, window) -> bool:
    q_runs = placement.runs[rank][qs[0] : qs[1]]
    k_runs = placement.runs[src][ks[0] : ks[1]]
    return any(run_pair_blocks(a, b, causal, window) for a in q_runs for b in k_runs)


def block_pairs(block: Block) -> int:
    """Visible (query, key) pairs in one block: the attention work it does."""
    rows, cols = block.q_stop - block.q_start, block.kv_stop - block.kv_start
    if block.tiles is not None:
        return block.tiles.visible_pairs()
    if block.causal:
        return rows * (rows + 1) // 2
    if block.band is None:
        return rows * cols
    lo, hi = block.band
    return sum(max(0, min(cols - 1, i + hi) - max(0, i + lo) + 1) for i in range(rows))


def work_per_rank(placement: Placement, causal: bool, window: tuple[int, int] | None) -> list[int]:
    """Visible (query, key) pairs each rank's queries compute, over all sources."""
    world_size = placement.world_size
    return [
        sum(
            block_pairs(block)
            for src in range(world_size)
            for block in placement_blocks(placement, rank, src, causal, window)
        )
        for rank in range(world_size)
    ]
