"""Block kernels, single process: forward (out, lse) and the backward from global out and lse.

Splitting the keys into blocks, computing each block's gradient from the *global* out and lse, and
summing must give the gradient of attention over all keys. That identity is what the ring relies on.
"""

import pytest
import torch

import ringattn
from ringattn.kernels import KERNELS, select_kernel
from ringattn.merge import merge
from ringattn.testing.yardstick import compare, reference_attention

CPU_KERNELS = ["reference", "cpu_flash"]
CUDA_KERNELS = ["cudnn", "flash", "efficient", "reference"]


def _inputs(hq, hkv, seq_len, head_dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, seq_len, head_dim), (2, hkv, seq_len, head_dim)] * 2
    q, k, dout, v = (torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def _split_keys_check(kernel_name, dtype, hq, hkv, head_dim, device="cpu"):
    """Query block of 12 rows against keys in two blocks: 12 causal (diagonal) + 12 earlier."""
    kernel = KERNELS[kernel_name]
    q, k, v, dout = _inputs(hq, hkv, 24, head_dim, dtype, device)
    scale = head_dim**-0.5
    # the last 12 queries see the first 12 keys fully and the last 12 causally
    causal_ref = reference_attention(q, k, v, dout, causal=True, scale=scale)
    early = kernel.forward(q[:, :, 12:], k[:, :, :12], v[:, :, :12], False, scale)
    diag = kernel.forward(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], True, scale)
    out, lse = merge(*early, *diag)
    expected_out = causal_ref.out[:, :, 12:]
    out_q = out.to(dtype)
    grads_early = kernel.backward(
        dout[:, :, 12:], q[:, :, 12:], k[:, :, :12], v[:, :, :12], out_q, lse, False, scale
    )
    grads_diag = kernel.backward(
        dout[:, :, 12:], q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], out_q, lse, True, scale
    )
    full = _masked_grads(q, k, v, dout, scale)
    dq = grads_early[0].double() + grads_diag[0].double()
    dk = torch.cat([grads_early[1].double(), grads_diag[1].double()], dim=2)
    dv = torch.cat([grads_early[2].double(), grads_diag[2].double()], dim=2)
    return {
        "out": compare(out, expected_out).max,
        "lse": compare(lse, causal_ref.lse[:, :, 12:]).max,
        "dq": compare(dq, full[0]).max,
        "dk": compare(dk, full[1]).max,
        "dv": compare(dv, full[2]).max,
    }


