"""Recurrent and convolutional sequence mixers (Mamba, gated DeltaNet, short convolutions) under CP.

A hybrid model's attention layers go through ringattn's attention. Its other sequence mixers
carry a state along the sequence (an SSM or linear-attention recurrence, a causal convolution's
last K-1 inputs): a rank that ran one on its own shard would start from a zero state at the
shard's first token, as if the shard were the whole sequence, and train with wrong numbers and
no error. Each mixer class ringattn knows (`MIXERS`, an allow-list keyed by the class name and
checked to come from transformers) runs here on the whole sequence instead, through two public
hooks on the mixer module and nothing else:

    pre-hook   x_local (1, S_local, H)   this rank's rows, layout order, padding rows included
               x = gather_rows(x_local)  (1, S, H) global order: an all-gather forward, a
                                         reduce-scatter of the gradient backward (comm.py)
               docs = split(x, bounds)   one row per packed document, right-padded to the
                                         longest: (n_docs, L_max, H); causal mixers never read
                                         the padding (it is after every real token of its row)
               -> the module's forward(docs) with no cache, no mask, no per-token kwargs:
                  each document from a zero state (the state resets at every document start,
                  no convolution reads across a document boundary)
    hook       y (n_docs, L_max, H) -> (1, S, H) global order -> shard(y): this rank's rows

The module's own code computes every token's output, with its parameters and names untouched (a
checkpoint saves and loads as before). Backward is exact: each rank's parameter gradients come
from its own rows' outputs only (the other rows' outputs are dropped by `shard`), so they sum to
the single-process gradients over the group, as every per-token layer's do; the input's
gradient, which on each rank holds its own rows' contributions to every position, is summed over
the group and each rank keeps its rows (`gather_rows`' reduce-scatter).

This is the "whole" scheme. A mixer class that splits by heads (heads.py: gated DeltaNet,
Nemotron-H's Mamba2) runs its heads' share instead, on the same gathered input, and the partial
outputs are summed into each rank's rows by a reduce-scatter (`scatter_rows`).

Cost ("gather" in the planner): per mixer layer per rank, an all-gather of S x H activations and
a reduce-scatter of their gradient; the mixer's compute and activations are those of the whole
sequence on every rank (W times the work of one shard). It is exact for every layout (contiguous,
zigzag's two runs, striped's runs of one token) and every W, and kernel-agnostic; the state-
passing scheme (each rank runs only its own runs from entering states exchanged as fixed-size
summaries, DESIGN.md section 13) is the faster path still to come for the popular mixers.

KV-cache decoding (generate, serve) carries these states per sequence instead: the layer stands
aside here while inference/hf/mixer_states.py runs it.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

import ringattn
from ringattn.comm import resolve_group
from ringattn.integrations.hf import vision
from ringattn.integrations.hf.attention import (
    CONTEXT_ATTR,
    LOCAL_ATTR,
    SEGMENTS_KWARG,
    _check_padding_mask,
)
from ringattn.integrations.hf.mixers.comm import gather_rows, scatter_rows
from ringattn.integrations.hf.mixers.heads import HeadShare, splits
from ringattn.integrations.hf.mixers.state import has_state, run_state
from ringattn.integrations.hf.mixers.whole_attention import (
    WHOLE_ATTENTION,
    check_whole,
    document_kwargs,
    local_attention,
    runs_whole,
    to_documents,
)
from ringattn.layout import get_layout
from ringattn.sharding import local_placement

# class name -> the mixer it is. Each was checked against one process in tests/test_hf_hybrid.py
# (forward and backward, three layouts, packed documents). Only classes defined in transformers'
# own modeling files qualify (`_known`): a user's class of the same name is not trusted.
MIXERS: dict[str, str] = {
    "Qwen3NextGatedDeltaNet": "gated DeltaNet",
    "Qwen3_5GatedDeltaNet": "gated DeltaNet",
    "Qwen3_5MoeGatedDeltaNet": "gated DeltaNet",
    "OlmoHybridGatedDeltaNet": "gated DeltaNet",
    "KimiLinearDeltaAttention": "Kimi delta attention (KDA)",
    "Mamba2Mixer": "Mamba2 (SSD)",
    "NemotronHMamba2Mixer": "Mamba2 (SSD)",
    "FalconH1Mixer": "Mamba2 (SSD)",
    "GraniteMoeHybridMambaLayer": "Mamba2 (SSD)",
    "BambaMixer": "Mamba2 (SSD)",
    "Zamba2MambaMixer": "Mamba2 (SSD)",
    "MambaMixer": "Mamba1 (selective scan)",
    "FalconMambaMixer": "Mamba1 (selective scan)",
    "JambaMambaMixer": "Mamba1 (selective scan)",
    "ZambaMambaMixer": "Mamba1 (selective scan)",
    "Lfm2ShortConv": "short causal convolution",
    "Lfm2MoeShortConv": "short causal convolution",
    "MiniMaxLightningAttention": "lightning attention",
    "ZayaCCAProjection": "CCA projection (causal convolution on q/k, v from the previous token)",
    # an attention module run whole (whole_attention.py): its compressed layers only
    "DeepseekV4Attention": "compressed attention (pooled windows, a top-k indexer)",
}
# mixers whose every output is per token (Zaya's q, k, v): the hook shards each one; the others
# return one sequence output (and, in a tuple, nothing per token after it)
ALL_OUTPUTS_PER_TOKEN = {"ZayaCCAProjection"}

# leaf modules that mix tokens by themselves: refused wherever no handled mixer holds them
_TOKEN_MIXING_LEAVES = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)
# where a module class must come from for ringattn to know whether it mixes tokens: transformers'
# modeling files (the model family itself is checked against the family allow-list), torch (its
# token-mixing leaves above are refused), PEFT's adapters and ringattn's own. Anything else, a
# user's or another library's module, is refused: ringattn cannot see inside its forward.
_KNOWN_SOURCES = ("torch.", "transformers.", "peft.", "ringattn.")
_CACHE_ARGS = ("cache_params", "past_key_values", "cache_position")
STATE_ATTR = "ringattn_mixer_state"


def _known(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ not in MIXERS or not cls.__module__.startswith("transformers.models."):
        return False
    return runs_whole(module)


def _layer_of(names: str) -> str:
    """'model.layers.3.mixer' -> 'layer 3'; the module's path when it has no layer index."""
    parts = names.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks", "mamba_layers") and parts[i + 1].isdigit():
            return f"layer {parts[i + 1]}"
    return names or "the model"


