"""TRL SFTTrainer's MoE router loss under CP: its router logits gathered over the cp group.

SFTTrainer trains through a fused LM head that calls the model's backbone directly and computes
the load-balancing loss itself, `load_balancing_loss_func(backbone_out.router_logits, ...)`, so
the hook that corrects the causal LM's own `out.loss` (integrations/hf/moe.py) never sees it.
Here a forward hook on the backbone (public `register_forward_hook`) replaces its
`router_logits` by those of every real token of the cp group's sequence, in training only:

    rank r:   logits_r (layers, S_local, E)      real_r: rows that are tokens, not layout padding
    gathered  all_gather(logits_r)               torch.distributed.nn.functional: its backward
                                                 returns each rank the gradients of its own rows
    router_logits[layer] = cat_r logits_r[layer, real_r]     (rows, E): the whole sequence

TRL's aux loss is then the single-device one, the same on the cp ranks. TRL adds it to each
rank's loss unscaled (DDP averages it over all W ranks): each rank's backward sends its rows the
gradient of the whole aux, so the cp ranks together give cp x the group's gradient and DDP's
average over W = dp x cp leaves the mean over the dp groups, as plain DDP does. In eval the model's
own forward runs and moe.py's hook applies, so the hook steps aside when the model is not training.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ringattn.integrations.hf.attention import CONTEXT_ATTR
from ringattn.integrations.hf.moe import real_rows

__all__ = ["gather_router_logits"]


def _hook(module, args, kwargs, output):
    logits = getattr(output, "router_logits", None)
    context = getattr(module, CONTEXT_ATTR, None)
    if not module.training or not logits or context is None or context.group is None:
        return None
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise ValueError(f"{type(module).__name__}: the batch has no cu_seq_lens_q; build it with "
                         f"ringattn.hf.shard_batch")  # fmt: skip
    stacked = torch.stack([layer.reshape(-1, layer.shape[-1]) for layer in logits])  # (L, S, E)
    real = real_rows(bounds, context, stacked.device).to(torch.int32)  # (S_local,)
    masks = [torch.empty_like(real) for _ in range(dist.get_world_size(context.group))]
    dist.all_gather(masks, real, group=context.group)  # ints: gloo gathers no bools
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():  # "deprecated": its replacement has no autograd here
        warnings.simplefilter("ignore", FutureWarning)
        gathered = all_gather(stacked, group=context.group)
    rows = torch.cat([g[:, m.bool()] for g, m in zip(gathered, masks)], dim=1)  # (L, rows, E)
    output.router_logits = tuple(rows.unbind(0))
    return output


def gather_router_logits(model: torch.nn.Module) -> None:
    """Install the hook on `model`'s backbone (`model.base_model`), once."""
    backbone = model.base_model
    if not getattr(backbone, "_ringattn_router_gather", False):
        backbone.register_forward_hook(_hook, with_kwargs=True)
        backbone._ringattn_router_gather = True
