"""The only module that calls torch.distributed.

    resolve_group(group)  a ProcessGroup, a 1-D DeviceMesh or None -> GroupInfo(group, rank, size)
    RingComm              send to rank+1, receive from rank-1, batched isend/irecv, non-blocking
    all_gather_cat        concatenation of every rank's tensor along a dim

With one rank (or no initialised process group) nothing here communicates: gloo cannot send to
itself, and a single process needs no transport at all.

Ring exchanges are posted with `batch_isend_irecv` and waited on only when the data is needed, so
the transfer overlaps the compute in between. On NCCL `wait()` only orders the current CUDA stream
after the transfer; it does not block the host.
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


def resolve_group(group: object = None) -> GroupInfo:
    """Turn the user's `group` argument into a GroupInfo.

    None means the default group, or a single process when torch.distributed is not initialised.
    A DeviceMesh must be 1-D here (the hybrid strategy resolves its two axes itself).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
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


class RingComm:
    """Point-to-point ring: every rank sends to rank+1 and receives from rank-1 at once."""

    def __init__(self, info: GroupInfo):
        assert info.world_size > 1, "a ring of one rank has nothing to exchange"
        self.group = info.group
        self.rank, self.world_size = info.rank, info.world_size
        self.next = dist.get_global_rank(info.group, (info.rank + 1) % info.world_size)
        self.prev = dist.get_global_rank(info.group, (info.rank - 1) % info.world_size)

    def exchange(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], tag: int = 0, hop: int = 1
    ) -> list[dist.Work]:
        """Post, for each (send, recv) pair, send to the next rank and receive from the previous.

        Returns the pending works; call `wait(works)` before reading any recv buffer or writing
        any send buffer. Every rank posts the same pairs in the same order, which is what lets the
        transport match them; `tag` keeps two streams of messages (K/V and dK/dV) apart on
        transports that honour tags (gloo; NCCL matches by order, which is the same). `hop`
        sends to rank + hop and receives from rank - hop instead (a ring cut short returns its
        last dK/dV partial straight to the owner).
        """
        send_to, recv_from = self.next, self.prev
        if hop != 1:
            send_to = dist.get_global_rank(self.group, (self.rank + hop) % self.world_size)
            recv_from = dist.get_global_rank(self.group, (self.rank - hop) % self.world_size)
        ops = []
        for send, recv in pairs:
            ops.append(dist.P2POp(dist.isend, send, send_to, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, recv_from, self.group, tag))
        return dist.batch_isend_irecv(ops)


def wait(works: list[dist.Work]) -> None:
    """Complete posted transfers (on NCCL this orders the stream; it does not block the host)."""
    for work in works:
        work.wait()


def all_gather_cat(x: torch.Tensor, dim: int, info: GroupInfo) -> torch.Tensor:
    """Every rank's `x` (all the same shape) concatenated along `dim`, in rank order."""
    if info.world_size == 1:
        return x
    device = backend_device(info, x.device)
    x_comm = x.detach().contiguous().to(device)
    parts = [torch.empty_like(x_comm) for _ in range(info.world_size)]
    dist.all_gather(parts, x_comm, group=info.group)
    return torch.cat(parts, dim=dim).to(x.device)


def all_gather_ints(values: list[int], info: GroupInfo, device: torch.device) -> list[list[int]]:
    """Every rank's list of integers (all lists of one length), for agreement checks."""
    local = torch.tensor(values, dtype=torch.int64, device=backend_device(info, device))
    if info.world_size == 1:
        return [values]
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local, group=info.group)
    return [part.tolist() for part in parts]


def all_gather_objects(obj: object, info: GroupInfo) -> list[object]:
    """Every rank's picklable `obj` (used only to word error messages)."""
    if info.world_size == 1:
        return [obj]
    parts: list[object] = [None] * info.world_size
    dist.all_gather_object(parts, obj, group=info.group)
    return parts
