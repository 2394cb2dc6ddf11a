"""The dynamic-CP scheduler: per step, a group size and a place for every document. Pure.

Input: the lengths of the step's documents (every window of every dp row, in order), the mesh's
dp x cp, a rank's token budget (what static CP gives each rank: batch_size x seq_len / cp) and
a cost `cost(length, size)`: the seconds one rank spends on a document sharded over `size` ranks
(cost.py: the planner's quadratic attention + linear layers + ring traffic).

Groups. A cp row of ranks c = 0..cp-1 is cut into aligned blocks of g = 1, 2, 4, ..., cp ranks:
group (d, g, j) is ranks j*g .. j*g + g - 1 of dp row d. The blocks of one size are disjoint, so
a rank belongs to exactly one group of each size (runtime/subgroups.py creates them once).

    1. size: the smallest power of two g with length <= g x budget (a document that fits one
       rank's budget runs on one rank, with no communication)
    2. place (`_place`): documents by size, largest first, then by per-rank cost, largest first
       (longest-processing-time first); each goes on the group of its size, in any dp row, whose
       busiest member is least busy (ties: the lowest dp row, then the lowest block)
    3. refine: while the busiest rank is more than `tolerance` above the mean, double the size of
       its costliest document that can still grow and place again; keep it only if the busiest
       rank's cost went down (a quadratic document split in two costs each rank a quarter of its
       attention, plus traffic)

Bound. Once the step's last document of size 1 is placed on the least busy rank (LPT), every
rank ends at most one document's per-rank cost above the mean: max <= mean + max_i c_i, where
c_i = cost(length_i, size_i); tests/test_dynamic_cp.py fuzzes this. Every rank computes the same
schedule from the same lengths (Python floats in a fixed order): no communication decides it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Schedule", "min_size", "plan_step", "static_schedule"]

Cost = Callable[[int, int], float]


@dataclass(frozen=True)
class Schedule:
    """Where each document of a step runs: document i on group (rows[i], sizes[i], blocks[i])."""

    dp: int
    cp: int
    sizes: tuple[int, ...]
    rows: tuple[int, ...]
    blocks: tuple[int, ...]
    costs: tuple[float, ...]
    """Planned seconds of each rank (dp row d, cp index c at d * cp + c)."""

    def documents(self, row: int, size: int, block: int) -> list[int]:
        """The documents on group (row, size, block), in step order."""
        return [i for i in range(len(self.sizes))
                if (self.rows[i], self.sizes[i], self.blocks[i]) == (row, size, block)]  # fmt: skip

    @property
    def histogram(self) -> dict[str, int]:
        """{group size as a string: documents placed on groups of that size}, sizes ascending."""
        counts = Counter(self.sizes)
        return {str(g): counts[g] for g in sorted(counts)}

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' planned costs (1.0: perfectly balanced)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0


def min_size(length: int, budget: int, cp: int) -> int:
    """The smallest power of two g <= cp with length <= g * budget (cp when none)."""
    g = 1
    while g < cp and length > g * budget:
        g *= 2
    return min(g, cp)


def _check(lengths: Sequence[int], dp: int, cp: int, budget: int) -> None:
    if dp < 1 or cp < 1 or cp & (cp - 1):
        raise ValueError(f"dynamic CP needs dp >= 1 and cp a power of two, got dp={dp}, cp={cp}")
    if budget < 1:
        raise ValueError(f"the token budget per rank must be >= 1, got {budget}")
    bad = [n for n in lengths if n < 0]
    if bad:
        raise ValueError(f"document lengths must be >= 0, got {bad[:5]}")


def _place(lengths: Sequence[int], sizes: Sequence[int], dp: int, cp: int, cost: Cost) -> Schedule:
    """Longest-processing-time placement of documents of fixed sizes (step 2 above)."""
    load = [0.0] * (dp * cp)
    rows, blocks = [0] * len(lengths), [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-sizes[i], -cost(lengths[i], sizes[i]), i))
    for i in order:
        g, c = sizes[i], cost(lengths[i], sizes[i])
        groups = [(d, j) for d in range(dp) for j in range(cp // g)]
        _, rows[i], blocks[i] = min((max(load[d * cp + j * g : d * cp + j * g + g]), d, j)
                                    for d, j in groups)  # fmt: skip
        first = rows[i] * cp + blocks[i] * g
        for r in range(first, first + g):
            load[r] += c
    return Schedule(dp, cp, tuple(sizes), tuple(rows), tuple(blocks), tuple(load))


def plan_step(
    lengths: Sequence[int], dp: int, cp: int, budget: int, cost: Cost, tolerance: float = 0.05
) -> Schedule:
    """The step's schedule (see the module docstring)."""
    _check(lengths, dp, cp, budget)
    sizes = [min_size(n, budget, cp) for n in lengths]
    best = _place(lengths, sizes, dp, cp, cost)
    while best.imbalance > 1 + tolerance:
        busiest = max(range(dp * cp), key=lambda r: (best.costs[r], -r))
        row, c = divmod(busiest, cp)
        on = [i for i in range(len(lengths))
              if best.rows[i] == row and best.blocks[i] == c // best.sizes[i]
              and best.sizes[i] < cp]  # fmt: skip
        if not on:
            break
        grow = max(on, key=lambda i: (cost(lengths[i], sizes[i]), -i))
        trial_sizes = list(sizes)
        trial_sizes[grow] *= 2
        trial = _place(lengths, trial_sizes, dp, cp, cost)
        if max(trial.costs) >= max(best.costs):
            break
        sizes, best = trial_sizes, trial
    return best


def static_schedule(lengths: Sequence[int], rows: Sequence[int], dp: int, cp: int,
                    cost: Cost) -> Schedule:  # fmt: skip
    """Static CP as a schedule: every document on its own dp row's whole cp group."""
    load = [0.0] * (dp * cp)
    for n, d in zip(lengths, rows):
        for r in range(d * cp, d * cp + cp):
            load[r] += cost(n, cp)
    return Schedule(dp, cp, (cp,) * len(lengths), tuple(rows), (0,) * len(lengths), tuple(load))
