"""The only module that calls torch.distributed.

    resolve_group(group)  a ProcessGroup, a 1-D DeviceMesh or None -> GroupInfo(group, rank, size)
                          (a 2-D "ulysses" x "ring" mesh -> MeshInfo, the flattened world)
    RingComm              send to rank+1, receive from rank-1, batched isend/irecv, non-blocking
    RingTransport         the ring strategy's transport seam (K/V and dK/dV messages) on RingComm
    all_gather_cat        concatenation of every rank's tensor along a dim
    all_gather_json       every rank's JSON value (agreement checks: data, never pickles)
    all_gather_async      every rank's tensor stacked, posted without waiting (all-gather strategy)
    reduce_scatter        rank r gets the sum of every rank's r-th slice (NCCL native, else a ring)
    all_to_all            per-destination lists of tensors of any dtypes, as one all_to_all_single

With one rank (or no initialised process group) nothing here communicates: gloo cannot send to
itself, and a single process needs no transport at all.

Ring exchanges are posted with `batch_isend_irecv` and waited on only when the data is needed, so
the transfer overlaps the compute in between. On NCCL `wait()` only orders the current CUDA stream
after the transfer; it does not block the host.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringattn.merge import accumulator_dtype


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


class RingComm:
    """Point-to-point ring: every rank sends to rank+1 and receives from rank-1 at once."""

    def __init__(self, info: GroupInfo):
        assert info.world_size > 1, "a ring of one rank has nothing to exchange"
        single_group(info, "a ring")
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


KV_TAG, DKV_TAG = 0, 1  # the ring strategy's two message streams


class RingTransport:
    """The ring loop's transport seam, over real point-to-point messages between ranks.

    The ring strategy (strategies/ring.py) moves two kinds of messages and touches them only
    through these calls, so the same loop runs over `testing.emulated.LocalTransport` (W emulated
    ranks on one device) for benchmarks and single-device tests:

        post_kv(kv, kv_next, step)          send this step's K/V on, receive the next into kv_next
        new_partial(like)                   the float32 dK/dV partial of our own K/V, before any
                                            contribution (zeros)
        post_partial(dkv, step, steps)      send the partial we hold on to whoever needs it next
        receive_partial(pending) -> dkv     wait for the partial that arrives instead
        wait(pending)                       complete a posted K/V exchange

    Nothing is set up until the first message, so a ring of one rank (or a one-step ring) costs
    nothing.
    """

    def __init__(self, info: GroupInfo):
        self.info = info
        self._comm: RingComm | None = None
        self._spare: torch.Tensor | None = None  # the partial buffer the next one arrives in

    @property
    def comm(self) -> RingComm:
        if self._comm is None:
            self._comm = RingComm(self.info)
        return self._comm

    def post_kv(self, kv: torch.Tensor, kv_next: torch.Tensor, step: int) -> list[dist.Work]:
        return self.comm.exchange([(kv, kv_next)], KV_TAG)

    def wait(self, pending: list[dist.Work]) -> None:
        wait(pending)

    def new_partial(self, like: torch.Tensor) -> torch.Tensor:
        acc = accumulator_dtype(like.dtype)
        return torch.zeros((2, *like.shape), dtype=acc, device=like.device)

    def post_partial(
        self, dkv: torch.Tensor, step: int, steps: int
    ) -> tuple[list[dist.Work], torch.Tensor]:
        # a ring cut short returns its last partial straight to its owner, steps - 1 ranks behind
        hop = 1 if step + 1 < steps else self.info.world_size - steps + 1
        recv = torch.empty_like(dkv) if self._spare is None else self._spare
        works = self.comm.exchange([(dkv, recv)], DKV_TAG, hop)
        self._spare = dkv  # free again once `works` completed (receive_partial waits on them)
        return works, recv

    def receive_partial(self, pending: tuple[list[dist.Work], torch.Tensor]) -> torch.Tensor:
        works, recv = pending
        wait(works)
        return recv


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

RS_TAG = 2  # ring reduce-scatter messages (the ring strategy uses tags 0 and 1)


def all_gather_async(x: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post the gather of every rank's `x` into a (W, *x.shape) tensor; wait(works) to read it.

    One all-gather of x.numel() elements per rank: each rank receives (W - 1) * x's bytes.
    """
    if info.world_size == 1:
        return x.unsqueeze(0), []
    single_group(info, "all_gather_async")
    out = torch.empty((info.world_size, *x.shape), dtype=x.dtype, device=x.device)
    work = dist.all_gather_into_tensor(
        out.view(-1), x.contiguous().view(-1), group=info.group, async_op=True
    )
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
        dist.reduce_scatter_tensor(out.view(-1), x.view(-1), group=info.group)
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
