"""Attention over segments of the local rows: each its own packed documents and process group.

Dynamic context parallelism (train/dynamic/) gives one rank several pieces of a step's documents
at once: a piece of short documents that it computes alone, and its share of longer documents
sharded over sub-groups of 2, 4, ... ranks. The rank's local rows are these pieces end to end:

    local rows   | piece on group of 4 | piece on group of 2 | piece alone (group of 1) |
    Segment      (0, 96, G4, cu4)      (96, 160, G2, cu2)    (160, 230, G1, cu1)

Every layer but attention works token by token, so only attention needs to know this: for each
segment it calls `ringattn.attention` on the segment's rows with the segment's group and
`cu_seqlens` (the piece's documents, block-diagonal and causal), and the outputs are put end to
end again. One segment over the whole cp group is static CP over packed documents.

Collectives never hang on it: the segments of every rank come in the same global order (the
scheduler's: largest group first), the groups of one size are disjoint, and the members of a
group all hold its segment, of the same length (padding included), or all skip it when the step
placed no document there. Backward runs the segments' attention in reverse creation order on
every rank (autograd executes the ready node with the highest sequence number first), again one
global order.

`rank_pieces` builds one rank's rows and Segments from a step's schedule; the decoder's loader
(train/dynamic/loader.py), `train --hf` and the Trainer integration all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple, Protocol

import torch
from torch import nn

from ringattn import attention
from ringattn.layout import get_layout
from ringattn.packing import place
from ringattn.runtime.subgroups import SubGroups, sizes_of

__all__ = ["Placement", "Segment", "attend_segments", "rank_pieces", "set_segments"]


class Segment(NamedTuple):
    """Local rows [start, stop) hold this rank's share of packed documents `cu_seqlens` that are
    sharded over `group` (a process group; None: one process)."""

    start: int
    stop: int
    group: object
    cu_seqlens: tuple[int, ...]


def attend_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[Segment],
    layout: str,
    strategy: str,
) -> torch.Tensor:
    """Causal attention of q (B, Hq, S, D), k, v (B, Hkv, S, D) segment by segment (B = 1);
    rows outside every segment get 0. Returns (B, Hq, S, D)."""
    outs, at = [], 0
    for seg in segments:
        if seg.start > at:  # rows in no segment: none today, but never attended
            outs.append(q.new_zeros(*q.shape[:2], seg.start - at, q.shape[3]))
        part = slice(seg.start, seg.stop)
        q_, k_, v_ = q[:, :, part], k[:, :, part], v[:, :, part]  # (B, H, stop - start, D)
        out = attention(q_, k_, v_, causal=True, group=seg.group, layout=layout,
                        strategy=strategy, cu_seqlens=list(seg.cu_seqlens))  # fmt: skip
        outs.append(out)  # (B, Hq, stop - start, D)
        at = seg.stop
    if at < q.shape[2]:
        outs.append(q.new_zeros(*q.shape[:2], q.shape[2] - at, q.shape[3]))
    return torch.cat(outs, dim=2)  # (B, Hq, S, D)


def set_segments(model: nn.Module, segments: list[Segment] | None) -> None:
    """Every attention layer of `model` attends by `segments` from the next forward on (None:
    over its context-parallel group, the whole local sequence as one)."""
    for module in model.modules():
        if hasattr(module, "segments"):
            module.segments = segments


class Placement(Protocol):
    """What `rank_pieces` reads of a schedule (planner/dynamic_cp/schedule.Schedule)."""

    cp: int

    def documents(self, row: int, size: int, block: int) -> list[int]: ...


def rank_pieces(
    columns: Sequence[list[torch.Tensor]],
    fills: Sequence[int],
    plan: Placement,
    dp_rank: int,
    groups: SubGroups,
    layout: str,
) -> tuple[list[torch.Tensor], list[Segment]]:
    """This rank's rows of a step's documents under `plan`, and their Segments.

    `columns[c][i]` is document i's column c (tokens, labels, positions: 1-D, one length per
    document), `fills[c]` what a padding row holds there. For g = cp, cp/2, ..., 1 the documents
    on this rank's group of size g are packed (cu_seqlens), placed with `layout` over the g ranks
    (packing.place) and this rank keeps its rows (-1 in the placement: padding, filled): one
    piece; the pieces end to end, one (local_len,) tensor per column. A rank given no document
    gets a one-token document of `fills`, alone: it still runs the step's forward and backward
    through every parameter (train/dynamic/loader.py says why that matters)."""
    pieces = [(g, plan.documents(dp_rank, g, groups.block(g))) for g in sizes_of(plan.cp)]
    pieces = [(g, docs) for g, docs in pieces if docs]  # a group's members all skip it
    columns = [list(col) for col in columns]
    if not pieces:
        for col, fill in zip(columns, fills):
            like = col[0] if col else torch.empty(0, dtype=torch.int64, device="cpu")
            col.append(torch.full((1,), fill, dtype=like.dtype, device=like.device))
        pieces = [(1, [len(columns[0]) - 1])]
    parts: list[list[torch.Tensor]] = [[] for _ in columns]
    segments, at = [], 0
    for g, docs in pieces:
        bounds = (0, *accumulate(len(columns[0][i]) for i in docs))
        index = place(get_layout(layout), g, bounds).global_indices(groups.rank_in(g))
        real, take = index >= 0, index.clamp(min=0)  # (local_len,): -1 on padding rows
        for part, col, fill in zip(parts, columns, fills):
            whole = torch.cat([col[i] for i in docs])
            real_, take_ = real.to(whole.device), take.to(whole.device)
            part.append(torch.where(real_, whole[take_], fill))  # on the documents' device
        segments.append(Segment(at, at + len(index), groups.group(g), bounds))
        at += len(index)
    return [torch.cat(part) for part in parts], segments
