"""Tiled blocks: many short packed documents of one ring step, a few kernel calls in all.

A tiled block (layout.Block with `tiles`) covers rows [q_start, q_stop) against key rows
[kv_start, kv_stop) of one (rank, src) step. Its tiles are disjoint rectangles, each holding
whole documents (packing.step_blocks), so each tile is one masked kernel call and the block is
one merge:

    query rows   |doc 7|doc 8 |doc 9|  ...  |doc 40|doc 41|      tile = rows of consecutive
                 +-----------------+       +-------------+       short documents, at most
      tile 0     | 7x7   8x8  9x9  |       |   tile 5    |       TILE_ROWS on each side;
                 +-----------------+  ...  +-------------+       mask: same document, causal,
                                                                  window (global offsets)

Forward fills float32 (out, lse) over the whole block, 0 and -inf where no tile row sees a key;
backward fills dq over the block's rows and dk, dv over its key rows. Tiles never overlap, so
every result is written once and nothing is summed between tiles.
"""

from __future__ import annotations

import torch

from ringattn.kernels.base import Kernel
from ringattn.layout import Tiles
from ringattn.merge import accumulator_dtype


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return x.narrow(2, start, stop - start)


def tiles_forward(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: Tiles,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a tiled block: q (B, Hq, Sq, D) its query rows, k, v its key rows."""
    acc = accumulator_dtype(q.dtype)
    b, h, s, d = q.shape
    out = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    for index, (q0, q1, k0, k1) in enumerate(tiles.spans):
        mask = tiles.mask(index).to(q.device)
        tile_out, tile_lse = kernel.forward_mask(
            _rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), mask, scale
        )
        _rows(out, q0, q1).copy_(tile_out)
        _rows(lse, q0, q1).copy_(tile_lse)
    return out, lse


def tiles_backward(
    kernel: Kernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: Tiles,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a tiled block from the global out and lse of its query rows."""
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for index, (q0, q1, k0, k1) in enumerate(tiles.spans):
        mask = tiles.mask(index).to(q.device)
        tile_dq, tile_dk, tile_dv = kernel.backward_mask(
            _rows(dout, q0, q1),
            _rows(q, q0, q1),
            _rows(k, k0, k1),
            _rows(v, k0, k1),
            _rows(out, q0, q1),
            _rows(lse, q0, q1),
            mask,
            scale,
        )
        _rows(dq, q0, q1).copy_(tile_dq)
        _rows(dk, k0, k1).copy_(tile_dk)
        _rows(dv, k0, k1).copy_(tile_dv)
    return dq, dk, dv
