"""The fixed costs of attention calls, ring steps and kernel calls, measured on this CPU.

Dynamic CP trades one ring over the whole cp group for many pieces: groups of 2, 4, ... ranks
that still run a ring, and documents alone on one rank. Beyond flops and bytes each costs a fixed
amount per layer and direction, measured here with the job's `nproc` processes busy at once, as
in a training step, on sizes whose flops cost almost nothing (one head of 16):

    piece_s       one attention call on a rank alone (a group of one), one document of 2 rows:
                  validation, the plan, autograd, one kernel call; fwd + bwd / 2, minus call_s
    call_s        each further kernel call: the same call with DOCS documents of TILE_ROWS + 1
                  tokens (one exact block each, pieces.py counts them the same way):
                  the difference / (2 x (DOCS - 1))
    ring_step_s   one ring step over all nproc ranks (2 rows each): send, receive, merge and the
                  wait for a peer that may not be running: fwd + bwd / (2 x nproc), minus call_s

Each rank keeps the median of `repeats` timed calls (the typical wait, not the luckiest: what a
step pays is mostly the wait for a descheduled peer); the slowest rank's figure is the one a ring
waits for. Cached in the calibration file under "ring_step" by process count (predict.py
reads it, measuring once, ~10-60 s, when it is missing).
`python -m ringattn.planner.dynamic_cp.ringstep` under torchrun measures the same over any
ranks (over two hosts: the link's cost per ring step included) and rank 0 prints them as one
JSON line.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from ringattn.api import attention
from ringattn.layout import get_layout
from ringattn.packing import place
from ringattn.plan import TILE_ROWS
from ringattn.runtime.launch import init_distributed, launch

__all__ = ["measure_ring_step"]

DOCS = 9


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: the first call checks the ranks agree and builds the plan
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(repeats: int) -> dict:
    """This rank's figures; every rank of the default group calls it (module docstring)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes all
    gen = torch.Generator().manual_seed(rank)

    def call(tokens: int, group, docs: int = 1) -> float:
        cu = None if docs == 1 else [i * tokens // docs for i in range(docs + 1)]
        rows = tokens if cu is None else place(get_layout("zigzag"), 1, tuple(cu)).local_len
        q, k, v = (torch.randn(1, 1, rows, 16, generator=gen, device="cpu").requires_grad_()
                   for _ in range(3))  # fmt: skip

        def run() -> None:
            attention(q, k, v, causal=True, group=group, cu_seqlens=cu).sum().backward()

        return _timed(run, repeats)

    one = call(2, alone) / 2
    many = call(DOCS * (TILE_ROWS + 1), alone, DOCS) / 2
    call_s = max(0.0, (many - one) / (DOCS - 1))
    ring = call(2, None) / (2 * world)
    return {"ring_step_s": max(0.0, ring - call_s), "piece_s": max(0.0, one - call_s),
            "call_s": call_s}  # fmt: skip


def _slowest(per_rank: list[dict]) -> dict:
    """The figures a ring waits for: each term's largest over the ranks."""
    return {key: max(r[key] for r in per_rank) for key in ("ring_step_s", "piece_s", "call_s")}


def _worker(repeats: int) -> dict:
    init_distributed("gloo")
    got = _measure(repeats)
    dist.destroy_process_group()
    return got


def measure_ring_step(nproc: int, repeats: int = 20) -> dict:
    """{"ring_step_s", "piece_s", "call_s"} at `nproc` local processes (module docstring)."""
    if nproc < 2:
        raise ValueError(f"a ring step needs at least 2 processes, got {nproc}")
    return _slowest(list(launch(_worker, nproc, repeats).values()))


def main() -> None:
    """Under torchrun (e.g. over two hosts, scripts/bench/dynamic_cp.py): rank 0 prints the
    slowest rank's figures as one JSON line."""
    init_distributed("gloo")
    mine = _measure(20)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(json.dumps(_slowest(every)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
