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

transformers.Trainer enables checkpointing only when `train()` starts, after the Trainer (and
ours, `ContextParallelConfig(offload_activations=True)`) is built: `when_checkpointed=True`
wraps the layers' functions at each training forward instead (the same pre-hook), and raises
there if none is checkpointed; `check_trainer_args` refuses such a Trainer's arguments up front.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ringattn.models.offload import ActivationOffload

__all__ = ["OFFLOAD_ATTR", "check_trainer_args", "offload_activations"]

OFFLOAD_ATTR = "ringattn_offload"
"""The model's current ActivationOffload (an attribute on the model), set by its pre-hook."""


def _in_offload(model: nn.Module, checkpoint_fn: object, *args: object, **kwargs: object):
    with getattr(model, OFFLOAD_ATTR):
        return checkpoint_fn(*args, **kwargs)


def _fresh(model: nn.Module, args: tuple, kwargs: dict) -> None:
    setattr(model, OFFLOAD_ATTR, ActivationOffload())


def _fresh_and_wrapped(model: nn.Module, args: tuple, kwargs: dict) -> None:
    if model.training and torch.is_grad_enabled():
        _wrap(model)
    _fresh(model, args, kwargs)


def _wrap(model: nn.Module) -> int:
    """Wrap every checkpoint function of `model` not yet wrapped; how many modules hold one.
    ValueError when none does, or for the reentrant checkpoint (see offload_activations)."""
    layers = [m for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None)]
    if not layers or not getattr(model, "is_gradient_checkpointing", True):
        raise ValueError(
            f"offload_activations: {type(model).__name__} has no checkpointed layers; enable "
            f"gradient checkpointing first (model.gradient_checkpointing_enable("
            f"{{'use_reentrant': False}}), --activation-checkpointing, or "
            f"TrainingArguments(activation_checkpointing=True))"
        )
    for layer in layers:
        fn = layer._gradient_checkpointing_func
        if getattr(fn, "func", None) is _in_offload:
            continue  # already wrapped
        if getattr(fn, "keywords", {}).get("use_reentrant", False):
            raise ValueError(
                "offload_activations needs the non-reentrant checkpoint: "
                "gradient_checkpointing_enable({'use_reentrant': False})"
            )
        layer._gradient_checkpointing_func = functools.partial(_in_offload, model, fn)
    return len(layers)


def offload_activations(model: nn.Module, *, when_checkpointed: bool = False) -> int:
    """Offload the checkpointed layer inputs of `model` (in place); returns how many modules
    holding a checkpoint function were wrapped (its layers; the model keeps one too).

    ValueError when gradient checkpointing is off (there is nothing checkpointed to offload) or
    uses the reentrant checkpoint (which saves its inputs in its own autograd function). With
    `when_checkpointed=True` (checkpointing is enabled later, as transformers.Trainer does in
    `train()`), the layers are wrapped at each training forward, the same checks raising there,
    and 0 is returned."""
    wrapped = 0 if when_checkpointed else _wrap(model)
    if not hasattr(model, OFFLOAD_ATTR):
        setattr(model, OFFLOAD_ATTR, ActivationOffload())
        model.register_forward_pre_hook(_fresh_and_wrapped if when_checkpointed else _fresh,
                                        with_kwargs=True)  # fmt: skip
    return wrapped


def check_trainer_args(args: object) -> None:
    """ValueError for TrainingArguments that ContextParallelConfig(offload_activations=True)
    cannot run with: checkpointing off, the reentrant checkpoint, transformers' own offload
    (save_on_cpu: one of the two), torch_compile (the hooks run outside a graph)."""
    what = "ContextParallelConfig(offload_activations=True)"
    on = getattr(args, "activation_checkpointing", None) or getattr(
        args, "gradient_checkpointing", False
    )
    if not on:
        raise ValueError(f"{what} moves the checkpointed layer inputs to host memory: set "
                         f"TrainingArguments(activation_checkpointing=True)")  # fmt: skip
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None) or {})  # fmt: skip
    if kwargs.get("use_reentrant", False):
        raise ValueError(f"{what} needs the non-reentrant checkpoint: drop use_reentrant=True "
                         f"from the checkpointing kwargs")  # fmt: skip
    if kwargs.get("offload", False):
        raise ValueError(
            f"{what} and transformers' own checkpoint offload (offload=True in the kwargs: "
            f"save_on_cpu) both move the layer inputs: keep one"
        )
    if getattr(args, "torch_compile", False):
        raise ValueError(f"{what} is not supported with torch_compile=True (its saved-tensor "
                         f"hooks run outside a graph); set one of them off")  # fmt: skip
