"""The two collectives of a mixer run on the whole sequence: rows in, rows out (Megatron's SP).

    gather_rows(x_local)   (S_local, H) this rank's rows  ->  (S, H) every token, global order
                           forward: an all-gather; backward: a reduce-scatter of the gradient
                           (each rank's gradient holds its rows' share of every position)
    scatter_rows(y)        (S, H) a partial sum over ranks ->  (S_local, H) this rank's rows of
                           the sum; forward: a reduce-scatter; backward: an all-gather

The layout's placement says which global token each local row is (-1: padding). Both functions go
through the rank-major buffer (W x S_local, H), rank r's rows in its local order, which is what
the collectives split and join: row i of it is token held[i], held = every rank's global indices
in rank order. Each sends (W-1)/W of the (S, H) tensor per direction, forward and backward: half
an all-reduce's bytes.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, all_gather_cat, reduce_scatter
from ringattn.packing import Placement


def _held(placement: Placement, info: GroupInfo, device: torch.device) -> torch.Tensor:
    """(W x S_local,) global token of each rank-major row, -1 for padding."""
    rows = [placement.global_indices(r) for r in range(info.world_size)]
    return torch.cat(rows).to(device)


def _to_global(rank_major: torch.Tensor, held: torch.Tensor, seq_len: int) -> torch.Tensor:
    real = torch.nonzero(held >= 0).flatten()
    order = torch.empty(seq_len, dtype=torch.int64, device=held.device)
    order[held[real]] = real  # token t is rank-major row order[t]
    return rank_major.index_select(0, order)


def _to_rank_major(full: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    out = full.index_select(0, held.clamp(min=0))
    return out * (held >= 0).unsqueeze(1).to(out.dtype)  # padding rows: zeros


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, placement, info):
        held = _held(placement, info, x_local.device)
        ctx.held, ctx.info = held, info
        return _to_global(all_gather_cat(x_local, 0, info), held, placement.seq_len)

    @staticmethod
    def backward(ctx, grad):
        info = ctx.info
        rank_major = _to_rank_major(grad.contiguous(), ctx.held)
        local = reduce_scatter(rank_major.view(info.world_size, -1, grad.shape[-1]), info)
        return local, None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, placement, info):
        held = _held(placement, info, full.device)
        ctx.held, ctx.info, ctx.seq_len = held, info, placement.seq_len
        rank_major = _to_rank_major(full.contiguous(), held)
        return reduce_scatter(rank_major.view(info.world_size, -1, full.shape[-1]), info)

    @staticmethod
    def backward(ctx, grad):
        gathered = all_gather_cat(grad.contiguous(), 0, ctx.info)
        return _to_global(gathered, ctx.held, ctx.seq_len), None, None


def gather_rows(x_local: torch.Tensor, placement: Placement, info: GroupInfo) -> torch.Tensor:
    """(S_local, H) -> (S, H): every rank's rows in global order (module docstring)."""
    return _GatherRows.apply(x_local, placement, info)


def scatter_rows(full: torch.Tensor, placement: Placement, info: GroupInfo) -> torch.Tensor:
    """(S, H) partial sums -> (S_local, H): this rank's rows of their sum over the group."""
    return _ScatterRows.apply(full, placement, info)
