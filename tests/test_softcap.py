"""Attention logit softcapping (`attention(..., softcap=c)`, Gemma 2): exact under CP.

The kernel first (single process, float64): blocks of keys capped and merged, each block's
gradient from the global out and lse, equal to float64 autograd through c * tanh(s / c). Then
every strategy and layout at W = 2-4, dense and packed (with a window), against the float64
reference per rank, forward and backward; and the refusals (a bad cap, a kernel that cannot cap,
ranks that disagree), each on every rank before any communication.
"""

from __future__ import annotations

import pytest
import torch

from ringattn.kernels import softcap as softcap_module
from ringattn.kernels import softcap_kernel
from ringattn.merge import merge
from ringattn.testing.yardstick import compare, reference_attention
from test_ring import LAYOUTS, _assert_rows
from tiers import stride

CAP = 1.5  # small against scores of randn inputs (|s| up to ~4), so the cap changes the result


def _inputs(hq=6, hkv=2, seq_len=24, head_dim=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, seq_len, head_dim), (2, hkv, seq_len, head_dim)] * 2
    q, k, dout, v = (torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes)
    return q, k, v, dout


@pytest.mark.parametrize("chunk_scores", [1 << 24, 50], ids=["one-chunk", "chunked-rows"])
def test_kernel_blocks_merge_to_capped_attention_fp64(monkeypatch, chunk_scores):
    """Last 12 queries: 12 earlier keys (full block) + 12 diagonal keys (causal block)."""
    monkeypatch.setattr(softcap_module, "CHUNK_SCORES", chunk_scores)
    q, k, v, dout = _inputs()
    scale = 20**-0.5
    kernel = softcap_kernel("auto", CAP)
    ref = reference_attention(q, k, v, dout, causal=True, scale=scale, softcap=CAP)
    rows, early, diag = slice(12, 24), slice(0, 12), slice(12, 24)
    qr = q[:, :, rows]
    out_a, lse_a = kernel.forward(qr, k[:, :, early], v[:, :, early], False, scale)
    out_b, lse_b = kernel.forward(qr, k[:, :, diag], v[:, :, diag], True, scale)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert compare(out, ref.out[:, :, rows]).max < 1e-12
    assert compare(lse, ref.lse[:, :, rows]).max < 1e-12
    # full attention for rows 12..23 through autograd: only those rows get a dout
    dout_rows = torch.zeros_like(dout)
    dout_rows[:, :, rows] = dout[:, :, rows]
    want = reference_attention(q, k, v, dout_rows, causal=True, scale=scale, softcap=CAP)
    ga = kernel.backward(
        dout[:, :, rows], qr, k[:, :, early], v[:, :, early], out, lse, False, scale
    )
    gb = kernel.backward(dout[:, :, rows], qr, k[:, :, diag], v[:, :, diag], out, lse, True, scale)
    assert compare(ga[0] + gb[0], want.dq[:, :, rows]).max < 1e-12
    assert compare(torch.cat([ga[1], gb[1]], 2), want.dk).max < 1e-12
    assert compare(torch.cat([ga[2], gb[2]], 2), want.dv).max < 1e-12


