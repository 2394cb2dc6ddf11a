"""Masked blocks on CUDA run fused kernels: sliding-window bands on flash's window op, tiles of
packed documents on the memory-efficient op with a bias; never the reference kernel. GPU cases
skip cleanly on CPU; the refusal of a window on a kernel without one is checked everywhere."""

from __future__ import annotations

import pytest
import torch

import ringattn
from ringattn.comm import GroupInfo
from ringattn.kernels import KERNELS, select_kernel
from ringattn.kernels.base import band_mask
from ringattn.kernels.tiled import tiles_backward, tiles_forward
from ringattn.layout import LAYOUTS, get_layout
from ringattn.packing import place
from ringattn.plan import Call, step_blocks
from ringattn.testing.yardstick import compare

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda(fn):
    """GPU-only: skipped without CUDA, marked `gpu` so scripts/bench/gpu.sh's `-m gpu` runs it."""
    return pytest.mark.gpu(_needs_cuda(fn))


def test_window_on_a_kernel_without_one_names_the_kernel_needed():
    with pytest.raises(ValueError, match="'efficient' kernel does not.*backend 'flash'"):
        Call(
            GroupInfo(None, 0, 2), LAYOUTS["zigzag"], KERNELS["efficient"], True, 1.0, None, (4, 0)
        )
    Call(GroupInfo(None, 0, 2), LAYOUTS["zigzag"], KERNELS["reference"], True, 1.0, None, (4, 0))


def _inputs(hq, hkv, sq, sk, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, hq, sq, 64), (1, hkv, sk, 64), (1, hkv, sk, 64), (1, hq, sq, 64)]
    return [torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes]


def _gate(got, want64, base):
    """Low-precision result within 2.5x max / 2x mean of the reference kernel in that dtype."""
    err, ref = compare(got, want64), compare(base, want64)
    assert err.max <= 2.5 * ref.max + 1e-6 and err.mean <= 2 * ref.mean + 1e-7, (err, ref)


@cuda
@pytest.mark.parametrize("kernel_name", ["flash", "cudnn"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("band, sq, sk", [((-5, 0), 96, 96), ((-40, 3), 80, 64), ((0, 30), 64, 94)])
def test_band_on_flash_window_matches_reference(kernel_name, hq, hkv, band, sq, sk):
    q, k, v, dout = _inputs(hq, hkv, sq, sk, torch.bfloat16)
    kernel, ref = KERNELS[kernel_name], KERNELS["reference"]
    visible = band_mask(sq, sk, band, q.device)
    assert visible.any(1).all() and visible.any(0).all()  # a band block, as packing makes them
    want = ref.forward_band(*(x.double() for x in (q, k, v)), band, 0.125)
    base = ref.forward_band(q, k, v, band, 0.125)
    got = kernel.forward_band(q, k, v, band, 0.125)
    _gate(got[0], want[0], base[0])
    torch.testing.assert_close(got[1].double(), want[1], atol=2e-2, rtol=0)
    args64 = [x.double() for x in (dout, q, k, v)] + [want[0], want[1]]
    want_g = ref.backward_band(*args64, band, 0.125)
    base_g = ref.backward_band(dout, q, k, v, base[0], base[1], band, 0.125)
    got_g = kernel.backward_band(dout, q, k, v, got[0], got[1], band, 0.125)
    for a, w, b in zip(got_g, want_g, base_g):
        assert a.shape == w.shape  # dk, dv with the K/V heads: GQA taken natively
        _gate(a, w, b)


@cuda
@pytest.mark.parametrize("kernel_name", ["flash", "efficient"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_on_the_efficient_op_match_reference(kernel_name, dtype):
    if dtype == torch.float32 and kernel_name == "flash":
        pytest.skip("flash runs half dtypes only")
    bounds = tuple(range(0, 400, 7)) + (403,)
    placement = place(get_layout("zigzag"), 2, bounds)
    (block,) = [b for b in step_blocks(placement, 1, 0, True, None) if b.tiles is not None]
    m, n = block.q_stop - block.q_start, block.kv_stop - block.kv_start
    q, k, v, dout = _inputs(8, 2, m, n, dtype)  # GQA: 8 query heads on 2 K/V heads
    ref, kernel = KERNELS["reference"], KERNELS[kernel_name]
    want = tiles_forward(ref, *(x.double() for x in (q, k, v)), block.tiles, 0.125)
    base = tiles_forward(ref, q, k, v, block.tiles, 0.125)
    got = tiles_forward(kernel, q, k, v, block.tiles, 0.125)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    _gate(got[0], want[0], base[0])
    args = [x.double() for x in (dout, q, k, v)]
    want_g = tiles_backward(ref, *args, *want, block.tiles, 0.125)
    base_g = tiles_backward(ref, dout, q, k, v, *base, block.tiles, 0.125)
    got_g = tiles_backward(kernel, dout, q, k, v, got[0].to(dtype), got[1], block.tiles, 0.125)
    for a, w, b in zip(got_g, want_g, base_g):
        assert bool(torch.isfinite(a).all())
        _gate(a, w, b)


@cuda
def test_packed_window_attention_on_cuda_never_runs_the_reference_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the reference kernel ran on CUDA")

    bounds = [0, 3, 300, 301, 1100, 1101, 1400]
    q, k, v, dout = _inputs(8, 2, 1400, 1400, torch.bfloat16)
    q.requires_grad_()
    # `auto` probes fused kernels against the reference once: probe before refusing it
    assert select_kernel("auto", q, k).name != "reference"
    for name in ("forward", "backward", "forward_band", "backward_band"):
        monkeypatch.setattr(KERNELS["reference"], name, refuse)
    monkeypatch.setattr(KERNELS["reference"], "forward_mask", refuse)
    monkeypatch.setattr(KERNELS["reference"], "backward_mask", refuse)
    out = ringattn.attention(q, k, v, causal=True, cu_seqlens=bounds, window=(100, 0))
    out.backward(dout[:, :8])
    assert bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all())


def test_flash_window_of_every_band_block_reproduces_its_mask():
    """Pure check: flash's bottom-right window (left, right) gives each band block's mask."""
    from ringattn.kernels.cuda import _flash_window
    from ringattn.packing import placement_blocks

    placement = place(get_layout("zigzag"), 3, (0, 40, 41, 130, 200))
    seen = 0
    for window in ((3, 0), (2, 5), (0, 0), (-1, 2), (9, -1)):
        for rank in range(3):
            for src in range(3):
                for b in placement_blocks(placement, rank, src, False, window):
                    if b.band is None:
                        continue
                    sq, sk = b.q_stop - b.q_start, b.kv_stop - b.kv_start
                    left, right = _flash_window(b.band, sq, sk)
                    i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
                    flash = (j >= i + sk - sq - left) & (j <= i + sk - sq + right)
                    assert torch.equal(flash, band_mask(sq, sk, b.band, torch.device("cpu")))
                    seen += 1
    assert seen > 20
