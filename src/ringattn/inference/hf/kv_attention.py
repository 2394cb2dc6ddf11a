"""The attention function "ringattn-kv": a transformers model over a sharded KV cache.

transformers calls `_attention(module, query, key, value, ...)` once per layer; the model runs
with `use_cache=False` and the cache is ours: one `ShardedKVCache` per (layer, sequence), held by
a `KVState` put on every module for the call. `_attention` calls `attend`, the per-layer
function that ringattn's decoder calls too (inference/native.py): one engine for both model
kinds. The forward's local rows are cut into segments (`KVState.segments`: row ranges, in
order), each of one kind:

    Fresh     prompts packed as documents (cu_seqlens = [0, S_0, S_0 + S_1, ...]) and sharded
              by the layout; ringattn.attention over the whole pack; each rank stores the K/V of
              its real rows in the cache of the row's sequence (a document never sees another)
    Decode    L live sequences, one token each (every rank runs all L): token j's K/V go to one
              rank (round-robin per sequence), each rank attends every query over its shard of
              that query's sequence, and the L partials merge across ranks in one collective per
              layer (inference/partials.py)
    Extend    a follow-up turn (or a prefill chunk) of one sequence: T new tokens sharded like a
              prompt at positions P .. P + T - 1, pass-KV or pass-Q over the cache
              (inference/turns.py); with nothing cached yet, plain ringattn.attention

A forward is one segment (`KVEngine.prefill`, `decode`, `extend`) or several packed in one batch
row (`KVEngine.step`, the server's step: decodes, new prompts and prefill chunks in one pass over
the weights). Segments never see each other's keys; every row's MLP is its own, so a row's output
is what its segment alone gives. `decode` alone runs its L tokens as a batch (query (L, Hq, 1, D)).
A layer's sliding window (`sliding_window = w`: keys with q - k < w) bounds what that layer keeps.
Decode partials merge by `KVState.merge` ("allgather" or "allreduce", partials.py); every
partial runs the kernel `KVState.backend` selects. Attention sinks (gpt-oss's `s_aux`) scale the
merged output by sigmoid(lse - sink). Attention logit softcapping (Gemma 2's `softcap`) runs
every partial through the softcap kernel.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import ringattn
from ringattn.comm import GroupInfo, all_gather_async, wait
from ringattn.inference.cache import ShardedKVCache
from ringattn.inference.paged import PagedStore, PagedView, parts
from ringattn.inference.partials import (
    attention_options,
    check_merge,
    local_partial,
    merge_across_ranks,
    merge_stacked,
    self_score,
)
from ringattn.inference.turns import Turn, pass_kv, pass_q
from ringattn.integrations.hf import vision
from ringattn.integrations.hf.attention import _check_call, ringattn_mask
from ringattn.kernels import select_kernel, softcap_kernel

ATTENTION_NAME = "ringattn-kv"
STATE_ATTR = "ringattn_kv_state"


@dataclasses.dataclass
class Fresh:
    """Prompts packed as documents: `bounds` (n + 1,) on the host; per prompt (sequence, its
    local rows within the segment, their positions, its length)."""

    bounds: torch.Tensor
    rows: list[tuple[int, torch.Tensor, torch.Tensor, int]]


@dataclasses.dataclass
class Decode:
    """One token for each live sequence, in row order: its position and the rank keeping it."""

    live: list[int]
    positions: list[int]
    owners: list[int]


@dataclasses.dataclass
class Extend:
    """A turn of sequence `seq`: the turn (window and kernel filled in per layer), its real local
    rows and their positions (-1: padding), and each layer's kept tokens per rank."""

    seq: int
    mode: str
    turn: Turn
    rows: torch.Tensor
    positions: torch.Tensor
    lengths: dict[int, list[int]]


