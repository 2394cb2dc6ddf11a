"""The reference block kernel: explicit-mask attention in plain PyTorch, any dtype and device.

Scores are computed in the accumulator dtype (float32, float64 for float64 inputs) with the mask
applied as -inf; rows that see no key give out = 0 and lse = -inf, never NaN. O(Sq * Sk) memory:
the kernel of last resort, and the one every fused kernel is probed against.
"""

from __future__ import annotations

import math

import torch

from ringattn.kernels.base import Kernel, band_mask, causal_mask
from ringattn.merge import accumulator_dtype


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
    supports_mask = True

    def forward_mask(self, q, k, v, mask, scale):
        return reference_forward(q, k, v, mask, scale)

    def backward_mask(self, dout, q, k, v, out, lse, mask, scale):
        return reference_backward(dout, q, k, v, out, lse, mask, scale)

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
