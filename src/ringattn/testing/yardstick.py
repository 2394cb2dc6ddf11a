"""Independent reference attention and the error gates that judge ringattn against it.

Nothing here imports ringattn's kernels, merge or ring code: the reference is the textbook formula
on the *full* (unsharded) tensors, so a bug in the library cannot hide in its own yardstick.

    scores = (q @ k^T) * scale              # (B, Hq, S, S), K/V heads repeated for GQA/MQA
    scores[j > i] = -inf  (when causal)     # explicit mask, top-left aligned like SDPA
    lse = logsumexp(scores, -1)             # (B, Hq, S), natural log
    out = softmax(scores) @ v               # (B, Hq, S, D)

`reference_attention` runs it in float64 and gets dq, dk, dv from autograd for a given `dout`.

Gates (DESIGN §5):

- float64: `|a - e| <= atol + rtol * |e|` with atol = rtol = 1e-9.
- float32: out and lse 2e-5 / 1e-5, grads 1e-4 / 1e-4 (atol / rtol).
- bfloat16 / float16: a plain single-device implementation in the same dtype is the yardstick
  (flash-attention's test method). Both it and ringattn are compared with the float64 reference;
  ringattn's max error may be at most 2.5x and its mean error at most 2x the yardstick's.

Every gate also fails on NaN or Inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "LOW_PRECISION",
    "MAX_RATIO",
    "MEAN_RATIO",
    "Errors",
    "Result",
    "allclose_gate",
    "compare",
    "reference_attention",
    "relative_gate",
    "sdpa_attention",
    "tolerance",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)
MAX_RATIO = 2.5
MEAN_RATIO = 2.0

# (atol, rtol) per dtype and quantity; "grad" covers dq, dk and dv.
_TOLERANCES: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.float64: {"out": (1e-9, 1e-9), "lse": (1e-9, 1e-9), "grad": (1e-9, 1e-9)},
    torch.float32: {"out": (2e-5, 1e-5), "lse": (2e-5, 1e-5), "grad": (1e-4, 1e-4)},
}


@dataclass
class Result:
    """Attention outputs on full tensors: out (B, Hq, S, D), lse (B, Hq, S), grads or None."""

    out: torch.Tensor
    lse: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


@dataclass
class Errors:
    """Absolute error of one tensor against the reference: max and mean over all elements."""

    max: float
    mean: float


def _repeat_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hq, S, D): query head h reads kv head h // (Hq // Hkv)."""
    if num_q_heads % x.shape[1]:
        raise ValueError(f"query heads {num_q_heads} are not a multiple of kv heads {x.shape[1]}")
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


def _forward_fp64(
    q, k, v, causal: bool, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    num_q_heads = q.shape[1]
    k = _repeat_kv(k, num_q_heads)  # (B, Hq, Sk, D)
    v = _repeat_kv(v, num_q_heads)  # (B, Hq, Sk, D)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, Hq, Sq, Sk)
    if softcap is not None:  # Gemma 2's logit softcapping, as transformers' eager attention
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Sq)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # rows with lse = -inf never occur here
    return torch.matmul(probs, v), lse  # (B, Hq, Sq, D), (B, Hq, Sq)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> Result:
    """Float64 attention with an explicit mask on full tensors; grads via autograd when `dout`.
    `softcap = c` caps the scaled scores to c * tanh(s / c) before the softmax.

    q: (B, Hq, S, D); k, v: (B, Hkv, S, D) with Hq % Hkv == 0; dout like q. Inputs of any dtype
    are upcast (their rounding is part of the problem, not of the error). All results are float64.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q64, k64, v64 = (
        x.detach().to(torch.float64).requires_grad_(dout is not None) for x in (q, k, v)
    )
    with torch.enable_grad():
        out, lse = _forward_fp64(q64, k64, v64, causal, scale, softcap)
        if dout is None:
            return Result(out.detach(), lse.detach())
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64))
    return Result(out.detach(), lse.detach(), dq, dk, dv)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    with_lse: bool = False,
) -> Result:
    """Single-device `F.scaled_dot_product_attention` in the inputs' own dtype.

    The yardstick for low-precision gates: what a user gets today without context parallelism.
    K/V heads are repeated explicitly so this works on every torch that has SDPA. SDPA does not
    return lse; `with_lse=True` adds the plain one (scores from a matmul in the inputs' dtype,
    logsumexp in float32, the dtype of the library's lse). It materialises (B, Hq, S, S): small
    shapes only.
    """
    num_q_heads = q.shape[1]
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(
            leaves[0],
            _repeat_kv(leaves[1], num_q_heads),
            _repeat_kv(leaves[2], num_q_heads),
            is_causal=causal,
            scale=scale,
        )
        grads = (None, None, None)
        if dout is not None:
            grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    lse = _plain_lse(q, k, causal, scale) if with_lse else None
    return Result(out.detach(), lse, *grads)


def _plain_lse(q, k, causal: bool, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k = _repeat_kv(k.detach(), q.shape[1])  # (B, Hq, S, D)
    scores = torch.matmul(q.detach(), k.transpose(-2, -1)).float() * scale  # (B, Hq, S, S)
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.logsumexp(scores, dim=-1)  # (B, Hq, S) float32


def compare(actual: torch.Tensor, expected: torch.Tensor) -> Errors:
    """Max and mean absolute error, computed in float64; NaN or Inf anywhere gives inf."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs {tuple(expected.shape)}")
    diff = (actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs()
    if not torch.isfinite(actual).all() or not torch.isfinite(diff).all():
        return Errors(math.inf, math.inf)
    if diff.numel() == 0:
        return Errors(0.0, 0.0)
    return Errors(diff.max().item(), diff.mean().item())


def tolerance(dtype: torch.dtype, quantity: str) -> tuple[float, float]:
    """(atol, rtol) for float64/float32 `quantity` in {"out", "lse", "dq", "dk", "dv"}."""
    if dtype not in _TOLERANCES:
        raise ValueError(f"no absolute tolerance for {dtype}; low precision uses relative_gate")
    key = "grad" if quantity in ("dq", "dk", "dv") else quantity
    if key not in _TOLERANCES[dtype]:
        raise ValueError(f"unknown quantity {quantity!r}; choose out, lse, dq, dk or dv")
    return _TOLERANCES[dtype][key]


def allclose_gate(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float
) -> tuple[bool, float]:
    """Pass when `|a - e| <= atol + rtol * |e|` everywhere and all is finite.

    Returns (passed, worst ratio of |a - e| to its allowance): a ratio of 0.3 means "30% of the
    allowed error", which is what a table should show next to PASS/FAIL.
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {tuple(a.shape)} vs {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        return False, math.inf
    if a.numel() == 0:
        return True, 0.0
    ratio = ((a - e).abs() / (atol + rtol * e.abs())).max().item()
    return ratio <= 1.0, ratio


def relative_gate(
    errors: Errors,
    baseline: Errors,
    max_ratio: float = MAX_RATIO,
    mean_ratio: float = MEAN_RATIO,
) -> tuple[bool, float]:
    """Low-precision gate: errors within `max_ratio` x / `mean_ratio` x the baseline's errors.

    Returns (passed, worst of the two ratios as a fraction of its allowance).
    """
    if not (math.isfinite(errors.max) and math.isfinite(errors.mean)):
        return False, math.inf
    checks = ((errors.max, max_ratio * baseline.max), (errors.mean, mean_ratio * baseline.mean))
    worst = max(
        0.0 if err == 0 else (err / allowed if allowed > 0 else math.inf) for err, allowed in checks
    )
    return worst <= 1.0, worst
