"""Fused online-softmax merge for CUDA: one Triton pass over out and lse, in place.

`merge.merge_` is a chain of PyTorch ops (logaddexp, where, two exps, mul_, add_, copy_), each a
full pass over memory; on a GPU those passes, not the attention kernels, are the gap between a ring
and monolithic attention (DESIGN §6). This kernel reads each accumulator row and the block's row
once and writes the row once:

    program (row tile, b*h):   m    = max(lse, block_lse)         safe = 0 where m = -inf
                               wa   = exp(lse - safe)             wb = exp(block_lse - safe)
                               lse  = safe + log(wa + wb)         (-inf where wa + wb = 0)
                               out  = (wa * out + wb * block_out) / (wa + wb)

Every tensor is addressed through its strides, so the halves of a zigzag shard (rows narrowed out of
(B, H, S, D)) and cuDNN's lse with a trailing 1 squeezed away are read in place, never copied.
Arithmetic is float32; block_out may be bf16/fp16/fp32. The -inf cases match `merge_` exactly:
an empty accumulator (lse = -inf) takes the block as it is (wa = 0, wb = 1, log 1 = 0), and two
empty partials give (0, -inf) (wa = wb = 0) — never NaN.

`merge_fused_` is what the ring path calls: this kernel for float32 accumulators on CUDA when Triton
imports and a one-time probe (a tiny merge with -inf rows, checked against `merge_`) passes;
`merge_` everywhere else (CPU, float64, no Triton, a Triton that cannot compile the kernel).
`triton_merge_` runs the kernel unconditionally: on CPU tensors it needs `TRITON_INTERPRET=1` set
before the first call (the tests do that in a subprocess). Triton is imported only on first use.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ringattn.merge import merge_

__all__ = ["merge_fused_", "triton_available", "triton_merge_"]

_MAX_HEAD_DIM = 512
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which indexes (batch, head)
# verdict of the probe per CUDA device index: True = use the kernel
_VERDICTS: dict[int, bool] = {}


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (import and JIT are lazy: `import ringattn` needs
    only torch, and TRITON_INTERPRET is read when the kernel is decorated)."""
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(
        out_ptr, lse_ptr, bout_ptr, blse_ptr,
        H, S, D,
        so_b, so_h, so_s, so_d,
        sl_b, sl_h, sl_s,
        sbo_b, sbo_h, sbo_s, sbo_d,
        sbl_b, sbl_h, sbl_s,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # int64 offsets: at 1M tokens x 32 heads x 128 an element index exceeds 2**31
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < S
        lse_at = lse_ptr + b * sl_b + h * sl_h + rows * sl_s
        lse = tl.load(lse_at, mask=row_ok, other=float("-inf")).to(tl.float32)
        blse_at = blse_ptr + b * sbl_b + h * sbl_h + rows * sbl_s
        blse = tl.load(blse_at, mask=row_ok, other=float("-inf")).to(tl.float32)
        top = tl.maximum(lse, blse)
        safe = tl.where(top == float("-inf"), 0.0, top)
        wa = tl.exp(lse - safe)
        wb = tl.exp(blse - safe)
        total = wa + wb
        seen = total > 0.0
        new_lse = tl.where(seen, safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        tl.store(lse_at, new_lse, mask=row_ok)
        tile_ok = row_ok[:, None] & (cols < D)[None, :]
        out_at = out_ptr + b * so_b + h * so_h + rows[:, None] * so_s + cols[None, :] * so_d
        bout_at = bout_ptr + b * sbo_b + h * sbo_h + rows[:, None] * sbo_s + cols[None, :] * sbo_d
        acc = tl.load(out_at, mask=tile_ok, other=0.0).to(tl.float32)
        blk = tl.load(bout_at, mask=tile_ok, other=0.0).to(tl.float32)
        merged = acc * (wa * inv)[:, None] + blk * (wb * inv)[:, None]
        tl.store(out_at, merged, mask=tile_ok)

    return triton, merge_kernel


def _check_shapes(out, lse, block_out, block_lse) -> None:
    assert out.dim() == 4 and lse.shape == out.shape[:3], (tuple(out.shape), tuple(lse.shape))
    assert block_out.shape == out.shape and block_lse.shape == lse.shape, (
        tuple(block_out.shape),
        tuple(block_lse.shape),
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    assert out.shape[-1] <= _MAX_HEAD_DIM, out.shape


def triton_merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """`merge_` as one Triton kernel. out (B, H, S, D) and lse (B, H, S) float32, any strides
    (views are written through); block_out (B, H, S, D) any float dtype; block_lse (B, H, S)."""
    _check_shapes(out, lse, block_out, block_lse)
    b, h, s, d = out.shape
    if out.numel() == 0:
        return
    triton, kernel = _kernel()
    block_d = triton.next_power_of_2(d)
    block_s = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(s, block_s), b * h)
    kernel[grid](
        out, lse, block_out, block_lse,
        h, s, d,
        *out.stride(), *lse.stride(), *block_out.stride(), *block_lse.stride(),
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (it needs no GPU to import)."""
    try:
        import triton.language  # noqa: F401 - the kernel needs both
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


def _probe(device: torch.device) -> bool:
    """Run the kernel once on a small strided case with -inf rows and compare with `merge_`."""
    gen = torch.Generator().manual_seed(0)
    full_out = torch.randn(2, 3, 10, 40, generator=gen, device="cpu")  # moved below
    full_lse = torch.randn(2, 3, 10, generator=gen, device="cpu")
    full_lse[0, 0, :3] = float("-inf")  # an empty accumulator row
    full_out[0, 0, :3] = 0.0
    block_out = torch.randn(2, 3, 5, 40, generator=gen, device="cpu").bfloat16()
    block_lse = torch.randn(2, 3, 5, generator=gen, device="cpu")
    block_lse[0, 0, 1:3] = float("-inf")  # row 1: one empty side; row 2: both empty
    block_lse[1, 2, 4] = float("-inf")
    want_out, want_lse = full_out.clone(), full_lse.clone()
    merge_(want_out.narrow(2, 0, 5), want_lse.narrow(2, 0, 5), block_out, block_lse)
    got_out, got_lse = full_out.to(device), full_lse.to(device)
    try:
        triton_merge_(
            got_out.narrow(2, 0, 5), got_lse.narrow(2, 0, 5), block_out.to(device),
            block_lse.to(device),
        )  # fmt: skip
        torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - any failure means: use merge_
        warnings.warn(f"Triton merge unavailable ({type(err).__name__}: {err}); using merge_")
        return False
    same_inf = torch.equal(torch.isneginf(got_lse.cpu()), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    close = torch.allclose(got_out.cpu(), want_out, atol=1e-5, rtol=1e-5) and torch.allclose(
        got_lse.cpu()[finite], want_lse[finite], atol=1e-5, rtol=1e-5
    )
    if not (same_inf and close):
        warnings.warn("Triton merge disagrees with merge_ on its probe; using merge_")
    return same_inf and close


def use_triton(out: torch.Tensor, block_out: torch.Tensor) -> bool:
    """Whether `merge_fused_` takes the Triton kernel for these tensors."""
    if out.device.type != "cuda" or out.dtype != torch.float32 or out.shape[-1] > _MAX_HEAD_DIM:
        return False
    if out.shape[0] * out.shape[1] > _MAX_GRID_Y:
        return False
    if block_out.device != out.device or not triton_available():
        return False
    index = out.device.index if out.device.index is not None else torch.cuda.current_device()
    if index not in _VERDICTS:
        _VERDICTS[index] = _probe(torch.device("cuda", index))
    return _VERDICTS[index]


def merge_fused_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold (block_out, block_lse) into (out, lse) in place: the Triton kernel where it applies
    (see module docstring), `merge_` otherwise. Same contract as `merge_`."""
    if use_triton(out, block_out):
        triton_merge_(out, lse, block_out, block_lse)
    else:
        merge_(out, lse, block_out, block_lse)
