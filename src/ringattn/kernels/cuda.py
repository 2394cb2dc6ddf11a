"""CUDA block kernels on PyTorch's fused SDPA ops that return the log-sum-exp.

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

import torch

from ringattn.kernels.base import HALF, Kernel, aten, expand_kv, lse_3d, reduce_kv


class _CudaKernel(Kernel):
    """Shared shape handling of the CUDA ops: contiguous inputs, GQA expansion."""

    dtypes: tuple[torch.dtype, ...] = HALF
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
        q, k, v = (x.contiguous() for x in (q, expand_kv(k, groups), expand_kv(v, groups)))
        out, lse = self._forward(q, k, v, causal, scale)
        return out, lse_3d(lse, q.shape[2])

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        tensors = (dout, q, expand_kv(k, groups), expand_kv(v, groups), out)
        dout, q, k, v, out = (x.contiguous() for x in tensors)
        dq, dk, dv = self._backward(dout, q, k, v, out, lse.float().contiguous(), causal, scale)
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)

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
        s_q, s_k = q.shape[2], k.shape[2]
        # cum_seq_q/k: None (an undefined tensor), as the dense forward returns them. A defined
        # tensor, even an empty one, selects aten's variable-length path and fails.
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, s_q, s_k, 0.0, causal, seed, offset, scale=scale
        )


class EfficientKernel(_CudaKernel):
    name = "efficient"
    dtypes = (torch.float32, *HALF)

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
