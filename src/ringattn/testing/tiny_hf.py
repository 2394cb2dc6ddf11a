"""A transformers config shrunk to a tiny width, keeping what makes the model what it is.

`ringattn check --hf` runs a real model family through context parallelism on a CPU in seconds,
and the family survey (scripts/tools/family_survey.py) every family transformers registers, so
both take the family's config and keep its *structure* while dropping its *size*:

    kept                                        shrunk
    ----                                        ------
    model_type, architectures, auto class       hidden_size -> 64, vocab -> 256
    the layer pattern: layer_types,             heads -> 4 (kv: 4, 2 or 1, as MHA/GQA/MQA),
      layers_block_type, attn_layer_indices,      head dims -> 16, other heads scaled together
      full_attn_idxs, periods and offsets       intermediate sizes -> 96, ranks and states -> 16
      (one of each kind of layer, the prefix    experts: kept up to 16 (else 8), top-k <= 4
      that shows them all, in order)            layers: the shortest prefix holding every kind
    the mixers (attention, Mamba, linear        (at most 8; beyond that one of each kind)
      attention, convolutions), MoE, vision
    conv kernels, scan chunk sizes              dropout and router jitter -> 0
                                                windows (sliding, chunked attention) -> 8
                                                  tokens: shorter than the documents checked

1. Layers: the shortest prefix that shows every kind of layer (tiny_layers.py).
2. Widths. Every int whose name says it is a width (`*_size`, `*_dim`, `*heads`, `*_rank`,
   `*state*`, and the older names: GPT-2's `n_embd`, BART's `d_model`, `d_ff`, `d_head`...) is
   set to a small value by its kind; names that are not widths (kernels, patches, windows,
   chunks, blocks, positions) keep theirs.
3. Constraints. A short table of fixes restores what the config's own checks need
   (`FIXES`: a Mamba layer's heads x head dim = expand x hidden, a multimodal RoPE's sections
   summing to half the head dim, ...), keyed by the fields present rather than by family.

Sub-configs (text_config, vision_config, ...) are shrunk the same way. The result is rebuilt
through the config's own class, so its own validation and derived fields run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ringattn.integrations.hf import vision
from ringattn.testing.tiny_layers import LAYER_COUNTS, keep_layers

HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
FFN = 96
RANK = 16
WINDOW = 8
_WINDOWS = ("sliding_window", "attention_chunk_size")
VOCAB = 256
MAX_EXPERTS = 16
INIT_RANGE = 0.1
"""initializer_range of the tiny model: large enough that every layer changes the loss."""
SPECIAL_IDS = 16
"""The top ids of the tiny vocabulary are kept for special tokens (image, pad, bos, eos...)."""

_NOT_WIDTH = re.compile(
    r"conv|kernel|patch|chunk|window|block_size|merge|position|image_size|cache|temporal|"
    r"vocab|batch|max_|bucket|num_labels|multiple_of"
)
# widths by name where the name does not say "_size" or "_dim" (GPT-2's n_embd, BART's d_model)
_HIDDEN_NAMES = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "emb_dim",
                 "embedding_size", "word_embed_proj_dim", "lru_width", "input_embedding_size",
                 "output_embedding_size", "dim")  # fmt: skip
_FFN_NAMES = ("d_ff", "n_inner", "dff", "dim_ff", "d_inner", "feed_forward_size")
_HEAD_DIM_NAMES = ("d_head", "dim_head", "attention_head_size")
_VOCABS = ("vocab_size", "unpadded_vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")


def _is_heads(name: str) -> bool:
    return name.endswith("heads") or name in ("n_head", "num_query_groups")


def _shrink_heads(d: dict) -> None:
    """Query heads -> HEADS, kv heads keeping MHA/GQA/MQA; other head counts scaled together."""
    q = d.get("num_attention_heads")
    if isinstance(q, int) and q > 0:
        d["num_attention_heads"] = HEADS
        for name in ("num_key_value_heads", "num_query_groups"):
            old = d.get(name)
            if isinstance(old, int) and old > 0:
                d[name] = HEADS if old == q else 1 if old == 1 else 2
    paired = ("num_attention_heads", "num_key_value_heads", "num_query_groups")
    others = {n: v for n, v in d.items()
              if _is_heads(n) and isinstance(v, int) and not isinstance(v, bool) and v > 0
              and n not in paired}  # fmt: skip
    if others:
        least = min(others.values())
        for name, value in others.items():
            d[name] = max(1, value * HEADS // least) if value % least == 0 else HEADS


def _width(name: str, value: int) -> int | None:
    """The tiny value of one int field, or None to keep it (module docstring, step 2)."""
    if name in _HIDDEN_NAMES:
        return HIDDEN
    if _NOT_WIDTH.search(name):
        return None
    if "intermediate" in name or "ffn" in name or name in _FFN_NAMES:
        return FFN
    if ("rope" in name or "rotary" in name) and "dim" in name:
        return HEAD_DIM // 2
    if (
        "head_dim" in name
        or name in _HEAD_DIM_NAMES
        or name.endswith(("_d_head", "headdim", "kv_channels"))
    ):
        return HEAD_DIM
    if "state" in name and name.endswith(("_size", "_state", "_dim")):
        return RANK
    if name.endswith("_rank"):
        return RANK
    if name.endswith(("_size", "_dim")) and value > HIDDEN:
        return HIDDEN
    return None


_MLA = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _shrink_value_width(d: dict, full: dict) -> None:
    """v's width scaled with q and k's, so that it equals theirs where the full model's does
    and differs where it differs: MLA's three widths together (rope part -> HEAD_DIM / 2;
    GLM-4.7-Flash: qk 256 = v 256, DeepSeek-V3: 192 vs 128), or v_head_dim with head_dim
    (MiMo-V2-Flash: 192 vs 128 -> 16 vs 11)."""
    if all(isinstance(full.get(n), int) and full[n] > 0 for n in _MLA):
        scale = max(1, full["qk_rope_head_dim"] // (HEAD_DIM // 2))
        for name in _MLA:
            d[name] = max(1, full[name] // scale)
    elif all(isinstance(full.get(n), int) and full[n] > 0 for n in ("head_dim", "v_head_dim")):
        d["v_head_dim"] = max(1, round(full["v_head_dim"] * d["head_dim"] / full["head_dim"]))


def _shrink_widths(d: dict) -> None:
    # MLA (DeepSeek): head_dim is the rotary part's width, and must stay so
    rotary_head = d.get("head_dim") is not None and d.get("head_dim") == d.get("qk_rope_head_dim")
    full = dict(d)
    for name, value in list(d.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        new = _width(name, value)
        if new is not None and not _is_heads(name):
            d[name] = min(value, new) if name not in _HIDDEN_NAMES else new
    _shrink_value_width(d, full)
    if rotary_head:
        d["head_dim"] = d["qk_rope_head_dim"]


def _shrink_experts(d: dict) -> None:
    experts = next((d[n] for n in _EXPERTS if isinstance(d.get(n), int) and d[n] > 0), None)
    if experts is None:
        return
    new = experts if experts <= MAX_EXPERTS else 8
    for name in _EXPERTS:
        if isinstance(d.get(name), int) and d[name] > 0:
            d[name] = new
    for name in _TOP_K:
        if isinstance(d.get(name), int) and d[name] > 0:
            d[name] = min(d[name], 4, new)
    if new != experts:  # grouped routing (DeepSeek, Kimi): the groups must divide the experts
        for name in ("n_group", "num_expert_group", "topk_group"):
            if isinstance(d.get(name), int) and d[name] > 1:
                d[name] = 1


def _fix_mamba(d: dict) -> None:
    """A Mamba mixer's heads x head dim must equal expand x hidden_size."""
    for heads, head_dim, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                                    ("mamba_num_heads", "mamba_head_dim", "expand"),
                                    ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
                                    ("num_heads", "head_dim", "expand")):  # fmt: skip
        if all(isinstance(d.get(k), (int, float)) for k in (heads, expand)) and head_dim in d:
            d[head_dim] = int(d[expand] * d["hidden_size"]) // d[heads]
    if isinstance(d.get("mamba_d_ssm"), int):  # Falcon-H1: an explicit inner width
        d["mamba_d_ssm"] = d["mamba_n_heads"] * d["mamba_d_head"]
    for name in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        if isinstance(d.get(name), int) and d[name] > 1:
            d[name] = 1


