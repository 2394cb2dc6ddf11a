"""Partial attention over one rank's cache, and the exact merge of the ranks' partials.

A query attends the union of every rank's cached keys. Each rank computes the softmax over its
own keys only, a partial `(out_r, lse_r)`; the partials merge exactly (DESIGN.md §1):

    lse = log sum_r exp(lse_r)            out = sum_r exp(lse_r - lse) * out_r

in float32, with one collective per call. Two ways, both exact ("merge" option):

    allgather   gather every rank's [out_r | lse_r] (W * (D + 1) floats per query head), then each
                rank merges the W partials itself, in rank order (so every rank gets the same bits)
    allreduce   one all-reduce (sum) of [w_r * out_r | w_r], w_r = exp(lse_r - ref); out = the
                first sum over the second.
                `ref` must be known to every rank without communicating: the query's score against
                its own key (a decoded token always sees itself, so the owner's w_r >= 1 and the
                denominator never vanishes). If some rank's scores exceed ref by more than float32's
                exp range, the sum overflows; every rank sees the same inf and all take a second
                all-reduce (max of lse_r) and redo the sum against it. Exact either way.

A rank whose cache holds no visible key contributes (0, -inf), i.e. weight 0.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, all_gather_async, all_reduce, wait
from ringattn.kernels.base import Kernel
from ringattn.kernels.reference import reference_forward
from ringattn.kernels.softcap import SoftcapKernel

MERGES = ("allgather", "allreduce")


def check_merge(merge: str) -> None:
    if merge not in MERGES:
        raise ValueError(f"unknown merge {merge!r}; choose one of {list(MERGES)}")


def local_partial(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) float32 of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D); all keys visible unless
    a boolean `visible` (Sq, Sk) mask is given. No key at all: out = 0, lse = -inf."""
    b, h, sq, d = q.shape
    if k.shape[2] == 0 or (visible is not None and not bool(visible.any())):
        out = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
        return out, torch.full((b, h, sq), float("-inf"), device=q.device)
    if visible is None:
        out, lse = kernel.forward(q, k, v, False, scale)
    elif isinstance(kernel, SoftcapKernel):  # capped scores: its own masked path
        out, lse = kernel.forward_mask(q, k, v, visible, scale)
    else:
        out, lse = reference_forward(q, k, v, visible, scale)
    return out.float(), lse.float()


def attention_options(kernel: Kernel) -> dict:
    """The `ringattn.attention` keywords that run `kernel` (the softcap kernel: its cap)."""
    if isinstance(kernel, SoftcapKernel):
        return {"backend": "auto", "softcap": kernel.cap}
    return {"backend": kernel.name}


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge W partials stacked on dim 0: outs (W, ..., D), lses (W, ...) -> (out, lse)."""
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - safe).unsqueeze(-1)  # (W, ..., 1); exp(-inf) = 0
    return (weights * outs).sum(0), lse


def merge_across_ranks(
    out: torch.Tensor,
    lse: torch.Tensor,
    info: GroupInfo,
    merge: str = "allgather",
    ref: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The exact attention output (B, H, Sq, D) float32 from every rank's partial (out, lse),
    and with `return_lse` the merged lse (B, H, Sq) too (attention sinks need it).

    `ref` (B, H, Sq): a per-row score every rank knows, at most each row's true lse (allreduce).
    """
    if info.world_size == 1:
        merged, merged_lse = out, lse
    elif merge == "allgather":
        payload = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # (B, H, Sq, D + 1)
        gathered, works = all_gather_async(payload, info)  # (W, B, H, Sq, D + 1)
        wait(works)
        merged, merged_lse = merge_stacked(gathered[..., :-1], gathered[..., -1])
    else:
        assert merge == "allreduce" and ref is not None
        total = all_reduce(_weighted(out, lse, ref), info)
        if not bool(torch.isfinite(total).all()):  # the same on every rank: all take this branch
            ref = all_reduce(lse, info, "max")
            total = all_reduce(_weighted(out, lse, ref), info)
        merged, merged_lse = total[..., :-1] / total[..., -1:], ref + total[..., -1].log()
    return (merged, merged_lse) if return_lse else merged


def _weighted(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    weight = torch.exp(lse - ref).unsqueeze(-1)  # (B, H, Sq, 1); an empty partial: 0
    return torch.cat([out * weight, weight], dim=-1)  # (B, H, Sq, D + 1)


def self_score(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Each decoded query's scaled score against its own key: q (B, Hq, 1, D), k (B, Hkv, 1, D)."""
    groups = q.shape[1] // k.shape[1]
    k_rep = k.float().repeat_interleave(groups, dim=1)  # (B, Hq, 1, D)
    return (q.float() * k_rep).sum(-1) * scale  # (B, Hq, 1)


def padded_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (L, Hq, 1, D), lse (L, Hq, 1)) float32 of one query per sequence, q (L, Hq, 1, D),
    over its own keys k, v (L, N, Hkv, D) padded to N, `valid` (L, N): all L in one batched
    call (a paged cache's decode step). A sequence with no valid key gives (0, -inf), weight 0
    in the merge across ranks. `cap`: Gemma 2's c * tanh(s / c) on the scores. Grouped-query
    heads: query head h * g + i reads kv head h (transformers' repeat_kv order)."""
    n_seq, hq, _, d = q.shape
    hkv = k.shape[2]
    qg = q.float().reshape(n_seq, hkv, hq // hkv, d)  # (L, Hkv, g, D)
    scores = torch.einsum("lhgd,lnhd->lhgn", qg, k.float()) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (L, Hkv, g)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("lhgn,lnhd->lhgd", torch.exp(scores - safe[..., None]), v.float())
    return out.reshape(n_seq, hq, 1, -1), lse.reshape(n_seq, hq, 1)
