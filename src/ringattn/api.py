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

from ringattn.comm import GroupInfo, MeshInfo, resolve_group
from ringattn.kernels import select_kernel
from ringattn.layout import get_layout
from ringattn.packing import check_window
from ringattn.plan import Call
from ringattn.sharding import local_placement, positions, shard, unshard
from ringattn.strategies import STRATEGIES, Strategy
from ringattn.validate import call_signature, check_names, check_qkv, validated


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
    # a 2-D mesh resolves for every strategy, so the agreement can run over it even when one
    # rank names another strategy; that rank's check then fails (below), not its collective
    info = resolve_group(group, allow_2d=True)
    device = q.device if isinstance(q, torch.Tensor) else None

    def build() -> tuple[Call, tuple]:
        layout_obj = get_layout(layout)
        check_names(strategy, STRATEGIES, backend)
        check_qkv(q, k, v, scale)
        checked_window = check_window(window)
        _check_group(info, strategy)
        placement = None
        if cu_seqlens is not None or checked_window is not None:
            if cu_seqlens is not None and q.shape[0] != 1:
                raise ValueError(
                    f"cu_seqlens packs documents along the sequence of a single batch row, but q "
                    f"has batch size {q.shape[0]}; concatenate the batch along the sequence"
                )
            placement = local_placement(layout_obj, info, q.shape[2], cu_seqlens)
        else:
            layout_obj.check_local_len(q.shape[2])
        _check_device(info, q)
        resolved_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        STRATEGIES[strategy].check(q, k, info)
        kernel = select_kernel(backend, q, k)
        signature = call_signature(q, k, causal, resolved_scale, layout_obj, strategy, backend)
        bounds = None if placement is None else placement.bounds
        # the kernel `auto` picked: a probe that differs between ranks must not split them
        signature += (("window", checked_window), ("cu_seqlens", bounds), ("kernel", kernel.name))
        call = Call(
            info, layout_obj, kernel, bool(causal), resolved_scale, placement, checked_window
        )
        return call, signature

    call = validated(info, device, build)
    out, lse = _Attention.apply(q, k, v, STRATEGIES[strategy], call)
    if call.placement is not None and call.placement.has_padding:
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # padding rows see no key
    return (out, lse) if return_lse else out


def _check_group(info: GroupInfo, strategy: str) -> None:
    if isinstance(info, MeshInfo) and strategy != "hybrid":
        raise ValueError(
            f"strategy={strategy!r} needs a 1-D process group, got a 2-D DeviceMesh "
            f"({info.ring.world_size} x {info.ulysses.world_size}, dims 'ring' and 'ulysses'); "
            f"pass mesh[dim_name] or use strategy='hybrid'"
        )


def _check_device(info: GroupInfo, q: torch.Tensor) -> None:
    if info.group is None or info.world_size == 1:
        return
    import torch.distributed as dist

    backend = str(dist.get_backend(info.group)).lower()
    if backend != "nccl":
        return
    if q.device.type != "cuda":
        raise ValueError(
            f"the process group uses NCCL, which needs CUDA tensors, but q is on {q.device}; "
            f"move the tensors to the GPU or use a gloo group"
        )
    current = torch.cuda.current_device()
    if q.device.index is not None and q.device.index != current:
        raise ValueError(
            f"q is on {q.device} but this rank's current CUDA device is cuda:{current}; NCCL "
            f"would use the wrong GPU. Call torch.cuda.set_device(local_rank) once at start-up "
            f"(before init_process_group), with the tensors on that device"
        )


__all__ = ["STRATEGIES", "attention", "positions", "shard", "unshard"]
