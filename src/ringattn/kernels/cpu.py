"""The CPU block kernel: PyTorch's fused CPU flash op, which returns the log-sum-exp.

cpu_flash   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)
            all float dtypes, GQA native in the forward, any head dim
"""

from __future__ import annotations

import math

import torch

from ringattn.kernels.base import (
    Kernel,
    aten,
    band_mask,
    dense_last,
    expand_kv,
    reduce_kv,
    upcast_half,
)


class CpuFlashKernel(Kernel):
    """PyTorch's fused CPU flash attention; GQA without expanding K/V.

    Half-precision blocks run in float32 and return float32 partials. In bf16 the op would round
    every partial output and every block gradient before the float32 merge adds them up, which
    roughly doubles the worst-case error against single-device attention; most CPUs have no bf16
    matmul units, so the float32 path costs little.
    """

    name = "cpu_flash"
    supports_band = True

    def supports(self, q, k):
        if q.device.type != "cpu":
            return f"needs CPU tensors, got {q.device}"
        return None

    @staticmethod
    def _bias(q, k, band):
        """Additive mask in q's dtype (the op's rule); every row of a band block sees a key."""
        visible = band_mask(q.shape[2], k.shape[2], band, q.device)
        return torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, -math.inf)

    def forward_band(self, q, k, v, band, scale):
        q, k, v = dense_last(*upcast_half(q, k, v))
        bias = self._bias(q, k, band)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        dout, q, k, v, out = dense_last(*upcast_half(dout, q, k, v, out))
        bias = self._bias(q, k, band)
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout,
            q,
            expand_kv(k, groups),
            expand_kv(v, groups),
            out,
            lse.to(q.dtype),
            0.0,
            False,
            attn_mask=bias,
            scale=scale,
        )
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)

    def forward(self, q, k, v, causal, scale):
        q, k, v = dense_last(*upcast_half(q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        # K/V are expanded for the backward only: torch 2.13's CPU flash backward with fewer K/V
        # heads than query heads runs ~30x slower than with equal heads (measured 81 s vs 2.5 s,
        # 16k tokens, 2:1 GQA); its forward has no such problem
        dout, q, k, v, out = dense_last(*upcast_half(dout, q, k, v, out))
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout,
            q,
            expand_kv(k, groups),
            expand_kv(v, groups),
            out,
            lse.to(q.dtype),
            0.0,
            causal,
            scale=scale,
        )
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)