def find_mixers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The handled mixers under `root`, as (qualified name, module); ValueError for any module
    that mixes tokens and is neither a handled mixer nor inside one.

    The message names the class, its layer and what to do: ringattn refuses what it has not
    checked (an allow-list), so a sequence mixer that a later transformers adds is refused until
    someone makes it exact.
    """
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if _known(module):
            found.append((name, module))
            inside.append(name)
            continue
        cls = type(module).__name__
        source = type(module).__module__
        if isinstance(module, _TOKEN_MIXING_LEAVES):
            raise ValueError(  # noqa: TRY004 - the contract: a refused model is a ValueError
                f"{cls} ({_layer_of(name)}, module {name!r}) mixes tokens along the sequence, and "
                f"ringattn has no exact context-parallel path for it here: each rank would run it "
                f"over its own shard only. Run this model with cp 1 (no parallelize), or ask for "
                f"it to be added (`ringattn check --hf DIR` shows what ringattn does with your "
                f"model). Handled sequence mixers: {sorted(MIXERS)}"
            )
        if not source.startswith(_KNOWN_SOURCES):
            raise ValueError(
                f"{cls} ({_layer_of(name)}, module {name!r}, from {source}) is not a module "
                f"ringattn knows: it cannot tell whether it mixes tokens along the sequence, which "
                f"would be silently wrong when each rank holds a shard. Run this model with cp 1, "
                f"or build it from transformers' own classes"
            )
    return found


@dataclass
class MixerState:
    """Per model: the global document bounds of the forward in progress (set by `_capture`), the
    head-parallel twins by module, and each running mixer's hand-over from pre-hook to hook."""

    context: object
    bounds: torch.Tensor | None = None
    segments: list | None = None  # dynamic CP's pieces (attention.py's SEGMENTS_KWARG)
    heads: dict[int, HeadShare] = field(default_factory=dict)
    schemes: dict[int, str] = field(default_factory=dict)  # module id -> state, heads, whole
    pending: dict[int, tuple] = field(default_factory=dict)
    # bytes this rank sends per mixer call, forward + backward, by layer (for benchmarks): a
    # ring all-gather sends (W-1)/W of the gathered tensor, a ring all-reduce 2(W-1)/W of it
    traffic: dict[str, int] = field(default_factory=dict)


