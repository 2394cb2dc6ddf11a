"""The Trainer's training loss without the rank's whole (tokens, vocab) logits.

transformers.Trainer's `compute_loss` calls `model(**inputs)` (through DDP or FSDP, whose
forward must run for their gradient hooks) and reads `outputs.loss`. A causal LM's forward
projects every token onto the vocabulary and keeps those logits, their float32 copy and the
log-softmax for backward: 3 x S_local x vocab floats, the largest per-token activation of a small
model. Here the model instance's `forward` (the attribute accelerate's autocast also wraps) is
wrapped, once, so that a training forward with labels goes

    decoder(**inputs) -> hidden (S_local, dim) -> integrations/hf/loss.py's `loss`:
    `chunk` rows of lm_head + cross-entropy at a time, each recomputed in backward

and returns `CausalLMOutputWithPast(loss=...)` without logits: the same value (this rank's loss
sum over the global supervised-token count) as the model's own forward. Every other call (eval,
generation, no labels, positional arguments) is the model's own forward, untouched.

Installed only where it is exact: the Trainer's own `compute_loss` (a subclass such as TRL's
SFTTrainer reads logits for its metrics and has its own fused loss), a model with an nn.Linear
output head beside its decoder, and no MoE router loss (which the model's forward adds).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from ringattn.integrations.hf.loss import loss, output_head
from ringattn.integrations.hf.moe import router_settings

__all__ = ["install_chunked_loss"]

_ORIGINAL = "_ringattn_forward"


def _forward(self: nn.Module, *args, **kwargs):
    own = getattr(self, _ORIGINAL)
    chunk = self._ringattn_loss_chunk
    labelled = "shift_labels" in kwargs and kwargs.get("num_items_in_batch") is not None
    wanted = not args and self.training and torch.is_grad_enabled() and labelled
    if not wanted:
        return own(*args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss(self, kwargs, chunk=chunk))


def install_chunked_loss(model: nn.Module, chunk: int) -> bool:
    """Wrap `model.forward` (a causal LM, not its PEFT wrapper) as the module docstring says;
    False (nothing installed) when the model does not qualify or `chunk` is 0."""
    if chunk == 0 or router_settings(model) is not None:
        return False
    try:
        output_head(model)
    except TypeError:  # no separate decoder and nn.Linear head: the model's own logits
        return False
    if not hasattr(model, _ORIGINAL):
        setattr(model, _ORIGINAL, model.forward)

        # the model's own signature: the Trainer reads it to choose the dataset's columns
        @functools.wraps(type(model).forward)
        def forward(self, *args, **kwargs):
            return _forward(self, *args, **kwargs)

        model.forward = types.MethodType(forward, model)
    model._ringattn_loss_chunk = chunk
    return True
