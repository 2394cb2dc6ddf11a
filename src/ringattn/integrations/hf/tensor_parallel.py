"""Tensor parallelism for transformers models at inference: the model's own tp plan, applied with
`torch.distributed.tensor.parallel` over the tp dim of a (cp, tp) DeviceMesh.

transformers declares each architecture's plan in `config.base_model_tp_plan`, e.g. Llama's

    layers.*.self_attn.q_proj / k_proj / v_proj   "colwise"   this rank's heads (Hq / T, Hkv / T)
    layers.*.self_attn.o_proj                      "rowwise"   partial sums -> all-reduce over tp
    layers.*.mlp.gate_proj / up_proj               "colwise"   intermediate / T columns
    layers.*.mlp.down_proj                         "rowwise"   -> all-reduce over tp
    layers.*.self_attn.q_norm / k_norm             replicated  (per-head norms: any heads)

"colwise" becomes ColwiseParallel(), "rowwise" RowwiseParallel() (outputs are plain local
tensors: the attention code reshapes with -1 heads, so it sees Hq / T and Hkv / T heads and the
ringattn-kv attention runs unchanged over the cp group). Embeddings, norms and the LM head stay
replicated, so every tp rank ends each forward with the same logits.

Memory per rank, N = cp x tp ranks, a sequence of S tokens, L layers, head dim D, e bytes:

    weights    (attention + MLP) / tp  + embeddings, norms, LM head (replicated)
    KV cache   L * 2 * (S / cp) * (Hkv / tp) * D * e      (cp x tp shards of one cache)

A plan entry of another kind (MoE experts, packed projections) raises ValueError naming it.
"""

from __future__ import annotations

import torch

from ringattn.comm import group_cache

__all__ = ["check_tensor_parallel", "split_cp_tp", "tensor_parallel"]

_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def check_tensor_parallel(config, tp: int) -> None:
    """ValueError (values and fix) when the model cannot be split over `tp` ranks."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if tp == 1:
        return
    text = config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None)
    name = type(text).__name__
    if not plan:
        raise ValueError(f"{name} declares no tensor-parallel plan (base_model_tp_plan); run it "
                         f"with --tp 1")  # fmt: skip
    other = sorted({style for style in plan.values() if style not in _STYLES})
    if other:
        raise ValueError(f"{name}'s tp plan uses {other}, which ringattn's TP inference does "
                         f"not apply (only {list(_STYLES)}); run it with --tp 1")  # fmt: skip
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    for what, count in (("num_attention_heads", text.num_attention_heads),
                        ("num_key_value_heads", kv),
                        ("intermediate_size", getattr(text, "intermediate_size", tp))):  # fmt: skip
        if count % tp:
            raise ValueError(f"{name}.{what} = {count} does not split over --tp {tp}; pick a tp "
                             f"that divides it")  # fmt: skip


def tensor_parallel(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Split `model`'s base model in place over the 1-D DeviceMesh `tp_mesh` (module doc)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tensor_parallel(model.config, tp_mesh.size())
    plan = model.config.get_text_config().base_model_tp_plan
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    torch_plan = {fqn: styles[style]() for fqn, style in plan.items() if style in styles}
    parallelize_module(model.base_model, tp_mesh, torch_plan)
    return model


def split_cp_tp(model: torch.nn.Module, tp: int, world_size: int, device: torch.device) -> tuple:
    """(cp group, tp group) after splitting `model` by its own tp plan over a (world / tp, tp)
    mesh with dims ("cp", "tp"); (None, None) for tp 1 (the default group is the cp group).

    Call it with the model still on the CPU: distribute_tensor moves each planned weight to the
    mesh's device and keeps this rank's shard, one weight at a time, so no GPU ever holds the
    whole model; `model.to(device)` afterwards moves the replicated rest. (Host memory still
    holds the whole model per rank while loading.)"""
    if tp == 1:
        return None, None
    mesh = group_cache.device_mesh(device.type, (world_size // tp, tp), ("cp", "tp"))
    tensor_parallel(model, mesh["tp"])
    return mesh["cp"].get_group(), mesh["tp"].get_group()
