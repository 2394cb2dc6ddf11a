"""Rank functions for tests/test_group_leaks.py: a worker's threads, and group_cache's memo."""

from __future__ import annotations

import collections
import os

import torch
import torch.distributed as dist

from ringattn.comm import group_cache


def threads(rank: int, world_size: int) -> dict[str, int]:
    """This process's threads by name (/proc/<pid>/task/*/comm), and their total as "all"."""
    names: collections.Counter[str] = collections.Counter()
    task_dir = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except FileNotFoundError:  # a thread that ended while they were listed
            continue
    return {**names, "all": sum(names.values())}


def memo(rank: int, world_size: int) -> dict[str, bool]:
    """group_cache asked twice for each kind of group: the same object back, and no thread more;
    other arguments make another group; a rank outside `ranks` gets torch's NON_GROUP_MEMBER."""
    half = list(range(world_size // 2))
    ranks = torch.arange(world_size, device="cpu").view(world_size // 2, 2).t()  # (2, W / 2)

    def every_kind() -> list:
        return [
            group_cache.new_group(half),
            group_cache.new_group(half, backend="gloo"),
            group_cache.device_mesh("cpu", (world_size // 2, 2), ("dp", "cp")),
            group_cache.device_mesh("cpu", (2, world_size // 2), ("ep", "edp"), ranks=ranks),
        ]

    first = every_kind()
    before = threads(rank, world_size)["all"]
    second = every_kind()
    return {
        "same objects": all(a is b for a, b in zip(first, second)),
        "no thread more": threads(rank, world_size)["all"] == before,
        "other ranks, other group": group_cache.new_group(half)
        is not group_cache.new_group(range(world_size)),
        "outside is NON_GROUP_MEMBER": (first[0] is dist.GroupMember.NON_GROUP_MEMBER)
        == (rank not in half),
    }


def verdicts(rank: int, world_size: int) -> dict[str, bool]:
    """serve's Verdict (a gloo side group per server start) made twice with one timeout: the
    same group back, and no thread more; another timeout makes another group."""
    from ringattn.comm import resolve_group
    from ringattn.serve.protocol import Verdict

    info = resolve_group(None)
    first = Verdict(info, 7.0)
    before = threads(rank, world_size)["all"]
    second = Verdict(info, 7.0)
    return {
        "same group": first.side.group is second.side.group,
        "no thread more": threads(rank, world_size)["all"] == before,
        "a side group": first.side.group is not info.group,
        "another timeout, another group": Verdict(info, 8.0).side.group is not first.side.group,
    }
