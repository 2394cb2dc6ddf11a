"""Parallelism applied to a plain model from outside: a dp x cp mesh, CP attention, FSDP2.

    world of W = dp * cp ranks, as a DeviceMesh ("dp", "cp"), rank = dp_rank * cp + cp_rank:

              cp 0   cp 1   cp 2   cp 3
        dp 0  r0     r1     r2     r3      <- one sequence, its tokens sharded over a cp row
        dp 1  r4     r5     r6     r7      <- another sequence

- cp: the ranks of a row hold the shards of the same sequences; attention layers are given the
  row's group (`set_context_parallel`), everything else is per token and untouched.
- dp: rows read different samples.
- Parameters are sharded with FSDP2 (`fully_shard`) over ALL W ranks, dp and cp together, as
  torchtitan does. The parameters are the same on every rank of a cp row, and each rank's
  gradient is only its tokens' share, so the gradients must be summed over cp as well as over dp:
  FSDP's reduce-scatter over the whole world does exactly that, and sharding over cp too divides
  parameter, gradient and optimizer memory by W instead of by dp. The reduction is a SUM
  (divide factor 1): each rank's loss is already its sum of token losses divided by the number of
  supervised tokens in the whole global batch, so the sum over ranks is the global mean.

FSDP2 works with gloo on CPU in torch 2.13 (checked: reduce-scatter, all-gather, DCP state dicts).

`parallelize` is the decoder's: `run.DECODER` pairs it with the model's constructor, and a
model family with other layers (or tensor/pipeline parallelism) brings its own. `sum_over_world`
and `gather_over_world` are the trainer's two scalar collectives (loss counts, memory figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ringattn.train.model import Transformer, set_context_parallel

__all__ = ["Mesh", "build_mesh", "gather_over_world", "parallelize", "sum_over_world"]


@dataclass
class Mesh:
    """The training mesh; `single` when there is no process group (one process)."""

    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    cp_group: object  # 1-D DeviceMesh of this rank's cp row, or None for one process
    fsdp_mesh: object  # 1-D DeviceMesh of all ranks, or None

    @property
    def world_size(self) -> int:
        return self.dp * self.cp


def degrees(world_size: int, dp: int, cp: int) -> tuple[int, int]:
    """(dp, cp) for `world_size` ranks; 0 means "what is left". ValueError when they do not fit."""
    if dp < 0 or cp < 0:
        raise ValueError(f"--dp and --cp must be >= 0 (0 = the rest), got dp={dp}, cp={cp}")
    if dp == 0 and cp == 0:
        dp = 1
    if dp == 0:
        dp = world_size // cp if cp and world_size % cp == 0 else 0
    if cp == 0:
        cp = world_size // dp if world_size % dp == 0 else 0
    if dp * cp != world_size:
        raise ValueError(
            f"dp x cp must equal the number of processes: dp={dp or '?'} x cp={cp or '?'} != "
            f"{world_size}; pick degrees whose product is {world_size}"
        )
    return dp, cp


def build_mesh(device: torch.device, dp: int, cp: int, ulysses: int = 0) -> Mesh:
    """The dp x cp mesh over the default process group (or a single process without one).

    `ulysses` > 0 splits each cp row into (cp / ulysses) x ulysses, the 2-D "ring" x "ulysses"
    mesh that strategy="hybrid" takes as its group.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dp, cp = degrees(world_size, dp, cp)
    if not dist.is_initialized():
        return Mesh(1, 1, 0, 0, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    fsdp_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    if ulysses:
        if cp % ulysses:
            raise ValueError(f"--ulysses {ulysses} does not divide cp={cp}; pick a divisor of {cp}")
        shape, names = (dp, cp // ulysses, ulysses), ("dp", "ring", "ulysses")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        cp_rank = mesh.get_local_rank("ring") * ulysses + mesh.get_local_rank("ulysses")
        return Mesh(dp, cp, mesh.get_local_rank("dp"), cp_rank, mesh["ring", "ulysses"], fsdp_mesh)
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return Mesh(dp, cp, mesh.get_local_rank("dp"), mesh.get_local_rank("cp"), mesh["cp"], fsdp_mesh)


def parallelize(
    model: Transformer,
    mesh: Mesh,
    *,
    layout: str,
    strategy: str,
    checkpoint_blocks: bool = False,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Make `model` context-parallel over mesh.cp and shard it with FSDP2 over every rank.

    `param_dtype` (e.g. bfloat16) runs forward/backward in that dtype with float32 master
    weights and float32 gradient reduction (FSDP's mixed precision).
    """
    set_context_parallel(model, mesh.cp_group, layout=layout, strategy=strategy)
    model.checkpoint_blocks = checkpoint_blocks
    if mesh.fsdp_mesh is None:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    modules = [*model.layers, model]  # one all-gather per block, the root holds the rest
    for module in modules:
        fully_shard(module, mesh=mesh.fsdp_mesh, mp_policy=policy)
    for module in modules:
        # a plain SUM over ranks (see the module docstring); forcing SUM collectives keeps it off
        # PREMUL_SUM, which gloo does not have
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def sum_over_world(values: list[float], device: torch.device) -> list[float]:
    """Each value summed over every rank (float64); the values themselves on one process."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def gather_over_world(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (a list of one on one process)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return [value]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]
