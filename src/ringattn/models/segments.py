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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ringattn import attention

__all__ = ["Segment", "attend_segments", "set_segments"]


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
