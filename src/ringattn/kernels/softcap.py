"""The softcap block kernel: attention scores capped by tanh (Gemma 2's logit softcapping).

With raw scores r = scale * q . k and a cap c > 0, the score is

    s = c * tanh(r / c)                      (|s| < c; s ~ r where |r| << c)

and attention is softmax(s) over the visible keys. The cap is elementwise on the scores, before
the softmax, so a block's (out, lse) still merge exactly by the online softmax (merge.py): the
block returns lse = log sum_j exp(s_j) of its capped scores, and the ring, all-gather, Ulysses and
hybrid strategies need nothing new. Backward, from the global out and lse as every kernel
(base.py): P = exp(s - lse), dS = P * (dout v^T - rowsum(dout * out)), and the chain rule through
the cap, dr = dS * (1 - tanh(r / c)^2), gives dq = scale * dr k and dk = scale * dr^T q.

No fused op softcaps and returns the log-sum-exp for an external merge (SDPA's ops take no score
function; flex_attention's `score_mod` does, but its backward recomputes from its own lse and
cannot take the global one), so this kernel computes in plain PyTorch in the accumulator dtype
(float32; float64 for float64), query rows in chunks so that a block's score matrix never exceeds
CHUNK_SCORES entries: O(chunk * Sk) memory, not O(Sq * Sk). Rows that see no key give out = 0
and lse = -inf, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ringattn.kernels.base import Kernel
from ringattn.merge import accumulator_dtype

#: the most score entries (B * Hq * rows * Sk) one chunk of query rows materialises
CHUNK_SCORES = 1 << 24

# rows [r0, r1) -> the (r1 - r0, Sk) bool mask of those rows (True = visible), or None (all)
RowMask = Callable[[int, int], torch.Tensor | None]


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, R, D) -> (B, Hkv, G * R, D): the rows of the G query heads that share a K/V head,
    stacked, so that one plain matmul per K/V head serves them all (no expanded K/V)."""
    b, hq, r, d = x.shape
    return x.reshape(b, hkv, hq // hkv * r, d)


def _capped_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, tanh(r / c)) for stacked q (B, Hkv, G * rows, D) and k (B, Hkv, Sk, D), both
    (B, Hkv, G * rows, Sk); s is -inf where the (rows, Sk) mask hides a key."""
    t = torch.matmul(q, k.transpose(-1, -2)).mul_(scale / cap).tanh_()
    s = t * cap
    if mask is not None:
        b, hkv, gr, sk = s.shape
        s.view(b, hkv, gr // rows, rows, sk).masked_fill_(~mask, -math.inf)
    return s, t


def _chunk_rows(q: torch.Tensor, k_len: int) -> int:
    b, hq, _, _ = q.shape
    return max(1, CHUNK_SCORES // max(1, b * hq * k_len))


def _unstack(x: torch.Tensor, hq: int, rows: int) -> torch.Tensor:
    """(B, Hkv, G * rows, ...) -> (B, Hq, rows, ...)."""
    return x.reshape(x.shape[0], hq, rows, *x.shape[3:])


def softcap_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_mask: RowMask, scale: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of capped attention, rows in chunks, both in the accumulator dtype (a half
    precision block's partial is not rounded before the float32 merge)."""
    acc = accumulator_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    kf, vf = k.to(acc), v.to(acc)  # (B, Hkv, Sk, D)
    out = torch.empty(b, hq, sq, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=acc, device=q.device)
    step = _chunk_rows(q, k.shape[2])
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        qg = _grouped(q[:, :, r0:r1].to(acc), hkv)  # (B, Hkv, G * R, D)
        s, _ = _capped_scores(qg, kf, row_mask(r0, r1), scale, cap, r1 - r0)
        chunk_lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, Hkv, G * R, 1)
        safe = chunk_lse.masked_fill(torch.isneginf(chunk_lse), 0.0)
        chunk_out = torch.matmul(s.sub_(safe).exp_(), vf)  # (B, Hkv, G * R, D)
        out[:, :, r0:r1] = _unstack(chunk_out, hq, r1 - r0)
        lse[:, :, r0:r1] = _unstack(chunk_lse, hq, r1 - r0).squeeze(-1)
    return out, lse


