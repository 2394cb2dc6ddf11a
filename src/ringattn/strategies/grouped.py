"""Blocks over gathered shards: several shards' queries against several shards' keys at once.

After the Ulysses all-to-all a rank holds, for its heads, the U shards of its ulysses group end to
end (shard of rank g*U first, then g*U+1, ...). Attention of that sequence against itself, or
against another group's K/V, is still the per-shard schedule of the layout: for query shard r and
key shard s, `call.blocks(r, s, n)` offset by the shards' places in the concatenation. Nothing
here looks at a layout's name or a mask's shape, so packed documents and windows come for free.

    group of U = 2 shards (r0, r1) against group (s0, s1), n rows each:

              s0        s1                 every (r, s) pair brings its own blocks;
         +---------+---------+             full blocks that line up are merged:
      r0 | b(r0,s0)| b(r0,s1)|  rows 0..n   side by side (same query rows, adjacent keys),
         +---------+---------+             then stacked (same key rows, adjacent queries),
      r1 | b(r1,s0)| b(r1,s1)|  rows n..2n  so a full attention is one kernel call and one
         +---------+---------+             merge instead of U*U.

`RingSchedule` presents this to the ring loop: a ring whose ranks are whole ulysses groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ringattn.comm import GroupInfo
from ringattn.layout import Block
from ringattn.packing import meeting_pairs
from ringattn.plan import Call

_RANGES = ("q_start", "q_stop", "kv_start", "kv_stop")


def _is_full(block: Block) -> bool:
    """True for an unmasked block: every field besides the row ranges is at its default."""
    return all(
        getattr(block, f.name) == f.default
        for f in dataclasses.fields(block)
        if f.name not in _RANGES
    )


def _join(blocks: list[Block], outer: tuple[str, str], inner: tuple[str, str]) -> list[Block]:
    """Merge blocks that share their `outer` range and whose `inner` ranges touch."""
    blocks = sorted(blocks, key=lambda b: tuple(getattr(b, n) for n in (*outer, *inner)))
    joined: list[Block] = []
    for block in blocks:
        last = joined[-1] if joined else None
        if (
            last is not None
            and all(getattr(last, n) == getattr(block, n) for n in outer)
            and getattr(last, inner[1]) == getattr(block, inner[0])
        ):
            joined[-1] = dataclasses.replace(last, **{inner[1]: getattr(block, inner[1])})
        else:
            joined.append(block)
    return joined


def coalesce(blocks: Sequence[Block]) -> list[Block]:
    """The same visible (query, key) pairs in fewer blocks: full blocks side by side or stacked
    are merged; masked blocks (causal, banded) are kept as they are. Blocks never overlap, before
    or after, so the result is exact whatever the order the blocks are merged in."""
    full = [b for b in blocks if _is_full(b)]
    masked = [b for b in blocks if not _is_full(b)]
    full = _join(full, ("q_start", "q_stop"), ("kv_start", "kv_stop"))
    full = _join(full, ("kv_start", "kv_stop"), ("q_start", "q_stop"))
    return masked + full


def gathered_blocks(
    call: Call, q_shards: Sequence[int], kv_shards: Sequence[int], local_len: int
) -> list[Block]:
    """Blocks of the queries of `q_shards` (concatenated in that order, `local_len` rows each)
    against the keys of `kv_shards` (likewise), from the per-shard schedule `call.blocks`."""
    blocks = []
    for i, rank in enumerate(q_shards):
        for j, src in enumerate(kv_shards):
            dq, dk = i * local_len, j * local_len
            for b in call.blocks(rank, src, local_len):
                blocks.append(
                    dataclasses.replace(
                        b,
                        q_start=b.q_start + dq,
                        q_stop=b.q_stop + dq,
                        kv_start=b.kv_start + dk,
                        kv_stop=b.kv_stop + dk,
                    )
                )
    return coalesce(blocks)


@dataclass(frozen=True)
class RingSchedule:
    """What the ring loop runs: a ring over `ring` whose ranks each hold `group_size` consecutive
    shards of `call`'s world, end to end.

    `group_size = 1` is the plain ring: ring rank r holds shard r and its blocks against ring rank
    s are `call.blocks(r, s, n)`. The hybrid strategy's ring runs over ulysses groups: ring rank g
    holds shards g*U .. g*U+U-1 (after the all-to-all) and its blocks are `gathered_blocks` over
    them. Ulysses is the one-step case (a ring of one group). Kernel, scale, merge and mask
    options are `call`'s.
    """

    call: Call
    ring: GroupInfo
    group_size: int = 1

    @property
    def rank(self) -> int:
        return self.ring.rank

    @property
    def world_size(self) -> int:
        return self.ring.world_size

    def shards(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def blocks(self, rank: int, src: int, local_len: int) -> Sequence[Block]:
        """Blocks of ring rank `rank`'s queries against ring rank `src`'s keys."""
        if self.group_size == 1:
            return self.call.blocks(rank, src, local_len)
        n = local_len // self.group_size
        return gathered_blocks(self.call, self.shards(rank), self.shards(src), n)

    def steps(self, local_len: int) -> int:
        """Ring steps that carry any work: 1 + the farthest src distance any rank needs.

        Steps past it would only move K/V that no rank attends to (a window shorter than the
        distance between shards), so the ring stops there and sends nothing more. A pure function
        of the placement (`packing.meeting_pairs`, computed once per placement), so every rank
        stops at the same step.
        """
        if self.call.placement is None:
            return self.world_size
        pairs = meeting_pairs(self.call.placement, self.call.causal, self.call.window)
        u, world_size = self.group_size, self.world_size
        return 1 + max(((rank // u - src // u) % world_size for rank, src in pairs), default=0)
