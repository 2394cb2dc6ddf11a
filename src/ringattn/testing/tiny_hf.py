"""A transformers config shrunk to a tiny width, keeping what makes the model what it is.

`ringattn check --hf` runs a real model family through context parallelism on a CPU in seconds,
so it takes the family's config and keeps its *structure* while dropping its *size*:

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

1. Layers. Each layer gets a signature: its entry in every per-layer list (a list of length
   num_hidden_layers), whether it is in every layer-index list (increasing ints below that
   count), and where it falls in every period (jamba's `attn_layer_period`/`_offset`,
   `decoder_sparse_step`, `first_k_dense_replace`...). The kept layers are the shortest prefix
   that shows every signature (at least 2 layers), and the lists are re-indexed to them.
2. Widths. Every int whose name says it is a width (`*_size`, `*_dim`, `*heads`, `*_rank`,
   `*state*`) is set to a small value by its kind; names that are not widths (kernels, patches,
   windows, chunks, blocks, positions) keep theirs.
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

HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
FFN = 96
RANK = 16
WINDOW = 8
_WINDOWS = ("sliding_window", "attention_chunk_size")
VOCAB = 256
MAX_LAYERS = 8
MAX_EXPERTS = 16
INIT_RANGE = 0.1
"""initializer_range of the tiny model: large enough that every layer changes the loss."""
SPECIAL_IDS = 16
"""The top ids of the tiny vocabulary are kept for special tokens (image, pad, bos, eos...)."""

_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "depth")
_LAYER_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern")
_NOT_WIDTH = re.compile(
    r"conv|kernel|patch|chunk|window|block_size|merge|position|image_size|cache|temporal|"
    r"vocab|batch|max_|bucket|num_labels|multiple_of"
)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")


def _is_heads(name: str) -> bool:
    return name.endswith("heads") or name in ("n_head", "num_query_groups")


def _signatures(d: dict, count: int, per_layer: list[str], indexed: list[str]) -> list[tuple]:
    """One hashable signature per layer (module docstring, step 1)."""
    periods = []
    for name, value in d.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            continue
        if name.endswith("_period"):
            offset = d.get(name.removesuffix("_period") + "_offset", 0) or 0
            periods.append(lambda i, p=value, o=offset: i % p == o % p)
        elif name.endswith(("_step", "_interval", "_freq")):
            periods.append(lambda i, p=value: (i + 1) % p == 0)
    if isinstance(d.get("first_k_dense_replace"), int):
        periods.append(lambda i, k=d["first_k_dense_replace"]: i >= k)
    sets = [set(d[name]) for name in indexed]
    return [
        (
            tuple(repr(d[name][i]) for name in per_layer),
            tuple(i in s for s in sets),
            tuple(f(i) for f in periods),
        )
        for i in range(count)
    ]


def _keep_layers(d: dict) -> None:
    """Cut the layers to the shortest prefix showing each kind of layer, in place."""
    key = next((k for k in _LAYER_COUNTS if isinstance(d.get(k), int)), None)
    if key is not None:
        count = d[key]
    else:  # Nemotron-H: the count is a property, the length of its layer list
        lists = [d[k] for k in _LAYER_LISTS if isinstance(d.get(k), (list, str))]
        if not lists:
            return
        count = len(lists[0])
    per_layer, indexed = [], []
    for name, value in d.items():
        if isinstance(value, (list, str)) and len(value) == count and name != key:
            if isinstance(value, str) and "pattern" not in name:
                continue  # a string of that length by chance, not a per-layer pattern
            items = list(value)
            if all(isinstance(x, int) for x in items) and items == sorted(set(items)):
                indexed.append(name)  # 0..count-1: an index list and a per-layer list alike
            else:
                per_layer.append(name)
        elif (isinstance(value, list) and value and all(isinstance(x, int) for x in value)
              and value == sorted(set(value)) and value[-1] < count
              and re.search(r"layer|idx|indices|ids|indexes", name)):  # fmt: skip
            indexed.append(name)
    signatures = _signatures(d, count, per_layer, indexed)
    first_seen = sorted({s: i for i, s in reversed(list(enumerate(signatures)))}.values())
    prefix = max(first_seen[-1] + 1 if first_seen else 1, min(2, count))  # 2: layers compose
    keep = list(range(prefix)) if prefix <= MAX_LAYERS else first_seen
    if key is not None:
        d[key] = len(keep)
    for name in per_layer:
        kept = [d[name][i] for i in keep]
        d[name] = "".join(kept) if isinstance(d[name], str) else kept
    for name in indexed:
        d[name] = [keep.index(i) for i in d[name] if i in keep]


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
    if name == "hidden_size":
        return HIDDEN
    if _NOT_WIDTH.search(name):
        return None
    if "intermediate" in name or "ffn" in name or name in ("d_ff", "n_inner"):
        return FFN
    if "rope" in name and "dim" in name:
        return HEAD_DIM // 2
    if "head_dim" in name or name.endswith(("_d_head", "headdim", "kv_channels")):
        return HEAD_DIM
    if "state" in name and name.endswith(("_size", "_state", "_dim")):
        return RANK
    if name.endswith("_rank"):
        return RANK
    if name.endswith(("_size", "_dim")) and value > HIDDEN:
        return HIDDEN
    return None


def _shrink_widths(d: dict) -> None:
    # MLA (DeepSeek): head_dim is the rotary part's width, and must stay so
    rotary_head = d.get("head_dim") is not None and d.get("head_dim") == d.get("qk_rope_head_dim")
    for name, value in list(d.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        new = _width(name, value)
        if new is not None and not _is_heads(name):
            d[name] = min(value, new) if name != "hidden_size" else new
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


FIXES: tuple[Callable[[dict], None], ...] = (_fix_mamba, _fix_rope, _fix_misc)
"""Applied to every (sub-)config dict after the generic shrinking, in order."""


def _shrink(d: dict) -> dict:
    """One config dict (and its sub-config dicts), shrunk in place and returned."""
    for value in d.values():
        if isinstance(value, dict) and "model_type" in value:
            _shrink(value)
    _keep_layers(d)
    _shrink_heads(d)
    _shrink_widths(d)
    _shrink_experts(d)
    for fix in FIXES:
        fix(d)
    for name, value in list(d.items()):
        if ("dropout" in name or "jitter" in name) and isinstance(value, float):
            d[name] = 0.0
    for name in _WINDOWS:
        if isinstance(d.get(name), int) and d[name] > WINDOW:
            d[name] = WINDOW
    if "initializer_range" in d:
        d["initializer_range"] = INIT_RANGE
    if "output_router_logits" in d:  # a batch-wide loss term: the reference runs per document
        d["output_router_logits"] = False
    if isinstance(d.get("vocab_size"), int):
        d["vocab_size"] = VOCAB
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


def tiny_config(config: object) -> object:
    """A tiny copy of a transformers `config` (module docstring); the config itself is unchanged."""
    d = _shrink(config.to_dict())
    _special_ids(d, {})
    tiny = type(config).from_dict(d)
    tiny.use_cache = False
    return tiny


def describe(config: object) -> str:
    """One line: model type, width, layers and their kinds, experts."""
    text = config.get_text_config()
    count = next((getattr(text, k) for k in _LAYER_COUNTS if hasattr(text, k)), "?")
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
