"""`--compile`: torch.compile the parallelized model, each graph with fullgraph=True.

    one process (no FSDP)       the whole model is one graph: torch.compile(model, fullgraph=True)
    FSDP2 over dp x cp (x tp)   every block's forward is one graph, FSDP2's hooks run between them
    pp > 1                      the same for each stage's blocks; the pipeline schedule (its
                                sends, receives and backward calls) stays eager

FSDP2 wraps its pre/post-forward hooks in `torch._dynamo.disable` (they all-gather and free
parameters outside any graph), so a model sharded block by block cannot be a single graph; like
torchtitan, the trainer then compiles each block, whose hooks (FSDP's, and TP's input
redistribution inside it) stay outside or trace as DTensor ops. Attention inside a block is
ringattn's custom op (ringattn/ops.py), which is what makes `fullgraph=True` hold there. The
compile is in place (`nn.Module.compile`, or the block's `forward`), so parameter names, the
state_dict and checkpoints are those of the eager model: a run may resume with or without
`--compile`.

Tensor parallelism's embedding (RowwiseParallel, output reduce-scattered to the sequence split
with async_op=True) hands the first block a bare AsyncCollectiveTensor (the `to_local()` of a
pending collective). torch 2.13's AOTAutograd unwraps such a graph input with `trigger_wait()`,
which returns the inner tensor without `requires_grad`: the graph then computes no gradient for
that input and the embedding's gradient is silently zero while every block's is right (the
upstream report and proposed fix: pytorch/pytorch#191113). So each compiled block is called through
`_settle_inputs`, which waits on such arguments in eager inside an autograd Function whose
backward passes the gradient through: the graph sees a plain tensor that requires grad, no copy.

The sequence length is fixed for a run (`--seq-len`), so every step reuses the graphs of the
first: no recompilation. (ringattn.hf's packed documents vary per batch: there the document
bounds are data of the op, and dynamo's automatic dynamic shapes make the lengths symbolic after
the first change, one recompile in all.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile `model` in place (see the module docstring); returns it."""
    layers = getattr(model, "layers", ())
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    if not _sharded(model) or not blocks:
        model.compile(fullgraph=True, backend=backend)
        return model
    for block in blocks:
        # the forward, not __call__: FSDP2's hooks on the block run around the graph
        block.forward = _settle_inputs(
            torch.compile(block.forward, fullgraph=True, backend=backend)
        )
    return model


def _settle_inputs(graph: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`graph` called with every AsyncCollectiveTensor argument waited on first, in eager, its
    gradient passed through (see the module docstring: tensor parallelism's embedding)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    @functools.wraps(graph)
    def run(*args: object, **kwargs: object) -> torch.Tensor:
        args, kwargs = tree_map_only(AsyncCollectiveTensor, _Waited.apply, (args, kwargs))
        return graph(*args, **kwargs)

    return run


class _Waited(torch.autograd.Function):
    """An AsyncCollectiveTensor's value, waited on, as a plain tensor; identity gradient."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.trigger_wait()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _sharded(model: nn.Module) -> bool:
    """True when FSDP2 manages the model (its hooks cannot be traced)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
