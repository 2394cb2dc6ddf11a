"""The plan of one attention call, shared by every strategy.

`Call` holds what the API resolved and validated (group, layout, kernel, mask options). A strategy
asks it which blocks rank `rank`'s queries compute against the keys of rank `src`
(`call.blocks(rank, src, local_len)`), and runs each block with `block_forward` /
`block_backward`, which slice the local rows and call the kernel, folding the results into float32
accumulators with `accumulate_block` (through `call.merge`) / `accumulate_dq`. Strategies
therefore never look at a layout's name or a mask's shape: a new layout or mask changes the
schedule, not the loops.

With packed documents a step's blocks come from `step_blocks`: the documents the two ranks share
(packing's per-rank document index, so the plan is linear in documents), the short ones packed
into masked tiles of one tiled block (kernels/tiled.py), the long ones as exact per-piece blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo
from ringattn.kernels import KERNELS
from ringattn.kernels.base import Kernel
from ringattn.kernels.tiled import tiles_backward, tiles_forward
from ringattn.kernels.triton_merge import merge_fused_
from ringattn.layout import Block, Layout, Tiles
from ringattn.merge import accumulator_dtype
from ringattn.packing import Placement, may_meet, run_pair_blocks

#: documents whose rows on both ranks of a step fit in TILE_ROWS rows run as masked tiles, the
#: short ones several to a tile while it stays within PACK_ROWS rows; longer documents get exact
#: full/causal/band blocks. Measured on the project's CPU (8 heads x 64, fused CPU flash op,
#: forward + backward): ~70 ns per (query, key) pair from 64 rows up plus ~50 us per call, and
#: each exact block adds a merge; one masked call per document of up to 128 rows beats its 3-4
#: exact blocks, and tiles of about 64 rows balance calls against masked-out pairs.
TILE_ROWS = 128
PACK_ROWS = 64

Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Call:
    """Everything a strategy needs besides the tensors, resolved and validated by the API.

    `placement` is None for a dense sequence without a window: the layout's closed-form schedule
    applies. Otherwise (packed documents, padding, sliding window) blocks come from the placement's
    runs (packing.py).
    """

    info: GroupInfo
    layout: Layout
    kernel: Kernel
    causal: bool
    scale: float
    placement: Placement | None = None
    window: tuple[int, int] | None = None
    # folds a block's (out, lse) into the float32 accumulators in place; None skips merging
    # (benchmarks only: the kernels' share of the time, with a wrong result)
    merge: Merge | None = merge_fused_
    # what the ranks agreed on for this call ((name, value) pairs): published while it runs
    signature: tuple = ()

    def __post_init__(self) -> None:
        if self.window is not None and not self.kernel.supports_band:
            raise ValueError(
                f"a sliding window needs a kernel that takes one, but the {self.kernel.name!r} "
                f"kernel does not (it would fall back to the O(block^2) reference kernel); use "
                f"bfloat16/float16 inputs with a head dim <= 256 divisible by 8 on CUDA (the flash "
                f"window kernel, backend 'flash' or 'cudnn'), or pass backend='reference' to "
                f"accept O(block^2) memory"
            )

    def blocks(self, rank: int, src: int, local_len: int) -> list[Block] | tuple[Block, ...]:
        """Blocks of rank `rank`'s queries against rank `src`'s keys (ranks of this group)."""
        if self.placement is None:
            return self.layout.schedule(rank, src, self.info.world_size, local_len, self.causal)
        return step_blocks(self.placement, rank, src, self.causal, self.window)


def step_blocks(
    placement: Placement, rank: int, src: int, causal: bool, window: tuple[int, int] | None
) -> tuple[Block, ...]:
    """What the kernels run for rank `rank`'s queries against rank `src`'s keys.

    Documents that fit in TILE_ROWS rows on both ranks become tiles, consecutive ones packed in
    local order into one tile while it spans at most PACK_ROWS query and key rows. All tiles of
    the step form one tiled block (one merge), whose masks (same document, causal, window) come
    from the rows' global indices. Larger documents keep exact per-piece blocks. Linear in the
    documents the two ranks hold.
    """
    key = ("step", rank, src, causal, window)
    if key in placement.memo:
        return placement.memo[key]
    q_runs, k_runs = placement.runs[rank], placement.runs[src]
    k_spans = placement.doc_spans(src)
    blocks: list[Block] = []
    tiles: list[list[int]] = []  # [q0, q1, k0, k1], local rows
    for doc, qs in placement.doc_spans(rank).items():
        ks = k_spans.get(doc)
        if ks is None or not may_meet(qs, ks, causal, window):
            continue
        if qs[3] - qs[2] <= TILE_ROWS and ks[3] - ks[2] <= TILE_ROWS:
            last = tiles[-1] if tiles else None
            if last is not None and qs[3] - last[0] <= PACK_ROWS and ks[3] - last[2] <= PACK_ROWS:
                last[1], last[3] = qs[3], ks[3]
            else:
                tiles.append([qs[2], qs[3], ks[2], ks[3]])
            continue
        for q_run in q_runs[qs[0] : qs[1]]:
            for k_run in k_runs[ks[0] : ks[1]]:
                blocks.extend(run_pair_blocks(q_run, k_run, causal, window))
    if tiles:
        q0, q1, k0, k1 = tiles[0][0], tiles[-1][1], tiles[0][2], tiles[-1][3]
        q_pos, q_doc = (x[q0:q1] for x in placement.rows(rank))
        k_pos, k_doc = (x[k0:k1] for x in placement.rows(src))
        spans = tuple((a - q0, b - q0, c - k0, d - k0) for a, b, c, d in tiles)
        tiled = Tiles(spans, q_pos, q_doc, k_pos, k_doc, causal, window)
        blocks.append(Block(q0, q1, k0, k1, tiles=tiled))
    placement.memo[key] = tuple(blocks)
    return placement.memo[key]


def rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """View of sequence rows [start, stop) along dim 2 of a (B, H, S, D) or (B, H, S) tensor."""
    return x.narrow(2, start, stop - start)


def block_forward(
    call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block: the block's query rows of q against its key rows of k, v."""
    q_rows = rows(q, block.q_start, block.q_stop)
    k_rows = rows(k, block.kv_start, block.kv_stop)
    v_rows = rows(v, block.kv_start, block.kv_stop)
    if block.tiles is not None:
        return tiles_forward(_mask_kernel(call), q_rows, k_rows, v_rows, block.tiles, call.scale)
    if block.band is not None:
        return _band_kernel(call).forward_band(q_rows, k_rows, v_rows, block.band, call.scale)
    return call.kernel.forward(q_rows, k_rows, v_rows, block.causal, call.scale)


