"""Public API: `attention`, `shard`, `unshard`, `positions`, and the one autograd Function.

    q_local = shard(q, 2, layout="zigzag")                 # (B, Hq, S/W, D) on each rank
    out = attention(q_local, k_local, v_local, causal=True)  # exact attention over all S tokens
    out_full = unshard(out, 2)                              # (B, Hq, S, D), original token order

`attention` validates everything locally, picks the kernel, checks once per call signature that the
ranks agree, and only then communicates. The strategy does the distributed work; the autograd
Function saves the local q, k, v, out and lse and asks the same strategy for the backward.
"""

from __future__ import annotations

import math

import torch

from .comm import GroupInfo, all_gather_cat, resolve_group
from .kernels import select_kernel
from .layout import Layout, get_layout
from .plan import Call
from .ring import RingStrategy
from .validate import call_signature, check_agreement, check_names, check_qkv


class _NotBuilt:
    """A valid strategy name whose implementation has not landed yet."""

    def __init__(self, name: str):
        self.name = name


STRATEGIES: dict[str, object] = {
    "ring": RingStrategy(),
    "allgather": _NotBuilt("allgather"),
    "ulysses": _NotBuilt("ulysses"),
    "hybrid": _NotBuilt("hybrid"),
}


class _Attention(torch.autograd.Function):
    """Context-parallel attention as one autograd node; lse is returned without a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, strategy, call):
        out, lse = strategy.forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.strategy, ctx.call = strategy, call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.strategy.backward(dout, q, k, v, out, lse, ctx.call)
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0, each rank holding the
    tokens that `shard(..., layout=layout)` gives it. Returns out (B, Hq, S_local, D) in q's dtype,
    and with `return_lse=True` also lse (B, Hq, S_local): natural-log log-sum-exp of the scaled
    scores, float32 (float64 for float64 inputs), without gradient. `scale` defaults to 1/sqrt(D).
    `group` is a ProcessGroup, a 1-D DeviceMesh, or None for the default group (a single process
    when torch.distributed is not initialised). `backend` is "auto" or a kernel name.
    """
    layout_obj = get_layout(layout)
    check_names(strategy, STRATEGIES, backend)
    check_qkv(q, k, v, scale)
    info = resolve_group(group)
    layout_obj.check_local_len(q.shape[2])
    _check_device(info, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    strategy_obj = STRATEGIES[strategy]
    if isinstance(strategy_obj, _NotBuilt):
        raise NotImplementedError(
            f"strategy {strategy!r} is not implemented yet; use strategy='ring'"
        )
    kernel = select_kernel(backend, q, k)
    signature = call_signature(q, k, causal, scale, layout_obj, strategy, backend)
    check_agreement(signature, info, q.device)
    call = Call(info, layout_obj, kernel, bool(causal), scale)
    out, lse = _Attention.apply(q, k, v, strategy_obj, call)
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


def _check_dim(x: object, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(
    x: torch.Tensor, dim: int, *, group: object = None, layout: str = "zigzag"
) -> torch.Tensor:
    """This rank's part of the full tensor `x` along `dim` (the sequence dim), in `layout` order.

    Differentiable: the gradient flows back to the matching positions of `x`.
    """
    layout_obj = get_layout(layout)
    dim = _check_dim(x, dim)
    info = resolve_group(group)
    layout_obj.check_seq_len(x.shape[dim], info.world_size)
    index = layout_obj.global_indices(x.shape[dim], info.world_size, info.rank)
    return x.index_select(dim, index.to(x.device))


class _Unshard(torch.autograd.Function):
    """All-gather + inverse permutation; backward takes this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, x_local, dim, info, layout_obj):
        world_size = info.world_size
        seq_len = x_local.shape[dim] * world_size
        gathered = all_gather_cat(x_local, dim, info)  # shards end to end, rank 0 first
        inverse = torch.argsort(layout_obj.permutation(seq_len, world_size)).to(x_local.device)
        ctx.dim, ctx.info, ctx.layout = dim, info, layout_obj
        return gathered.index_select(dim, inverse)

    @staticmethod
    def backward(ctx, grad):
        seq_len = grad.shape[ctx.dim]
        index = ctx.layout.global_indices(seq_len, ctx.info.world_size, ctx.info.rank)
        return grad.index_select(ctx.dim, index.to(grad.device)), None, None, None


def unshard(
    x_local: torch.Tensor, dim: int, *, group: object = None, layout: str = "zigzag"
) -> torch.Tensor:
    """The full tensor, in original token order, from every rank's `x_local` along `dim`.

    Every rank gets the whole tensor. Backward treats the result as replicated: each rank's
    gradient is the rows of its own shard (as for a DTensor going from Replicate to Shard).
    """
    layout_obj = get_layout(layout)
    dim = _check_dim(x_local, dim)
    info = resolve_group(group)
    layout_obj.check_local_len(x_local.shape[dim])
    signature = (
        ("op", "unshard"),
        ("shape", tuple(x_local.shape)),
        ("dtype", str(x_local.dtype)),
        ("dim", dim),
        ("layout", layout_obj.name),
    )
    check_agreement(signature, info, x_local.device)
    return _Unshard.apply(x_local, dim, info, layout_obj)


def positions(
    seq_len: int,
    *,
    group: object = None,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token indices (int64, increasing) that this rank holds: for RoPE and labels."""
    layout_obj = get_layout(layout)
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    info = resolve_group(group)
    layout_obj.check_seq_len(seq_len, info.world_size)
    return layout_obj.global_indices(seq_len, info.world_size, info.rank).to(device)


__all__ = ["STRATEGIES", "Layout", "attention", "positions", "shard", "unshard"]
