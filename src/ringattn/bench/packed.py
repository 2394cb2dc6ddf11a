"""`ringattn bench --documents N [--window L]`: the packed case beside the dense one.

The same global q, k, v as the dense configuration, cut into N documents (random boundaries,
seeded) and/or limited to a sliding window of L keys back, run by the same emulated ring
(testing/emulated.py) with the call's placement. Every timed step rebuilds the placement and
its plans from the boundaries (caches cleared), as a training step with new cu_seqlens does.
Reported per pass: the step time of the slower timed rank, its ratio to the dense ring, the host
plan alone (place + ring reach + the rank's step plans) and its share of the step, and the
attention FLOPs actually needed (visible query-key pairs, fwd 4*H*D per pair, bwd 2.5x) with
the rate they ran at.
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from ringattn.bench.common import time_interleaved
from ringattn.layout import Layout
from ringattn.packing import Placement, meeting_pairs, place, work_per_rank
from ringattn.plan import Call, step_blocks
from ringattn.testing import emulated as emulate


def document_bounds(seq_len: int, documents: int, seed: int) -> tuple[int, ...]:
    """cu_seqlens of `documents` documents with random boundaries (seeded), ending at seq_len."""
    if documents < 1 or documents > seq_len:
        raise ValueError(
            f"--documents {documents}: need 1 <= documents <= sequence length {seq_len}"
        )
    cuts = sorted(random.Random(seed).sample(range(1, seq_len), documents - 1))
    return (0, *cuts, seq_len)


def packed_shards(placement: Placement, q, k, v, dout) -> emulate.Shards:
    """Every rank's shard of global (B, H, S, D) tensors under `placement`, padding rows zero."""

    def gather(x: torch.Tensor, rank: int) -> torch.Tensor:
        index = placement.rows(rank)[0].to(x.device)
        rows = x.index_select(2, index.clamp(min=0))  # (B, H, n, D)
        return rows.masked_fill((index < 0).view(1, 1, -1, 1), 0.0)

    w = placement.world_size
    index = [placement.global_indices(r) for r in range(w)]
    kv = torch.stack([torch.stack([gather(k, r), gather(v, r)]) for r in range(w)])
    q_shards = torch.stack([gather(q, r) for r in range(w)])
    return emulate.Shards(q_shards, kv, torch.stack([gather(dout, r) for r in range(w)]), index)


def host_plan_ms(layout: Layout, world_size: int, bounds, call: Call, ranks: list[int]) -> float:
    """Milliseconds of the host plan on fresh boundaries, for the slowest of `ranks`."""
    worst = 0.0
    for rank in ranks:
        place.cache_clear()
        start = time.perf_counter()
        placement = place(layout, world_size, bounds)
        meeting_pairs(placement, call.causal, call.window)
        for src in range(world_size):
            step_blocks(placement, rank, src, call.causal, call.window)
        worst = max(worst, (time.perf_counter() - start) * 1e3)
    return worst


def packed_rows(cfg, dense_rows: list[dict], call: Call, tensors, ranks, device) -> list[dict]:
    """Rows of the packed case, one per pass of `dense_rows` (same configuration)."""
    q, k, v, dout = tensors
    w, seq_len = dense_rows[0]["world_size"], q.shape[2]
    bounds = document_bounds(seq_len, cfg.documents or 1, cfg.seed)
    window = None if cfg.window is None else (cfg.window, 0 if call.causal else cfg.window)
    layout = call.layout
    placement = place(layout, w, bounds)
    shards = packed_shards(placement, q, k, v, dout)
    partials = emulate.new_partials(shards)

    def step(rank: int, backward: bool) -> None:
        place.cache_clear()  # rebuilt from the boundaries, like new cu_seqlens each step
        fresh = dataclasses.replace(call, placement=place(layout, w, bounds), window=window)
        out, lse = emulate.forward_share(fresh, shards, rank)
        if backward:
            emulate.backward_share(fresh, shards, rank, out, lse, partials)

    pairs = max(work_per_rank(placement, call.causal, window)[r] for r in ranks)
    heads, head_dim = q.shape[1], q.shape[3]
    plan_ms = host_plan_ms(layout, w, bounds, dataclasses.replace(call, window=window), ranks)
    rows = []
    for dense in dense_rows:
        backward = dense["pass"] != "fwd"
        fns = {r: (lambda r=r, b=backward: step(r, b)) for r in ranks}
        ms = max(time_interleaved(fns, device, cfg.warmup, cfg.repeats).values())
        flops = 4.0 * q.shape[0] * heads * head_dim * pairs * (3.5 if backward else 1.0)
        rows.append(
            {
                **{key: dense[key] for key in ("mask", "hq", "hkv", "world_size", "pass")},
                "tokens_per_rank": dense["tokens_per_rank"],
                "documents": len(bounds) - 1,
                "window": cfg.window,
                "local_len": placement.local_len,
                "ring_ms": ms,
                "over_dense": ms / dense["ring_ms"],
                "host_plan_ms": plan_ms,
                "host_plan_share": plan_ms / ms,
                "needed_flops": flops,
                "needed_tflops": flops / (ms * 1e-3) / 1e12,
            }
        )
    return rows


def format_packed(rows: list[dict]) -> str:
    head = (
        f"{'mask':<6} {'heads':>6} {'W':>2} {'tok/rank':>8} {'docs':>6} {'window':>6} "
        f"{'pass':<7} {'ring ms':>9} {'/dense':>7} {'plan ms':>8} {'plan %':>6} "
        f"{'GFLOP':>8} {'TF/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        window = "-" if r["window"] is None else str(r["window"])
        lines.append(
            f"{r['mask']:<6} {r['hq']:>3}:{r['hkv']:<2} {r['world_size']:>2} "
            f"{r['tokens_per_rank']:>8} {r['documents']:>6} {window:>6} {r['pass']:<7} "
            f"{r['ring_ms']:>9.2f} {r['over_dense']:>7.3f} {r['host_plan_ms']:>8.2f} "
            f"{100 * r['host_plan_share']:>5.1f}% {r['needed_flops'] / 1e9:>8.3f} "
            f"{r['needed_tflops']:>8.3g}"
        )
    return "\n".join(lines)
