"""Ring strategy: K/V shards travel around the ring while each rank keeps its queries.

Forward, rank r, world size W. At step t the rank holds the K/V shard of src = (r - t) mod W:

    step t:  post  send kv -> r+1, recv kv' <- r-1      (double buffer, not waited on yet)
             for each block of layout.schedule(r, src):  kernel forward, merge into (out, lse)
             wait, swap kv and kv'

That is W-1 K/V transfers, each hidden behind one step of compute. When a sliding window makes
every later step empty on every rank (a pure function of the schedule, so all ranks agree), the
ring stops early and moves nothing more (`Call.ring_steps`). `out` and `lse` accumulate in
float32 (float64 for float64 input) and `out` is cast once at the end.

Backward. The gradient of the K/V shard of src is the sum of contributions from every rank's
queries, so a float32 dK/dV accumulator travels with the K/V shard, one hop behind it:

    step t:  post  kv exchange (as forward)
             block gradients against src, using the global out and lse; dq += block dq
             wait for the dK/dV partial of src from r-1 (step 0: start from zero), add ours
             post  send that partial -> r+1, recv the next one <- r-1
             wait kv exchange, swap

After the last step the partial that arrives from r-1 holds every rank's contribution to our own
K/V: W dK/dV transfers in all, and W-1 K/V transfers. Only the local q, k, v, out and lse are saved
for backward; no received K/V block is kept.
"""

from __future__ import annotations

import torch

from ringattn.comm import RingComm, wait
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

KV_TAG, DKV_TAG = 0, 1


class RingStrategy:
    name = "ring"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rank, world_size = call.info.rank, call.info.world_size
        s = q.shape[2]
        out = lse = None  # the first block over all rows becomes the accumulator (no merge pass)
        steps = call.ring_steps(s)
        ring = RingComm(call.info) if steps > 1 else None
        kv = torch.stack([k, v]) if ring else None  # (2, B, Hkv, S, D): one message per step
        kv_next = torch.empty_like(kv) if ring else None
        for step in range(steps):
            src = (rank - step) % world_size
            works = ring.exchange([(kv, kv_next)], KV_TAG) if ring and step + 1 < steps else []
            keys, values = (kv[0], kv[1]) if ring else (k, v)
            for block in call.blocks(rank, src, s):
                block_result = block_forward(call, q, keys, values, block)
                out, lse = accumulate_block(out, lse, q, block, *block_result)
            if works:
                wait(works)
                kv, kv_next = kv_next, kv
        if out is None:  # no block at all: every local row is padding
            out, lse = empty_accumulators(q)
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: Call,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rank, world_size = call.info.rank, call.info.world_size
        s = q.shape[2]
        acc = accumulator_dtype(q.dtype)
        dq = None  # like out in the forward: the first block over all rows starts it
        steps = call.ring_steps(s)
        ring = RingComm(call.info) if steps > 1 else None
        kv = torch.stack([k, v]) if ring else None
        kv_next = torch.empty_like(kv) if ring else None
        # dkv: the travelling dK/dV partial sum; dkv_other: the buffer the next one arrives in
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        dkv_other = torch.empty_like(dkv) if ring else None
        dkv_works: list = []
        for step in range(steps):
            src = (rank - step) % world_size
            kv_works = ring.exchange([(kv, kv_next)], KV_TAG) if ring and step + 1 < steps else []
            keys, values = (kv[0], kv[1]) if ring else (k, v)
            grads = [
                (block, block_backward(call, dout, q, keys, values, out, lse, block))
                for block in call.blocks(rank, src, s)
            ]
            for block, (block_dq, _, _) in grads:
                dq = accumulate_dq(dq, q, block, block_dq)
            if dkv_works:
                wait(dkv_works)  # the partial for src has arrived in dkv_other
                dkv, dkv_other = dkv_other, dkv
            for block, (_, block_dk, block_dv) in grads:
                rows(dkv[0], block.kv_start, block.kv_stop).add_(block_dk)
                rows(dkv[1], block.kv_start, block.kv_stop).add_(block_dv)
            if ring:
                # the last partial goes straight back to its owner, steps - 1 ranks behind
                hop = 1 if step + 1 < steps else world_size - steps + 1
                dkv_works = ring.exchange([(dkv, dkv_other)], DKV_TAG, hop)
            if kv_works:
                wait(kv_works)
                kv, kv_next = kv_next, kv
        if dkv_works:
            wait(dkv_works)  # every rank's contribution to our own K/V
            dkv = dkv_other
        if dq is None:
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
