"""The fixed costs of a ring step and of a local piece, measured on this CPU (`--hardware cpu`).

Dynamic CP trades one ring over the whole cp group for many pieces: groups of 2, 4, ... ranks
that still run a ring, and documents alone on one rank that run one local kernel call. Beyond
their flops and bytes each costs a fixed amount per layer and direction: a ring step is a kernel
call, a merge, a send and a receive that waits for the peer (on a CPU with more processes than
cores, for the peer to be scheduled); a local piece is a kernel call. Both are measured here with
the whole job's `nproc` processes busy at once, as in a training step, on sizes where the flops
cost nothing (2 rows per rank, one head of 16):

    ring_step_s   one fwd + bwd of ringattn.attention over all nproc ranks / (2 x nproc steps)
    piece_s       one fwd + bwd of ringattn.attention on each rank alone (a group of one) / 2

Each rank keeps the median of `repeats` timed calls (the typical wait, not the luckiest: what
a step pays is mostly the wait for a descheduled peer); the slowest rank's figure is the one a
ring waits for. Cached in the calibration file under
"ring_step" by process count (planner/dynamic.py reads it, measuring once when it is missing).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ringattn.runtime.launch import init_distributed, launch

__all__ = ["measure_ring_step"]


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: the first call checks the ranks agree and builds the plan
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(repeats: int) -> dict:
    from ringattn.api import attention  # the ranks import the library, not the planner's caller

    init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank makes all
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 1, 2, 16, generator=gen, device="cpu").requires_grad_()
               for _ in range(3))  # fmt: skip

    def call(group) -> None:
        attention(q, k, v, causal=True, group=group).sum().backward()

    ring = _timed(lambda: call(None), repeats) / (2 * world)
    local = _timed(lambda: call(alone), repeats) / 2
    dist.destroy_process_group()
    return {"ring_step_s": ring, "piece_s": local}


def measure_ring_step(nproc: int, repeats: int = 20) -> dict:
    """{"ring_step_s", "piece_s"} at `nproc` local processes (see the module docstring)."""
    if nproc < 2:
        raise ValueError(f"a ring step needs at least 2 processes, got {nproc}")
    got = launch(_worker, nproc, repeats)
    return {key: max(r[key] for r in got.values()) for key in ("ring_step_s", "piece_s")}
