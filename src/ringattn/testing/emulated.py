"""An emulated ring: one rank's share of a W-way ring attention, run on one device.

Measuring a ring against single-device attention needs W devices, unless the ring is emulated: all
W ranks' shards live on one device, and a rank's share of the work runs exactly as on a real rank.
The loops below mirror ring.py step for step, with the same `plan.Call` schedule, the same
`plan.block_forward` / `plan.block_backward` kernels and the same merge, only the transport differs:

    real rank r (ring.py)                      emulated rank r (here)
    -----------------------------------        ------------------------------------------------
    post isend kv -> r+1, irecv kv' <- r-1     post copy kv_shards[src(t+1)] -> kv_next, on a side
                                               CUDA stream (CPU: a plain copy), one event to wait on
    blocks of (r, src): kernel, merge          the same calls
    wait, swap kv and kv'                      main stream waits on the copy's event, swap
    backward: dK/dV partial of src arrives,    backward: the partial of src is dkv_partials[src]
      += our block dk, dv, send it on            (float32, shared by all emulated ranks), += ours,
                                                 and one copy of it per step stands for the send

So one step moves the same bytes as a real step (one K/V message, one dK/dV message in backward),
and the compute waits for them at the same points. Run every rank (`run_ring`) and the results are
the ring's: out, lse and dq of rank r are computed by exactly the same operations; dk and dv differ
only in the order the W contributions are added (rank order here, ring order on a real ring).

Memory: a real rank holds its travelling dK/dV partial; here the partials of all ranks live in
`dkv_partials`, so a measured per-rank peak must add one partial's bytes (`partial_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo
from ringattn.kernels import select_kernel
from ringattn.kernels.triton_merge import merge_fused_
from ringattn.layout import Layout, get_layout
from ringattn.merge import accumulator_dtype
from ringattn.plan import (
    Call,
    accumulate_block,
    accumulate_dq,
    block_backward,
    block_forward,
    empty_accumulators,
    rows,
)

Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LocalTransport:
    """The "transfers" of an emulated ring: device copies, on a side stream on CUDA.

    `post` orders the copy after everything already queued on the current stream (the buffer it
    overwrites was last read there) and returns an event; `wait` makes the current stream wait for
    it. On CPU the copy runs at once and `wait` has nothing to do.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def post(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, handle: torch.cuda.Event | None) -> None:
        if handle is not None:
            handle.wait(torch.cuda.current_stream(self.device))


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
) -> Call:
    """The Call a real ring of `world_size` ranks would get for local q, k like these."""
    layout_obj = get_layout(layout) if isinstance(layout, str) else layout
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = select_kernel(backend, q, k)
    return Call(GroupInfo(None, 0, world_size), layout_obj, kernel, bool(causal), scale)


def forward_share(
    call: Call,
    shards: Shards,
    rank: int,
    transport: LocalTransport,
    merge: Merge | None = merge_fused_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s ring forward: (out, lse) of its queries over the whole sequence.

    `merge=None` skips the merge (the kernels' share of the time only; the result is wrong).
    """
    world_size = shards.world_size
    q = shards.q[rank]
    s = q.shape[2]
    out = lse = None  # started by the first block over all rows, as in ring.py
    steps = call.ring_steps(s)
    ring = steps > 1  # one step: no transport, the local K/V as they are (as ring.py)
    kv = shards.kv[rank].clone() if ring else shards.kv[rank]  # the ring's torch.stack([k, v])
    kv_next = torch.empty_like(kv) if ring else None
    for step in range(steps):
        src = (rank - step) % world_size
        arrival = None
        if step + 1 < steps:
            arrival = transport.post(kv_next, shards.kv[(src - 1) % world_size])
        for block in call.blocks(rank, src, s):
            block_out, block_lse = block_forward(call, q, kv[0], kv[1], block)
            out, lse = accumulate_block(out, lse, q, block, block_out, block_lse, merge)
        if step + 1 < steps:
            transport.wait(arrival)
            kv, kv_next = kv_next, kv
    if out is None:
        out, lse = empty_accumulators(q)
    return out.to(q.dtype), lse


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
    dkv_partials: torch.Tensor,
    transport: LocalTransport,
) -> torch.Tensor:
    """Rank `rank`'s ring backward: returns its dq and adds its dk, dv contributions to
    `dkv_partials[src]` for every src it attends to. `out`, `lse` are the rank's forward results.
    After every rank has run, `dkv_partials[r]` holds rank r's dk, dv (see `finish_dkv`)."""
    world_size = shards.world_size
    q, dout = shards.q[rank], shards.dout[rank]
    s = q.shape[2]
    dq = None
    steps = call.ring_steps(s)
    ring = steps > 1
    kv = shards.kv[rank].clone() if ring else shards.kv[rank]
    kv_next = torch.empty_like(kv) if ring else None
    wire = torch.empty_like(dkv_partials[0]) if ring else None  # the ring's second dK/dV buffer
    sent = None
    for step in range(steps):
        src = (rank - step) % world_size
        arrival = None
        if step + 1 < steps:
            arrival = transport.post(kv_next, shards.kv[(src - 1) % world_size])
        grads = [
            (block, block_backward(call, dout, q, kv[0], kv[1], out, lse, block))
            for block in call.blocks(rank, src, s)
        ]
        for block, (block_dq, _, _) in grads:
            dq = accumulate_dq(dq, q, block, block_dq)
        transport.wait(sent)  # the previous partial has left: its buffers may change
        dkv = dkv_partials[src]
        for block, (_, block_dk, block_dv) in grads:
            rows(dkv[0], block.kv_start, block.kv_stop).add_(block_dk)
            rows(dkv[1], block.kv_start, block.kv_stop).add_(block_dv)
        if ring:
            sent = transport.post(wire, dkv)  # the partial moves on to the next rank
        if step + 1 < steps:
            transport.wait(arrival)
            kv, kv_next = kv_next, kv
    transport.wait(sent)
    if dq is None:
        dq = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    return dq.to(q.dtype)


def finish_dkv(
    dkv_partials: torch.Tensor, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s dk, dv from the summed partial, cast once (as the ring's last step)."""
    return dkv_partials[rank, 0].to(dtype), dkv_partials[rank, 1].to(dtype)


def run_ring(
    call: Call, shards: Shards, merge: Merge | None = merge_fused_
) -> list[dict[str, torch.Tensor]]:
    """Every rank's out, lse (and dq, dk, dv when shards carry dout), one rank at a time."""
    transport = LocalTransport(shards.q.device)
    results = []
    for rank in range(shards.world_size):
        out, lse = forward_share(call, shards, rank, transport, merge)
        results.append({"out": out, "lse": lse})
    if shards.dout is None:
        return results
    partials = new_partials(shards)
    for rank, result in enumerate(results):
        result["dq"] = backward_share(
            call, shards, rank, result["out"], result["lse"], partials, transport
        )
    for rank, result in enumerate(results):
        result["dk"], result["dv"] = finish_dkv(partials, rank, shards.kv.dtype)
    return results
