"""The online-softmax merge: exact against one softmax over all keys, and the -inf cases."""

import math

import pytest
import torch

from ringattn.merge import merge, merge_

NEG_INF = float("-inf")


def _partial(scores: torch.Tensor, values: torch.Tensor):
    """(out, lse) of softmax attention over one block of keys, computed directly in float64."""
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ values, lse


@pytest.mark.parametrize("splits", [[5, 7], [1, 3, 8], [4, 4, 4]])
def test_merge_of_blocks_equals_one_softmax(splits):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 6, sum(splits), dtype=torch.float64, generator=gen) * 4
    values = torch.randn(2, 3, sum(splits), 5, dtype=torch.float64, generator=gen)
    expected_out, expected_lse = _partial(scores, values)
    out = torch.zeros(2, 3, 6, 5, dtype=torch.float64)
    lse = torch.full((2, 3, 6), NEG_INF, dtype=torch.float64)
    start = 0
    for width in splits:
        block = slice(start, start + width)
        merge_(out, lse, *_partial(scores[..., block], values[..., block, :]))
        start += width
    torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, expected_lse, atol=1e-12, rtol=1e-12)


def test_empty_partial_leaves_the_other_unchanged():
    out_b = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    lse_b = torch.tensor([[[0.5, -2.0, 30.0]]], dtype=torch.float64)
    empty_out = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    empty_lse = torch.full((1, 1, 3), NEG_INF, dtype=torch.float64)
    for first, second in (
        ((empty_out, empty_lse), (out_b, lse_b)),
        ((out_b, lse_b), (empty_out, empty_lse)),
    ):
        out, lse = merge(*first, *second)
        assert torch.equal(out, out_b)
        assert torch.equal(lse, lse_b)


def test_two_empty_partials_give_zero_and_neg_inf():
    empty_out = torch.zeros(2, 2, 3, 4)
    empty_lse = torch.full((2, 2, 3), NEG_INF)
    out, lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_sigmoid_merge_that_others_copy_gives_nan_where_ours_does_not():
    """The widely copied formula, for contrast: it fails exactly the cases tested above."""
    lse_a = torch.tensor([NEG_INF, NEG_INF])
    lse_b = torch.tensor([1.0, NEG_INF])
    out_a, out_b = torch.zeros(2, 1), torch.ones(2, 1)
    sig_out = out_a - torch.sigmoid(lse_b - lse_a).unsqueeze(-1) * (out_a - out_b)
    sig_lse = lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)
    assert torch.isnan(sig_out).any() or torch.isnan(sig_lse).any()
    out, lse = merge(
        out_a.reshape(1, 1, 2, 1),
        lse_a.reshape(1, 1, 2),
        out_b.reshape(1, 1, 2, 1),
        lse_b.reshape(1, 1, 2),
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert out.flatten().tolist() == [1.0, 0.0]
    assert lse.flatten().tolist() == [1.0, NEG_INF]


def test_merge_accumulates_low_precision_in_float32_and_writes_through_views():
    out = torch.zeros(1, 2, 8, 4)
    lse = torch.full((1, 2, 8), NEG_INF)
    block_out = torch.randn(1, 2, 4, 4).bfloat16()
    block_lse = torch.randn(1, 2, 4)
    merge_(out.narrow(2, 4, 4), lse.narrow(2, 4, 4), block_out, block_lse)
    assert out.dtype == torch.float32
    assert torch.equal(out[:, :, 4:], block_out.float())
    assert torch.equal(lse[:, :, 4:], block_lse)
    assert torch.isneginf(lse[:, :, :4]).all() and torch.equal(
        out[:, :, :4], torch.zeros(1, 2, 4, 4)
    )


def test_large_lse_gap_is_stable():
    out, lse = merge(
        torch.ones(1, 1, 1, 1),
        torch.tensor([[[1000.0]]]),
        torch.full((1, 1, 1, 1), 3.0),
        torch.tensor([[[-1000.0]]]),
    )
    assert out.item() == 1.0
    assert math.isclose(lse.item(), 1000.0)
