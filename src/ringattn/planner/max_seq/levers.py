"""What the memory levers cost in time, and the plans they cannot run with (cost.py's step_time
and search.py's check_plan call these; no planner imports here, so no cycle: `spec` is a
cost.PlanSpec).

    tiled MLP      each tile's MLP forward once more in backward (its intermediates were not
                   kept): 2 x 3 x dim x intermediate flops per token per layer
    offload        a layer's checkpoint (S/W x dim x bytes) to the host in forward and back in
                   backward on a side stream: exposed only where the copy outlasts that layer's
                   forward (backward) compute, at the host link's rate
"""

from __future__ import annotations

__all__ = ["check_levers", "lever_seconds"]


def lever_seconds(spec: object, tokens: int, fwd: float, bwd: float, threads: int,
                  slow: float) -> tuple[float, float]:  # fmt: skip
    """(one layer's backward seconds with the tiled MLP's recompute, the offload's exposed seconds
    per layer), for `tokens` rows per rank and one layer's forward and backward seconds."""
    m, hw = spec.model, spec.hw
    extra = offload = 0.0
    if spec.tiled_mlp and tokens > spec.tiled_mlp:
        mlp = m.top_k * (m.expert_hidden or m.hidden_dim) if m.experts else m.hidden_dim
        flops = 6 * tokens * m.dim * mlp / spec.tp
        extra = hw.matmul_s(flops, spec.tiled_mlp, m.dim, spec.dtype, threads) * slow
    if spec.offload_activations and spec.activation_checkpointing and not hw.is_cpu:
        copy = tokens * m.dim / spec.tp * spec.elem_bytes / (hw.host_link_gbs * 1e9)
        offload = max(0.0, copy - fwd) + max(0.0, copy - bwd - extra)
    return bwd + extra, offload


def check_levers(spec: object) -> None:
    """ValueError for a lever the trainer refuses with this plan's degrees (`spec`: a
    cost.PlanSpec, which imports this module)."""
    if spec.tiled_mlp and spec.tp > 1:
        raise ValueError(f"--tiled-mlp runs with tp 1 (the trainer refuses it with --tp); got "
                         f"tp={spec.tp}")  # fmt: skip
    if spec.offload_activations and spec.pp > 1:
        raise ValueError(f"--offload-activations runs with pp 1; got pp={spec.pp}")
