"""Dynamic CP's sub-groups of every cp row, created once at start-up and reused every step.

`new_group` is collective over the whole world and slow (a rendezvous per group), so all of them
are made when the run is built, and once per process (comm/group_cache.py keeps them for the next
run): for every dp row d and every size g = 1, 2, 4, ..., cp, the aligned blocks
j = 0 .. cp/g - 1 of ranks d*cp + j*g .. d*cp + j*g + g - 1 (schedule.py's groups). Size cp is
the mesh's own cp group. Every rank calls `new_group` for every group, in the same order, as
torch.distributed requires; a rank keeps the handles of the groups it is in.
With one process every group is None (attention runs locally).
"""

from __future__ import annotations

import torch.distributed as dist

from ringattn.comm import group_cache

__all__ = ["SubGroups", "build_sub_groups", "sizes_of"]


def sizes_of(cp: int) -> list[int]:
    """Group sizes, largest first: cp, cp/2, ..., 1 (cp a power of two)."""
    out, g = [], cp
    while g >= 1:
        out.append(g)
        g //= 2
    return out


class SubGroups:
    """This rank's group of each size: `group(size)`; `block(size)` is its index j in the row."""

    def __init__(self, cp_rank: int, groups: dict[int, object]):
        self.cp_rank = cp_rank
        self._groups = groups

    def group(self, size: int) -> object:
        return self._groups[size]

    def block(self, size: int) -> int:
        return self.cp_rank // size

    def rank_in(self, size: int) -> int:
        return self.cp_rank % size


def build_sub_groups(dp: int, cp: int, cp_group: object, cp_rank: int) -> SubGroups:
    """Collective over the world (or nothing, with one process): this rank's group of every size
    of its cp row (`cp_group`, the row's own, is size cp); see the module docstring."""
    if dp * cp == 1 or not dist.is_initialized():
        return SubGroups(0, {1: None})
    mine: dict[int, object] = {cp: cp_group}
    me = dist.get_rank()
    for g in sizes_of(cp)[1:]:
        for d in range(dp):
            for j in range(cp // g):
                ranks = list(range(d * cp + j * g, d * cp + j * g + g))
                group = group_cache.new_group(ranks)
                if me in ranks:
                    mine[g] = group
    return SubGroups(cp_rank, mine)
