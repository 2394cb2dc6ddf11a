"""Collectives: all-gathers (tensors, ints, JSON), a JSON broadcast, reduce-scatter, all-to-all,
all-reduce.

With one rank (or no initialised process group) nothing here communicates: gloo cannot send to
itself, and a single process needs no transport at all. A 2-D mesh's flattened world (MeshInfo)
gathers in two stages, over ulysses then over ring (`_gather_list`).
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from ringattn.comm.groups import GroupInfo, MeshInfo, backend_device, single_group
from ringattn.comm.ring import RingComm, wait


def all_gather_cat(x: torch.Tensor, dim: int, info: GroupInfo) -> torch.Tensor:
    """Every rank's `x` (all the same shape) concatenated along `dim`, in rank order."""
    if info.world_size == 1:
        return x
    device = backend_device(info, x.device)
    x_comm = x.detach().contiguous().to(device)
    parts = _gather_list(x_comm, info)
    return torch.cat(parts, dim=dim).to(x.device)


def all_gather_ints(values: list[int], info: GroupInfo, device: torch.device) -> list[list[int]]:
    """Every rank's list of integers (all lists of one length), for agreement checks."""
    local = torch.tensor(values, dtype=torch.int64, device=backend_device(info, device))
    if info.world_size == 1:
        return [values]
    return [part.tolist() for part in _gather_list(local, info)]


def all_gather_json(obj: object, info: GroupInfo) -> list[object]:
    """Every rank's JSON-serialisable `obj` (agreement checks and their error messages).

    JSON, not pickle: a peer's bytes are data, never code (pickle.loads runs what it is given).
    """
    if info.world_size == 1:
        return [obj]
    if isinstance(info, MeshInfo):  # two stages, as _gather_list
        inner = all_gather_json(obj, info.ulysses)
        return [x for part in all_gather_json(inner, info.ring) for x in part]
    payload = json.dumps(obj).encode()
    device = backend_device(info, torch.device("cpu"))
    sizes = [row[0] for row in all_gather_ints([len(payload)], info, device)]
    local = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local, group=info.group)
    return [json.loads(bytes(part[:size].cpu().tolist())) for part, size in zip(parts, sizes)]


def broadcast_json(obj: object, info: GroupInfo, src: int = 0) -> object:
    """Rank `src`'s JSON-serialisable `obj` on every rank (others pass anything, say None).

    Two broadcasts: the payload's length, then its bytes. JSON for the same reason as
    all_gather_json. The server (ringattn.serve) sends each admitted request this way.
    """
    if info.world_size == 1:
        return obj
    group = single_group(info, "broadcast_json").group
    device = backend_device(info, torch.device("cpu"))
    payload = json.dumps(obj).encode() if info.rank == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    root = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(size, src=root, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if info.rank == src:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=root, group=group)
    return json.loads(bytes(data.cpu().tolist()))


def _gather_list(x: torch.Tensor, info: GroupInfo) -> list[torch.Tensor]:
    """Every rank's `x` in (flattened) rank order; a mesh gathers over ulysses, then over ring."""
    if info.world_size == 1:
        return [x]
    if isinstance(info, MeshInfo):
        inner = torch.stack(_gather_list(x, info.ulysses))  # (U, ...)
        return [part for outer in _gather_list(inner, info.ring) for part in outer.unbind(0)]
    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x, group=info.group)
    return parts


# ---- collectives of the all-gather and Ulysses strategies ---------------------------------------


# torch 2.13 names the flat collectives all_gather_single / reduce_scatter_single and deprecates
# all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on every call); torch 2.11, on
# the GPU machine, has only the old names. Not dead code: each branch runs on one of them.
# Looked up per call, so a wrapped or patched torch.distributed is seen.
def _all_gather_flat(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        *args, **kwargs
    )


def _reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        *args, **kwargs
    )


RS_TAG = 2  # ring reduce-scatter messages (the ring strategy uses tags 0 and 1)