def _capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Model pre-hook: keep the forward's `cu_seq_lens_q` and dynamic CP's segments (None
    without) for the mixers, which are not given them."""
    state = getattr(module, STATE_ATTR)
    state.bounds, state.segments = kwargs.get("cu_seq_lens_q"), kwargs.get(SEGMENTS_KWARG)


def _capture_inner(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Decoder pre-hook: the same when the decoder is called alone (ringattn.hf.loss); a model
    that does not pass the bounds on to its decoder (Mamba2) keeps the model's."""
    state = getattr(module, STATE_ATTR)
    if kwargs.get("cu_seq_lens_q") is not None:
        state.bounds = kwargs["cu_seq_lens_q"]
    if kwargs.get(SEGMENTS_KWARG) is not None:
        state.segments = kwargs[SEGMENTS_KWARG]


def _by_segments(module: nn.Module, x: torch.Tensor, segments: list, layout: str, where: str):
    """Dynamic CP: (S_local, H) rows, pieces end to end, each over its own sub-group and
    documents (models/segments.py) -> the layer's outputs, each piece by state passing over its
    group (every member runs the same pieces in the same order, as attention's)."""
    outs = []
    for seg in segments:
        info = resolve_group(seg.group)
        rows = x[seg.start : seg.stop]
        placement = local_placement(get_layout(layout), info, rows.shape[0], list(seg.cu_seqlens))
        outs.append(run_state(module, rows, placement, info)[0])
    if sum(o.shape[0] for o in outs) != x.shape[0]:
        raise ValueError(f"{where}: {SEGMENTS_KWARG} cover {sum(o.shape[0] for o in outs)} "
                         f"rows, the batch has {x.shape[0]}")  # fmt: skip
    return torch.cat(outs)


