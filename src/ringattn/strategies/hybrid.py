"""Hybrid strategy (USP): Ulysses all-to-all inside groups, ring attention across them.

`group` is a 2-D DeviceMesh with dims "ulysses" (size U, e.g. the GPUs of one node on NVLink) and
"ring" (size R, e.g. across nodes). The layout sees one flattened world of W = R*U positions,
ring-major: the rank at ulysses index u and ring index g is position p = g*U + u, whatever the
order of the dims in the mesh. `shard`, `unshard` and `positions` given the same mesh use the same
positions, so they agree with `attention`; with the usual mesh (R, U), dims ("ring", "ulysses"), p
is the global rank.

    W = 4 as 2 x 2, zigzag: position p holds chunks p and 7-p of 8

    ring group g = 0: positions 0, 1  (u = 0, 1)      ring group g = 1: positions 2, 3
    1. all-to-all in each ulysses group: rank (u, g) now holds heads [u*H/2, (u+1)*H/2) of
       both shards of its group: sequence [shard 2g | shard 2g+1], 2n rows
    2. ring across groups (R steps): rank (u, g) sends its group's combined K/V (its heads) to
       (u, g+1); at each step the blocks are the layout's per-shard blocks for (each of our
       shards, each of the source group's shards), offset into the combined sequences
    3. all-to-all back: out and lse return to the sequence sharding

Load balance: each rank computes 1/U of the heads of its group's U shards, so a layout that
balances causal work per position (zigzag, striped) balances it per rank and per ring step too.
Costs per rank: the Ulysses all-to-alls over U ranks, and the ring's R - 1 K/V transfers of U*n
tokens of Hkv/U heads each (the same bytes as one shard's K/V for partitioned heads). U = 1 is the
ring strategy, R = 1 the Ulysses strategy.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, MeshInfo
from ringattn.strategies.ulysses import SINGLE, HeadParallel, check_heads


class HybridStrategy(HeadParallel):
    name = "hybrid"

    def groups(self, info: GroupInfo) -> tuple[GroupInfo, GroupInfo]:
        if isinstance(info, MeshInfo):
            return info.ulysses, info.ring
        return info, SINGLE  # one process (check() lets nothing else through)

    def check(self, q: torch.Tensor, k: torch.Tensor, info: GroupInfo) -> None:
        if not isinstance(info, MeshInfo):
            if info.world_size == 1:
                return
            raise ValueError(
                f"strategy='hybrid' needs group=a 2-D DeviceMesh with dims 'ulysses' and 'ring', "
                f"got a process group of {info.world_size} ranks; build one with "
                f"init_device_mesh(device_type, (ring_size, ulysses_size), "
                f"mesh_dim_names=('ring', 'ulysses')), or use strategy='ring' or 'ulysses'"
            )
        size = info.ulysses.world_size
        check_heads(q.shape[1], size, f"strategy='hybrid' with a 'ulysses' mesh dim of size {size}")
