"""`ContextParallelConfig` and the (dp, cp) split of a Trainer's world into process groups.

    world of W ranks, cp = C:   rank = dp_rank * C + cp_rank      (cp innermost, as runtime/mesh.py)

              cp 0   cp 1
        dp 0  r0     r1      <- one batch, its tokens sharded over r0 and r1
        dp 1  r2     r3      <- another batch

Every rank asks for every cp row's group in the same order (torch's rule for creating groups),
then keeps its own row; the groups are made once per process (comm/group_cache.py), so a second
Trainer reuses the first one's instead of holding a second set. One process without
torch.distributed is W = 1 (cp must be 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ringattn.api import STRATEGIES
from ringattn.comm import group_cache
from ringattn.integrations.hf.mixers.choice import check_scheme
from ringattn.layout import get_layout
from ringattn.models.tiled import check_tile
from ringattn.validate import check_names

__all__ = ["ContextParallelConfig", "Split", "split_world"]


@dataclass(frozen=True)
class ContextParallelConfig:
    """How a Trainer's ranks shard each sequence (the `context_parallel=` keyword)."""

    cp: int = 2
    """Ranks that share one batch and split its tokens; must divide the world size."""
    layout: str = "zigzag"
    """Which global token goes to which rank: "zigzag" (balanced causal work), "contiguous",
    "striped"."""
    strategy: str = "ring"
    """How the ranks exchange keys and values: "ring", "allgather" or "ulysses"."""
    backend: str = "auto"
    """The attention kernel of `ringattn.attention` ("auto" picks per device)."""
    loss_chunk: int = -1
    """Rows of logits at a time in the training loss of transformers.Trainer (chunked.py): -1
    picks them from the vocabulary (256 MiB of float32 logits), 0 keeps the model's own whole
    logits."""
    mixer_scheme: str = "auto"
    """Hybrid models: how each recurrent mixer runs across the ranks: "state", "heads", "whole"
    or "auto" (`ringattn.hf.parallelize`'s mixer_scheme)."""
    tiled_mlp: int = 0
    """Tokens per tile of each MLP and experts module (integrations/hf/levers/tiled.py): only one
    tile's intermediates alive, each tile recomputed in backward, the same loss; 0: untiled."""
    dynamic: bool = False
    """Dynamic CP (dynamic.py): each training step, the documents of every dp row's batch get a
    group of 1, 2, ... cp ranks and are placed over dp x cp by planned cost (short ones alone,
    no communication); the same loss and gradients as static CP. cp must be a power of two."""
    offload_activations: bool = False
    """Keep each checkpointed layer's input in pinned host memory, prefetched in backward on a
    side stream (integrations/hf/levers/offload.py), the same loss; needs
    TrainingArguments(activation_checkpointing=True). Saves GPU memory only (on CPU it runs
    and changes nothing)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp < 1:
            raise ValueError(f"ContextParallelConfig(cp={self.cp!r}): cp must be an int >= 1")
        get_layout(self.layout)
        check_tile(self.tiled_mlp, "ContextParallelConfig(tiled_mlp)")
        if not isinstance(self.offload_activations, bool):
            raise TypeError(f"ContextParallelConfig(offload_activations="
                            f"{self.offload_activations!r}): True or False")  # fmt: skip
        if not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk, bool):
            raise TypeError(f"ContextParallelConfig(loss_chunk={self.loss_chunk!r}): an int "
                             f"(-1: from the vocabulary, 0: whole logits, > 0: rows)")  # fmt: skip
        if self.strategy == "hybrid":
            raise ValueError(
                "ContextParallelConfig(strategy='hybrid') needs a 2-D mesh, which the Trainer "
                "integration does not build; use 'ring', 'allgather' or 'ulysses'"
            )
        check_names(self.strategy, STRATEGIES, self.backend)
        check_scheme(self.mixer_scheme)
        if self.dynamic and self.cp & (self.cp - 1):
            low = 1 << (self.cp.bit_length() - 1)
            raise ValueError(
                f"ContextParallelConfig(cp={self.cp}, dynamic=True): dynamic CP's groups are 1, "
                f"2, 4, ... ranks, so cp must be a power of two; use cp={low} or {2 * low}"
            )


@dataclass(frozen=True)
class Split:
    """This rank's place in the (dp, cp) grid."""

    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    group: object
    """The process group of this rank's cp row (None in one process)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.cp


def split_world(config: ContextParallelConfig) -> Split:
    """Build the cp row groups of the default group; ValueError (on every rank) when cp does not
    divide the world size."""
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    if world % config.cp:
        raise ValueError(
            f"ContextParallelConfig(cp={config.cp}) does not divide the world size {world}: the "
            f"{world} ranks must form data-parallel groups of cp={config.cp} ranks each; launch "
            f"a multiple of {config.cp} processes or choose cp among the divisors of {world}"
        )
    if not initialized:
        return Split(1, 1, 0, 0, None)
    dp = world // config.cp
    mine = None
    for row in range(dp):  # every rank creates every group, in the same order
        group = group_cache.new_group(range(row * config.cp, (row + 1) * config.cp))
        if row == rank // config.cp:
            mine = group
    return Split(dp, config.cp, rank // config.cp, rank % config.cp, mine)
