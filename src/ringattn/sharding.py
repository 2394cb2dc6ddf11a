"""`shard`, `unshard` and `positions`: moving between the full sequence and each rank's part.

All three agree with `attention` for the same `group`, `layout` and `cu_seqlens`:
`unshard(attention(shard(q), shard(k), shard(v)))` is single-device attention on q, k, v.

Dense sequences must split evenly (S divisible by W, or 2W for zigzag). Packed sequences
(`cu_seqlens`) may have any length: each rank's part is padded (zeros in `shard`, index -1 in
`positions`) and `unshard` drops the padding and returns exactly S tokens in the original order.
A dense sequence of any length is the packed sequence `cu_seqlens=[0, S]`.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, all_gather_cat, resolve_group
from ringattn.layout import Layout, get_layout
from ringattn.packing import Placement, check_cu_seqlens, place
from ringattn.validate import validated


def resolve_placement(
    layout: Layout, info: GroupInfo, seq_len: int, cu_seqlens: object
) -> Placement:
    """The placement for a global length (dense: must split evenly) or for `cu_seqlens`."""
    if cu_seqlens is None:
        layout.check_seq_len(seq_len, info.world_size)
        return place(layout, info.world_size, (0, seq_len))
    bounds = check_cu_seqlens(cu_seqlens)
    if seq_len != bounds[-1]:
        raise ValueError(
            f"the sequence has {seq_len} tokens but cu_seqlens ends at {bounds[-1]}; "
            f"cu_seqlens[-1] must be the total length"
        )
    return place(layout, info.world_size, bounds)


def local_placement(
    layout: Layout, info: GroupInfo, local_len: int, cu_seqlens: object
) -> Placement:
    """The placement given a rank's local length; checks that the length matches it."""
    if cu_seqlens is None:
        layout.check_local_len(local_len)
        return place(layout, info.world_size, (0, local_len * info.world_size))
    placement = place(layout, info.world_size, check_cu_seqlens(cu_seqlens))
    if local_len != placement.local_len:
        raise ValueError(
            f"the local tensor has {local_len} tokens, but cu_seqlens (total "
            f"{placement.seq_len}) with the {layout.name} layout on {info.world_size} ranks gives "
            f"{placement.local_len} per rank, padding included; make it with "
            f"ringattn.shard(x, dim, cu_seqlens=...)"
        )
    return placement


def _check_dim(x: object, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _gather_rows(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(dim, index) where index -1 gives a row of zeros (differentiable)."""
    if bool((index >= 0).all()):
        return x.index_select(dim, index.to(x.device))
    zero_row = torch.zeros_like(x.narrow(dim, 0, 1))
    padded = torch.cat([x, zero_row], dim=dim)
    index = torch.where(index >= 0, index, x.shape[dim])
    return padded.index_select(dim, index.to(x.device))


def shard(
    x: torch.Tensor,
    dim: int,
    *,
    group: object = None,
    layout: str = "zigzag",
    cu_seqlens: object = None,
) -> torch.Tensor:
    """This rank's part of the full tensor `x` along `dim` (the sequence dim), in layout order.

    With `cu_seqlens`, padding rows are zeros. Differentiable: the gradient flows back to the
    matching positions of `x`.
    """
    layout_obj = get_layout(layout)
    dim = _check_dim(x, dim)
    info = resolve_group(group, allow_2d=True)
    placement = resolve_placement(layout_obj, info, x.shape[dim], cu_seqlens)
    return _gather_rows(x, dim, placement.global_indices(info.rank))


class _Unshard(torch.autograd.Function):
    """All-gather + reorder; backward takes this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x_local, dim, info, placement):
        gathered = all_gather_cat(x_local, dim, info)  # shards end to end, rank 0 first
        held = torch.cat([placement.global_indices(r) for r in range(info.world_size)])
        rows = torch.nonzero(held >= 0).flatten()
        order = torch.empty(placement.seq_len, dtype=torch.int64, device=held.device)
        order[held[rows]] = rows  # global token t sits at row order[t] of `gathered`
        ctx.dim, ctx.info, ctx.placement = dim, info, placement
        return gathered.index_select(dim, order.to(x_local.device))

    @staticmethod
    def backward(ctx, grad):
        index = ctx.placement.global_indices(ctx.info.rank)
        return _gather_rows(grad, ctx.dim, index), None, None, None


def unshard(
    x_local: torch.Tensor,
    dim: int,
    *,
    group: object = None,
    layout: str = "zigzag",
    cu_seqlens: object = None,
) -> torch.Tensor:
    """The full tensor, in original token order, from every rank's `x_local` along `dim`.

    Every rank gets the whole tensor (exactly S tokens; padding dropped). Backward treats the
    result as replicated: each rank's gradient is the rows of its own part (as for a DTensor going
    from Replicate to Shard).
    """
    info = resolve_group(group, allow_2d=True)

    def build() -> tuple[tuple[int, Placement], tuple]:
        layout_obj = get_layout(layout)
        checked_dim = _check_dim(x_local, dim)
        placement = local_placement(layout_obj, info, x_local.shape[checked_dim], cu_seqlens)
        signature = (
            ("op", "unshard"),
            ("shape", tuple(x_local.shape)),
            ("dtype", str(x_local.dtype)),
            ("dim", checked_dim),
            ("layout", layout_obj.name),
            ("cu_seqlens", placement.bounds),
        )
        return (checked_dim, placement), signature

    device = x_local.device if isinstance(x_local, torch.Tensor) else None
    checked_dim, placement = validated(info, device, build)
    return _Unshard.apply(x_local, checked_dim, info, placement)


def positions(
    seq_len: int,
    *,
    group: object = None,
    layout: str = "zigzag",
    cu_seqlens: object = None,
    within_document: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token index (int64) of each local row: for RoPE and labels. Padding rows get -1.

    `within_document=True` counts from each document's first token instead (RoPE positions that
    restart per packed document).
    """
    layout_obj = get_layout(layout)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    info = resolve_group(group, allow_2d=True)
    placement = resolve_placement(layout_obj, info, seq_len, cu_seqlens)
    index = placement.global_indices(info.rank)
    if within_document:
        bounds = placement.bounds
        starts = torch.zeros(placement.local_len, dtype=torch.int64, device=index.device)
        for run in placement.runs[info.rank]:
            starts[run.local_start : run.local_start + run.length] = bounds[run.doc]
        index = torch.where(index >= 0, index - starts, index)
    return index.to(device)
