"""Head-parallel mixers (gated DeltaNet, Nemotron-H's Mamba2): each rank runs 1/W of the heads.

A gated DeltaNet layer (Qwen3.5, Qwen3-Next) is per-token projections around a recurrence that
never mixes heads: in_proj (hidden -> q, k, v, z, b, a of every head), a depthwise causal
convolution over the q, k, v channels, the delta-rule recurrence per value head (its key head
shared by nv/nk value heads), a gated RMS norm over each head's own channels, and out_proj (every
head's channels -> hidden). So heads split exactly, as in Megatron's gated-DeltaNet CP:

    rank r of W:  x (S, hidden)  the whole sequence (all-gathered, hooks.py)
                  twin(x)        the layer's own forward, built for nk/W key heads and nv/W value
                                 heads, its parameters the rows (columns for out_proj) of key-head
                                 groups [r*nk/W, (r+1)*nk/W) of the layer's own parameters
                  -> (S, hidden) this rank's heads' share of out_proj's sum
    sum over ranks, each rank's rows (a reduce-scatter, comm.py) -> the layer's output

The twin is a module of the same class on the meta device (no memory), run with
`torch.func.functional_call` and slices of the real parameters, so autograd takes each rank's
gradients into its slice of the real parameters: names, shapes and checkpoints are untouched. The
gated norm's weight (per channel of a head, shared by all heads) is used whole by every rank and
its gradients sum over the ranks like any replicated parameter's.

Compute and activation memory of the layer are 1/W of one process's, the recurrence runs on the
whole sequence (the layer's own kernel: flash-linear-attention's where installed, transformers'
PyTorch path otherwise), and the traffic per layer per rank is an all-gather of S x hidden in and
a reduce-scatter of S x hidden out (and the same back): 4 (W-1)/W x S x hidden elements per layer,
growing with S like Ulysses' all-to-alls (Megatron's sequence parallelism around TP). Needs W to
divide the key-head count; otherwise hooks.py runs the layer whole on every rank.

Nemotron-H's Mamba2 (SSD) splits the same way by groups of heads: each group's heads share its
B and C rows and its gated-norm group, and its heads' decay, D and dt are their own (`_nemotron_h`;
W must divide n_groups). Other Mamba2 families derive their inner width from hidden x expand,
which a twin cannot divide; they run whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# (start, stop) row ranges, concatenated, for one parameter; or None: the parameter whole
Ranges = list[tuple[int, int]] | None


def _qwen3_5(m: nn.Module, r: int, w: int) -> dict[str, tuple[int, Ranges]]:
    """Qwen3.5: in_proj_qkv rows [q of every head | k | v], in_proj_z / _b / _a per value head."""
    nk, dk, dv, ratio = m.num_k_heads, m.head_k_dim, m.head_v_dim, m.num_v_heads // m.num_k_heads
    g0, g1 = r * nk // w, (r + 1) * nk // w  # this rank's key heads
    v0, v1 = g0 * ratio, g1 * ratio  # and the value heads they serve
    qkv = [(g0 * dk, g1 * dk), (nk * dk + g0 * dk, nk * dk + g1 * dk),
           (2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv)]  # fmt: skip
    return {
        "in_proj_qkv.weight": (0, qkv),
        "in_proj_z.weight": (0, [(v0 * dv, v1 * dv)]),
        "in_proj_b.weight": (0, [(v0, v1)]),
        "in_proj_a.weight": (0, [(v0, v1)]),
        "conv1d.weight": (0, qkv),
        "conv1d.bias": (0, qkv),
        "dt_bias": (0, [(v0, v1)]),
        "A_log": (0, [(v0, v1)]),
        "norm.weight": (0, None),
        "out_proj.weight": (1, [(v0 * dv, v1 * dv)]),
    }


def _qwen3_next(m: nn.Module, r: int, w: int) -> dict[str, tuple[int, Ranges]]:
    """Qwen3-Next: in_proj_qkvz rows grouped by key head [q k v z], in_proj_ba by key head [b a]."""
    nk, dk, dv, ratio = m.num_k_heads, m.head_k_dim, m.head_v_dim, m.num_v_heads // m.num_k_heads
    g0, g1 = r * nk // w, (r + 1) * nk // w
    v0, v1 = g0 * ratio, g1 * ratio
    group_qkvz, group_ba = 2 * dk + 2 * ratio * dv, 2 * ratio
    conv = [(g0 * dk, g1 * dk), (nk * dk + g0 * dk, nk * dk + g1 * dk),
            (2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv)]  # fmt: skip
    return {
        "in_proj_qkvz.weight": (0, [(g0 * group_qkvz, g1 * group_qkvz)]),
        "in_proj_ba.weight": (0, [(g0 * group_ba, g1 * group_ba)]),
        "conv1d.weight": (0, conv),
        "conv1d.bias": (0, conv),
        "dt_bias": (0, [(v0, v1)]),
        "A_log": (0, [(v0, v1)]),
        "norm.weight": (0, None),
        "out_proj.weight": (1, [(v0 * dv, v1 * dv)]),
    }


def _nemotron_h(m: nn.Module, r: int, w: int) -> dict[str, tuple[int, Ranges]]:
    """Nemotron-H's Mamba2: in_proj rows [z | x B C | dt], x and z per head, B and C per group of
    heads, the gated norm per group: a rank takes whole groups (their heads and B, C rows)."""
    nh, ng, hd, n = m.num_heads, m.n_groups, m.head_dim, m.ssm_state_size
    inner = nh * hd
    g0, g1 = r * ng // w, (r + 1) * ng // w  # this rank's groups
    h0, h1 = g0 * nh // ng, g1 * nh // ng  # and their heads
    xbc = [(h0 * hd, h1 * hd), (inner + g0 * n, inner + g1 * n),
           (inner + ng * n + g0 * n, inner + ng * n + g1 * n)]  # fmt: skip
    projection = [(h0 * hd, h1 * hd), *((inner + a, inner + b) for a, b in xbc),
                  (2 * inner + 2 * ng * n + h0, 2 * inner + 2 * ng * n + h1)]  # fmt: skip
    heads = [(h0, h1)]
    return {
        "in_proj.weight": (0, projection),
        "in_proj.bias": (0, projection),
        "conv1d.weight": (0, xbc),
        "conv1d.bias": (0, xbc),
        "dt_bias": (0, heads),
        "A_log": (0, heads),
        "D": (0, heads),
        "norm.weight": (0, [(h0 * hd, h1 * hd)]),
        "out_proj.weight": (1, [(h0 * hd, h1 * hd)]),
        "out_proj.bias": (0, "first"),
    }


@dataclass(frozen=True)
class Split:
    """How one mixer class splits: the config fields its twin divides by W (each read from the
    module's attribute of the same meaning), the one that W must divide, and the parameters'
    slices (dim, ranges; None: whole on every rank; "first": whole on rank 0, zeros elsewhere,
    for an output bias that the sum over ranks must add once)."""

    fields: dict[str, str]
    unit: str
    plan: Callable[[nn.Module, int, int], dict[str, tuple[int, Ranges | str]]]


_GDN_FIELDS = {"linear_num_key_heads": "num_k_heads", "linear_num_value_heads": "num_v_heads"}
SPLITS: dict[str, Split] = {
    "Qwen3_5GatedDeltaNet": Split(_GDN_FIELDS, "num_k_heads", _qwen3_5),
    "Qwen3_5MoeGatedDeltaNet": Split(_GDN_FIELDS, "num_k_heads", _qwen3_5),
    "Qwen3NextGatedDeltaNet": Split(_GDN_FIELDS, "num_k_heads", _qwen3_next),
    "NemotronHMamba2Mixer": Split(
        {"mamba_num_heads": "num_heads", "n_groups": "n_groups"}, "n_groups", _nemotron_h
    ),
}


def splits(module: nn.Module, world_size: int) -> bool:
    """True when `module` runs head-parallel over `world_size` ranks (its class has a split and
    W divides its key heads, or its groups)."""
    split = SPLITS.get(type(module).__name__)
    if world_size < 2 or split is None:
        return False
    return all(getattr(module, attr) % world_size == 0 for attr in split.fields.values())


@dataclass
class HeadShare:
    """This rank's twin of one layer: the meta module and the index of each parameter's slice."""

    twin: nn.Module
    index: dict[str, tuple[int, torch.Tensor | str | None]]

    @classmethod
    def build(cls, module: nn.Module, config: object, rank: int, world_size: int) -> HeadShare:
        split = SPLITS[type(module).__name__]
        twin_config = copy.copy(config)
        for field_name, attr in split.fields.items():
            setattr(twin_config, field_name, getattr(module, attr) // world_size)
        with torch.device("meta"):
            twin = type(module)(twin_config, module.layer_idx)
        plan = split.plan(module, rank, world_size)
        index = {}
        for name, parameter in module.named_parameters():
            dim, ranges = plan[name]  # a parameter the split does not name: KeyError, loudly
            if ranges is None or ranges == "first":
                index[name] = (dim, None if ranges is None or rank == 0 else "zeros")
                continue
            rows = torch.cat([torch.arange(a, b, device=parameter.device) for a, b in ranges])
            index[name] = (dim, rows)
            assert dict(twin.named_parameters())[name].shape[dim] == rows.numel(), name
        return cls(twin, index)

    def __call__(self, module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share of `module(hidden_states)` (no cache, no mask)."""
        params = {}
        for name, parameter in module.named_parameters():
            dim, rows = self.index[name]
            if isinstance(rows, str):  # "zeros": added once, by rank 0
                params[name] = torch.zeros_like(parameter)
                continue
            if rows is not None and rows.device != parameter.device:  # the model moved
                rows = rows.to(parameter.device)
                self.index[name] = (dim, rows)
            params[name] = parameter if rows is None else parameter.index_select(dim, rows)
        return torch.func.functional_call(self.twin, params, (hidden_states,))
