"""All-gather strategy: every rank gathers all K/V shards, then computes its queries against them.

Forward, rank r of W:

    post   all-gather of kv = (k, v) packed as (2, B, Hkv, n, D)  ->  (W, 2, B, Hkv, n, D)
    blocks of (r, r) from the local k, v                          (overlaps the all-gather)
    wait
    blocks of (r, src) for src = r-1, r-2, ...  from the gathered buffer, merged in float32

The schedule is the ring's (`call.blocks(r, src, n)`, the same merge order), only the transport
differs: one collective instead of W - 1 dependent steps, and no merge waits on a transfer after
the first. When no rank has work against another rank's keys (a short sliding window), nothing is
gathered.

Backward gathers K/V again rather than keeping the gathered buffer: autograd keeps only the local
q, k, v, out and lse, W times less than the gathered K/V. Each rank computes dq for its queries
and the contributions of its queries to every source's dK/dV, in a float32 (W, 2, B, Hkv, n, D)
buffer; one reduce-scatter then gives each rank the sum over all ranks for its own K/V.

Bytes per rank (e = bytes per element, kv = 2*B*Hkv*n*D): forward (W-1)*kv*e received; backward
(W-1)*kv*e for the gather plus (W-1)*kv*4 for the float32 reduce-scatter. Peak extra memory:
W*kv*e for the gathered K/V, and in backward W*kv*4 for the dK/dV buffer.
"""

from __future__ import annotations

import torch

from ringattn.comm import all_gather_async, reduce_scatter, wait
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


def _sources(call: Call) -> list[int]:
    """Sources in merge order: our own shard first (no transfer needed), then r-1, r-2, ..."""
    rank, world_size = call.info.rank, call.info.world_size
    return [(rank - step) % world_size for step in range(world_size)]


def _gather(call: Call, k: torch.Tensor, v: torch.Tensor, local_len: int):
    """Post the K/V all-gather when some rank needs another rank's keys; (buffer, works)."""
    if call.info.world_size == 1 or RingSchedule(call, call.info).steps(local_len) == 1:
        return None, []
    return all_gather_async(torch.stack([k, v]), call.info)  # (W, 2, B, Hkv, n, D)


class AllGatherStrategy(Strategy):
    name = "allgather"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call) -> Forward:
        s = q.shape[2]
        out = lse = None  # started by the first block over all rows (plan.accumulate_block)
        kv, works = _gather(call, k, v, s)
        for index, src in enumerate(_sources(call)):
            if index == 1:
                if kv is None:
                    break  # nothing was gathered: no rank has blocks against another's keys
                wait(works)
            keys, values = (k, v) if index == 0 else (kv[src, 0], kv[src, 1])
            for block in call.blocks(call.info.rank, src, s):
                block_result = block_forward(call, q, keys, values, block)
                out, lse = accumulate_block(out, lse, q, block, *block_result, call.merge)
        if out is None:  # no block at all: every local row is padding
            out, lse = empty_accumulators(q)
        out = out.to(q.dtype)
        return Forward(out, lse, (q, k, v, out, lse))

    def backward(
        self, dout: torch.Tensor, saved: tuple[torch.Tensor, ...], call: Call
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = saved
        rank, s = call.info.rank, q.shape[2]
        acc = accumulator_dtype(q.dtype)
        dq = None
        kv, works = _gather(call, k, v, s)
        # dkv[src]: our queries' contribution to the gradient of src's K/V (ours alone if W = 1)
        dkv = torch.zeros((1 if kv is None else len(kv), 2, *k.shape), dtype=acc, device=k.device)
        for index, src in enumerate(_sources(call)):
            if index == 1:
                if kv is None:
                    break
                wait(works)
            keys, values = (k, v) if index == 0 else (kv[src, 0], kv[src, 1])
            slot = 0 if kv is None else src
            for block in call.blocks(rank, src, s):
                block_dq, block_dk, block_dv = block_backward(
                    call, dout, q, keys, values, out, lse, block
                )
                dq = accumulate_dq(dq, q, block, block_dq)
                rows(dkv[slot, 0], block.kv_start, block.kv_stop).add_(block_dk)
                rows(dkv[slot, 1], block.kv_start, block.kv_stop).add_(block_dv)
        dkv = dkv[0] if kv is None else reduce_scatter(dkv, call.info)
        if dq is None:
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
