"""Cases for the Triton merge kernel, run by test_merge_triton.py in a subprocess.

The subprocess has TRITON_INTERPRET=1 set before Triton decorates the kernel, so the kernel runs
on CPU tensors under Triton's interpreter (which needs numpy). `python merge_triton_cases.py`
runs every case and prints one JSON line: {case name: "ok" or the traceback}.
On a GPU the same cases run in-process on CUDA tensors (test_merge_triton.py, marked gpu).
"""

from __future__ import annotations

import json
import traceback

import torch

from ringattn.kernels.triton_merge import triton_merge_
from ringattn.merge import merge_

NEG_INF = float("-inf")


def _partial(scores: torch.Tensor, values: torch.Tensor):
    """(out, lse) of softmax attention over one block of keys, in float64, from raw scores."""
    return torch.softmax(scores, dim=-1) @ values, torch.logsumexp(scores, dim=-1)


def blocks_equal_one_softmax(device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(0)
    splits = [5, 7, 1, 3]
    scores = torch.randn(2, 3, 37, sum(splits), dtype=torch.float64, generator=gen) * 4
    values = torch.randn(2, 3, sum(splits), 40, dtype=torch.float64, generator=gen)
    expected_out, expected_lse = _partial(scores, values)
    out = torch.zeros(2, 3, 37, 40, device=device)
    lse = torch.full((2, 3, 37), NEG_INF, device=device)
    start = 0
    for width in splits:
        part = _partial(scores[..., start : start + width], values[..., start : start + width, :])
        triton_merge_(out, lse, *(x.float().to(device) for x in part))
        start += width
    torch.testing.assert_close(out.cpu().double(), expected_out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, atol=2e-6, rtol=2e-6)


def empty_partial_leaves_the_other_unchanged(device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(1)
    out_b = torch.randn(1, 2, 3, 24, generator=gen, device="cpu").to(device)
    lse_b = torch.tensor([[[0.5, -2.0, 30.0], [1.0, 2.0, -7.0]]], device=device)
    empty_out = torch.zeros(1, 2, 3, 24, device=device)
    empty_lse = torch.full((1, 2, 3), NEG_INF, device=device)
    for acc, block in (
        ((empty_out, empty_lse), (out_b, lse_b)),
        ((out_b, lse_b), (empty_out, empty_lse)),
    ):
        out, lse = acc[0].clone(), acc[1].clone()
        triton_merge_(out, lse, *block)
        assert torch.equal(out, out_b), (out - out_b).abs().max()
        assert torch.equal(lse, lse_b), (lse, lse_b)


def two_empty_partials_give_zero_and_neg_inf(device: str = "cpu") -> None:
    out = torch.zeros(2, 2, 3, 16, device=device)
    lse = torch.full((2, 2, 3), NEG_INF, device=device)
    triton_merge_(out, lse, torch.zeros_like(out).bfloat16(), torch.full_like(lse, NEG_INF))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert not torch.isnan(out).any()


def strided_halves_are_written_through(device: str = "cpu") -> None:
    """Zigzag halves: rows narrowed out of (B, H, S, D) accumulators, a bf16 block, and a block
    lse that is a strided view (cuDNN's (B, H, S, 1) squeezed): read and written in place."""
    gen = torch.Generator().manual_seed(2)
    out = torch.randn(1, 4, 16, 40, generator=gen)
    lse = torch.randn(1, 4, 16, generator=gen)
    lse[0, 1, 9] = NEG_INF
    out[0, 1, 9] = 0.0
    block_out = torch.randn(1, 4, 8, 40, generator=gen).bfloat16()
    block_lse_4d = torch.randn(1, 4, 8, 1, generator=gen)
    block_lse_4d[0, 2, 3] = NEG_INF
    block_lse = block_lse_4d.squeeze(-1)
    want_out, want_lse = out.clone(), lse.clone()
    merge_(want_out.narrow(2, 8, 8), want_lse.narrow(2, 8, 8), block_out, block_lse)
    got_out, got_lse = out.to(device), lse.to(device)
    half_out, half_lse = got_out.narrow(2, 8, 8), got_lse.narrow(2, 8, 8)
    assert not half_out.is_contiguous()
    triton_merge_(half_out, half_lse, block_out.to(device), block_lse.to(device))
    got_out, got_lse = got_out.cpu(), got_lse.cpu()
    assert torch.equal(got_out[:, :, :8], out[:, :, :8]) and torch.equal(
        got_lse[:, :, :8], lse[:, :, :8]
    )
    torch.testing.assert_close(got_out, want_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[finite], want_lse[finite], atol=1e-6, rtol=1e-6)


def matches_merge_on_random_rows(device: str = "cpu") -> None:
    """Head dims 40 (not a power of two) and 128, lengths that are not tile multiples, a
    transposed (B, S, H, D)-stored block, -inf sprinkled on both sides."""
    gen = torch.Generator().manual_seed(3)
    for d, s in ((40, 19), (128, 70)):
        out = torch.randn(2, 3, s, d, generator=gen)
        lse = torch.randn(2, 3, s, generator=gen) * 3
        block_out = torch.randn(2, s, 3, d, generator=gen).transpose(1, 2)  # (B, H, S, D) view
        block_lse = torch.randn(2, 3, s, generator=gen) * 3
        lse[torch.rand(lse.shape, generator=gen) < 0.2] = NEG_INF
        block_lse[torch.rand(lse.shape, generator=gen) < 0.2] = NEG_INF
        out[torch.isneginf(lse)] = 0.0
        want_out, want_lse = out.clone(), lse.clone()
        merge_(want_out, want_lse, block_out, block_lse)
        got_out, got_lse = out.to(device), lse.to(device)
        triton_merge_(got_out, got_lse, block_out.to(device), block_lse.to(device))
        torch.testing.assert_close(got_out.cpu(), want_out, atol=1e-6, rtol=1e-6)
        assert torch.equal(torch.isneginf(got_lse.cpu()), torch.isneginf(want_lse))
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(got_lse.cpu()[finite], want_lse[finite], atol=1e-6, rtol=1e-6)


def large_lse_gap_is_stable(device: str = "cpu") -> None:
    out = torch.ones(1, 1, 1, 8, device=device)
    lse = torch.tensor([[[1000.0]]], device=device)
    triton_merge_(out, lse, torch.full_like(out, 3.0), torch.tensor([[[-1000.0]]], device=device))
    assert torch.equal(out, torch.ones_like(out)) and lse.item() == 1000.0


CASES = [
    blocks_equal_one_softmax,
    empty_partial_leaves_the_other_unchanged,
    two_empty_partials_give_zero_and_neg_inf,
    strided_halves_are_written_through,
    matches_merge_on_random_rows,
    large_lse_gap_is_stable,
]


def main() -> None:
    results = {}
    for case in CASES:
        try:
            case()
            results[case.__name__] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[case.__name__] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
