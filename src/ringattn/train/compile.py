"""`--compile`: torch.compile the parallelized model, each graph with fullgraph=True.

    one process (no FSDP)     the whole model is one graph: torch.compile(model, fullgraph=True)
    FSDP2 over dp x cp (x tp) every block's forward is one graph, FSDP2's hooks run between them

FSDP2 wraps its pre/post-forward hooks in `torch._dynamo.disable` (they all-gather and free
parameters outside any graph), so a model sharded block by block cannot be a single graph; like
torchtitan, the trainer then compiles each block, whose hooks (FSDP's, and TP's input
redistribution inside it) stay outside or trace as DTensor ops. Attention inside a block is
ringattn's custom op (ringattn/ops.py), which is what makes `fullgraph=True` hold there. The
compile is in place (`nn.Module.compile`, or the block's `forward`), so parameter names, the
state_dict and checkpoints are those of the eager model: a run may resume with or without
`--compile`.

The sequence length is fixed for a run (`--seq-len`), so every step reuses the graphs of the
first: no recompilation. (ringattn.hf's packed documents vary per batch: there the document
bounds are data of the op, and dynamo's automatic dynamic shapes make the lengths symbolic after
the first change, one recompile in all.)
"""

from __future__ import annotations

import torch
from torch import nn


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile `model` in place (see the module docstring); returns it."""
    blocks = list(getattr(model, "layers", ()))
    if not _sharded(model) or not blocks:
        model.compile(fullgraph=True, backend=backend)
        return model
    for block in blocks:
        # the forward, not __call__: FSDP2's hooks on the block run around the graph
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
    return model


def _sharded(model: nn.Module) -> bool:
    """True when FSDP2 manages the model (its hooks cannot be traced)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