def _band_kernel(call: Call) -> Kernel:
    """The call's kernel if it takes banded masks, else the reference kernel (any mask)."""
    return call.kernel if call.kernel.supports_band else KERNELS["reference"]


def _mask_kernel(call: Call) -> Kernel:
    """The call's kernel if it takes any mask, else the reference kernel. Tiles are at most
    TILE_ROWS on a side, so the reference kernel's scores stay small."""
    return call.kernel if call.kernel.supports_mask else KERNELS["reference"]


def block_backward(
    call: Call,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, for its query rows and key rows, from the global out and lse."""
    q_rows = (block.q_start, block.q_stop)
    kv_rows = (block.kv_start, block.kv_stop)
    tensors = (
        rows(dout, *q_rows),
        rows(q, *q_rows),
        rows(k, *kv_rows),
        rows(v, *kv_rows),
        rows(out, *q_rows),
        rows(lse, *q_rows),
    )
    if block.tiles is not None:
        return tiles_backward(_mask_kernel(call), *tensors, block.tiles, call.scale)
    if block.band is not None:
        return _band_kernel(call).backward_band(*tensors, block.band, call.scale)
    return call.kernel.backward(*tensors, block.causal, call.scale)


def _covers_all_rows(block: Block, local_len: int) -> bool:
    return block.q_start == 0 and block.q_stop == local_len


def empty_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) before any block: zeros and -inf, in the accumulator dtype."""
    b, h, s, d = q.shape
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
    return out, torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)


def accumulate_block(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    block: Block,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    merge: Merge | None = merge_fused_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into the accumulators, starting them if they are None.

    A first block that covers every query row becomes the accumulator itself (cast to the
    accumulator dtype): no zeroed buffer and no merge pass, which at W = 1 or for a dense
    step 0 is the whole cost of accumulating.
    """
    if out is None and _covers_all_rows(block, q.shape[2]):
        acc = accumulator_dtype(q.dtype)
        return block_out.to(acc), block_lse.to(acc)
    if out is None:
        out, lse = empty_accumulators(q)
    if merge is not None:
        merge(
            rows(out, block.q_start, block.q_stop),
            rows(lse, block.q_start, block.q_stop),
            block_out,
            block_lse,
        )
    return out, lse


def accumulate_dq(
    dq: torch.Tensor | None, q: torch.Tensor, block: Block, block_dq: torch.Tensor
) -> torch.Tensor:
    """Add one block's dq into the float32 accumulator, starting it (as accumulate_block)."""
    acc = accumulator_dtype(q.dtype)
    if dq is None and _covers_all_rows(block, q.shape[2]):
        return block_dq.to(acc)
    if dq is None:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    rows(dq, block.q_start, block.q_stop).add_(block_dq)
    return dq
