"""An emulated ring world: W ranks' shards on one device, run by the shipped ring loops.

Measuring a ring against single-device attention needs W devices, unless the ring is emulated: all
W ranks' shards live on one device, and each rank's share of the work runs through the very loops
a real rank runs (`strategies.ring.ring_forward` / `ring_backward`), with the same `plan.Call`
schedule, block kernels and merge. Only the transport differs: `LocalTransport` implements the
ring's transport seam (see `comm.RingTransport`) by moving blocks between the emulated ranks:

    real rank r (comm.RingTransport)           emulated rank r (LocalTransport)
    -----------------------------------        ------------------------------------------------
    post_kv: isend kv -> r+1, irecv <- r-1     copy the K/V of the next src into kv_next, on a
                                               side CUDA stream (CPU: a plain copy); an event
    wait: the works complete                   the current stream waits on the copy's event
    new_partial: zeros                         the world's partial of our own K/V
    post_partial: isend dK/dV partial on       one copy of it (the bytes a send moves); the sum
                                               itself lives in the world's partials
    receive_partial: the partial that arrives  the world's partial of the next src

So one step moves the same bytes as a real step (one K/V message, one dK/dV message in backward),
and the compute waits for them at the same points. Emulated ranks run one after another; each
adds its dK/dV contributions into the shared `World.partials`, so after every rank's backward has
run, `partials[r]` holds rank r's dk, dv (`finish_dkv`). out, lse and dq of rank r are computed by
exactly the same operations as on a real ring; dk and dv differ only in the order the W
contributions are added (rank order here, ring order on a real ring).

Memory: a real rank holds its travelling dK/dV partial; here the partials of all ranks live in
the world, so a measured per-rank peak must add one partial's bytes (`partial_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo
from ringattn.kernels import select_kernel
from ringattn.kernels.triton_merge import merge_fused_
from ringattn.layout import Layout, get_layout
from ringattn.merge import accumulator_dtype
from ringattn.plan import Call, Merge
from ringattn.strategies.grouped import RingSchedule
from ringattn.strategies.ring import ring_backward, ring_forward


@dataclass
class Shards:
    """Every rank's shard of one global sequence, stacked on one device.

    q, dout: (W, B, Hq, n, D); kv: (W, 2, B, Hkv, n, D) (K and V of a rank as one message, as the
    ring sends them). Each rank's slice is contiguous, as on a real rank.
    """

    q: torch.Tensor
    kv: torch.Tensor
    dout: torch.Tensor | None
    index: list[torch.Tensor]  # per rank: the global positions of its tokens (length n)

    @property
    def world_size(self) -> int:
        return self.q.shape[0]


def make_shards(
    layout: Layout,
    world_size: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None = None,
) -> Shards:
    """Shard global (B, H, S, D) tensors with `layout`; one copy of each input, no more."""
    seq_len = q.shape[2]
    layout.check_seq_len(seq_len, world_size)
    n = seq_len // world_size
    index = [layout.global_indices(seq_len, world_size, r).to(q.device) for r in range(world_size)]

    def stack(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((world_size, *x.shape[:2], n, x.shape[3]), dtype=x.dtype, device=x.device)
        for r in range(world_size):
            torch.index_select(x, 2, index[r], out=out[r])
        return out  # (W, B, H, n, D)

    kv = torch.empty((world_size, 2, *k.shape[:2], n, k.shape[3]), dtype=k.dtype, device=k.device)
    for r in range(world_size):
        torch.index_select(k, 2, index[r], out=kv[r, 0])
        torch.index_select(v, 2, index[r], out=kv[r, 1])
    return Shards(stack(q), kv, None if dout is None else stack(dout), index)


def make_call(
    layout: str | Layout,
    world_size: int,
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    backend: str = "auto",
    scale: float | None = None,
    merge: Merge | None = merge_fused_,
) -> Call:
    """The Call a real ring of `world_size` ranks would get for local q, k like these.

    `merge=None` skips the merge (benchmarks: the kernels' share of the time, a wrong result).
    """
    layout_obj = get_layout(layout) if isinstance(layout, str) else layout
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = select_kernel(backend, q, k)
    info = GroupInfo(None, 0, world_size)
    return Call(info, layout_obj, kernel, bool(causal), scale, merge=merge)


class LocalTransport:
    """The ring's transport seam between W emulated ranks on one device (module docstring).

    `post_kv` orders the copy after everything already queued on the current stream (the buffer
    it overwrites was last read there) and returns an event; `wait` makes the current stream wait
    for it. On CPU the copy runs at once and `wait` has nothing to do.
    """

    def __init__(self, shards: Shards, partials: torch.Tensor | None, rank: int):
        self.shards, self.partials, self.rank = shards, partials, rank
        self.device = shards.q.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.wire: torch.Tensor | None = None  # what a sent partial is copied to
        self.moved: list[int] = []  # elements of each message moved (K/V and dK/dV), for tests

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        self.moved.append(src.numel())
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def _src(self, step: int) -> int:
        return (self.rank - step) % self.shards.world_size

    def post_kv(self, kv: torch.Tensor, kv_next: torch.Tensor, step: int):
        return self._copy(kv_next, self.shards.kv[self._src(step + 1)])

    def wait(self, pending: torch.cuda.Event | None) -> None:
        if pending is not None:
            pending.wait(torch.cuda.current_stream(self.device))

    def new_partial(self, like: torch.Tensor) -> torch.Tensor:
        assert self.partials is not None, "a backward needs the world's partials"
        return self.partials[self.rank]

    def post_partial(self, dkv: torch.Tensor, step: int, steps: int):
        if self.wire is None:
            self.wire = torch.empty_like(dkv)
        next_src = self._src(step + 1) if step + 1 < steps else self.rank
        return self._copy(self.wire, dkv), next_src

    def receive_partial(self, pending) -> torch.Tensor:
        event, src = pending
        self.wait(event)
        return self.partials[src]


def rank_call(call: Call, rank: int, world_size: int) -> Call:
    """`call` as emulated rank `rank` of `world_size` sees it."""
    return dataclasses.replace(call, info=GroupInfo(None, rank, world_size))


def forward_share(
    call: Call, shards: Shards, rank: int, transport: LocalTransport | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s ring forward, (out, lse), through the shipped loop."""
    call = rank_call(call, rank, shards.world_size)
    kv = shards.kv[rank]
    transport = transport or LocalTransport(shards, None, rank)
    return ring_forward(shards.q[rank], kv[0], kv[1], RingSchedule(call, call.info), transport)


def new_partials(shards: Shards) -> torch.Tensor:
    """Zeroed dK/dV partial sums of every rank's K/V: (W, 2, B, Hkv, n, D), accumulator dtype."""
    acc = accumulator_dtype(shards.kv.dtype)
    return torch.zeros(shards.kv.shape, dtype=acc, device=shards.kv.device)


def partial_bytes(shards: Shards) -> int:
    """Bytes of one rank's travelling dK/dV partial (held by a real rank, shared here)."""
    return shards.kv[0].numel() * accumulator_dtype(shards.kv.dtype).itemsize


def backward_share(
    call: Call,
    shards: Shards,
    rank: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    partials: torch.Tensor,
    transport: LocalTransport | None = None,
) -> torch.Tensor:
    """Rank `rank`'s ring backward through the shipped loop: returns its dq and adds its dk, dv
    contributions into `partials[src]` for every src it attends to. After every rank has run,
    `partials[r]` holds rank r's dk, dv (see `finish_dkv`)."""
    call = rank_call(call, rank, shards.world_size)
    kv = shards.kv[rank]
    transport = transport or LocalTransport(shards, partials, rank)
    schedule = RingSchedule(call, call.info)
    dq, _, _ = ring_backward(
        shards.dout[rank], shards.q[rank], kv[0], kv[1], out, lse, schedule, transport
    )
    return dq


def finish_dkv(
    partials: torch.Tensor, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s dk, dv from the summed partial, cast once (as the ring's last step)."""
    return partials[rank, 0].to(dtype), partials[rank, 1].to(dtype)


def run_ring(call: Call, shards: Shards) -> list[dict[str, torch.Tensor]]:
    """Every rank's out, lse (and dq, dk, dv when shards carry dout), one rank at a time."""
    results = []
    for rank in range(shards.world_size):
        out, lse = forward_share(call, shards, rank)
        results.append({"out": out, "lse": lse})
    if shards.dout is None:
        return results
    partials = new_partials(shards)
    for rank, result in enumerate(results):
        result["dq"] = backward_share(call, shards, rank, result["out"], result["lse"], partials)
    for rank, result in enumerate(results):
        result["dk"], result["dv"] = finish_dkv(partials, rank, shards.kv.dtype)
    return results