def _fix_rope(d: dict) -> None:
    """Multimodal RoPE sections sum to half the rotary dim (Qwen-VL's code has a default for a
    full-size model when the config has none); MLA's qk head dim is nope + rope."""
    model_type = str(d.get("model_type", ""))
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if not isinstance(rope, dict):
            continue
        sections = rope.get("mrope_section")
        if sections is None and ("_vl" in model_type or model_type.startswith("qwen3_5")):
            sections = [1, 1, 1]
        if isinstance(sections, list) and sections and "num_attention_heads" in d:
            head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
            factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
            half = max(len(sections), int(head_dim * factor) // 2)
            new = [max(1, s * half // sum(sections)) for s in sections]
            new[-1] += half - sum(new)
            d[key] = {**rope, "mrope_section": new}
    mla = all(isinstance(d.get(k), int) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if mla and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def _fix_misc(d: dict) -> None:
    if isinstance(d.get("block_multiple_of"), int):  # LFM2 rounds its MLP width up to this
        d["block_multiple_of"] = 16
    if "out_hidden_size" in d:  # a vision merger's output is the text decoder's width
        d["out_hidden_size"] = HIDDEN
    if "attention_hidden_size" in d and isinstance(d["attention_hidden_size"], int):  # Zamba2
        d["attention_hidden_size"] = 2 * HIDDEN
    if "head_dim" in d and d["head_dim"] is None and d.get("num_attention_heads"):
        d["head_dim"] = HEAD_DIM  # Hunyuan, Ministral: None, which their attention cannot take
    if isinstance(d.get("hidden_size_per_layer_input"), int) and d["hidden_size_per_layer_input"]:
        d["hidden_size_per_layer_input"] = HEAD_DIM // 2  # Gemma 3n's per-layer embeddings
    if isinstance(d.get("num_kv_shared_layers"), int):  # the cut layers no longer share caches
        d["num_kv_shared_layers"] = 0
    experts = any(isinstance(d.get(n), int) and d[n] > 1 for n in _EXPERTS)
    if experts and "num_experts_per_tok" in d and d["num_experts_per_tok"] is None:
        d["num_experts_per_tok"] = 2


FIXES: tuple[Callable[[dict], None], ...] = (_fix_mamba, _fix_rope, _fix_misc)
"""Applied to every (sub-)config dict after the generic shrinking, in order."""


def _shrink_entry(d: dict) -> None:
    """A layer's own overrides (Gemma 4's per_layer_config entries): heads and widths only."""
    _shrink_heads(d)
    _shrink_widths(d)


def _shrink(d: dict) -> dict:
    """One config dict (and its sub-config dicts), shrunk in place and returned."""
    for value in d.values():
        if isinstance(value, dict) and "model_type" in value:
            _shrink(value)
    keep_layers(d, _shrink_entry)
    _shrink_heads(d)
    _shrink_widths(d)
    _shrink_experts(d)
    for fix in FIXES:
        fix(d)
    for name, value in list(d.items()):
        if isinstance(value, float) and re.search(r"dropout|pdrop|jitter|layerdrop$", name):
            d[name] = 0.0
    for name in _WINDOWS:
        if isinstance(d.get(name), int) and d[name] > WINDOW:
            d[name] = WINDOW
    for name in ("initializer_range", "init_std", "embedding_initializer_range"):
        if isinstance(d.get(name), float):
            d[name] = INIT_RANGE
    if "output_router_logits" in d:  # a batch-wide loss term: the reference runs per document
        d["output_router_logits"] = False
    for name in _VOCABS:
        if isinstance(d.get(name), int):
            d[name] = VOCAB
    return d


def _special_ids(d: dict, taken: dict[int, int]) -> None:
    """Token ids beyond the tiny vocabulary (image, pad, bos, eos...) -> its top SPECIAL_IDS."""
    for name, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            _special_ids(value, taken)
        elif name.endswith(("token_id", "token_index", "token_ids")):
            ids = value if isinstance(value, list) else [value]
            if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                new = [taken.setdefault(i, VOCAB - 1 - len(taken) % SPECIAL_IDS) for i in ids]
                d[name] = new if isinstance(value, list) else new[0]


def tiny_config(config: object, overrides: dict | None = None) -> object:
    """A tiny copy of a transformers `config` (module docstring); the config itself is unchanged.

    `overrides` {field: value} are set on the shrunk dict before the config's class rebuilds it
    (a sub-config as a dict): a caller's own choices, such as a family whose default config is
    no working model (the family survey's SETTINGS)."""
    d = _shrink(config.to_dict())
    _special_ids(d, {})
    d.update(overrides or {})
    tiny = type(config).from_dict(d)
    tiny.use_cache = False
    return tiny


def describe(config: object) -> str:
    """One line: model type, width, layers and their kinds, experts."""
    text = config.get_text_config()
    count = next((getattr(text, k) for k in LAYER_COUNTS if hasattr(text, k)), "?")
    kinds = next((getattr(text, k) for k in ("layer_types", "layers_block_type")
                  if isinstance(getattr(text, k, None), list)), None)  # fmt: skip
    parts = [f"{config.model_type}: hidden {getattr(text, 'hidden_size', '?')}, {count} layers"]
    if kinds:
        parts[0] += " (" + ", ".join(kinds) + ")"
    experts = next((getattr(text, n) for n in _EXPERTS if getattr(text, n, None)), None)
    if experts:
        parts.append(f"{experts} experts")
    if vision.has_other_modality(config):
        parts.append("vision tower kept")
    return ", ".join(parts)


def model_class(config: object) -> type:
    """The auto class that builds `config`: image-text-to-text for a VLM, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    if model_type in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    raise ValueError(
        f"model_type {model_type!r} ({type(config).__name__}) has no causal-LM or "
        f"image-text-to-text class in transformers; ringattn check --hf checks decoders"
    )


def build(config: object, seed: int = 0) -> torch.nn.Module:
    """The float32 model of `config` with seeded random weights, eager attention, train mode."""
    torch.manual_seed(seed)
    model = model_class(config).from_config(config, dtype=torch.float32,
                                            attn_implementation="eager")  # fmt: skip
    return model.train()


__all__ = ["build", "describe", "model_class", "tiny_config"]
