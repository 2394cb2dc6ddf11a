"""CUDA block kernels on PyTorch's fused SDPA ops that return the log-sum-exp.

    cudnn       aten._scaled_dot_product_cudnn_attention (+ _backward)     fp16/bf16
    flash       aten._scaled_dot_product_flash_attention (+ _backward)     fp16/bf16, D <= 256
    efficient   aten._scaled_dot_product_efficient_attention (+ _backward) fp32/fp16/bf16

The SDPA-level ops take equal head counts, so for full and causal blocks GQA K/V are expanded
locally (after communication, never before) and their gradients summed back over the query-head
groups.

Masked blocks never run the O(block^2) reference kernel here:

    band (sliding window)  aten._flash_attention_forward/_backward with window_size_left/right
                           (cudnn and flash kernels: fp16/bf16), fewer K/V heads taken natively
    tiles (packed docs)    the memory-efficient op with an additive bias, one tile at a time;
                           a tile is at most plan.TILE_ROWS a side, so the bias stays small

The efficient kernel (float32) takes no window: a windowed call on it is refused when the call is
planned (plan.Call), naming the kernel that would be needed. Each op returns its lse in its
own shape (cuDNN may add a trailing 1, the efficient op pads the length to a multiple of 32); these
wrappers return and take lse as (B, H, Sq) float32. Dropout is always 0, so the philox seed and
offset the backward ops ask for are never read.
"""

from __future__ import annotations

import math

import torch

from ringattn.kernels.base import HALF, Kernel, aten, dense_last, expand_kv, lse_3d, reduce_kv


class _CudaKernel(Kernel):
    """Shared shape handling of the CUDA ops: contiguous inputs, GQA expansion; windows on the
    flash op (half dtypes), tiles on the efficient op with a bias (module docstring)."""

    dtypes: tuple[torch.dtype, ...] = HALF
    max_head_dim = 256
    supports_band = True
    supports_mask = True

    def forward_band(self, q, k, v, band, scale):
        left, right = _flash_window(band, q.shape[2], k.shape[2])
        out, lse = aten._flash_attention_forward(
            *(x.transpose(1, 2) for x in dense_last(q, k, v)),  # (B, S, H, D) views
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            False,
            False,
            scale=scale,
            window_size_left=left,
            window_size_right=right,
        )[:2]
        return out.transpose(1, 2), lse_3d(lse, q.shape[2])

    def backward_band(self, dout, q, k, v, out, lse, band, scale):
        left, right = _flash_window(band, q.shape[2], k.shape[2])
        seed, offset = _no_rng(q.device)
        dq, dk, dv = aten._flash_attention_backward(
            *(x.transpose(1, 2) for x in dense_last(dout, q, k, v, out)),  # (B, S, H, D)
            lse.float().contiguous(),
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            False,
            seed,
            offset,
            scale=scale,
            window_size_left=left,
            window_size_right=right,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def forward_mask(self, q, k, v, mask, scale):
        groups = q.shape[1] // k.shape[1]
        q, k, v = (x.contiguous() for x in (q, expand_kv(k, groups), expand_kv(v, groups)))
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, k, v, _bias(mask, q), True, 0.0, False, scale=scale
        )[:2]
        lse = lse_3d(lse, q.shape[2])
        seen = mask.any(1)  # rows that see no key: out 0, lse -inf (whatever the op gave)
        return out.masked_fill(~seen.unsqueeze(-1), 0.0), lse.masked_fill(~seen, -math.inf)

    def backward_mask(self, dout, q, k, v, out, lse, mask, scale):
        groups = q.shape[1] // k.shape[1]
        tensors = (dout, q, expand_kv(k, groups), expand_kv(v, groups), out)
        dout, q, k, v, out = (x.contiguous() for x in tensors)
        # padding rows have lse = -inf; any finite value keeps their probabilities 0
        lse = lse.float().masked_fill(torch.isneginf(lse), 0.0)
        lse = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32)).contiguous()
        seed, offset = _no_rng(q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            k,
            v,
            _bias(mask, q),
            out,
            lse,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
            scale=scale,
        )
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)

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


def _flash_window(band: tuple[int, int], q_len: int, k_len: int) -> tuple[int, int]:
    """flash-attn's (left, right) for a band block. flash aligns its window to the bottom-right
    diagonal: key j is visible to query i iff i + d - left <= j <= i + d + right, d = Sk - Sq;
    the band is lo <= j - i <= hi, so left = d - lo and right = hi - d. Both are >= 0 because
    every row of a band block sees a key and every key is seen by a row (packing trims them)."""
    d = k_len - q_len
    left, right = d - band[0], band[1] - d
    assert left >= 0 and right >= 0, (band, q_len, k_len)
    return left, right


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B, H, Sq, Sk) additive bias in q's dtype, 0 where visible and -inf elsewhere, broadcast
    over batch and heads; its rows are padded to 16 elements, the alignment the op requires."""
    sq, sk = mask.shape
    storage = torch.full((sq, -(-sk // 16) * 16), -math.inf, dtype=q.dtype, device=q.device)
    bias = storage[:, :sk].masked_fill_(mask.to(q.device), 0.0)
    return bias.expand(q.shape[0], q.shape[1], sq, sk)


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
    supports_band = False  # no window on this op; see plan.Call for the error

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
