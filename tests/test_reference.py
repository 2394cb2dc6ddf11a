"""The yardstick itself: float64 reference attention, error measures and gates (ringattn.reference).

The reference is checked against torch's own SDPA in float64 and against values worked out by hand,
so the library's tests do not rest on an unchecked reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ringattn.testing import yardstick as ref


def _qkv(hq=4, hkv=2, s=24, d=20, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, s, d), (2, hkv, s, d), (2, hkv, s, d), (2, hq, s, d)]
    return [torch.randn(x, generator=gen, dtype=torch.float64).to(dtype) for x in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_matches_sdpa_in_float64(causal, hkv):
    q, k, v, dout = _qkv(hkv=hkv)
    got = ref.reference_attention(q, k, v, dout, causal=causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    group = 4 // hkv
    out = F.scaled_dot_product_attention(
        leaves[0],
        leaves[1].repeat_interleave(group, 1),
        leaves[2].repeat_interleave(group, 1),
        is_causal=causal,
    )
    out.backward(dout)
    assert got.out.dtype == torch.float64 and got.lse.shape == q.shape[:3]
    torch.testing.assert_close(got.out, out.detach(), atol=1e-12, rtol=1e-12)
    for mine, theirs in zip((got.dq, got.dk, got.dv), leaves):
        torch.testing.assert_close(mine, theirs.grad, atol=1e-12, rtol=1e-12)


def test_reference_lse_by_hand():
    q, k, v, _ = _qkv(hq=1, hkv=1, s=5, d=3)
    scale = 0.7
    got = ref.reference_attention(q, k, v, causal=True, scale=scale)
    # Causal row 0 sees only key 0: lse is its one score and out is v[0].
    first = (q[:, :, 0] * k[:, :, 0]).sum(-1) * scale
    torch.testing.assert_close(got.lse[:, :, 0], first, atol=1e-14, rtol=0)
    torch.testing.assert_close(got.out[:, :, 0], v[:, :, 0], atol=1e-14, rtol=0)
    # Last row sees all keys: lse = log sum_j exp(s_j), summed in plain Python.
    row = [(q[0, 0, 4] * k[0, 0, j]).sum().item() * scale for j in range(5)]
    assert got.lse[0, 0, 4].item() == pytest.approx(math.log(math.fsum(map(math.exp, row))), 1e-14)
    assert got.dq is None


def test_low_precision_inputs_are_upcast_not_reinterpreted():
    q, k, v, dout = _qkv(dtype=torch.bfloat16)
    got = ref.reference_attention(q, k, v, dout, causal=True)
    again = ref.reference_attention(*(x.double() for x in (q, k, v)), dout.double(), causal=True)
    assert torch.equal(got.out, again.out) and torch.equal(got.dk, again.dk)


def test_sdpa_baseline_has_low_precision_error_and_lse():
    q, k, v, dout = _qkv(dtype=torch.bfloat16)
    exact = ref.reference_attention(q, k, v, dout, causal=True)
    base = ref.sdpa_attention(q, k, v, dout, causal=True, with_lse=True)
    assert base.out.dtype == torch.bfloat16 and base.lse.dtype == torch.float32
    for name in ("out", "lse", "dq", "dk", "dv"):
        err = ref.compare(getattr(base, name), getattr(exact, name))
        assert 0 < err.mean <= err.max < 0.1, (name, err)


def test_compare():
    expected = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    err = ref.compare(expected + torch.tensor([0.0, 0.5, -1.0, 0.5]), expected)
    assert (err.max, err.mean) == (1.0, 0.5)
    assert ref.compare(torch.tensor([1.0, math.nan, 3.0, 4.0]), expected).max == math.inf
    assert ref.compare(torch.tensor([1.0, math.inf, 3.0, 4.0]), expected).mean == math.inf
    with pytest.raises(ValueError, match="shape mismatch"):
        ref.compare(expected[:3], expected)


def test_tolerances_are_the_design_gates():
    assert ref.tolerance(torch.float64, "dq") == (1e-9, 1e-9)
    assert ref.tolerance(torch.float32, "out") == (2e-5, 1e-5)
    assert ref.tolerance(torch.float32, "dv") == (1e-4, 1e-4)
    with pytest.raises(ValueError, match="relative_gate"):
        ref.tolerance(torch.bfloat16, "out")
    with pytest.raises(ValueError, match="unknown quantity"):
        ref.tolerance(torch.float32, "dx")


def test_allclose_gate_edges():
    expected = torch.tensor([0.0, 10.0], dtype=torch.float64)
    atol, rtol = 1e-3, 1e-2  # allowance: 1e-3 at 0, 0.101 at 10
    delta = torch.tensor([5e-4, 0.0909], dtype=torch.float64)
    ok, worst = ref.allclose_gate(expected + delta, expected, atol, rtol)
    assert ok and worst == pytest.approx(0.9)
    delta = torch.tensor([0.0, 0.2], dtype=torch.float64)
    ok, worst = ref.allclose_gate(expected + delta, expected, atol, rtol)
    assert not ok and worst == pytest.approx(0.2 / 0.101)
    assert ref.allclose_gate(torch.tensor([math.nan, 10.0]), expected, atol, rtol) == (
        False,
        math.inf,
    )


def test_relative_gate():
    base = ref.Errors(max=1e-2, mean=1e-3)
    assert ref.relative_gate(ref.Errors(2.5e-2, 2e-3), base) == (True, pytest.approx(1.0))
    assert not ref.relative_gate(ref.Errors(2.6e-2, 1e-3), base)[0]  # max over 2.5x
    assert not ref.relative_gate(ref.Errors(1e-2, 2.1e-3), base)[0]  # mean over 2x
    assert not ref.relative_gate(ref.Errors(math.inf, 1e-3), base)[0]
    zero = ref.Errors(0.0, 0.0)
    assert ref.relative_gate(zero, zero) == (True, 0.0)
    assert ref.relative_gate(ref.Errors(1e-6, 1e-7), zero) == (False, math.inf)
