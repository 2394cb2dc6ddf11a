"""Online-softmax merge of partial attention results.

Attention of one query row over keys split into blocks can be computed block by block: block i
gives a partial output `o_i` (softmax over that block's keys only) and its log-sum-exp `lse_i`.
Two partials combine exactly:

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

A row that sees no key of a block has lse = -inf. The formula above must then return the other
partial unchanged, and (0, -inf) when both are empty. `exp(-inf - -inf)` is NaN, so the weights are
taken against a "safe" lse that is 0 where the merged lse is -inf: both weights are then
exp(-inf) = 0.
(The sigmoid/logsigmoid rewrite that many ring implementations use returns NaN in both cases.)

Accumulators are float32 (float64 for float64 inputs) and are updated in place.
"""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one partial (block_out, block_lse) into the accumulators (out, lse), in place.

    out: (B, H, S, D) accumulator; lse: (B, H, S) accumulator, both in the accumulator dtype.
    block_out: (B, H, S, D) any float dtype; block_lse: (B, H, S). `out` and `lse` may be views
    (a half of the local rows); they are written through.
    """
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    safe_lse = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    weight_acc = torch.exp(lse - safe_lse).unsqueeze(-1)  # (B, H, S, 1)
    weight_block = torch.exp(block_lse - safe_lse).unsqueeze(-1)  # (B, H, S, 1)
    out.mul_(weight_acc).add_(block_out.to(out.dtype) * weight_block)
    lse.copy_(new_lse)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge of two partials; returns (out, lse) in the accumulator dtype."""
    acc = accumulator_dtype(out_a.dtype)
    out = out_a.to(acc, copy=True)
    lse = lse_a.to(acc, copy=True)
    merge_(out, lse, out_b, lse_b)
    return out, lse
