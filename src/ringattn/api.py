"""Public API: `attention`, `shard`, `unshard`, `positions`, and the one autograd Function.

    q_local = shard(q, 2, layout="zigzag")                 # (B, Hq, S/W, D) on each rank
    out = attention(q_local, k_local, v_local, causal=True)  # exact attention over all S tokens
    out_full = unshard(out, 2)                              # (B, Hq, S, D), original token order

`attention` validates everything locally, picks the kernel, checks once per call signature that the
ranks agree, and only then communicates. The strategy does the distributed work; the autograd
Function saves the local q, k, v, out and lse (or what the strategy returns in their place) and
asks the same strategy for the backward.

Under `torch.compile` the same call becomes one node of the graph: the custom ops of ops.py,
which run these checks, the agreement and the strategy at run time (no graph break).
"""

from __future__ import annotations

import torch

from ringattn.comm import resolve_group
from ringattn.inflight import running, start_call
from ringattn.ops import compiled_attention
from ringattn.plan import Call
from ringattn.resolve import build_call
from ringattn.sharding import positions, shard, unshard
from ringattn.strategies import STRATEGIES, Strategy
from ringattn.validate import validated


class _Attention(torch.autograd.Function):
    """Context-parallel attention as one autograd node; lse is returned without a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, strategy: Strategy, call: Call):
        with running(call.info, "forward", call.signature):
            result = strategy.forward(q, k, v, call)
        # what the strategy's backward needs (Ulysses: the head-sharded tensors)
        ctx.save_for_backward(*result.saved)
        ctx.strategy, ctx.call = strategy, call
        ctx.mark_non_differentiable(result.lse)
        return result.out, result.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        with running(ctx.call.info, "backward", ctx.call.signature):
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
    softcap: float | None = None,
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
    `softcap = c` (> 0) caps every scaled score s to c * tanh(s / c) before the softmax (Gemma 2's
    attention logit softcapping); the capped scores merge exactly, and lse is theirs. It runs the
    softcap kernel (kernels/softcap.py, plain PyTorch): `backend` must be "auto" or "reference".

    Works under `torch.compile(fullgraph=True)`: the call traces to `ringattn::attention_forward`
    (ops.py); keep `cu_seqlens` a CPU tensor (as `shard(..., cu_seqlens=...)` takes it) so a new
    document layout is new data for the same graph.
    """
    if torch.compiler.is_compiling():  # one custom op node per call (ops.py)
        out, lse = compiled_attention(
            q, k, v, causal=causal, scale=scale, group=group, layout=layout, strategy=strategy,
            backend=backend, cu_seqlens=cu_seqlens, window=window, softcap=softcap,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    # a 2-D mesh resolves for every strategy, so the agreement can run over it even when one
    # rank names another strategy; that rank's check then fails (below), not its collective
    info = resolve_group(group, allow_2d=True)
    device = q.device if isinstance(q, torch.Tensor) else None

    def build() -> tuple[Call, tuple]:
        return build_call(
            q, k, v, info, causal=causal, scale=scale, layout=layout, strategy=strategy,
            backend=backend, cu_seqlens=cu_seqlens, window=window, softcap=softcap,
        )  # fmt: skip

    call = validated(info, device, build, start_call(info))
    out, lse = _Attention.apply(q, k, v, STRATEGIES[strategy], call)
    if call.placement is not None and call.placement.has_padding:
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # padding rows see no key
    return (out, lse) if return_lse else out


__all__ = ["STRATEGIES", "attention", "positions", "shard", "unshard"]
