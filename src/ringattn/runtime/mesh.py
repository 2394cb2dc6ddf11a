"""Parallelism applied to a plain model from outside: one ("pp", "dp", "cp", "tp") DeviceMesh, CP
attention, tensor parallelism, FSDP2.

    world of W = pp * dp * cp * tp ranks, rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp
    + tp_rank (tp innermost: the ranks that talk most are neighbours). With pp = tp = 1:

              cp 0   cp 1   cp 2   cp 3
        dp 0  r0     r1     r2     r3      <- one sequence, its tokens sharded over a cp row
        dp 1  r4     r5     r6     r7      <- another sequence

- cp: the ranks of a row hold the shards of the same sequences; attention layers are given the
  row's group (`set_context_parallel`), everything else is per token and untouched.
- dp: rows read different samples.
- tp: the ranks of a tp group hold the same tokens and split each layer's heads and MLP columns
  (models/tensor_parallel.py); between layers the residual stream is split over tp by sequence.
- pp: the decoder's blocks split into stages (models/pipeline.py).
- Parameters are sharded with FSDP2 (`fully_shard`) over the flattened dp x cp sub-mesh
  ("dp_cp"), as torchtitan does; with tp > 1 they are already TP DTensors and FSDP shards them
  again over dp_cp (2-D parameters on the ("dp_cp", "tp") mesh). The parameters are the same on
  every rank of a cp row, and each rank's gradient is only its tokens' share, so the gradients
  must be summed over cp as well as over dp: FSDP's reduce-scatter over dp_cp does exactly that,
  and sharding over cp too divides parameter, gradient and optimizer memory by dp x cp instead of
  by dp. The reduction is a SUM (divide factor 1): each rank's loss is already its sum of token
  losses divided by the number of supervised tokens in the whole global batch, so the sum over
  ranks is the global mean.

FSDP2 works with gloo on CPU in torch 2.13 (checked: reduce-scatter, all-gather, DCP state dicts).

How a model is put on this mesh is the model's business: models/parallelize.py does it for the
decoder, train/hf/recipe.py for a Hugging Face model. The trainer's two scalar collectives (loss
counts, memory figures) are comm/world.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringattn.comm import group_cache

__all__ = [
    "DIMS",
    "Mesh",
    "build_mesh",
    "check_expert_degree",
    "degrees",
]

DIMS = ("pp", "dp", "cp", "tp")
"""The mesh's dimension names, outermost first."""


@dataclass
class Mesh:
    """The training mesh; `single` when there is no process group (one process)."""

    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    cp_group: object  # 1-D DeviceMesh of this rank's cp row (2-D for hybrid), or None
    fsdp_mesh: object  # 1-D DeviceMesh "dp_cp" of the ranks FSDP shards over, or None
    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    tp_mesh: object = None  # 1-D DeviceMesh "tp", or None
    pp_group: object = None  # process group of this rank's pipeline, or None
    device_mesh: object = None  # the whole ("pp", "dp", "cp", "tp") DeviceMesh, or None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


def degrees(world_size: int, dp: int, cp: int, tp: int = 1, pp: int = 1) -> tuple[int, int]:
    """(dp, cp) for `world_size` ranks given tp and pp; dp or cp 0 means "what is left".
    ValueError when the four degrees do not multiply to the world size."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got tp={tp}, pp={pp}")
    if dp < 0 or cp < 0:
        raise ValueError(f"--dp and --cp must be >= 0 (0 = the rest), got dp={dp}, cp={cp}")
    rest = world_size // (tp * pp) if world_size % (tp * pp) == 0 else 0
    if dp == 0 and cp == 0:
        dp = 1
    if dp == 0:
        dp = rest // cp if cp and rest % cp == 0 else 0
    if cp == 0:
        cp = rest // dp if rest % dp == 0 else 0
    if pp * dp * cp * tp != world_size:
        raise ValueError(
            f"pp x dp x cp x tp must equal the number of processes: pp={pp} x dp={dp or '?'} x "
            f"cp={cp or '?'} x tp={tp} != {world_size}; pick degrees whose product is {world_size}"
        )
    return dp, cp


def check_expert_degree(ep: int, dp: int, cp: int) -> None:
    """--ep folds onto whole cp groups and part of dp (torchtitan's rule): ep % cp == 0 and
    (dp x cp) % ep == 0, else a ValueError naming the values and the valid degrees."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be an integer >= 1, got {ep!r}")
    world = dp * cp
    if ep > 1 and (ep % cp or world % ep):
        valid = [e for e in range(cp, world + 1, cp) if world % e == 0]
        raise ValueError(
            f"--ep {ep} must be a multiple of cp={cp} and divide dp x cp = {dp} x {cp} = {world} "
            f"(experts fold onto whole cp groups and part of dp); valid: {valid}"
        )


def build_mesh(
    device: torch.device, dp: int, cp: int, ulysses: int = 0, *, tp: int = 1, pp: int = 1
) -> Mesh:
    """The ("pp", "dp", "cp", "tp") mesh over the default process group (or a single process
    without one).

    `ulysses` > 0 splits the cp dim into (cp / ulysses) x ulysses, the 2-D "ring" x "ulysses"
    mesh that strategy="hybrid" takes as its group.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dp, cp = degrees(world_size, dp, cp, tp, pp)
    if not dist.is_initialized():
        return Mesh(1, 1, 0, 0, None, None)
    if ulysses:
        if cp % ulysses:
            raise ValueError(f"--ulysses {ulysses} does not divide cp={cp}; pick a divisor of {cp}")
        cp_dims: tuple[str, ...] = ("ring", "ulysses")
        shape = (pp, dp, cp // ulysses, ulysses, tp)
    else:
        cp_dims, shape = ("cp",), (pp, dp, cp, tp)
    names = ("pp", "dp", *cp_dims, "tp")
    mesh = group_cache.device_mesh(device.type, shape, names)  # once per process
    cp_group = mesh[cp_dims]
    if ulysses:
        cp_rank = mesh.get_local_rank("ring") * ulysses + mesh.get_local_rank("ulysses")
    else:
        cp_rank = mesh.get_local_rank("cp")
    fsdp_mesh = mesh[("dp", *cp_dims)]._flatten("dp_cp")
    if tp > 1:  # lets DTensor reduce over (dp_cp, tp) in one collective (the gradient norm)
        mesh[("dp", *cp_dims, "tp")]._flatten("dp_cp_tp")
    return Mesh(
        dp, cp, mesh.get_local_rank("dp"), cp_rank, cp_group,
        fsdp_mesh=fsdp_mesh,
        tp=tp, pp=pp, tp_rank=mesh.get_local_rank("tp"), pp_rank=mesh.get_local_rank("pp"),
        tp_mesh=mesh["tp"], pp_group=mesh["pp"].get_group(), device_mesh=mesh,
    )  # fmt: skip
