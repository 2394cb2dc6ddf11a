"""Attention work per rank and per ring step, read off the layouts' own block schedules.

The unit is n^2 query-key pairs (n = tokens per rank) for one head: a full n x n block is 1, a
causal (square, diagonal) block 1/2, a zigzag half block (n x n/2) 1/2. Because the planner asks
`ringattn.layout` for the schedule the strategies execute, the causal imbalance of `contiguous`
comes out of the same code that creates it:

    W = 4, causal, work of each rank at each ring step (rank r computes the K/V of rank r - s):

                 contiguous              zigzag / striped
    step 0       .5  .5  .5  .5          .5  .5  .5  .5
    step 1        0   1   1   1          .5  .5  .5  .5
    step 2        0   0   1   1          .5  .5  .5  .5
    step 3        0   0   0   1          .5  .5  .5  .5
    slowest      .5  ... 3.5             2 = the mean

A ring step ends when its slowest rank does (the next K/V come from the neighbour), so the ring's
forward costs the sum over steps of the per-step maximum; the all-gather strategy costs the
slowest rank's total; Ulysses computes every (rank, source) pair for its share of the heads, so
its work is the total divided by W whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ringattn.layout import get_layout

__all__ = ["StepWork", "allgather_work", "group_ring_steps"]

_N = 4096  # local length used to read the schedules (any even length gives the same fractions)


@dataclass(frozen=True)
class StepWork:
    """Work of one ring step on its slowest rank: `full` and `causal` area in units of n^2 per
    head (causal area counted as visible pairs), and `block`: key rows per block call / n."""

    full: float
    causal: float
    block: float
    calls: int

    @property
    def area(self) -> float:
        return self.full + self.causal


def _pair(layout: str, rank: int, src: int, world_size: int) -> StepWork:
    full = causal = 0.0
    block, calls = 0.0, 0
    for b in get_layout(layout).schedule(rank, src, world_size, _N, True):
        pairs = (b.q_stop - b.q_start) * (b.kv_stop - b.kv_start) / _N**2
        if b.causal:
            causal += pairs / 2
        else:
            full += pairs
        block = max(block, (b.kv_stop - b.kv_start) / _N)
        calls += 1
    return StepWork(full, causal, block, calls)


def _add(a: StepWork, b: StepWork) -> StepWork:
    return StepWork(a.full + b.full, a.causal + b.causal, max(a.block, b.block), a.calls + b.calls)


@lru_cache(maxsize=512)
def group_ring_steps(layout: str, world_size: int, group: int) -> tuple[StepWork, ...]:
    """Per ring step, the slowest group's work, for a ring of world_size / group groups whose
    `group` ranks pool their tokens (hybrid: Ulysses inside a group; group = 1 is the plain ring,
    group = world_size is Ulysses). Areas are per head of the group's head share, in units of
    n^2 where n is one position's tokens (a group holds group * n tokens)."""
    rings = world_size // group
    steps = []
    for s in range(rings):
        slowest = StepWork(0.0, 0.0, 0.0, 0)
        for g in range(rings):
            src_group = (g - s) % rings
            work = StepWork(0.0, 0.0, 0.0, 0)
            for u in range(group):
                for v in range(group):
                    work = _add(work, _pair(layout, g * group + u, src_group * group + v,
                                            world_size))  # fmt: skip
            if work.area > slowest.area:
                slowest = work
        steps.append(slowest)
    return tuple(steps)


@lru_cache(maxsize=512)
def allgather_work(layout: str, world_size: int) -> StepWork:
    """The slowest rank's work against all gathered K/V shards."""
    totals = []
    for r in range(world_size):
        work = StepWork(0.0, 0.0, 0.0, 0)
        for src in range(world_size):
            work = _add(work, _pair(layout, r, src, world_size))
        totals.append(work)
    return max(totals, key=lambda w: w.area)
