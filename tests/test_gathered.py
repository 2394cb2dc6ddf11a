"""Single-process tests of the Ulysses/hybrid building blocks: gathered block schedules, the
coalescing of full blocks, and how heads are split over the ranks of a ulysses group."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringattn.comm import GroupInfo
from ringattn.kernels import KERNELS
from ringattn.kernels.base import band_mask
from ringattn.layout import LAYOUTS, Block
from ringattn.packing import place
from ringattn.plan import Call
from ringattn.strategies.grouped import RingSchedule, coalesce, gathered_blocks
from ringattn.strategies.ulysses import HeadPlan, check_heads


def _call(layout, world_size, causal, bounds=None, window=None, local_len=8):
    bounds = bounds or (0, local_len * world_size)
    placement = None
    if window is not None or bounds != (0, local_len * world_size):
        placement = place(LAYOUTS[layout], world_size, tuple(bounds))
    info = GroupInfo(None, 0, world_size)
    return Call(info, LAYOUTS[layout], KERNELS["reference"], causal, 1.0, placement, window)


def _pairs(blocks, rows, cols):
    """(rows, cols) int matrix: how many blocks cover each (query, key) pair."""
    count = torch.zeros(rows, cols, dtype=torch.int64)
    for b in blocks:
        m, n = b.q_stop - b.q_start, b.kv_stop - b.kv_start
        assert m > 0 and n > 0, b
        if b.tiles is not None:  # packed documents: each tile's own mask
            mask = torch.zeros(m, n, dtype=torch.bool)
            for t, (q0, q1, k0, k1) in enumerate(b.tiles.spans):
                mask[q0:q1, k0:k1] = b.tiles.mask(t)
        elif b.band is not None:
            mask = band_mask(m, n, b.band, torch.device("cpu"))
        elif b.causal:
            mask = torch.ones(m, n, dtype=torch.bool).tril()
        else:
            mask = torch.ones(m, n, dtype=torch.bool)
        count[b.q_start : b.q_stop, b.kv_start : b.kv_stop] += mask.long()
    return count


CASES = [
    # (layout, world size, group size, causal, bounds, window)
    *[
        (layout, w, u, causal, None, None)
        for layout in sorted(LAYOUTS)
        for w, u in ((2, 2), (4, 2), (8, 4), (6, 3), (8, 8))
        for causal in (False, True)
    ],
    ("zigzag", 4, 2, True, (0, 5, 5, 17, 18, 37), None),
    ("striped", 6, 3, False, (0, 13, 30), (2, 5)),
    ("contiguous", 4, 2, True, (0, 64), (3, 0)),
    ("zigzag", 4, 4, True, (0, 7, 29), (5, 0)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gathered_blocks_cover_the_per_shard_pairs_exactly(case):
    layout, world_size, group_size, causal, bounds, window = case
    call = _call(layout, world_size, causal, bounds, window)
    n = call.placement.local_len if call.placement else 8
    groups = world_size // group_size
    grouped = RingSchedule(call, GroupInfo(None, 0, groups), group_size)
    for g, h in itertools.product(range(groups), repeat=2):
        got = _pairs(grouped.blocks(g, h, group_size * n), group_size * n, group_size * n)
        expected = torch.zeros_like(got)
        for i, j in itertools.product(range(group_size), repeat=2):
            rank, src = g * group_size + i, h * group_size + j
            block = _pairs(call.blocks(rank, src, n), n, n)
            expected[i * n : (i + 1) * n, j * n : (j + 1) * n] = block
        assert torch.equal(got, expected), (g, h)
        assert int(got.max()) <= 1


def test_full_attention_of_a_group_is_one_block():
    call = _call("zigzag", 8, causal=False)
    assert gathered_blocks(call, range(4), range(4, 8), 8) == [Block(0, 32, 0, 32)]


def test_coalesce_keeps_masked_blocks_and_joins_full_ones():
    blocks = [
        Block(0, 4, 0, 4, causal=True),
        Block(4, 8, 0, 4),
        Block(4, 8, 4, 8, causal=True),
        Block(0, 4, 8, 12),
        Block(0, 4, 12, 16),
        Block(4, 8, 8, 12),
        Block(4, 8, 12, 16),
        Block(8, 10, 0, 3, band=(0, 1)),
    ]
    merged = coalesce(blocks)
    assert set(merged) == {
        Block(0, 4, 0, 4, causal=True),
        Block(4, 8, 4, 8, causal=True),
        Block(8, 10, 0, 3, band=(0, 1)),
        Block(4, 8, 0, 4),
        Block(0, 8, 8, 16),
    }


def test_ring_steps_of_a_grouped_call_stop_where_the_window_ends():
    call = _call("contiguous", 8, True, (0, 128), (3, 0), local_len=16)
    assert RingSchedule(call, GroupInfo(None, 0, 4), 2).steps(32) == 2
    dense = _call("contiguous", 8, True)
    assert RingSchedule(dense, GroupInfo(None, 0, 4), 2).steps(16) == 4


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8])
def test_head_plan(size):
    for hq in range(size, 25, size):
        for hkv in [h for h in range(1, hq + 1) if hq % h == 0]:
            plan, group = HeadPlan(hq, hkv, size), hq // hkv
            readers = [0] * hkv
            for rank in range(size):
                heads, kv = plan.q_heads(rank), plan.kv_heads(rank)
                assert len(heads) == hq // size
                needed = sorted({h // group for h in heads})
                assert list(kv) == needed  # exactly the K/V heads these queries read
                index = plan.kv_index(rank)
                expected = [h // group - kv.start for h in heads]
                if index is None:  # the kernels' even grouping reads the same heads
                    per_kv = len(heads) // len(kv)
                    assert expected == [j // per_kv for j in range(len(heads))]
                else:
                    assert index.tolist() == expected
                for h in kv:
                    readers[h] += 1
            assert plan.replicated == (max(readers) > 1)
            assert min(readers) >= 1


def test_head_count_not_divisible_names_the_fix():
    with pytest.raises(
        ValueError,
        match=r"splits the 6 query heads over its 4 ranks.*"
        r"\[1, 2, 3, 6\]",
    ):
        check_heads(6, 4, "strategy='ulysses' on 4 ranks")
