"""Hybrid models in KV-cache decoding: each sequence's recurrent and convolution states.

A hybrid's mixers (Mamba, gated DeltaNet, short convolutions) carry, per sequence and layer, a
fixed-size state from token to token instead of keys and values: the conv state (the last K
inputs of the causal convolution) and the recurrent state (the SSM's or delta rule's matrix).
transformers' mixers read and write them through their cache argument (`cache_params` /
`past_key_values`): `get_conv_state`, `update_conv_state`, `get_recurrent_state`,
`update_recurrent_state`, `is_recording_past`. `StateView` is that interface over a batch of
our sequences, with transformers' own semantics (cache_utils.LinearAttentionLayer: a first update
keeps the last K conv inputs, left-padded with zeros; a later one returns the previous K inputs
followed by the new ones, so the convolution sees its left context, and keeps the last K).

While the engine's forward runs (kv_attention.attach put its KVState on the modules), a pre-hook
on each mixer computes the layer's output segment by segment (kv_attention.py's segments), with
the layer's own forward and a view of the right sequences' states:

    Decode   L sequences, one token each (every rank runs all L): one call on (L, 1, hidden),
             the view stacking their states; every rank updates its (replicated) copy
    Fresh    prompts packed as documents and sharded: a mixer with a state-passing program
             (integrations/hf/mixers/state.py) runs each rank's own tokens only, and every rank
             keeps each prompt's final states folded from the exchanged summaries; any other
             all-gathers the segment's rows, runs each prompt alone from no state (it records
             its final states), and shards the outputs back
    Extend   T new tokens of one sequence, sharded: all-gather, one call continuing from the
             sequence's states (transformers' chunked-prefill path), shard back

The layer's own call then runs on one zero token without a cache and the hook returns the
computed rows instead (as in integrations/hf/mixers/hooks.py's head-parallel path). The states are
whole on every rank (they are small and every rank runs every decode token). A prefix's K/V can
be shared between sequences; these states cannot be rebuilt from rows, so a prefix entry of a
hybrid carries a *snapshot* of every mixer's states at its end (`snapshot`), and a sequence that
adopts the entry whole starts from a copy of it (`restore`): the server's prefix reuse for
hybrids (serve/pool.py: such a hit ends where an entry ends).
"""

from __future__ import annotations

import inspect
import itertools

import torch
from torch import nn

import ringattn
from ringattn.inference.hf.kv_attention import STATE_ATTR, Decode, Extend, Fresh
from ringattn.integrations.hf.mixers import MIXERS, _known
from ringattn.integrations.hf.mixers.passing import has_state, run_state
from ringattn.layout import get_layout
from ringattn.sharding import local_placement

# mixers whose cache interface is not the five methods above (MiniMax keeps a "linear cache")
NOT_CARRIED = {
    "MiniMaxLightningAttention": "its lightning-attention cache (get_linear_cache)",
    "ZayaCCAProjection": "its convolution and delayed-value states beside its q, k, v outputs",
}
# Mamba1 mixers scan a whole sequence from a zero state only (their cache is read by the
# one-token path): a turn after held states goes through them one token at a time
STEPWISE = {"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"}


class StateView:
    """transformers' linear-attention cache interface over `seqs`' states of one layer."""

    def __init__(self, store: dict, key: object, seqs: list[int]) -> None:
        self.store, self.key, self.seqs = store, key, seqs
        held = [store.get((key, s)) for s in seqs]
        self.previous = all(h is not None for h in held)
        assert self.previous or not any(h is not None for h in held), "mixed fresh and held"
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.kernel: dict[int, int] = {}
        if self.previous:
            for i in held[0]["conv"]:
                self.conv[i] = torch.cat([h["conv"][i] for h in held])
                self.kernel[i] = self.conv[i].shape[-1]
            for i in held[0]["recurrent"]:
                self.recurrent[i] = torch.cat([h["recurrent"][i] for h in held])

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get(state_idx) if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get(state_idx) if self.previous else None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if state_idx in self.conv:  # the previous K inputs, then the new ones
            full = torch.cat([self.conv[state_idx], conv_states], dim=-1)
        else:  # the first: left-padded to the kernel
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.kernel[state_idx] = kernel
            full = nn.functional.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
        self.conv[state_idx] = full[..., -self.kernel[state_idx] :].clone()
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:  # fmt: skip
        self.recurrent[state_idx] = recurrent_states.clone()
        return self.recurrent[state_idx]

    def save(self) -> None:
        """Write each sequence's row of the states back to the store."""
        for row, seq in enumerate(self.seqs):
            self.store[(self.key, seq)] = {
                "conv": {i: t[row : row + 1] for i, t in self.conv.items()},
                "recurrent": {i: t[row : row + 1] for i, t in self.recurrent.items()},
            }


def snapshot(state, seq: int) -> dict:
    """Copies of every mixer's states of `seq` now ({module key: {"conv", "recurrent"}}), from
    a KVState's `mixer_states`."""
    return {key: {kind: {i: t.clone() for i, t in states[kind].items()} for kind in states}
            for (key, s), states in state.mixer_states.items() if s == seq}  # fmt: skip


def restore(state, seq: int, snap: dict) -> None:
    """Start `seq` from copies of the states in `snap` (a `snapshot`)."""
    for key, states in snap.items():
        state.mixer_states[(key, seq)] = {kind: {i: t.clone() for i, t in states[kind].items()}
                                          for kind in states}  # fmt: skip


def snapshot_bytes(snap: dict) -> int:
    return sum(t.numel() * t.element_size() for states in snap.values()
               for kind in states.values() for t in kind.values())  # fmt: skip


