"""Scalar reductions over the whole default process group (not a CP group): the trainer's loss
counts and memory figures, a pipeline's supervised-token total.

Both work on one process without a group (they return the values themselves), so callers need no
branch for the single-process case. Values travel as float64: token counts stay exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_over_world", "sum_over_world"]


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
