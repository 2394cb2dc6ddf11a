"""Ring strategy: K/V shards travel around the ring while each rank keeps its queries.

Forward, rank r, world size W. At step t the rank holds the K/V shard of src = (r - t) mod W:

    step t:  post  send kv -> r+1, recv kv' <- r-1      (double buffer, not waited on yet)
             for each block of the schedule (r, src):   kernel forward, merge into (out, lse)
             wait, swap kv and kv'

That is W-1 K/V transfers, each hidden behind one step of compute. When a sliding window makes
every later step empty on every rank (a pure function of the schedule, so all ranks agree), the
ring stops early and moves nothing more (`RingSchedule.steps`). `out` and `lse` accumulate in
float32 (float64 for float64 input) and `out` is cast once at the end.

Backward. The gradient of the K/V shard of src is the sum of contributions from every rank's
queries, so a float32 dK/dV accumulator travels with the K/V shard, one hop behind it:

    step t:  post  kv exchange (as forward)
             block gradients against src, using the global out and lse; dq += block dq
             receive the dK/dV partial of src from r-1 (step 0: our own, zero), add ours
             post  send that partial on
             wait kv exchange, swap

After the last step the partial that arrives holds every rank's contribution to our own K/V: W
dK/dV transfers in all, and W-1 K/V transfers. Only the local q, k, v, out and lse are saved for
backward; no received K/V block is kept.

The loops touch messages only through a transport (`comm.RingTransport` between real ranks,
`testing.emulated.LocalTransport` between W emulated ranks on one device), and blocks only through
a `RingSchedule` (strategies/grouped.py), which is how Ulysses and the hybrid strategy reuse them.
"""

from __future__ import annotations

import torch

from ringattn.comm import RingTransport
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
from ringattn.strategies.base import Forward, Strategy
from ringattn.strategies.grouped import RingSchedule


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    schedule: RingSchedule,
    transport: RingTransport,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this ring rank's queries over every rank's keys (module docstring)."""
    call, rank, world_size = schedule.call, schedule.rank, schedule.world_size
    s = q.shape[2]
    out = lse = None  # the first block over all rows becomes the accumulator (no merge pass)
    steps = schedule.steps(s)
    ring = steps > 1
    kv = torch.stack([k, v]) if ring else None  # (2, B, Hkv, S, D): one message per step
    kv_next = torch.empty_like(kv) if ring else None
    for step in range(steps):
        src = (rank - step) % world_size
        more = step + 1 < steps
        pending = transport.post_kv(kv, kv_next, step) if more else None
        keys, values = (kv[0], kv[1]) if ring else (k, v)
        for block in schedule.blocks(rank, src, s):
            block_out, block_lse = block_forward(call, q, keys, values, block)
            out, lse = accumulate_block(out, lse, q, block, block_out, block_lse, call.merge)
        if more:
            transport.wait(pending)
            kv, kv_next = kv_next, kv
    if out is None:  # no block at all: every local row is padding
        out, lse = empty_accumulators(q)
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    schedule: RingSchedule,
    transport: RingTransport,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this ring rank from the global out and lse (module docstring)."""
    call, rank, world_size = schedule.call, schedule.rank, schedule.world_size
    s = q.shape[2]
    dq = None  # like out in the forward: the first block over all rows starts it
    steps = schedule.steps(s)
    ring = steps > 1
    kv = torch.stack([k, v]) if ring else None
    kv_next = torch.empty_like(kv) if ring else None
    dkv = transport.new_partial(k)  # (2, B, Hkv, S, D): the travelling dK/dV partial sum
    pending_dkv = None  # a partial on its way to us (none before step 1)
    for step in range(steps):
        src = (rank - step) % world_size
        more = step + 1 < steps
        pending_kv = transport.post_kv(kv, kv_next, step) if more else None
        keys, values = (kv[0], kv[1]) if ring else (k, v)
        grads = [
            (block, block_backward(call, dout, q, keys, values, out, lse, block))
            for block in schedule.blocks(rank, src, s)
        ]
        for block, (block_dq, _, _) in grads:
            dq = accumulate_dq(dq, q, block, block_dq)
        if pending_dkv is not None:
            dkv = transport.receive_partial(pending_dkv)  # the partial of src
        for block, (_, block_dk, block_dv) in grads:
            rows(dkv[0], block.kv_start, block.kv_stop).add_(block_dk)
            rows(dkv[1], block.kv_start, block.kv_stop).add_(block_dv)
        if ring:
            pending_dkv = transport.post_partial(dkv, step, steps)
        if more:
            transport.wait(pending_kv)
            kv, kv_next = kv_next, kv
    if pending_dkv is not None:
        dkv = transport.receive_partial(pending_dkv)  # every rank's contribution to our K/V
    if dq is None:
        dq = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingStrategy(Strategy):
    name = "ring"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call) -> Forward:
        out, lse = ring_forward(q, k, v, RingSchedule(call, call.info), RingTransport(call.info))
        return Forward(out, lse, (q, k, v, out, lse))

    def backward(
        self, dout: torch.Tensor, saved: tuple[torch.Tensor, ...], call: Call
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        schedule, transport = RingSchedule(call, call.info), RingTransport(call.info)
        return ring_backward(dout, *saved, schedule, transport)