class KVState:
    """The caches of one generation (or session) and the segments of the current forward."""

    def __init__(self, info: GroupInfo, group: object, layout: str, offload: bool = False,
                 n_layers: int = 0, merge: str = "allgather",
                 backend: str = "auto"):  # fmt: skip
        check_merge(merge)
        self.info, self.group, self.layout, self.offload = info, group, layout, offload
        # the decode merge (inference/partials.py) and the kernel choice (kernels.select_kernel)
        self.merge, self.backend = merge, backend
        self.n_layers = n_layers  # offload: the last layer prefetches layer 0
        self.caches: dict[tuple[int, int], ShardedKVCache] = {}  # by (layer, sequence)
        self.kernel = None
        self.paged: PagedStore | None = None  # the server's paged cache (paged.py), else None
        self.on_layer = None  # progress: on_layer(layer index) after each prefill layer
        self.segments: list[tuple[int, int, Fresh | Decode | Extend]] = []  # [start, stop) rows
        # a hybrid's mixers (mixer_states.py): states by (module id, sequence), and each
        # running mixer's output from its pre-hook to its hook
        self.mixer_states: dict[tuple[int, int], dict] = {}
        self.mixer_out: dict[int, torch.Tensor] = {}
        # a VLM's prefill (vision.py's decoder pre-hook reads these): real is not None while
        # the whole prompt goes in, positions the packed index of each local row; the hook
        # notes the first decoded position (M-RoPE numbers images by their grid)
        self.real: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.next_position: int | None = None

    def cache(self, layer: int, seq: int, left: int | None) -> ShardedKVCache | PagedView:
        """(layer, seq)'s cache: a view of the pages, or a contiguous cache of its own for a
        windowed layer without a server's pool (generate, Session), which drops the rows
        the window has passed (the pages keep them: a prefix entry may share their blocks)."""
        key = (layer, seq)
        paged = self.paged is not None and not (self.paged.elastic and left is not None)
        if key not in self.caches and paged:
            self.caches[key] = PagedView(self.paged, layer, seq, left, self.info.rank)
        elif paged:  # a view made before its layer ran (engine.adopt)
            self.caches[key].window = left
        elif key not in self.caches:
            cache = ShardedKVCache(1, self.info.rank, self.info.world_size, left)
            if self.offload:
                cache.offload()
            self.caches[key] = cache
        return self.caches[key]

    def kept_tokens(self, seq: int) -> int:
        """The most tokens any layer of `seq` keeps on this rank."""
        return max((c.tokens for (_, s), c in self.caches.items() if s == seq), default=0)

    def drop(self, seq: int) -> None:
        for key in [key for key in self.caches if key[1] == seq]:
            del self.caches[key]
        for key in [key for key in self.mixer_states if key[1] == seq]:
            del self.mixer_states[key]
        if self.paged is not None:
            self.paged.release(seq)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches.values())

    @property
    def capacity_bytes(self) -> int:
        return sum(cache.capacity_bytes for cache in self.caches.values())