def test_kernel_band_and_mask_match_the_reference_fp64():
    """A band block and an explicit mask with an empty row: lse -inf and out 0 there, no NaN."""
    q, k, v, dout = _inputs(hq=4, hkv=4, seq_len=10, head_dim=8, seed=1)
    kernel = softcap_kernel("reference", CAP)
    mask = torch.rand(10, 10, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[3] = False  # a row that sees no key
    out, lse = kernel.forward_mask(q, k, v, mask, 0.4)
    scores = torch.tanh(q @ k.transpose(-1, -2) * 0.4 / CAP) * CAP
    scores = scores.masked_fill(~mask, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    assert torch.isneginf(lse[:, :, 3]).all() and (out[:, :, 3] == 0).all()
    seen = mask.any(1)
    assert compare(lse[:, :, seen], want_lse[:, :, seen]).max < 1e-12
    dq, dk, dv = kernel.backward_mask(dout, q, k, v, out, lse, mask, 0.4)
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
    band_out, band_lse = kernel.forward_band(q, k, v, (-2, 1), 0.4)
    i, j = torch.arange(10).unsqueeze(1), torch.arange(10).unsqueeze(0)
    band_ref = kernel.forward_mask(q, k, v, (j - i >= -2) & (j - i <= 1), 0.4)
    assert compare(band_out, band_ref[0]).max < 1e-12
    assert compare(band_lse, band_ref[1]).max < 1e-12


def test_the_cap_changes_the_result_and_a_huge_cap_does_not():
    q, k, v, _ = _inputs(seed=3)
    capped = softcap_kernel("auto", CAP).forward(q, k, v, True, 1.0)
    loose = softcap_kernel("auto", 1e9).forward(q, k, v, True, 1.0)
    plain = reference_attention(q, k, v, causal=True, scale=1.0)
    assert compare(capped[0], plain.out).max > 1e-2
    assert compare(loose[0], plain.out).max < 1e-9


@pytest.mark.parametrize(
    ("backend", "cap", "error", "match"),
    [
        ("auto", 0.0, ValueError, r"softcap must be finite and > 0 .* got 0.0"),
        ("auto", -2.0, ValueError, r"got -2.0; pass softcap=None"),
        ("auto", float("nan"), ValueError, r"finite and > 0"),
        ("auto", "50", TypeError, r"softcap must be a number > 0 or None, got '50'"),
        ("cpu_flash", 30.0, ValueError, r"backend 'cpu_flash' cannot softcap .* backend='auto'"),
    ],
)
def test_bad_softcap_is_refused_by_name(backend, cap, error, match):
    import ringattn

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(error, match=match):
        ringattn.attention(q, q, q, softcap=cap, backend=backend)


def _dense_cases():
    cases = []
    for w in (2, 3, 4):
        for strategy, layout in (
            [("ring", lay) for lay in LAYOUTS]
            + [("allgather", lay) for lay in LAYOUTS]
            + [("ulysses", "zigzag"), ("ulysses", "striped")]
        ):
            hq, hkv = (2 * w, w) if strategy == "ulysses" else (6, 2)
            cases.append((w, {"strategy": strategy, "layout": layout, "hq": hq, "hkv": hkv}))
    cases.append((4, {"strategy": "hybrid", "layout": "zigzag", "hq": 4, "hkv": 2,
                      "mesh_shape": (2, 2)}))  # fmt: skip
    return cases


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "case", stride(_dense_cases(), 7, lambda c: f"W{c[0]}-{c[1]['strategy']}-{c[1]['layout']}")
)
def test_softcap_exact_every_strategy_and_layout(pools, case, causal):
    world_size, kwargs = case
    rows = pools(world_size).run(
        "workers_strategies:strategy_case", causal=causal, head_dim=24, dtype="float64",
        softcap=CAP, **kwargs,
    )  # fmt: skip
    _assert_rows(rows, f"{case} causal={causal}")


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    ("layout", "window", "dtype"),
    [("zigzag", None, "float64"), ("striped", (5, 0), "float64"), ("contiguous", None, "float32")],
)
def test_softcap_exact_packed_documents(pools, world_size, layout, window, dtype):
    """Packed documents (one of length 1, one longer than the window), tiles and exact blocks."""
    kwargs = {"bounds": [0, 11, 12, 30, 37], "layout": layout, "causal": True, "window": window,
              "hq": 4, "hkv": 2, "dtype": dtype, "softcap": CAP}  # fmt: skip
    _assert_rows(pools(world_size).run("workers_packed:packed_case", **kwargs), str(kwargs))


def test_softcap_on_one_rank_only_is_refused_on_every_rank(pools):
    pools(2).run_expect_error(
        "workers:call_attention",
        per_rank={1: {"softcap": 30.0}},
        match="softcap",
        exc_type=ValueError,
    )


def test_compiled_softcap_passes_opcheck_and_equals_eager():
    """The custom ops carry the cap as a static; fullgraph compile equals eager, with the cap."""
    import ringattn
    from ringattn import ops

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    statics = ("", "zigzag", "ring", "auto", True, None, None, CAP)
    torch.library.opcheck(ops.attention_forward, (q, k, v, None, *statics))

    def attend(q, k, v):
        return ringattn.attention(q, k, v, causal=True, softcap=CAP)

    torch._dynamo.reset()
    out = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = reference_attention(q, k, v, dout, causal=True, softcap=CAP)
    assert compare(out, want.out).max < 2e-5
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert compare(got, getattr(want, name)).max < 1e-4, name
