"""Process groups and device meshes made once per default group, then reused.

`dist.new_group`, `init_device_mesh` and `DeviceMesh(...)` are collective over the whole world,
and every group they make keeps its backend's resources until it is destroyed: on CPU each gloo
group holds three threads (two `pt_gloo_runloop`, one `gloo_tcp_loop`) and its sockets. Code that
builds its groups per call (a Trainer constructed twice, a training run or a server started twice
in one process: a notebook, a sweep, a test worker pool) would keep every earlier copy alive:
one process of the test suite's pools held 601 threads after an hour, about 200 groups.

So the library asks this module for its groups, keyed by everything that defines one:

    new_group(ranks, backend=, timeout=)         -> dist.new_group, once per key
    device_mesh(device_type, shape, names)       -> init_device_mesh, once per key
    device_mesh(device_type, shape, names,
                ranks=tensor)                    -> DeviceMesh(device_type, ranks), once per key

Why the ranks stay in step: torch requires every rank to call `new_group` for every group, in the
same order. A cache hit skips that call on every rank alike, because every rank asks for the
same groups in the same order (the code is SPMD) and so hits or misses together.

The memo belongs to the default group (a weak reference to it): after `destroy_process_group()`
and a new `init_process_group`, the first call of each key makes its group afresh. It holds no
options and changes no behaviour; it is the memo torch itself keeps of the default group.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["device_mesh", "new_group"]

_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # default group -> {key: group}


def _memo() -> dict:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "ringattn.comm.group_cache needs torch.distributed initialised: call "
            "dist.init_process_group (or launch through ringattn / torchrun) first"
        )
    world = dist.distributed_c10d._get_default_group()
    return _MEMO.setdefault(world, {})


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> dist.ProcessGroup:
    """`dist.new_group(ranks, backend=, timeout=)`, made once per distinct arguments (collective
    on the first call: every rank calls it, in the same order); `GroupMember.NON_GROUP_MEMBER` on
    a rank outside `ranks`, as torch returns."""
    key = ("group", None if ranks is None else tuple(int(r) for r in ranks), backend, timeout)
    memo = _memo()
    if key not in memo:
        memo[key] = dist.new_group(
            None if ranks is None else list(key[1]), backend=backend, timeout=timeout
        )
    return memo[key]


def device_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    ranks: torch.Tensor | None = None,
) -> object:
    """A DeviceMesh of `shape` with dims `names` over the default group, made once per distinct
    arguments (collective on the first call). `ranks` (a tensor of that shape) places the ranks
    explicitly; without it they run in row-major order, as `init_device_mesh` lays them."""
    layout = None if ranks is None else tuple(int(r) for r in ranks.flatten().tolist())
    key = ("mesh", device_type, tuple(shape), tuple(names), layout)
    memo = _memo()
    if key not in memo:
        if ranks is None:
            from torch.distributed.device_mesh import init_device_mesh

            memo[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        else:
            from torch.distributed.device_mesh import DeviceMesh

            if tuple(ranks.shape) != tuple(shape):
                raise ValueError(
                    f"device_mesh: ranks of shape {tuple(ranks.shape)} do not match shape "
                    f"{tuple(shape)}; pass ranks.view{tuple(shape)} or the matching shape"
                )
            memo[key] = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))
    return memo[key]