def _kept(state: KVState, layer: int, seq: int, cache: ShardedKVCache,
          like: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The live k, v, positions of (layer, seq); offloaded, the next layer's copy starts (the
    last layer's next is layer 0 of the next token), so at most two layers are on the device."""
    kept = cache.kept(0)
    following = state.caches.get(((layer + 1) % max(1, state.n_layers), seq))
    if following is not None and following is not cache:
        following.prefetch(0)
    if kept is None:
        empty = like[:, :, :0]
        return empty, empty, torch.empty(0, dtype=torch.int64, device=like.device)
    return kept


def _prefill(state: KVState, fresh: Fresh, layer: int, left, query, key, value, scale):
    out, lse = ringattn.attention(
        query, key, value, causal=True, scale=scale, group=state.group, layout=state.layout,
        cu_seqlens=fresh.bounds, window=None if left is None else (left, 0),
        return_lse=True, **attention_options(state.kernel),
    )  # fmt: skip
    for seq, rows, positions, length in fresh.rows:
        cache = state.cache(layer, seq, left)
        cache.store(0, key[:, :, rows], value[:, :, rows], positions)
        cache.evict(0, length)
    if state.on_layer is not None:
        state.on_layer(layer)
    return out, lse


def _merge(state: KVState, out, lse, query, key, scale):
    """The decode partials merged across ranks by `state.merge`; allreduce's reference is each
    query's score against its own key, which it always sees (partials.py)."""
    ref = self_score(query, key, scale) if state.merge == "allreduce" else None
    return merge_across_ranks(out, lse, state.info, state.merge, ref, return_lse=True)


def _decode(state: KVState, step: Decode, layer: int, left, query, key, value, scale):
    """Each live sequence's partial over this rank's rows of it (its cache: pages or a
    contiguous one), then the L partials merged across ranks (docs/paged-kv.md)."""
    outs, lses = [], []
    for j, seq in enumerate(step.live):  # query (L, Hq, 1, D): one row per live sequence
        cache = state.cache(layer, seq, left)
        q, k, v = query[j : j + 1], key[j : j + 1], value[j : j + 1]
        cache.append_decoded(0, k, v, step.positions[j], step.owners[j])
        cache.evict(0, step.positions[j])
        if isinstance(cache, PagedView):
            out, lse = _paged_partial(state, layer, cache, q, k, v, scale)
        else:
            kept_k, kept_v, _ = _kept(state, layer, seq, cache, k)
            out, lse = local_partial(state.kernel, q, kept_k, kept_v, scale)
        outs.append(out)
        lses.append(lse)
    return _merge(state, torch.cat(outs), torch.cat(lses), query, key, scale)


def _paged_partial(state: KVState, layer: int, view: PagedView, q, k, v, scale):
    """One sequence's visible rows on the pages in one kernel call (a long shared prefix read
    in place and the rest gathered: two, merged by lse; paged.parts)."""
    done = [local_partial(state.kernel, q, kept_k, kept_v, scale)
            for kept_k, kept_v in parts(state.paged, layer, view)]  # fmt: skip
    if not done:  # no row here: weight 0 in the merge
        done = [local_partial(state.kernel, q, k[:, :, :0], v[:, :, :0], scale)]
    if len(done) == 1:
        return done[0]
    return merge_stacked(torch.stack([o for o, _ in done]), torch.stack([x for _, x in done]))


def _extend(state: KVState, piece: Extend, layer: int, left, query, key, value, scale):
    cache = state.cache(layer, piece.seq, left)
    kept = _kept(state, layer, piece.seq, cache, key)
    lengths = piece.lengths[layer]
    turn, rows = piece.turn, piece.rows
    positions = None
    if max(lengths) == 0:  # a sequence's first chunk: nothing cached on any rank
        out, lse = ringattn.attention(
            query, key, value, causal=True, scale=scale, group=state.group, layout=state.layout,
            cu_seqlens=list(turn.placement.bounds), window=None if left is None else (left, 0),
            return_lse=True, **attention_options(state.kernel),
        )  # fmt: skip
        cache.store(0, key[:, :, rows], value[:, :, rows], piece.positions[rows])
        cache.evict(0, turn.offset + turn.placement.seq_len)
        return out, lse
    if left is not None:  # pass-KV masks the window by each rank's kept positions
        longest = max(lengths)
        padded = torch.full((longest,), -1, dtype=torch.int64, device=kept[2].device)
        padded[: kept[2].numel()] = kept[2]
        gathered, works = all_gather_async(padded, state.info)
        wait(works)
        positions = [gathered[r, : lengths[r]] for r in range(state.info.world_size)]
    turn = dataclasses.replace(turn, kernel=state.kernel, scale=scale, window=left,
                               cache_lengths=lengths, cache_positions=positions)  # fmt: skip
    attend = pass_kv if piece.mode == "pass-kv" else pass_q
    out, lse = attend(turn, query, key, value, kept, return_lse=True)
    cache.store(0, key[:, :, rows], value[:, :, rows], piece.positions[rows])
    cache.evict(0, turn.offset + turn.placement.seq_len)
    return out, lse


def _segment(state: KVState, what, layer: int, left, query, key, value, scale):
    """(out (1, Hq, n, D), lse (1, Hq, n)) of one segment's rows of a packed forward."""
    if isinstance(what, Fresh):
        out, lse = _prefill(state, what, layer, left, query, key, value, scale)
    elif isinstance(what, Extend):
        out, lse = _extend(state, what, layer, left, query, key, value, scale)
    else:  # the rows as a batch of one-token queries, and back
        batch = (t.permute(2, 1, 0, 3) for t in (query, key, value))
        out, lse = _decode(state, what, layer, left, *batch, scale)
        out, lse = out.permute(2, 1, 0, 3), lse.permute(2, 1, 0)
    return out, lse


def attend(state: KVState, layer: int, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor, left: int | None, scale: float, softcap: float | None = None,
           name: str = "attention") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One layer's attention over the sharded cache (module doc): q (B, Hq, S, D), k, v
    (B, Hkv, S, D) of the forward's rows, after RoPE -> (out (B, Hq, S, D), lse (B, Hq, S)).
    `left`: the layer's window (earlier tokens seen; None: all). Both model kinds call it:
    transformers' through `_attention`, ringattn's decoder through inference/native.py."""
    if state.kernel is None:
        auto = select_kernel(state.backend, query, key)
        state.kernel = auto if softcap is None else softcap_kernel(state.backend, softcap)
    if getattr(state.kernel, "cap", None) != (None if softcap is None else float(softcap)):
        raise ValueError(
            f"{name} (layer {layer}): attention logit softcapping {softcap}, unlike an earlier "
            f"layer; ringattn's KV-cache decoding takes one cap per model"
        )
    if query.shape[0] > 1:  # `decode` alone: a batch of L one-token queries, one segment
        return _decode(state, state.segments[0][2], layer, left, query, key, value, scale)
    parts = [_segment(state, what, layer, left, query[:, :, a:b], key[:, :, a:b],
                      value[:, :, a:b], scale) for a, b, what in state.segments]  # fmt: skip
    if len(parts) == 1:  # one segment as it comes
        return parts[0]
    # several in float32 (a decode's merge is float32 already)
    out, lse = (torch.cat([t.float() for t in x], 2) for x in zip(*parts))
    return out, lse


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, sliding_window=None, **kwargs):  # fmt: skip
    """transformers' attention-function signature over the sharded cache (see module doc)."""
    state: KVState = getattr(module, STATE_ATTR)
    _check_call(module, query, key, attention_mask, dropout, kwargs)
    left = None if not sliding_window else sliding_window - 1
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    width = value.shape[-1]
    if key.shape[-1] != width:  # MLA (DeepSeek, Kimi): zero columns on the narrower side, as
        # ringattn.hf's training attention pads them; the cache holds the padded values
        wide = max(key.shape[-1], width)
        query, key, value = (F.pad(t, (0, wide - t.shape[-1])) for t in (query, key, value))
    softcap = kwargs.get("softcap")  # Gemma 2: every layer's scores capped alike
    out, lse = attend(state, module.layer_idx, query, key, value, left, scale, softcap,
                      type(module).__name__)  # fmt: skip
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        out = out.float() * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return out[..., :width].to(query.dtype).transpose(1, 2).contiguous(), None  # (B, S, Hq, D)


def register() -> None:
    """Register "ringattn-kv" with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ringattn_mask)


def attach(model: torch.nn.Module, state: KVState | None) -> str:
    """Switch `model` to "ringattn-kv" with `state` on every module; returns the previous
    implementation. `state=None` removes the state (use `restore`)."""
    register()
    previous = model.config.get_text_config()._attn_implementation
    model.set_attn_implementation(vision.text_attention(model, ATTENTION_NAME))
    for module in model.modules():
        setattr(module, STATE_ATTR, state)
    return previous


def restore(model: torch.nn.Module, previous: str) -> None:
    for module in model.modules():
        if hasattr(module, STATE_ATTR):
            delattr(module, STATE_ATTR)
    model.set_attn_implementation(vision.text_attention(model, previous))