def _hidden(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = signature.bind_partial(*args, **kwargs)
    if "hidden_states" not in bound.arguments:
        raise ValueError("a sequence mixer was called without hidden_states")
    return bound


def _before(module: nn.Module, args: tuple, kwargs: dict):
    """Mixer pre-hook: this rank's rows -> the whole sequence, one row per document."""
    if getattr(module, vision.KV_STATE_ATTR, None) is not None:
        return None  # KV-cache decoding runs this layer (inference/hf/mixer_states.py)
    state: MixerState = getattr(module, STATE_ATTR)
    signature = inspect.signature(module.forward)
    bound = _hidden(signature, args, kwargs)
    x_local = bound.arguments["hidden_states"]
    var_kw = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    extra = dict(bound.arguments.get(var_kw[0], {})) if var_kw else {}
    bounds = extra.get("cu_seq_lens_q", state.bounds)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if state.segments is not None:  # dynamic CP: pieces over sub-groups
        if state.schemes.get(id(module)) != "state":
            raise ValueError(
                f"{where}: dynamic CP runs a mixer piece by piece by state passing, and this "
                f"layer runs {state.schemes.get(id(module))!r}; parallelize with "
                f"mixer_scheme='auto' or 'state', or train with static CP"
            )
        local = _by_segments(module, x_local[0], state.segments, state.context.layout, where)
        state.pending[id(module)] = ("done", local[None])
        return _zero_call(signature, bound, x_local)
    if bounds is None:
        raise ValueError(
            f"{where}: the model was parallelized with ringattn.hf.parallelize but the batch has "
            f"no cu_seq_lens_q; build it with ringattn.hf.shard_batch (the same group and layout)"
        )
    for name in _CACHE_ARGS:
        if bound.arguments.get(name) is not None and name != "cache_position":
            raise ValueError(
                f"{where}: a cache ({name}) in a context-parallel forward; ringattn.hf trains and "
                f"scores whole sequences: call the model with use_cache=False"
            )
    if type(module).__name__ in WHOLE_ATTENTION:
        check_whole(module, where)
    if x_local.dim() != 3 or x_local.shape[0] != 1:
        raise ValueError(
            f"{where}: expected hidden states (1, S_local, H), got {tuple(x_local.shape)}"
        )
    context = state.context
    mask = bound.arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # padding: all ones on every rank
        _check_padding_mask(mask, module, context)
    info = resolve_group(context.group, allow_2d=True)
    bounds_list = [int(b) for b in bounds.tolist()]
    placement = local_placement(get_layout(context.layout), info, x_local.shape[1], bounds_list)
    if state.schemes.get(id(module)) == "state":  # this rank's runs only (state.py)
        local, exchange = run_state(module, x_local[0], placement, info)
        state.pending[id(module)] = ("done", local[None])  # (1, S_local, H)
        state.traffic[where] = exchange.sent
        return _zero_call(signature, bound, x_local)
    full = gather_rows(x_local[0], placement, info)[None]  # (1, S, H)
    lengths = [b - a for a, b in itertools.pairwise(bounds_list) if b > a]
    docs = to_documents(full, lengths)  # (n_docs, L_max, H)
    share = state.heads.get(id(module))
    if info.world_size > 1:
        volume = full.numel() * full.element_size() * (info.world_size - 1) / info.world_size
        # in: an all-gather forward, a reduce-scatter of the gradient backward; head-parallel
        # out: a reduce-scatter forward, an all-gather backward (comm.py)
        state.traffic[where] = int(volume * (2 if share is None else 4))
    if share is not None:  # head-parallel: this rank's heads, summed over the group
        partial = _sequence(share(module, docs), lengths)  # (1, S, H)
        local = scatter_rows(partial[0], placement, info)[None]  # (1, S_local, H)
        state.pending[id(module)] = ("done", local)
        return _zero_call(signature, bound, x_local)
    state.pending[id(module)] = (lengths, bounds_list)
    new = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if name == "hidden_states":
            new[name] = docs
        elif name in bound.arguments:
            new[name] = None  # cache, mask, position embeddings: none of them per document
    if type(module).__name__ in WHOLE_ATTENTION:  # the attention itself
        args = bound.arguments
        new |= document_kwargs(module, args, x_local, placement, info, lengths)
    return (), new


def _zero_call(signature: inspect.Signature, bound: inspect.BoundArguments, x_local):
    """The layer's own forward still runs (hooks cannot skip it): on one zero token and nothing
    else, its output dropped by `_after` for the rows computed here."""
    new = {name: None for name, p in signature.parameters.items()
           if name in bound.arguments and p.kind is not inspect.Parameter.VAR_KEYWORD}  # fmt: skip
    return (), {**new, "hidden_states": x_local.new_zeros(1, 1, x_local.shape[-1])}


def _sequence(y: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(n_docs, L_max, H) right-padded documents -> (1, S, H), the documents end to end."""
    return torch.cat([y[i : i + 1, :n] for i, n in enumerate(lengths)], dim=1)


def _after(module: nn.Module, args: tuple, kwargs: dict, output):
    """Mixer hook: the documents' outputs -> the whole sequence -> this rank's rows."""
    if getattr(module, vision.KV_STATE_ATTR, None) is not None:
        return None
    state: MixerState = getattr(module, STATE_ATTR)
    lengths, bounds_list = state.pending.pop(id(module))
    context = state.context
    if lengths == "done":
        local = bounds_list
    else:
        kw = {"group": context.group, "layout": context.layout, "cu_seqlens": bounds_list}
        if type(module).__name__ in ALL_OUTPUTS_PER_TOKEN:
            return tuple(ringattn.shard(_sequence(y, lengths), 1, **kw) for y in output)
        y = output[0] if isinstance(output, tuple) else output
        local = ringattn.shard(_sequence(y, lengths), 1, **kw)
    if isinstance(output, tuple):
        return (local, *(None for _ in output[1:]))
    return local


SCHEMES = ("auto", "state", "heads", "whole")


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown mixer scheme {scheme!r}; choose one of {list(SCHEMES)}")


def choose(module: nn.Module, wanted: str, world_size: int) -> str:
    """The scheme `module` runs: `wanted` where it can run exactly, else the first that can of
    state (its class has a program in state.py; a striped layout's rows go through zigzag's
    runs, relayout.py), heads (W divides its head groups) and whole (always)."""
    can = {
        "state": has_state(module),
        "heads": splits(module, world_size),
        "whole": True,
    }
    order = ["state", "heads", "whole"]
    if wanted != "auto":
        order.remove(wanted)
        order.insert(0, wanted)
    return next(scheme for scheme in order if can[scheme])


def install(
    model: nn.Module, root: nn.Module, mixers: list[tuple[str, nn.Module]], scheme: str = "auto"
) -> None:
    """Hook each handled mixer under `root` (once) and the model's bounds capture; each runs
    the scheme `choose` gives for `scheme`."""
    context = getattr(model, CONTEXT_ATTR)
    state = MixerState(context)
    # the bounds come from the model's forward, or its decoder's (ringattn.hf.loss calls the
    # decoder alone): each of them keeps its call's cu_seq_lens_q for the mixers not given it
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for entry, hook in ((model, _capture), (decoder, _capture_inner)):
        if entry is None:
            continue
        setattr(entry, STATE_ATTR, state)  # a second parallelize: the new state, hooks kept
        if getattr(entry, "_ringattn_mixers_hooked", False):
            continue
        entry.register_forward_pre_hook(hook, with_kwargs=True)
        entry._ringattn_mixers_hooked = True
    info = resolve_group(context.group, allow_2d=True)
    config = model.config.get_text_config()
    for _, module in mixers:
        setattr(module, STATE_ATTR, state)
        if type(module).__name__ in WHOLE_ATTENTION:
            setattr(module, LOCAL_ATTR, local_attention(module))
        chosen = choose(module, scheme, info.world_size)
        state.schemes[id(module)] = chosen
        if chosen == "heads":
            state.heads[id(module)] = HeadShare.build(module, config, info.rank, info.world_size)
        if not getattr(module, "_ringattn_mixer_hooked", False):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True)
            module._ringattn_mixer_hooked = True


def has_mixers(model: nn.Module) -> bool:
    """True when `model` has a recurrent or convolutional mixer ringattn knows (a hybrid)."""
    return any(_known(module) for module in model.modules())


def schemes(model: nn.Module) -> dict[str, tuple[str, str]]:
    """{module name: (the mixer it is, "state", "heads" or "whole")} for a parallelized model:
    how each recurrent mixer runs across the ranks (state: state.py; heads: heads.py; whole:
    the module docstring)."""
    state: MixerState | None = getattr(model, STATE_ATTR, None)
    out = {}
    for name, module in model.named_modules():
        if _known(module) and state is not None:
            scheme = state.schemes.get(id(module), "whole")
            out[name] = (MIXERS[type(module).__name__], scheme)
    return out
