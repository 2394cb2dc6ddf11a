"""Public API: `attention`, `shard`, `unshard`, `positions`, and the one autograd Function.

    q_local = shard(q, 2, layout="zigzag")                 # (B, Hq, S/W, D) on each rank
    out = attention(q_local, k_local, v_local, causal=True)  # exact attention over all S tokens
    out_full = unshard(out, 2)                              # (B, Hq, S, D), original token order

`attention` validates everything locally, picks the kernel, checks once per call signature that the
ranks agree, and only then communicates. The strategy does the distributed work; the autograd
Function saves the local q, k, v, out and lse (or what the strategy returns in their place) and
asks the same strategy for the backward.
"""

from __future__ import annotations

import math

import torch

from ringattn.comm import GroupInfo, resolve_group
from ringattn.kernels import select_kernel
from ringattn.layout import get_layout
from ringattn.packing import check_window
from ringattn.plan import Call
from ringattn.sharding import local_placement, positions, shard, unshard
from ringattn.strategies import STRATEGIES, Strategy
from ringattn.validate import call_signature, check_agreement, check_names, check_qkv


class _Attention(torch.autograd.Function):
    """Context-parallel attention as one autograd node; lse is returned without a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, strategy: Strategy, call: Call):
        result = strategy.forward(q, k, v, call)
        # what the strategy's backward needs (Ulysses: the head-sharded tensors)
        ctx.save_for_backward(*result.saved)
        ctx.strategy, ctx.call = strategy, call
        ctx.mark_non_differentiable(result.lse)
        return result.out, result.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv = ctx.strategy.backward(dout, tuple(ctx.saved_tensors), ctx.call)
        return dq, dk, dv, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    group: object = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    backend: str = "auto",
    return_lse: bool = False,
    cu_seqlens: object = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0, each rank holding the
    tokens that `shard(..., layout=layout)` gives it. Returns out (B, Hq, S_local, D) in q's dtype,
    and with `return_lse=True` also lse (B, Hq, S_local): natural-log log-sum-exp of the scaled
    scores, float32 (float64 for float64 inputs), without gradient. `scale` defaults to 1/sqrt(D).
    `group` is a ProcessGroup, a 1-D DeviceMesh, or None for the default group (a single process
    when torch.distributed is not initialised); strategy="hybrid" takes a 2-D DeviceMesh with dims
    "ulysses" and "ring". `backend` is "auto" or a kernel name.

    `cu_seqlens` ([0, e1, ..., S], the same on every rank) packs documents along the sequence
    (B = 1): attention is block-diagonal by document, causal inside each when `causal`. Any
    lengths work; local tensors come from `shard(..., cu_seqlens=...)` and include padding rows,
    whose out and lse are 0. `window = (left, right)` limits each query to keys at most `left`
    before and `right` after it (-1: unbounded), as flash-attn's `window_size`.
    """
    layout_obj = get_layout(layout)
    check_names(strategy, STRATEGIES, backend)
    check_qkv(q, k, v, scale)
    window = check_window(window)
    info = resolve_group(group, allow_2d=strategy == "hybrid")
    placement = None
    if cu_seqlens is not None or window is not None:
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens packs documents along the sequence of a single batch row, but q has "
                f"batch size {q.shape[0]}; concatenate the batch along the sequence"
            )
        placement = local_placement(layout_obj, info, q.shape[2], cu_seqlens)
    else:
        layout_obj.check_local_len(q.shape[2])
    _check_device(info, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    strategy_obj = STRATEGIES[strategy]
    strategy_obj.check(q, k, info)
    kernel = select_kernel(backend, q, k)
    signature = call_signature(q, k, causal, scale, layout_obj, strategy, backend)
    bounds = None if placement is None else placement.bounds
    signature += (("window", window), ("cu_seqlens", bounds))
    check_agreement(signature, info, q.device)
    call = Call(info, layout_obj, kernel, bool(causal), scale, placement, window)
    out, lse = _Attention.apply(q, k, v, strategy_obj, call)
    if placement is not None and placement.has_padding:
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # padding rows see no key
    return (out, lse) if return_lse else out


def _check_device(info: GroupInfo, q: torch.Tensor) -> None:
    if info.group is None or info.world_size == 1:
        return
    import torch.distributed as dist

    backend = str(dist.get_backend(info.group)).lower()
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(
            f"the process group uses NCCL, which needs CUDA tensors, but q is on {q.device}; "
            f"move the tensors to the GPU or use a gloo group"
        )


__all__ = ["STRATEGIES", "attention", "positions", "shard", "unshard"]