def _cache_name(module: nn.Module) -> str:
    names = inspect.signature(module.forward).parameters
    return "cache_params" if "cache_params" in names else "past_key_values"


def _call(module: nn.Module, x: torch.Tensor, view: StateView) -> torch.Tensor:
    """The layer's own forward on `x` (B, T, hidden) from the view's states, which it updates."""
    name = _cache_name(module)
    if view.previous and x.shape[1] > 1 and type(module).__name__ in STEPWISE:
        outs = [module.forward(x[:, t : t + 1], **{name: view}) for t in range(x.shape[1])]
    else:
        outs = [module.forward(x, **{name: view})]
    view.save()
    return torch.cat([out[0] if isinstance(out, tuple) else out for out in outs], dim=1)


def _fresh_by_state(module: nn.Module, state: object, rows: torch.Tensor, fresh: Fresh):
    """Prompts packed as documents, by state passing (integrations/hf/mixers/state.py): each
    rank runs its own tokens, and every rank keeps each prompt's final conv inputs and
    recurrent state, folded from the exchanged summaries, where its decoding continues."""
    bounds = [int(b) for b in fresh.bounds.tolist()]
    placement = local_placement(get_layout(state.layout), state.info, rows.shape[1], bounds)
    out, exchange = run_state(module, rows[0], placement, state.info, keep=True)
    for doc, (seq, _, _, _) in enumerate(fresh.rows):
        conv, recurrent = exchange.conv_finals.get(doc), exchange.finals.get(doc)
        state.mixer_states[(id(module), seq)] = {
            "conv": {} if conv is None else {0: conv[None]},  # (1, C, K)
            "recurrent": {} if recurrent is None else {0: recurrent[None]},
        }
    return out[None]  # (1, rows, hidden)


def _run(module: nn.Module, state: object, x: torch.Tensor) -> torch.Tensor:
    """The layer's output for the forward's local rows `x` (B, S_local, hidden), by segment."""
    store, key = state.mixer_states, id(module)
    if x.shape[1] == 1 and len(state.segments) == 1:  # decode alone: a batch (L, 1, hidden)
        (_, _, step), = state.segments  # fmt: skip
        assert isinstance(step, Decode), step
        return _call(module, x, StateView(store, key, step.live))
    outs = []
    for start, stop, segment in state.segments:
        rows = x[:, start:stop]  # (1, rows, hidden)
        if isinstance(segment, Decode):
            y = _call(module, rows.transpose(0, 1), StateView(store, key, segment.live))
            outs.append(y.transpose(0, 1))
            continue
        if isinstance(segment, Fresh) and has_state(module):
            outs.append(_fresh_by_state(module, state, rows, segment))
            continue
        if isinstance(segment, Fresh):
            bounds = [int(b) for b in segment.bounds.tolist()]
            seqs = [seq for seq, _, _, _ in segment.rows]
        else:
            assert isinstance(segment, Extend), segment
            bounds, seqs = [0, int(segment.turn.placement.seq_len)], [segment.seq]
        common = {"group": state.group, "layout": state.layout, "cu_seqlens": bounds}
        full = ringattn.unshard(rows, 1, **common)  # (1, S, hidden): the segment's tokens
        parts = [
            _call(module, full[:, a:b], StateView(store, key, [seq]))
            for (a, b), seq in zip(itertools.pairwise(bounds), seqs)
        ]
        outs.append(ringattn.shard(torch.cat(parts, dim=1), 1, **common))
    return torch.cat(outs, dim=1)


def _before(module: nn.Module, args: tuple, kwargs: dict):
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        return None
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args, **kwargs)
    x = bound.arguments["hidden_states"]
    state.mixer_out[id(module)] = _run(module, state, x)
    # the layer's own call: one zero token, nothing else (no cache, no mask)
    new = {name: None for name, p in signature.parameters.items()
           if name in bound.arguments and p.kind is not inspect.Parameter.VAR_KEYWORD}  # fmt: skip
    return (), {**new, "hidden_states": x.new_zeros(1, 1, x.shape[-1])}


def _after(module: nn.Module, args: tuple, kwargs: dict, output):
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        return None
    y = state.mixer_out.pop(id(module))
    return (y, *(None for _ in output[1:])) if isinstance(output, tuple) else y


# families whose decoding the engine does not run (checked by tests/test_hf_hybrid.py)
DECODE_REFUSED = {
    "zamba2": "its shared attention block runs at several depths under one layer index",
    "zamba": "its shared attention block runs at several depths, with no layer index of its own",
    "deepseek_v4": (
        "its compressed attention layers keep window buffers, overlap states and pooled entries "
        "in their own cache layers (DeepseekV4CSACache, DeepseekV4HCACache), which ringattn's "
        "sharded KV cache does not carry"
    ),
}


def install(model: nn.Module) -> None:
    """Hook every mixer of `model` (once); ValueError for one whose states are not carried."""
    model_type = model.config.get_text_config().model_type
    if model_type in DECODE_REFUSED:
        raise ValueError(
            f"ringattn's KV-cache decoding (generate, serve): {type(model).__name__} "
            f"(config.model_type={model_type!r}): {DECODE_REFUSED[model_type]}; decode it with "
            f"transformers' own model.generate on one process"
        )
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not _known(module):
            continue
        if cls in NOT_CARRIED:
            raise ValueError(
                f"ringattn's KV-cache decoding (generate, serve): {cls} ({MIXERS[cls]}, module "
                f"{name!r}) keeps {NOT_CARRIED[cls]}, which ringattn does not carry yet; decode "
                f"this model with transformers' own model.generate on one process"
            )
        if not getattr(module, "_ringattn_states_hooked", False):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True)
            module._ringattn_states_hooked = True
