"""What one piece costs each rank of its group: the documents of one group, run as one attention
call per layer (dynamic CP's unit of work; static CP is one piece per dp row, of size cp).

The documents are placed exactly as the trainer places them (packing.place with the layout over
the g ranks) and each ring step's kernel calls are the ring's own (plan.step_blocks: exact
blocks for long documents, masked tiles for short ones), so the work counted is the work run,
masked-out tile pairs and padding rows included. Per rank, per layer:

    linear      the rank's rows x the plan's seconds per token outside attention (matmuls,
                norms, the output projection: the static plan's compute minus its attention)
    kernels     per ring step s (keys of rank i - s), forward and backward (2.5x the flops):
                each block's flops at the hardware's attention rate for its key length, plus
                `call_s` per kernel call (a tile or an exact block)
    ring        g > 1: `ring_step_s` per step and direction (send, receive, merge, the wait for
                the peer); the next step's K/V (backward: K/V and float32 dK/dV) hide behind
                this step's kernels, the rest is exposed, as in planner/cost.py; the last dK/dV
                returns after the loop
    call        `piece_s` per attention call and direction (validation, the plan, autograd)

A group wider than a host (ranks_per_host > 0) sends its hops at the inter-host rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ringattn.layout import get_layout
from ringattn.packing import place
from ringattn.plan import step_blocks
from ringattn.planner.hardware import Hardware
from ringattn.planner.models import ModelSpec

__all__ = ["PieceCosts", "piece_seconds"]


@dataclass(frozen=True, eq=False)
class PieceCosts:
    """The rates and fixed terms pieces are priced with (module docstring)."""

    model: ModelSpec
    hw: Hardware
    nproc: int
    """Processes of the job (cpu: how many share the cores)."""
    layout: str
    dtype: str
    kernel: str
    linear_s_per_token: float
    link_bytes_per_s: float
    inter_bytes_per_s: float
    ranks_per_host: int
    """0: one host."""
    ring_step_s: float
    piece_s: float
    call_s: float

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype in ("fp32", "tf32") else 2

    def attention_s(self, flops: float, keys: int, causal: bool, backward: bool) -> float:
        hw = self.hw
        threads = hw.threads_per_process(self.nproc)
        kw = {} if hw.is_cpu else {"kernel": self.kernel, "dtype": self.dtype}
        t = hw.attention_s(flops, max(1, keys), self.model.d_head, causal, backward, threads, **kw)
        return t * hw.slowdown(self.nproc)


def _step_kernels(c: PieceCosts, placement, rank: int, src: int) -> tuple[float, float]:
    """(forward s, backward s) of one ring step's kernel calls on `rank`."""
    unit = 4 * c.model.n_heads * c.model.d_head  # flops per visible (query, key) pair, forward
    fwd = bwd = 0.0
    for block in step_blocks(placement, rank, src, True, None):
        if block.tiles is not None:  # masked tiles: the kernel runs every pair of each tile
            shapes = [(q1 - q0, k1 - k0, False) for q0, q1, k0, k1 in block.tiles.spans]
        else:
            shapes = [(block.q_stop - block.q_start, block.kv_stop - block.kv_start, block.causal)]
        for rows, keys, causal in shapes:
            flops = unit * rows * keys / (2 if causal else 1)
            fwd += c.attention_s(flops, keys, causal, False) + c.call_s
            bwd += c.attention_s(2.5 * flops, keys, causal, True) + c.call_s
    return fwd, bwd


def piece_seconds(c: PieceCosts, lengths: Sequence[int], size: int) -> list[float]:
    """Seconds of each of the `size` ranks of a group for its documents `lengths` (one step)."""
    bounds = (0, *accumulate(lengths))
    placement = place(get_layout(c.layout), size, bounds)
    rows = placement.local_len
    m = c.model
    kv = 2 * m.kv_dim * rows  # K and V elements of one rank
    across = 0 < c.ranks_per_host < size and c.inter_bytes_per_s > 0
    rate = min(c.link_bytes_per_s, c.inter_bytes_per_s) if across else c.link_bytes_per_s
    hop_f, hop_b = kv * c.elem_bytes / rate, kv * (c.elem_bytes + 4) / rate
    out = []
    for rank in range(size):
        layer = 2 * c.piece_s
        for s in range(size):
            fwd, bwd = _step_kernels(c, placement, rank, (rank - s) % size)
            layer += fwd + bwd
            if size > 1:
                layer += 2 * c.ring_step_s
                if s < size - 1:  # the next step's hop travels during this step's kernels
                    layer += max(0.0, hop_f - fwd) + max(0.0, hop_b - bwd)
        if size > 1:  # the last dK/dV partial returns to its owner after the loop
            layer += kv * 4 / rate
        out.append(m.attention_layers * layer + rows * c.linear_s_per_token)
    return out
