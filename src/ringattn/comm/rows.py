"""Rows of variable counts to every rank and back, differentiable: the expert-parallel dispatch.

    recv_counts = exchange_counts(send_counts, info)        # (W,) ints: one all_to_all_single
    rows, ids = exchange_rows([x, ids], send, recv, info)   # rank d gets x[rows for d] of all

Expert parallelism must not drop tokens to stay exact, so the number of rows a rank sends to each
rank is whatever its router chose. The counts travel first (an all-to-all of W ints per rank:
a host sync, the price of exact variable routing), then the rows, packed by `all_to_all` into
one `all_to_all_single` whatever their dtypes. Rows for rank d are the d-th block of `send`
consecutive rows; what arrives is concatenated by source rank:

    rank 0 sends [a0 a0 | b0]     rank 1 sends [a1 | b1 b1 b1]      (| = the send_counts split)
    rank 0 gets  [a0 a0 | a1]     rank 1 gets  [b0 | b1 b1 b1]

Backward is the same exchange with the counts swapped: each gradient row goes back to the rank
its row came from. Integer tensors (expert ids) travel along and get no gradient. `anchor`, a
tensor that requires grad, keeps the node in the autograd graph on a rank whose rows do not
(a rank that received no rows has no expert output to differentiate): every rank must take part
in the backward exchange, or the others wait for it forever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringattn.comm.collectives import all_to_all
from ringattn.comm.groups import GroupInfo, backend_device, single_group

__all__ = ["exchange_counts", "exchange_rows"]


def exchange_counts(counts: list[int], info: GroupInfo) -> list[int]:
    """`counts[d]`: rows this rank sends to rank d -> the rows it receives from each rank."""
    if info.world_size == 1:
        return list(counts)
    single_group(info, "exchange_counts")
    device = backend_device(info, torch.device("cpu"))
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=info.group)
    return [int(n) for n in recv.tolist()]


def _exchange(
    tensors: list[torch.Tensor], send: list[int], recv: list[int], info: GroupInfo
) -> list[torch.Tensor]:
    offsets = [0]
    for n in send:
        offsets.append(offsets[-1] + n)
    sends = [[t[offsets[d] : offsets[d + 1]] for t in tensors] for d in range(len(send))]
    specs = [[((n, *t.shape[1:]), t.dtype) for t in tensors] for n in recv]
    received = all_to_all(sends, specs, info)
    return [torch.cat([parts[i] for parts in received]) for i in range(len(tensors))]


class _ExchangeRows(torch.autograd.Function):
    """exchange_rows' autograd: forward sends rows by `send`, backward their gradients by `recv`."""

    @staticmethod
    def forward(ctx, send, recv, info, anchor, *tensors):
        ctx.send, ctx.recv, ctx.info, ctx.device = send, recv, info, tensors[0].device
        ctx.shapes = [(t.shape[1:], t.dtype, t.is_floating_point()) for t in tensors]
        ctx.anchor_shape = None if anchor is None else (anchor.shape, anchor.dtype)
        out = _exchange(list(tensors), send, recv, info)
        ctx.mark_non_differentiable(*[o for o in out if not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        rows, floating = sum(ctx.recv), []
        for grad, (shape, dtype, is_float) in zip(grads, ctx.shapes):
            if is_float and grad is None:  # an output the loss did not use
                grad = torch.zeros(rows, *shape, dtype=dtype, device=ctx.device)
            if is_float:
                floating.append(grad)
        back = iter(_exchange(floating, ctx.recv, ctx.send, ctx.info) if floating else [])
        anchor = None
        if ctx.anchor_shape is not None:
            shape, dtype = ctx.anchor_shape
            anchor = torch.zeros(shape, dtype=dtype, device=ctx.device)
        out = [next(back) if is_float else None for _, _, is_float in ctx.shapes]
        return (None, None, None, anchor, *out)


def exchange_rows(
    tensors: list[torch.Tensor],
    send: list[int],
    recv: list[int],
    info: GroupInfo,
    *,
    anchor: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Rows `send[d]` at a time of every tensor in `tensors` (same row count) to rank d; returns
    the rows received (`recv[s]` from rank s, in rank order) of each. Differentiable in the
    floating tensors; `anchor` (optional) only ties this exchange into the autograd graph."""
    if len(send) != info.world_size or len(recv) != info.world_size:
        raise ValueError(
            f"exchange_rows: {len(send)} send and {len(recv)} receive counts for a group of "
            f"{info.world_size} ranks; pass one count per rank"
        )
    return list(_ExchangeRows.apply(send, recv, info, anchor, *tensors))
