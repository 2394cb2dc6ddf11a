"""The decoder's parallelism, applied from outside: CP attention, tensor parallelism, pipeline
stages and FSDP2 over a runtime/mesh.py `Mesh`, in that order.

    set_context_parallel   every attention layer attends over mesh.cp_group with the layout
    apply_tensor_parallel  tp > 1: heads and MLP columns split (models/tensor_parallel.py)
    split_stage            pp > 1: this rank keeps its stage's blocks (models/pipeline.py)
    fully_shard            FSDP2 over the flattened dp x cp sub-mesh, one unit per block, with
                           gradient divide factor 1: each rank's loss is already its share of the
                           global token mean, so the plain SUM over ranks is the right gradient

FSDP2 works with gloo on CPU in torch 2.13 (checked: reduce-scatter, all-gather, DCP state dicts).
"""

from __future__ import annotations

import torch
from torch import nn

from ringattn.models.decoder import Transformer, set_context_parallel
from ringattn.models.pipeline import split_stage
from ringattn.models.tensor_parallel import apply_tensor_parallel
from ringattn.runtime.mesh import Mesh

__all__ = ["parallelize"]


def parallelize(
    model: Transformer,
    mesh: Mesh,
    *,
    layout: str,
    strategy: str,
    checkpoint_blocks: bool = False,
    param_dtype: torch.dtype | None = None,
    microbatches: int = 1,
    pp_schedule: str = "gpipe",
) -> nn.Module:
    """Make `model` context-parallel over mesh.cp, tensor-parallel over mesh.tp (when > 1), and
    shard it with FSDP2 over dp x cp.

    `param_dtype` (e.g. bfloat16) runs forward/backward in that dtype with float32 master
    weights and float32 gradient reduction (FSDP's mixed precision).
    """
    set_context_parallel(model, mesh.cp_group, layout=layout, strategy=strategy)
    model.checkpoint_blocks = checkpoint_blocks
    if mesh.fsdp_mesh is None:
        return model
    if mesh.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh)
    if mesh.pp > 1:  # this rank keeps its stage's blocks: a DecoderStage (pipeline.py)
        model = split_stage(model, mesh.pp, mesh.pp_rank, mesh.pp_group,
                            microbatches=microbatches, schedule=pp_schedule,
                            tp_share=(mesh.tp, mesh.tp_rank))  # fmt: skip
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    modules = [*blocks, model]  # one all-gather per block, the root holds the rest
    for module in modules:
        fully_shard(module, mesh=mesh.fsdp_mesh, mp_policy=policy)
    for module in modules:
        # a plain SUM over ranks (see the module docstring); forcing SUM collectives keeps it off
        # PREMUL_SUM, which gloo does not have
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model
