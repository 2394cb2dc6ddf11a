"""Activation offload for a transformers model trained with gradient checkpointing.

    model.gradient_checkpointing_enable({"use_reentrant": False})
    offload_activations(model)      # each checkpointed layer's input kept in host memory

transformers checkpoints a layer by calling the function it keeps on that layer
(`_gradient_checkpointing_func`, torch's checkpoint with the kwargs given to
gradient_checkpointing_enable) inside the layer's forward, so module hooks (FSDP2's) stay outside.
Each such function is wrapped here to run inside the model's current `ActivationOffload`
(models/offload.py), one per forward (a forward pre-hook on the model starts it): the non-reentrant
checkpoint saves the layer's inputs through those hooks, and nothing else is offloaded. The
memory saved is on a GPU only (on CPU the path runs and is exact); see models/offload.py.
"""

from __future__ import annotations

import functools

from torch import nn

from ringattn.models.offload import ActivationOffload

__all__ = ["OFFLOAD_ATTR", "offload_activations"]

OFFLOAD_ATTR = "ringattn_offload"
"""The model's current ActivationOffload (an attribute on the model), set by its pre-hook."""


def _in_offload(model: nn.Module, checkpoint_fn: object, *args: object, **kwargs: object):
    with getattr(model, OFFLOAD_ATTR):
        return checkpoint_fn(*args, **kwargs)


def _fresh(model: nn.Module, args: tuple, kwargs: dict) -> None:
    setattr(model, OFFLOAD_ATTR, ActivationOffload())


def offload_activations(model: nn.Module) -> int:
    """Offload the checkpointed layer inputs of `model` (in place); returns how many modules
    holding a checkpoint function were wrapped (its layers; the model keeps one too).

    ValueError when gradient checkpointing is off (there is nothing checkpointed to offload) or
    uses the reentrant checkpoint (which saves its inputs in its own autograd function)."""
    layers = [m for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None)]
    if not layers or not getattr(model, "is_gradient_checkpointing", True):
        raise ValueError(
            f"offload_activations: {type(model).__name__} has no checkpointed layers; enable "
            f"gradient checkpointing first (model.gradient_checkpointing_enable("
            f"{{'use_reentrant': False}}), or --activation-checkpointing)"
        )
    for layer in layers:
        fn = layer._gradient_checkpointing_func
        if getattr(fn, "keywords", {}).get("use_reentrant", False):
            raise ValueError(
                "offload_activations needs the non-reentrant checkpoint: "
                "gradient_checkpointing_enable({'use_reentrant': False})"
            )
        if getattr(fn, "func", None) is _in_offload:
            continue  # already wrapped
        layer._gradient_checkpointing_func = functools.partial(_in_offload, model, fn)
    if not hasattr(model, OFFLOAD_ATTR):
        setattr(model, OFFLOAD_ATTR, ActivationOffload())
        model.register_forward_pre_hook(_fresh, with_kwargs=True)
    return len(layers)
