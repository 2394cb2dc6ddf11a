"""Process groups as ringattn sees them: a resolved group, and a 2-D mesh's flattened world.

resolve_group(group)  a ProcessGroup, a 1-D DeviceMesh or None -> GroupInfo(group, rank, size)
                      (a 2-D "ulysses" x "ring" mesh -> MeshInfo, the flattened world)
single_group(info)    refuses a MeshInfo where one process group is needed
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupInfo:
    """A resolved process group: `group` is None when running as a single process."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @property
    def key(self) -> str:
        """A name for caches that must not mix groups."""
        return "single" if self.group is None else self.group.group_name


def resolve_group(group: object = None, *, allow_2d: bool = False) -> GroupInfo:
    """Turn the user's `group` argument into a GroupInfo.

    None means the default group, or a single process when torch.distributed is not initialised.
    A DeviceMesh must be 1-D, unless `allow_2d` (the hybrid strategy, shard/unshard/positions):
    then a 2-D mesh with dims "ulysses" and "ring" gives its flattened world (`MeshInfo`).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim == 2 and allow_2d:
            return resolve_mesh(group)
        if group.ndim != 1:
            raise ValueError(
                f"this strategy needs a 1-D process group, got a {group.ndim}-D DeviceMesh "
                f"with dims {group.mesh_dim_names}; pass mesh[dim_name] or use strategy='hybrid'"
            )
        group = group.get_group()
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return GroupInfo(None, 0, 1)
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
            f"got {type(group).__name__}"
        )
    return GroupInfo(group, dist.get_rank(group), dist.get_world_size(group))


def backend_device(info: GroupInfo, like: torch.device) -> torch.device:
    """Device that collectives of this group take tensors on (NCCL: CUDA; gloo: CPU)."""
    if info.group is None:
        return like
    backend = str(dist.get_backend(info.group)).lower()
    if "nccl" in backend and like.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return like if "nccl" in backend else torch.device("cpu")


def single_group(info: GroupInfo, what: str) -> GroupInfo:
    """`info` itself, refusing a 2-D mesh's flattened world, which has no one process group.

    (`MeshInfo.group` is the ulysses sub-group, kept for backend queries only: a collective on it
    would silently talk to the wrong ranks.)
    """
    if isinstance(info, MeshInfo):
        raise TypeError(
            f"{what} needs one process group, but got the flattened world of a 2-D mesh "
            f"({info.ring.world_size} x {info.ulysses.world_size}); pass its 'ring' or 'ulysses' "
            f"sub-group (info.ring / info.ulysses)"
        )
    return info


# ---- 2-D meshes: the hybrid strategy's "ulysses" x "ring" world --------------------------------


@dataclass(frozen=True)
class MeshInfo(GroupInfo):
    """A 2-D DeviceMesh with dims "ulysses" (size U) and "ring" (size R) seen as one world.

    The rank at ulysses index u and ring index g has flattened rank `g * U + u` of `R * U`
    (ring-major: the U ranks of one ulysses group hold consecutive flattened ranks), whatever the
    order of the dims in the mesh. With the usual mesh `(R, U)`, dims `("ring", "ulysses")`, the
    flattened rank is the global rank. `group` is the ulysses sub-group, there only so backend
    queries (device, NCCL or gloo) work; collectives over the whole world go through
    `_gather_list` / `all_gather_json`, which gather in two stages.
    """

    ulysses: GroupInfo
    ring: GroupInfo

    @property
    def key(self) -> str:
        return f"mesh({self.ulysses.key},{self.ring.key})"


MESH_DIMS = ("ulysses", "ring")


def resolve_mesh(mesh: object) -> MeshInfo:
    """The flattened world of a 2-D mesh with dims "ulysses" and "ring" (ValueError otherwise)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != sorted(MESH_DIMS):
        raise ValueError(
            f"a 2-D DeviceMesh for ringattn needs dims named 'ulysses' and 'ring', got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)} with dims {names or None}; build it "
            f"with init_device_mesh(device_type, (ring_size, ulysses_size), "
            f"mesh_dim_names=('ring', 'ulysses'))"
        )
    ulysses = resolve_group(mesh.get_group("ulysses"))
    ring = resolve_group(mesh.get_group("ring"))
    return MeshInfo(
        ulysses.group,
        ring.rank * ulysses.world_size + ulysses.rank,
        ring.world_size * ulysses.world_size,
        ulysses,
        ring,
    )
