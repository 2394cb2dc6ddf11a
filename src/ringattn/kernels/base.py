"""The block-kernel interface, the masks of a block, and helpers shared by the fused kernels.

Every kernel has the same two calls:

    forward(q, k, v, causal, scale)                      -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale)     -> (dq, dk, dv)

q is (B, Hq, Sq, D); k, v are (B, Hkv, Sk, D) with Hq % Hkv == 0 (GQA/MQA: K/V heads are shared by
Hq/Hkv query heads). `out` has q's dtype, `lse` is float32 (float64 for float64 inputs). A causal
block is square and top-left aligned (key j visible to query i iff j <= i).

The backward takes the *global* `out` and `lse` of the query rows, i.e. after every block has been
merged, not this block's own. With D = rowsum(dout * out) and P = exp(s - lse) this gives the
block's exact share of the gradient (dS = P * (dout v^T - D)), and the shares sum over blocks.
"""

from __future__ import annotations

import torch


class Kernel:
    """Interface of a block kernel; `supports` says why a case cannot run (None when it can).

    Kernels with `supports_band` also run banded blocks (sliding windows): `forward_band` and
    `backward_band` take `band = (lo, hi)`, key j visible to query i iff lo <= j - i <= hi.
    Kernels with `supports_mask` run any boolean (Sq, Sk) mask (`forward_mask`, `backward_mask`;
    the tiles of packed documents): a row that sees no key gets out = 0 and lse = -inf.
    """

    name: str = ""
    supports_band: bool = False
    supports_mask: bool = False

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


aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv*groups, S, D), each K/V head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of expand_kv for gradients: sum over each K/V head's query-head group."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    acc = torch.float64 if dx.dtype == torch.float64 else torch.float32
    return dx.reshape(b, h // groups, groups, s, d).sum(2, dtype=acc).to(dx.dtype)


def lse_3d(lse: torch.Tensor, q_len: int) -> torch.Tensor:
    """Any op's lse -> (B, H, Sq) float32."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :q_len].float()


def dense_last(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with a unit stride in its last dim (copied only when it has not).

    The fused ops assume it: SDPA checks before calling them, a direct op call does not, and the
    CPU flash op silently returns wrong values for a K whose last dim is strided.
    """
    return [x if x.stride(-1) == 1 else x.contiguous() for x in tensors]


def upcast_half(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [x.float() if x.dtype in HALF else x for x in tensors]
