"""`ringattn.hf.generate`: greedy decoding of a transformers model over a sharded KV cache.

    tokens = ringattn.hf.generate(model, input_ids, max_new_tokens=64, group=None, layout="zigzag")

`input_ids` (1, S) is the whole prompt, the same on every rank; every rank returns the same
(1, S + new) tensor, equal to `model.generate(input_ids, do_sample=False, ...)` on one device.

How, through transformers' public seams only: an attention function and a mask function are
registered under the name "ringattn-kv" (`AttentionInterface.register`,
`AttentionMaskInterface.register`) and the model is switched to it for the call
(`set_attn_implementation`, restored afterwards). The model runs with `use_cache=False`: the
cache is ours, one `ShardedKVCache` per layer held by the attention function's state (put on each
module as an attribute for the call, as `parallelize` does with its context).

    prefill   the prompt sharded by the layout (any length, cu_seqlens = [0, S]), position_ids
              global; each layer's attention is ringattn.attention over the prompt and stores this
              rank's real K/V rows; the last token's logits live on one rank: one all-reduce
    decode    every rank runs the new token; its K/V go to one rank (round-robin), each rank
              attends over its shard, the partials merge exactly (inference/partials.py)

A layer's sliding window (`sliding_window = w`: keys with q - k < w) bounds what that layer keeps.
Attention sinks (gpt-oss's `s_aux`) scale the merged output by sigmoid(lse - sink).

Vision-language models (vision.py): the prompt goes in whole with its images
(`pixel_values=...`, `image_grid_thw=...`, `mm_token_type_ids=...`, as the processor returns
them); the vision tower keeps its own attention, and the text decoder's pre-hook cuts the merged
embeddings and (3-D M-RoPE) positions into this rank's rows and notes the largest position, so
that decoded token i sits at position max + 1 + i, as in `model.generate`.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch

import ringattn
from ringattn.comm import all_reduce, resolve_group
from ringattn.inference.cache import ShardedKVCache
from ringattn.inference.partials import local_partial, merge_across_ranks
from ringattn.inference.session import TurnStats
from ringattn.integrations.hf import vision
from ringattn.integrations.hf.attention import _check_call, ringattn_mask
from ringattn.kernels import select_kernel
from ringattn.layout import get_layout
from ringattn.validate import validated

ATTENTION_NAME = "ringattn-kv"
STATE_ATTR = "ringattn_kv_state"


class _State:
    """One `generate` call's cache and phase, shared by every attention module of the model."""

    def __init__(self, info, group, layout: str, on_prefill=None, n_layers: int = 0):
        self.info, self.group, self.layout = info, group, layout
        self.on_prefill, self.n_layers = on_prefill, n_layers  # progress: (layers done, total)
        self.caches: dict[int, ShardedKVCache] = {}  # by layer index
        self.seq_len = 0  # tokens in the sequence before the current call
        self.real: torch.Tensor | None = None  # prefill: local rows that are not padding
        self.positions: torch.Tensor | None = None  # prefill: global position of each row
        self.owner = 0  # decode: the rank that keeps this token's K/V
        self.next_position: int | None = None  # a VLM's first decoded position (vision.py)
        self.kernel = None


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, sliding_window=None, **kwargs):  # fmt: skip
    """transformers' attention-function signature over the sharded cache (see module doc)."""
    state: _State = getattr(module, STATE_ATTR)
    _check_call(module, query, key, attention_mask, dropout, kwargs)
    layer = module.layer_idx
    left = None if not sliding_window else sliding_window - 1
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if state.kernel is None:
        state.kernel = select_kernel("auto", query, key)
    if layer not in state.caches:
        state.caches[layer] = ShardedKVCache(1, state.info.rank, state.info.world_size, left)
    cache = state.caches[layer]
    if state.real is not None:  # prefill
        out, lse = ringattn.attention(
            query, key, value, causal=True, scale=scale, group=state.group, layout=state.layout,
            cu_seqlens=kwargs["cu_seq_lens_q"], window=None if left is None else (left, 0),
            return_lse=True, backend=state.kernel.name,
        )  # fmt: skip
        cache.store(0, key[:, :, state.real], value[:, :, state.real], state.positions[state.real])
        cache.evict(0, state.seq_len)
        if state.on_prefill is not None:
            state.on_prefill(layer + 1, state.n_layers)
    else:
        cache.append_decoded(0, key, value, state.seq_len, state.owner)
        cache.evict(0, state.seq_len)
        kept_k, kept_v, _ = cache.kept(0)
        out, lse = local_partial(state.kernel, query, kept_k, kept_v, scale)
        out, lse = merge_across_ranks(out, lse, state.info, return_lse=True)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        out = out.float() * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None  # (B, S, Hq, D)


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ringattn_mask)


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _check(input_ids, max_new_tokens, layout, multimodal) -> tuple[torch.Tensor, tuple]:
    get_layout(layout)
    unknown = sorted(set(multimodal) - set(vision.MULTIMODAL_KEYS))
    if unknown:
        raise ValueError(f"ringattn.hf.generate does not know the inputs {unknown}; it takes "
                         f"input_ids and {list(vision.MULTIMODAL_KEYS)}")  # fmt: skip
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids must be a (1, S) tensor of the whole prompt, got {shape}")
    if input_ids.shape[1] == 0 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must hold at least one integer token, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    prompt_crc = zlib.crc32(input_ids.cpu().to(torch.int64).numpy().tobytes())
    signature = (("op", "hf.generate"), ("prompt_len", input_ids.shape[1]), ("crc", prompt_crc),
                 ("max_new_tokens", max_new_tokens), ("layout", layout))  # fmt: skip
    return input_ids, signature


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    group: object = None,
    layout: str = "zigzag",
    *,
    eos_token_id: int | list[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
    return_stats: bool = False,
    **multimodal: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, TurnStats]:
    """Greedy continuation of `input_ids` (1, S) by up to `max_new_tokens` tokens, stopping after
    an end-of-sequence token (`eos_token_id`, default the model's generation_config's).

    Returns (1, S + new) on every rank of `group`. The model needs no `parallelize` (its
    attention implementation is switched for the call and restored). `on_token(token)` is called
    on every rank as each new token is chosen (streaming), `on_prefill(layers_done, layers)` after
    each layer's prefill attention; with `return_stats`, also this rank's `TurnStats` (time to
    first token, decode time, the bytes and tokens of K/V this rank keeps). A vision-language
    model (Qwen2-VL, LLaVA) also takes the processor's image inputs as keywords (`pixel_values`,
    `image_grid_thw`, `mm_token_type_ids`, the video equivalents), the same on every rank.
    """
    info = resolve_group(group)
    where = input_ids.device if isinstance(input_ids, torch.Tensor) else None
    input_ids = validated(
        info, where, lambda: _check(input_ids, max_new_tokens, layout, multimodal)
    )
    multimodal = {key: value for key, value in multimodal.items() if value is not None}
    whole = bool(multimodal) or vision.is_multimodal(model)  # a VLM takes the whole prompt
    if whole:
        vision.check_family(model)
        vision.install(model)
    _register()
    device, seq_len = input_ids.device, input_ids.shape[1]
    n_layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0)
    state = _State(info, group, layout, on_prefill, n_layers)
    stats, start = TurnStats(prompt_tokens=seq_len), time.perf_counter()
    previous = model.config.get_text_config()._attn_implementation
    model.set_attn_implementation(vision.text_attention(model, ATTENTION_NAME))
    for module in model.modules():
        setattr(module, STATE_ATTR, state)
    try:
        bounds = torch.tensor([0, seq_len], device="cpu")  # read on the host, like shard_batch's
        common = {"group": group, "layout": layout, "cu_seqlens": bounds}
        local = ringattn.shard(input_ids, 1, **common)  # (1, S_local), padding: token 0
        positions = ringattn.positions(seq_len, device=device, **common)
        state.real, state.positions = (positions >= 0).nonzero().flatten(), positions
        state.seq_len = seq_len  # the next query's position: what a window must keep for it
        lengths = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": seq_len,
                   "max_length_k": seq_len}  # fmt: skip
        if whole:  # the prompt, the images; the decoder's pre-hook cuts (vision.py)
            logits = model(input_ids=input_ids, **multimodal, use_cache=False, **lengths).logits
        else:
            logits = model(input_ids=local, position_ids=positions.clamp(min=0)[None],
                           use_cache=False, **lengths).logits  # fmt: skip
        shift = 0 if state.next_position is None else state.next_position - seq_len
        row = (positions == seq_len - 1).nonzero().flatten()
        last = logits[0, row].sum(0) if len(row) else logits.new_zeros(logits.shape[-1])
        logits = all_reduce(last.float(), info)  # (vocab,), the same on every rank
        state.real = None
        stats.prefill_s = time.perf_counter() - start
        eos, out = _eos_ids(model, eos_token_id), []
        one = torch.tensor([0, 1], device="cpu")
        while len(out) < max_new_tokens:
            token = int(logits.argmax())
            out.append(token)
            if len(out) == 1:
                decode_start = time.perf_counter()
                stats.first_token_s = decode_start - start
            if on_token is not None:
                on_token(token)
            if token in eos or len(out) == max_new_tokens:
                break
            logits = model(input_ids=torch.tensor([[token]], device=device),
                           position_ids=torch.tensor([[state.seq_len + shift]], device=device),
                           use_cache=False, cu_seq_lens_q=one, cu_seq_lens_k=one, max_length_q=1,
                           max_length_k=1).logits[0, -1].float()  # fmt: skip
            state.seq_len += 1
            state.owner = (state.owner + 1) % info.world_size
        if out:
            stats.decode_s = time.perf_counter() - decode_start
        stats.new_tokens = len(out)
        stats.cache_bytes = sum(cache.nbytes for cache in state.caches.values())
        stats.cache_tokens = max((cache.tokens for cache in state.caches.values()), default=0)
    finally:
        for module in model.modules():
            if hasattr(module, STATE_ATTR):
                delattr(module, STATE_ATTR)
        model.set_attn_implementation(vision.text_attention(model, previous))
    new = torch.tensor([out], dtype=input_ids.dtype, device=device).reshape(1, len(out))
    tokens = torch.cat([input_ids, new], dim=1)
    return (tokens, stats) if return_stats else tokens


__all__ = ["generate"]
