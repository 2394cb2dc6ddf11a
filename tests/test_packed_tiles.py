"""Tiled blocks of packed documents, without processes: the step plan covers every visible
(query, key) pair exactly once, the ring's reach equals a brute-force search over the exact
blocks, the plan's size is linear in the documents, and the tiled kernels match the float64
reference kernel (rows that see no key, padding, GQA included)."""

from __future__ import annotations

import random

import pytest
import torch

from ringattn.kernels import KERNELS
from ringattn.kernels.tiled import tiles_backward, tiles_forward
from ringattn.layout import LAYOUTS, get_layout
from ringattn.packing import meeting_pairs, place, placement_blocks
from ringattn.plan import PACK_ROWS, TILE_ROWS, step_blocks


def _bounds(seed: int, count: int, max_len: int, long_doc: int = 0) -> tuple[int, ...]:
    """`count` documents of 0..max_len tokens, with one of `long_doc` tokens in the middle."""
    rng = random.Random(seed)
    lengths = [rng.randint(0, max_len) for _ in range(count)]
    if long_doc:
        lengths.insert(count // 2, long_doc)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return tuple(bounds)


def _expected(bounds, causal, window) -> torch.Tensor:
    seq_len = bounds[-1]
    doc = torch.bucketize(torch.arange(seq_len), torch.tensor(bounds[1:]), right=True)
    visible = doc.unsqueeze(1) == doc.unsqueeze(0)
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    if causal:
        visible &= j <= i
    if window is not None:
        if window[0] >= 0:
            visible &= j >= i - window[0]
        if window[1] >= 0:
            visible &= j <= i + window[1]
    return visible.long()


def _block_mask(b) -> torch.Tensor:
    m, n = b.q_stop - b.q_start, b.kv_stop - b.kv_start
    i, j = torch.arange(m).unsqueeze(1), torch.arange(n).unsqueeze(0)
    if b.tiles is not None:
        mask = torch.zeros(m, n, dtype=torch.bool)
        for t, (q0, q1, k0, k1) in enumerate(b.tiles.spans):
            mask[q0:q1, k0:k1] = b.tiles.mask(t)
        return mask
    if b.causal:
        return j <= i
    if b.band is not None:
        return (j - i >= b.band[0]) & (j - i <= b.band[1])
    return torch.ones(m, n, dtype=torch.bool)


CASES = [
    (layout, w, causal, window, seed)
    for layout in sorted(LAYOUTS)
    for w in (1, 3, 4)
    for causal in (False, True)
    for window, seed in ((None, 0), ((5, 0), 1), ((2, 7), 2))
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_step_plan_covers_every_visible_pair_once(case):
    layout, world_size, causal, window, seed = case
    # many tiny documents (0-6 tokens) around one longer than a tile on every rank
    bounds = _bounds(seed, 60, 6, long_doc=2 * TILE_ROWS * world_size + 5)
    placement = place(get_layout(layout), world_size, bounds)
    counts = torch.zeros(bounds[-1], bounds[-1], dtype=torch.int64)
    kinds = set()
    for rank in range(world_size):
        q_idx = placement.global_indices(rank)
        for src in range(world_size):
            k_idx = placement.global_indices(src)
            for b in step_blocks(placement, rank, src, causal, window):
                kinds.add("tiles" if b.tiles is not None else "exact")
                rows, cols = q_idx[b.q_start : b.q_stop], k_idx[b.kv_start : b.kv_stop]
                visible = _block_mask(b)
                assert bool((rows[visible.any(1)] >= 0).all()), "a padding row sees a key"
                if b.tiles is None:
                    assert bool((rows >= 0).all() and (cols >= 0).all()), "padding in a block"
                qq, kk = torch.meshgrid(rows, cols, indexing="ij")
                counts.index_put_((qq[visible], kk[visible]), torch.tensor(1), accumulate=True)
    assert torch.equal(counts, _expected(bounds, causal, window))
    assert kinds == {"tiles", "exact"}  # both paths ran in this plan


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, (3, 0), (0, 0), (9, 2), (-1, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_reach_equals_brute_force(layout, window, causal):
    for world_size, seed in ((3, 5), (4, 6), (8, 7)):
        for bounds in (_bounds(seed, 30, 40), (0, 16 * world_size), _bounds(seed, 5, 300)):
            placement = place(get_layout(layout), world_size, bounds)
            brute = {
                (rank, src)
                for rank in range(world_size)
                for src in range(world_size)
                if placement_blocks(placement, rank, src, causal, window)
            }
            assert meeting_pairs(placement, causal, window) == brute, (world_size, bounds)


def test_plan_is_linear_in_documents():
    """2,048 documents over 32k tokens at W = 4: a step's kernel calls are bounded by the
    local rows over PACK_ROWS, not by documents or document pairs."""
    bounds = _bounds(11, 2048, 32)
    for layout in sorted(LAYOUTS):
        placement = place(get_layout(layout), 4, bounds)
        for src in range(4):
            blocks = step_blocks(placement, 0, src, True, None)
            calls = sum(len(b.tiles.spans) if b.tiles else 1 for b in blocks)
            assert calls <= 2 * placement.local_len / PACK_ROWS + 2, (layout, src, calls)
        # derived tables are memoised on the placement, keyed by small tuples
        assert step_blocks(placement, 0, 1, True, None) is step_blocks(placement, 0, 1, True, None)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiled_kernels_match_the_reference(hq, hkv, dtype):
    bounds = _bounds(3, 40, 9)
    placement = place(get_layout("zigzag"), 2, bounds)
    (block,) = [b for b in step_blocks(placement, 1, 0, True, (4, 0)) if b.tiles is not None]
    gen = torch.Generator().manual_seed(0)
    m, n = block.q_stop - block.q_start, block.kv_stop - block.kv_start
    q = torch.randn(1, hq, m, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, hq, m, 8, generator=gen, dtype=torch.float64)
    ref = KERNELS["reference"]
    out, lse = tiles_forward(ref, q, k, v, block.tiles, 0.3)
    assert bool(torch.isneginf(lse).any()), "the case should hold rows that see no key"
    grads = tiles_backward(ref, dout, q, k, v, out, lse, block.tiles, 0.3)
    cast = [x.to(dtype) for x in (q, k, v, dout)]
    got_out, got_lse = tiles_forward(KERNELS["cpu_flash"], *cast[:3], block.tiles, 0.3)
    got = tiles_backward(
        KERNELS["cpu_flash"], cast[3], *cast[:3], got_out, got_lse, block.tiles, 0.3
    )
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(lse))
    finite = ~torch.isneginf(lse)
    torch.testing.assert_close(got_lse[finite].double(), lse[finite], atol=tol, rtol=tol)
    torch.testing.assert_close(got_out.double(), out, atol=tol, rtol=tol)
    for a, b in zip(got, grads):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)
