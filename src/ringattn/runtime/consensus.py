"""One small all-reduce per step through which every rank learns every rank's flags.

    rank r puts its flag word (bits: stop requested, non-finite loss, non-finite grad norm...)
    at index r of a zero vector of W integers; an all-reduce SUM gives every rank the whole
    vector: the same decision everywhere (stop? skip the update?) and who caused it.

W int64 values (8 bytes per rank) per step: negligible next to a step's gradient traffic, and it
is what makes a SIGTERM or a NaN on one rank a decision of all of them, at the same step, instead
of one rank leaving a collective its peers then wait in until the process-group timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["share_flags"]


def share_flags(bits: int, device: torch.device) -> list[int]:
    """Every rank's `bits`, in rank order (collective over the default group; [bits] alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [bits]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    flags[dist.get_rank()] = bits
    dist.all_reduce(flags)
    return flags.tolist()