def softcap_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    row_mask: RowMask,
    scale: float,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block from the global out and lse (module docstring), rows in chunks,
    in the accumulator dtype; dk and dv add up over the chunks (and a K/V head's query heads)."""
    acc = accumulator_dtype(q.dtype)
    hq, sq = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    kf, vf = k.to(acc), v.to(acc)  # (B, Hkv, Sk, D)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    step = _chunk_rows(q, k.shape[2])
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        qg, dog, og = (_grouped(x[:, :, r0:r1].to(acc), hkv) for x in (q, dout, out))
        lse_g = _grouped(lse[:, :, r0:r1].to(acc).unsqueeze(-1), hkv)  # (B, Hkv, G * R, 1)
        safe = lse_g.masked_fill(torch.isneginf(lse_g), 0.0)
        s, t = _capped_scores(qg, kf, row_mask(r0, r1), scale, cap, r1 - r0)
        probs = s.sub_(safe).exp_()  # (B, Hkv, G * R, Sk); hidden keys: 0
        dv += torch.matmul(probs.transpose(-1, -2), dog)  # (B, Hkv, Sk, D)
        delta = (dog * og).sum(-1, keepdim=True)  # (B, Hkv, G * R, 1)
        # dr = P * (dout v^T - delta) * (1 - t^2) * scale, in place over the (R, Sk) buffers
        draw = torch.matmul(dog, vf.transpose(-1, -2)).sub_(delta).mul_(probs)
        draw.mul_(t.mul_(t).neg_().add_(1.0)).mul_(scale)
        dq[:, :, r0:r1] = _unstack(torch.matmul(draw, kf), hq, r1 - r0)
        dk += torch.matmul(draw.transpose(-1, -2), qg)  # (B, Hkv, Sk, D)
    return dq, dk, dv


def _causal_rows(k_len: int, device: torch.device) -> RowMask:
    cols = torch.arange(k_len, device=device)
    return lambda r0, r1: cols <= torch.arange(r0, r1, device=device).unsqueeze(1)


def _band_rows(k_len: int, band: tuple[int, int], device: torch.device) -> RowMask:
    cols = torch.arange(k_len, device=device)

    def rows(r0: int, r1: int) -> torch.Tensor:
        offset = cols - torch.arange(r0, r1, device=device).unsqueeze(1)  # j - i
        return (offset >= band[0]) & (offset <= band[1])

    return rows


def _mask_rows(mask: torch.Tensor) -> RowMask:
    return lambda r0, r1: mask[r0:r1]


def _all_rows(r0: int, r1: int) -> None:
    return None


class SoftcapKernel(Kernel):
    """Capped-score attention in plain PyTorch: any dtype, device, mask, band and GQA.

    One instance per cap (`resolve.build_call` makes it when `attention(..., softcap=c)`).
    """

    name = "softcap"
    supports_band = True
    supports_mask = True

    def __init__(self, cap: float) -> None:
        self.cap = float(cap)

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        return None

    def forward(self, q, k, v, causal, scale):
        rows = _causal_rows(k.shape[2], q.device) if causal else _all_rows
        return softcap_forward(q, k, v, rows, scale, self.cap)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        rows = _causal_rows(k.shape[2], q.device) if causal else _all_rows
        return softcap_backward(dout, q, k, v, out, lse, rows, scale, self.cap)

    def forward_band(self, q, k, v, band, scale):
        return softcap_forward(q, k, v, _band_rows(k.shape[2], band, q.device), scale, self.cap)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        rows = _band_rows(k.shape[2], band, q.device)
        return softcap_backward(dout, q, k, v, out, lse, rows, scale, self.cap)

    def forward_mask(self, q, k, v, mask, scale):
        return softcap_forward(q, k, v, _mask_rows(mask), scale, self.cap)

    def backward_mask(self, dout, q, k, v, out, lse, mask, scale):
        return softcap_backward(dout, q, k, v, out, lse, _mask_rows(mask), scale, self.cap)