def _masked_grads(q, k, v, dout, scale):
    """fp64 autograd grads of <dout[12:], causal_attention(q, k, v)[12:]>."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores = (q64 @ k64.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) * scale
    mask = torch.ones(24, 24, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = probs @ v64.repeat_interleave(q.shape[1] // k.shape[1], 1)
    (out[:, :, 12:] * dout[:, :, 12:].double()).sum().backward()
    return q64.grad[:, :, 12:], k64.grad, v64.grad


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("kernel_name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(4, 4, 40), (6, 2, 64), (4, 1, 24)])
def test_block_gradients_sum_to_full_gradient_cpu(kernel_name, dtype, hq, hkv, head_dim):
    errors = _split_keys_check(kernel_name, dtype, hq, hkv, head_dim)
    assert all(err <= TOL[dtype] for err in errors.values()), errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel_name", CUDA_KERNELS)
@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(4, 4, 64), (8, 2, 128)])
def test_block_gradients_sum_to_full_gradient_cuda(kernel_name, hq, hkv, head_dim):
    q, k = _inputs(hq, hkv, 24, head_dim, torch.bfloat16, "cuda")[:2]
    if KERNELS[kernel_name].supports(q, k) is not None:
        pytest.skip(KERNELS[kernel_name].supports(q, k))
    errors = _split_keys_check(kernel_name, torch.bfloat16, hq, hkv, head_dim, "cuda")
    assert all(err <= TOL[torch.bfloat16] for err in errors.values()), errors


def test_reference_kernel_fully_masked_rows_are_zero_not_nan():
    from ringattn.kernels.reference import reference_backward, reference_forward

    q, k, v, dout = _inputs(2, 1, 4, 8, torch.float64)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2:, :2] = True  # rows 0 and 1 see nothing
    out, lse = reference_forward(q, k, v, mask, 0.5)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    grads = reference_backward(dout, q, k, v, out, lse, mask, 0.5)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, :2], torch.zeros_like(grads[0][:, :, :2]))


def test_auto_picks_cpu_flash_on_cpu_and_explicit_names_are_checked():
    q, k = _inputs(4, 2, 8, 16, torch.float32)[:2]
    assert select_kernel("auto", q, k).name == "cpu_flash"
    assert select_kernel("reference", q, k).name == "reference"
    with pytest.raises(ValueError, match="backend 'flash' cannot run this case: needs CUDA"):
        select_kernel("flash", q, k)
    with pytest.raises(ValueError, match=r"unknown backend 'xformers'; choose one of \['auto'"):
        select_kernel("xformers", q, k)


def test_auto_falls_back_when_a_kernel_fails_its_probe(monkeypatch):
    """A fused op that raises at run time is skipped by auto, not hit inside the ring."""
    from ringattn.kernels import probe

    broken = KERNELS["cpu_flash"]

    def fail(*args, **kwargs):
        raise RuntimeError("simulated: op not supported on this machine")

    monkeypatch.setattr(probe, "_VERDICTS", {})
    monkeypatch.setattr(broken, "forward", fail)
    q, k = _inputs(4, 2, 8, 16, torch.float32)[:2]
    assert select_kernel("auto", q, k).name == "reference"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_single_process_without_distributed(dtype, causal):
    """W = 1 with no process group at all: plain exact attention, no communication."""
    q, k, v, dout = _inputs(6, 3, 10, 12, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ringattn.attention(*leaves, causal=causal, layout="striped", return_lse=True)
    out.backward(dout)
    ref = reference_attention(q, k, v, dout, causal=causal)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in [
        (out, ref.out),
        (lse, ref.lse),
        (leaves[0].grad, ref.dq),
        (leaves[1].grad, ref.dk),
        (leaves[2].grad, ref.dv),
    ]:
        assert compare(got, want).max <= tol
    assert not lse.requires_grad


@pytest.mark.parametrize("kernel_name", CPU_KERNELS)
def test_strided_last_dim_gives_the_same_result(kernel_name):
    """A K (or Q, V, dout) whose last dim is strided: the raw CPU op silently got it wrong."""
    kernel = KERNELS[kernel_name]
    q, k, v, dout = _inputs(2, 2, 16, 8, torch.float64)
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v, dout)]
    assert all(x.stride(-1) != 1 for x in strided)
    want = kernel.forward(q, k, v, True, 0.3)
    got = kernel.forward(*strided[:3], True, 0.3)
    for a, b in zip(got, want):
        assert compare(a, b).max < 1e-12
    want_grads = kernel.backward(dout, q, k, v, *want, True, 0.3)
    got_grads = kernel.backward(strided[3], *strided[:3], *want, True, 0.3)
    for a, b in zip(got_grads, want_grads):
        assert compare(a, b).max < 1e-12


def test_flash_backward_passes_undefined_cum_seq(monkeypatch):
    """aten's flash backward takes a *defined* cum_seq_q/k (even empty) as the variable-length
    path; the dense backward must pass None (an undefined tensor), as SDPA's own autograd does."""
    from ringattn.kernels import cuda

    seen = {}

    class Ops:
        @staticmethod
        def _scaled_dot_product_flash_attention_backward(*args, **kwargs):
            seen["cum_seq"] = args[6:8]
            return args[1], args[2], args[3]

    monkeypatch.setattr(cuda, "aten", Ops)
    monkeypatch.setattr(cuda, "_no_rng", lambda device: (None, None))
    q, k, v, dout = _inputs(2, 2, 8, 8, torch.float32)
    cuda.FlashKernel()._backward(dout, q, k, v, q, q[..., 0], True, 0.3)
    assert seen["cum_seq"] == (None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_backend_backward_runs_on_cuda():
    q, k, v, dout = _inputs(4, 2, 64, 64, torch.bfloat16, device="cuda")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ringattn.attention(q, k, v, causal=True, backend="flash")
    out.backward(dout)
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_reference_fallback_on_cuda_warns(monkeypatch):
    """float64 on CUDA has no fused kernel: the O(block^2) reference kernel is said, not silent."""
    from ringattn import kernels

    class FakeCuda:
        type = "cuda"

    class Q:
        device = FakeCuda()
        dtype = torch.float64
        shape = (1, 2, 8, 16)

    monkeypatch.setattr(kernels, "AUTO_ORDER", {"cuda": ("reference",)})
    with pytest.warns(RuntimeWarning, match=r"reference kernel.*O\(block\^2\)"):
        assert kernels.select_kernel("auto", Q(), Q()).name == "reference"
