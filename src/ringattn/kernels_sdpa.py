"""Block kernels on PyTorch's fused attention ops that return the log-sum-exp.

    cpu_flash   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)
                all float dtypes, GQA native, any head dim
    cudnn       aten._scaled_dot_product_cudnn_attention (+ _backward)     fp16/bf16
    flash       aten._scaled_dot_product_flash_attention (+ _backward)     fp16/bf16, D <= 256
    efficient   aten._scaled_dot_product_efficient_attention (+ _backward) fp32/fp16/bf16

The CUDA ops take equal head counts, so GQA K/V are expanded locally (after communication, never
before) and their gradients summed back over the query-head groups. Each op returns its lse in its
own shape (cuDNN may add a trailing 1, the efficient op pads the length to a multiple of 32); these
wrappers return and take lse as (B, H, Sq) float32. Dropout is always 0, so the philox seed and
offset the backward ops ask for are never read.
"""

from __future__ import annotations

import math

import torch

from .kernels import Kernel, band_mask

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv*groups, S, D), each K/V head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of _expand_kv for gradients: sum over each K/V head's query-head group."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    acc = torch.float64 if dx.dtype == torch.float64 else torch.float32
    return dx.reshape(b, h // groups, groups, s, d).sum(2, dtype=acc).to(dx.dtype)


def _lse_3d(lse: torch.Tensor, q_len: int) -> torch.Tensor:
    """Any op's lse -> (B, H, Sq) float32."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :q_len].float()


def _upcast_half(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [x.float() if x.dtype in _HALF else x for x in tensors]


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
        q, k, v = _upcast_half(q, k, v)
        bias = self._bias(q, k, band)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        dout, q, k, v, out = _upcast_half(dout, q, k, v, out)
        bias = self._bias(q, k, band)
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse.to(q.dtype), 0.0,
            False, attn_mask=bias, scale=scale,
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)

    def forward(self, q, k, v, causal, scale):
        q, k, v = _upcast_half(q, k, v)
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        # K/V are expanded for the backward only: torch 2.13's CPU flash backward with fewer K/V
        # heads than query heads runs ~30x slower than with equal heads (measured 81 s vs 2.5 s,
        # 16k tokens, 2:1 GQA); its forward has no such problem
        dout, q, k, v, out = _upcast_half(dout, q, k, v, out)
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse.to(q.dtype), 0.0,
            causal, scale=scale,
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


class _CudaKernel(Kernel):
    """Shared shape handling of the CUDA ops: contiguous inputs, GQA expansion."""

    dtypes: tuple[torch.dtype, ...] = _HALF
    max_head_dim = 256

    def supports(self, q, k):
        if q.device.type != "cuda":
            return f"needs CUDA tensors, got {q.device}"
        if q.dtype not in self.dtypes:
            return f"supports dtypes {[str(d) for d in self.dtypes]}, got {q.dtype}"
        if q.shape[-1] > self.max_head_dim:
            return f"supports head dim up to {self.max_head_dim}, got {q.shape[-1]}"
        if q.shape[-1] % 8:
            return f"needs a head dim divisible by 8, got {q.shape[-1]}"
        return None

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        q, k, v = (x.contiguous() for x in (q, _expand_kv(k, groups), _expand_kv(v, groups)))
        out, lse = self._forward(q, k, v, causal, scale)
        return out, _lse_3d(lse, q.shape[2])

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        tensors = (dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out)
        dout, q, k, v, out = (x.contiguous() for x in tensors)
        dq, dk, dv = self._backward(dout, q, k, v, out, lse.float().contiguous(), causal, scale)
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)

    def _forward(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError


def _no_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and offset placeholders: unused because dropout is 0."""
    return (torch.zeros((), dtype=torch.int64, device=device),) * 2


class CudnnKernel(_CudaKernel):
    name = "cudnn"
    max_head_dim = 128

    def _forward(self, q, k, v, causal, scale):
        result = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        self._lse_trailing_one = result[1].dim() == 4  # remembered for the backward's lse shape
        return result[0], result[1]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        if getattr(self, "_lse_trailing_one", False):
            lse = lse.unsqueeze(-1)
        seed, offset = _no_rng(q.device)
        s_q, s_k = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            seed,
            offset,
            None,
            None,
            None,
            s_q,
            s_k,
            0.0,
            causal,
            scale=scale,
        )


class FlashKernel(_CudaKernel):
    name = "flash"

    def _forward(self, q, k, v, causal, scale):
        result = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return result[0], result[1]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        seed, offset = _no_rng(q.device)
        empty = torch.empty(0, dtype=torch.int32, device=q.device)
        s_q, s_k = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, empty, empty, s_q, s_k, 0.0, causal, seed, offset, scale=scale
        )


class EfficientKernel(_CudaKernel):
    name = "efficient"
    dtypes = (torch.float32, *_HALF)

    def _forward(self, q, k, v, causal, scale):
        result = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return result[0], result[1]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        # the op reads lse padded to a multiple of 32 along the sequence, as its forward wrote it
        pad = -q.shape[2] % 32
        lse = torch.nn.functional.pad(lse, (0, pad)).contiguous()
        seed, offset = _no_rng(q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            None,
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, dk, dv
