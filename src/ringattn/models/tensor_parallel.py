"""Tensor parallelism (Megatron-style, with sequence parallelism) for models/decoder.py's decoder,
from outside with `torch.distributed.tensor.parallel`: the model's code stays single-device.

One block on a tp group of T ranks, the tokens (B, S) of this cp rank, h = heads / T:

    x (B, S/T, dim), split by sequence over tp
      attention_norm  SequenceParallel         norm of the local S/T tokens, weight replicated
      -> all-gather over tp -> (B, S, dim)     PrepareModuleInput: Shard(1) -> Replicate
      wq, wk, wv      ColwiseParallel          the local heads: q (B, S, h*D), k, v (B, S, hkv*D)
      attention       ringattn.attention       local heads over the CP group (view(b, s, -1, D))
      wo              RowwiseParallel          partial sums -> reduce-scatter -> (B, S/T, dim)
    x + ...           (B, S/T, dim)
      ffn_norm        SequenceParallel
      -> all-gather; w1, w3 ColwiseParallel (hidden/T columns); w2 RowwiseParallel -> (B, S/T, dim)

Outside the blocks: the embedding is RowwiseParallel (vocab rows over tp; its output
reduce-scattered to the sequence split), the final norm is SequenceParallel and so is the output
projection (weight replicated, each rank projects its own S/T tokens), and a forward pre-hook on
the model keeps each rank's share of the labels: every token's loss is then computed once, on one
tp rank, and the trainer's sums over the world stay the global sums. Gradients of replicated weights
(norms, output) are summed over tp by DTensor; FSDP2 sums everything over dp x cp.

The vocabulary is not split for the loss (torchtitan's loss_parallel): the output projection is
replicated, which for the byte vocabulary of these models is cheaper than gathering logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ringattn.models.config import ModelConfig
from ringattn.models.decoder import Transformer

__all__ = ["apply_tensor_parallel", "check_tensor_parallel"]


def check_tensor_parallel(mcfg: ModelConfig, tp: int, tokens_per_cp_rank: int) -> None:
    """ValueError (values and fix) when the model or the sequence does not split over tp ranks."""
    if tp == 1:
        return
    for what, n in (("--heads", mcfg.n_heads), ("--kv-heads", mcfg.n_kv_heads),
                    ("the MLP hidden size", mcfg.hidden_dim),
                    ("the vocabulary", mcfg.vocab_size)):  # fmt: skip
        if n % tp:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"{what} ({n}) is not divisible by --tp {tp}: tensor parallelism splits it over "
                f"the tp ranks; pick --tp among {divisors} or change the model"
            )
    if tokens_per_cp_rank % tp:
        raise ValueError(
            f"{tokens_per_cp_rank} tokens per cp rank are not divisible by --tp {tp} (sequence "
            f"parallelism splits them over the tp ranks); pick --seq-len a multiple of cp x {tp}"
        )


def _plan(block_prefix: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    p = block_prefix
    # attention(x, cos, sin) and feed_forward(x): gather x over tp, leave the angles alone
    gather_x = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                  desired_input_layouts=(Replicate(), None, None))  # fmt: skip
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        f"{p}attention_norm": SequenceParallel(),
        f"{p}attention": gather_x,
        f"{p}attention.wq": ColwiseParallel(),
        f"{p}attention.wk": ColwiseParallel(),
        f"{p}attention.wv": ColwiseParallel(),
        f"{p}attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        f"{p}ffn_norm": SequenceParallel(),
        f"{p}feed_forward": gather,
        f"{p}feed_forward.w1": ColwiseParallel(),
        f"{p}feed_forward.w3": ColwiseParallel(),
        f"{p}feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh: object) -> Transformer:
    """Split `model`'s layers over the 1-D DeviceMesh `tp_mesh` (see the module docstring).

    Every rank must hold the same weights (build_run seeds them): replicated weights are wrapped
    as they are, without a broadcast.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
        "output": SequenceParallel(sequence_dim=0, use_local_output=True),  # rows = tokens
    }
    for i in range(len(model.layers)):
        plan.update(_plan(f"layers.{i}."))
    parallelize_module(model, tp_mesh, plan)
    model.register_forward_pre_hook(_labels_hook(tp_mesh.size(), tp_mesh.get_local_rank()))
    return model


def _labels_hook(tp: int, tp_rank: int):
    """Forward pre-hook: labels (B, S) -> this tp rank's (B, S/tp), the tokens whose hidden
    states it holds after the last block (Shard(1) splits like torch.chunk)."""

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if len(args) < 3 or args[2] is None:
            return None
        labels: torch.Tensor = args[2]
        return (*args[:2], labels.chunk(tp, dim=1)[tp_rank], *args[3:])

    return hook
