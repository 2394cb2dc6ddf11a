"""What one rank pays for a document of L tokens sharded over g ranks: the scheduler's cost.

    compute   planner/flops.py's train_step_flops(model, L, 1) / g, at `flops_per_s`: the
              linear layers (2 x params per token, x 3 with backward) and causal attention
              (4 x heads x head_dim x L^2 / 2 per layer, x 3.5 with backward): quadratic in L
    traffic   g > 1: a ring over g ranks sends g - 1 hops of one shard's K/V per layer forward
              (2 x kv_dim x L/g elements), and in backward the K/V again plus the float32
              dK/dV: bytes at `link_bytes_per_s`, plus `hop_latency_s` per hop (4 per hop and
              layer: forward, backward's K/V and dK/dV, the last dK/dV return)

The same model as the planner's (planner/cost.py prices attention and the ring per strategy in
more detail, with overlap); here nothing is taken as hidden behind compute, which makes a group
look a little dearer than it is and keeps documents on one rank when in doubt. The defaults are
this repository's CPU figures (gloo over loopback); give a GPU's rates for a GPU cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ringattn.planner.flops import train_step_flops
from ringattn.planner.models import ModelSpec

__all__ = ["DocumentCost"]


@dataclass(frozen=True)
class DocumentCost:
    """`cost(length, size)`: planned seconds of one rank (see the module docstring)."""

    model: ModelSpec
    flops_per_s: float = 2e10
    """One rank's sustained training FLOP/s (a CPU core with OMP_NUM_THREADS=1: ~20 GFLOP/s)."""
    link_bytes_per_s: float = 1e9
    """Bytes/s of one rank's ring link (gloo over loopback: ~1 GB/s)."""
    hop_latency_s: float = 5e-5
    """Fixed cost of one message (gloo: tens of microseconds)."""
    elem_bytes: int = 4
    """Bytes of one K/V element (4: float32, 2: bfloat16)."""

    def __call__(self, length: int, size: int) -> float:
        return _cost(self, length, size)


@lru_cache(maxsize=65536)
def _cost(c: DocumentCost, length: int, size: int) -> float:
    compute = train_step_flops(c.model, length, 1) / size / c.flops_per_s
    if size == 1 or length == 0:
        return compute
    shard_elems = 2 * c.model.kv_dim * length / size  # one shard's K and V
    hop_bytes = shard_elems * (2 * c.elem_bytes + 4)  # K/V forward and backward, fp32 dK/dV
    layers = c.model.attention_layers
    traffic = layers * (size - 1) * hop_bytes / c.link_bytes_per_s
    return compute + traffic + layers * 4 * (size - 1) * c.hop_latency_s
