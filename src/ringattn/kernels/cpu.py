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
    supports_mask = True

    def supports(self, q, k):
        if q.device.type != "cpu":
            return f"needs CPU tensors, got {q.device}"
        return None

    @staticmethod
    def _bias(q, visible):
        """Additive mask in q's dtype (the op's rule): 0 where visible, -inf elsewhere."""
        return torch.zeros(visible.shape, dtype=q.dtype, device=visible.device).masked_fill(
            ~visible, -math.inf
        )

    def forward_band(self, q, k, v, band, scale):
        # every row of a band block sees a key, so the op's lse needs no fix-up
        visible = band_mask(q.shape[2], k.shape[2], band, q.device)
        return self._masked_forward(q, k, v, self._bias(upcast_half(q)[0], visible), scale)

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        visible = band_mask(q.shape[2], k.shape[2], band, q.device)
        return self.backward_mask(dout, q, k, v, out, lse, visible, scale)

    def forward_mask(self, q, k, v, mask, scale):
        """Any mask; the op gives rows that see no key out = 0 and lse = 0: lse is set to -inf."""
        out, lse = self._masked_forward(q, k, v, self._bias(upcast_half(q)[0], mask), scale)
        seen = mask.any(1)
        if not bool(seen.all()):
            lse = lse.masked_fill(~seen, -math.inf)
            out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
        return out, lse

    @staticmethod
    def _masked_forward(q, k, v, bias, scale):
        q, k, v = dense_last(*upcast_half(q, k, v))
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )[:2]

    def backward_mask(self, dout, q, k, v, out, lse, mask, scale):
        # rows that see no key anywhere have lse = -inf (padding): any finite value keeps their
        # probabilities exp(-inf - lse) = 0 where exp(-inf - -inf) would be NaN
        dout, q, k, v, out = dense_last(*upcast_half(dout, q, k, v, out))
        lse = lse.masked_fill(torch.isneginf(lse), 0.0).to(q.dtype)
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout,
            q,
            expand_kv(k, groups),
            expand_kv(v, groups),
            out,
            lse,
            0.0,
            False,
            attn_mask=self._bias(q, mask),
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
