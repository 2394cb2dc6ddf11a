"""Block attention kernels: one (query block, key block) pair, forward and backward.

Every kernel has the same two calls:

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

q is (B, Hq, Sq, D); k, v are (B, Hkv, Sk, D) with Hq % Hkv == 0 (GQA/MQA: K/V heads are shared by
Hq/Hkv query heads). `out` has q's dtype, `lse` is float32 (float64 for float64 inputs). A causal
block is square and top-left aligned (key j visible to query i iff j <= i).

The backward takes the *global* `out` and `lse` of the query rows, i.e. after every block has been
merged, not this block's own. With D = rowsum(dout * out) and P = exp(s - lse) this gives the
block's exact share of the gradient (dS = P * (dout v^T - D)), and the shares sum over blocks.

This module holds the interface, the pure-PyTorch reference kernel (any mask, any float dtype) and
the registry with `auto` selection; the fused PyTorch SDPA ops are wrapped in `kernels_sdpa.py`.
"""

from __future__ import annotations

import math

import torch

from .merge import accumulator_dtype


class Kernel:
    """Interface of a block kernel; `supports` says why a case cannot run (None when it can).

    Kernels with `supports_band` also run banded blocks (sliding windows): `forward_band` and
    `backward_band` take `band = (lo, hi)`, key j visible to query i iff lo <= j - i <= hi.
    """

    name: str = ""
    supports_band: bool = False

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(q_len, k_len) bool mask, True where key j is visible to query i (j <= i, top-left)."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return cols <= rows


def band_mask(q_len: int, k_len: int, band: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(q_len, k_len) bool mask, True where band[0] <= j - i <= band[1]."""
    offset = torch.arange(k_len, device=device).unsqueeze(0) - torch.arange(
        q_len, device=device
    ).unsqueeze(1)
    return (offset >= band[0]) & (offset <= band[1])


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D): query heads grouped by the K/V head they share."""
    b, hq, s, d = q.shape
    return q.reshape(b, hkv, hq // hkv, s, d)


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with an explicit boolean mask (True = visible), computed in the accumulator
    dtype. Rows with no visible key give out = 0 and lse = -inf (never NaN)."""
    acc = accumulator_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    qg = _grouped(q.to(acc), hkv)  # (B, Hkv, G, Sq, D)
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    scores = torch.matmul(qg, kf.transpose(-1, -2)) * scale  # (B, Hkv, G, Sq, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G, Sq)
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    out = torch.matmul(probs, vf)  # (B, Hkv, G, Sq, D)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block from the global out and lse (see module docstring)."""
    acc = accumulator_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    qg = _grouped(q.to(acc), hkv)  # (B, Hkv, G, Sq, D)
    dog = _grouped(dout.to(acc), hkv)
    og = _grouped(out.to(acc), hkv)
    lse_g = lse.to(acc).reshape(b, hkv, hq // hkv, sq, 1)
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    scores = torch.matmul(qg, kf.transpose(-1, -2)) * scale  # (B, Hkv, G, Sq, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    safe_lse = torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g)
    probs = torch.exp(scores - safe_lse)  # (B, Hkv, G, Sq, Sk)
    dv = torch.matmul(probs.transpose(-1, -2), dog).sum(2)  # (B, Hkv, Sk, D)
    dprobs = torch.matmul(dog, vf.transpose(-1, -2))  # (B, Hkv, G, Sq, Sk)
    delta = (dog * og).sum(-1, keepdim=True)  # (B, Hkv, G, Sq, 1)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kf).reshape(b, hq, sq, d)
    dk = torch.matmul(dscores.transpose(-1, -2), qg).sum(2)  # (B, Hkv, Sk, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class ReferenceKernel(Kernel):
    """Explicit-mask attention in plain PyTorch: every dtype and device, O(Sq*Sk) memory."""

    name = "reference"
    supports_band = True

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return None

    def forward_band(self, q, k, v, band, scale):
        return reference_forward(q, k, v, band_mask(q.shape[2], k.shape[2], band, q.device), scale)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        mask = band_mask(q.shape[2], k.shape[2], band, q.device)
        return reference_backward(dout, q, k, v, out, lse, mask, scale)

    def forward(self, q, k, v, causal, scale):
        mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
        return reference_forward(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
        return reference_backward(dout, q, k, v, out, lse, mask, scale)


def _registry() -> dict[str, Kernel]:
    from .kernels_sdpa import CpuFlashKernel, CudnnKernel, EfficientKernel, FlashKernel

    kernels = [ReferenceKernel(), CpuFlashKernel(), CudnnKernel(), FlashKernel(), EfficientKernel()]
    return {kernel.name: kernel for kernel in kernels}


KERNELS: dict[str, Kernel] = _registry()
BACKENDS = ("auto", *KERNELS)

# `auto` tries these in order and takes the first that supports the case and passes its probe
AUTO_ORDER = {
    "cpu": ("cpu_flash", "reference"),
    "cuda": ("cudnn", "flash", "efficient", "reference"),
}


def check_backend_name(backend: str) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")


def select_kernel(backend: str, q: torch.Tensor, k: torch.Tensor) -> Kernel:
    """The kernel for `backend` on tensors like q, k.

    An explicit name must support the case (ValueError with its reason otherwise). `auto` takes
    the first kernel in AUTO_ORDER for the device that supports the case and whose one-time probe
    (a tiny forward and backward checked against the reference) succeeds, so a fused op that is
    missing or broken on this machine falls back instead of failing inside the ring.
    """
    check_backend_name(backend)
    if backend != "auto":
        kernel = KERNELS[backend]
        reason = kernel.supports(q, k)
        if reason is not None:
            raise ValueError(
                f"backend {backend!r} cannot run this case: {reason}; use backend='auto'"
            )
        return kernel
    from .probe import kernel_works

    for name in AUTO_ORDER.get(q.device.type, ("reference",)):
        kernel = KERNELS[name]
        if kernel.supports(q, k) is None and kernel_works(kernel, q, k):
            return kernel
    return KERNELS["reference"]