def all_gather_async(x: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post the gather of every rank's `x` into a (W, *x.shape) tensor; wait(works) to read it.

    One all-gather of x.numel() elements per rank: each rank receives (W - 1) * x's bytes.
    """
    if info.world_size == 1:
        return x.unsqueeze(0), []
    single_group(info, "all_gather_async")
    out = torch.empty((info.world_size, *x.shape), dtype=x.dtype, device=x.device)
    work = _all_gather_flat(out.view(-1), x.contiguous().view(-1), group=info.group, async_op=True)
    return out, [work]


def _is_nccl(info: GroupInfo) -> bool:
    return info.group is not None and "nccl" in str(dist.get_backend(info.group)).lower()


def reduce_scatter(x: torch.Tensor, info: GroupInfo, *, native: bool | None = None) -> torch.Tensor:
    """x is (W, *shape) on every rank; rank r gets the sum over all ranks of their x[r].

    `native` (default: on NCCL) uses the backend's reduce_scatter. Otherwise (gloo, whose
    reduce_scatter only exists in recent torch releases) a ring of W - 1 point-to-point steps:
    at step t rank r sends its running sum of slice (r - t - 1) mod W to r + 1 and adds its own
    part of slice (r - t - 2) mod W to what arrives from r - 1; after the last step the arriving
    sum is slice r minus our own part. Either way each rank sends and receives (W - 1) slices, the
    minimum, and the order of additions is fixed (deterministic). An all-reduce of the whole
    buffer followed by a slice moves about twice as much (a ring all-reduce is a reduce-scatter
    plus an all-gather); W reduce calls, one per destination, move about as much as the ring but
    run W collectives one after another.
    """
    world_size, rank = info.world_size, info.rank
    assert x.shape[0] == world_size, (tuple(x.shape), world_size)
    if world_size == 1:
        return x[0]
    single_group(info, "reduce_scatter")
    x = x.contiguous()
    if _is_nccl(info) if native is None else native:
        out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
        _reduce_scatter_flat(out.view(-1), x.view(-1), group=info.group)
        return out
    ring = RingComm(info)
    send, recv = x[(rank - 1) % world_size].clone(), torch.empty_like(x[0])
    for step in range(world_size - 1):
        wait(ring.exchange([(send, recv)], RS_TAG))
        recv.add_(x[(rank - step - 2) % world_size])  # the slice that just arrived, plus ours
        send, recv = recv, send
    return send


_ALIGN = 8  # bytes: every tensor in an all-to-all message starts at a multiple of this


def _padded_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    nbytes = math.prod(shape) * dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


def all_to_all(
    sends: list[list[torch.Tensor]],
    recv_specs: list[list[tuple[tuple[int, ...], torch.dtype]]],
    info: GroupInfo,
) -> list[list[torch.Tensor]]:
    """Send the tensors `sends[d]` to every rank d; receive from every rank s tensors of the
    (shape, dtype) in `recv_specs[s]`. Returns the received tensors by source rank.

    All tensors travel in one `all_to_all_single` of bytes, each at an 8-byte-aligned offset, so
    tensors of different dtypes (bf16 outputs and float32 lse) share one message. Each rank sends
    the bytes of sends[d] for d != rank; its own part is a local copy inside the collective.
    """
    if info.world_size == 1:
        return [list(sends[0])]
    single_group(info, "all_to_all")
    device = sends[0][0].device
    send_sizes = [sum(_padded_bytes(tuple(x.shape), x.dtype) for x in xs) for xs in sends]
    recv_sizes = [sum(_padded_bytes(*spec) for spec in specs) for specs in recv_specs]
    send_buf = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
    offset = 0
    for xs in sends:
        for x in xs:
            nbytes = x.numel() * x.element_size()
            send_buf[offset : offset + nbytes].view(x.dtype).view(x.shape).copy_(x)
            offset += _padded_bytes(tuple(x.shape), x.dtype)
    recv_buf = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=info.group)
    received, offset = [], 0
    for specs in recv_specs:
        parts = []
        for shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            parts.append(recv_buf[offset : offset + nbytes].view(dtype).view(shape))
            offset += _padded_bytes(shape, dtype)
        received.append(parts)
    return received


# ---- inference ----------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, info: GroupInfo, op: str = "sum") -> torch.Tensor:
    """The elementwise `op` ("sum" or "max") of every rank's `x`, the same on every rank.

    Out of place: `x` is left as it was. One collective of x.numel() elements (the decode merge of
    inference/partials.py, and the prompt's last hidden row, held by one rank, shared by all).
    """
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    assert op in ops, op
    if info.world_size == 1:
        return x.clone()
    device = backend_device(info, x.device)
    out = x.detach().to(device, copy=True).contiguous()
    dist.all_reduce(out, op=ops[op], group=info.group)
    return out.to(x.device)
