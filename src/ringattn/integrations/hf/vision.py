"""Vision-language models: the vision tower sees whole images, the text decoder one shard.

A transformers VLM's forward (Qwen2-VL, LLaVA) runs in three stages; ringattn enters at the third:

    1. vision tower    pixel_values -> image embeddings        its own attention (eager/SDPA),
                                                               the whole images, on every rank
    2. merge           embeddings scattered into inputs_embeds at the image tokens, and the
                       positions computed on the FULL sequence (Qwen2-VL: 3-D M-RoPE t/h/w rows
                       from image_grid_thw and mm_token_type_ids; LLaVA: 0..S-1)
    3. text decoder    a forward pre-hook on it (`register_forward_pre_hook(with_kwargs=True)`)
                       cuts inputs_embeds (1, S, H) and position_ids (.., 1, S) into this rank's
                       rows in layout order (`ringattn.positions`, padding rows: zero embedding,
                       position 0); its attention is ringattn's, exact over the whole sequence

So `shard_batch` leaves input_ids, pixel values and the token-type ids whole (the model needs the
whole sequence to place the images and to number the positions) and shards only the labels,
shifted on the global sequence as for text. The logits come out per rank, and the loss summed
over the group is the single-device loss; the vision tower's gradient on each rank comes from
this rank's image tokens only, so the summed gradients are the single-device ones.

Cost: every rank runs the whole vision tower on every image (its FLOPs and activations do not
shrink with W); only the text decoder's are divided by W. Sharding frames across ranks is a later
step.

Families: a VLM must merge image features into `inputs_embeds` before a causal text decoder
(`model.get_decoder()`) that takes them by keyword. Those tested are in `FAMILIES`; families whose
text attention is not plain causal (Gemma 3 and PaliGemma: image tokens attend each other both
ways; Mllama: cross-attention layers) or that feed the decoder more per-token inputs (Qwen3-VL's
deepstack embeddings) raise ValueError naming the setting.
"""

from __future__ import annotations

import torch

import ringattn
from ringattn.integrations.hf.attention import CONTEXT_ATTR

FAMILIES = ("qwen2_vl", "llava")  # config.model_type of the VLMs checked against one device
_REFUSED = {
    "gemma3": "image tokens attend each other bidirectionally (token_type_ids mask overlay)",
    "paligemma": "the image and prefix tokens attend bidirectionally (token_type_ids)",
    "gemma3n": "image and audio tokens attend bidirectionally (token_type_ids mask overlay)",
    "mllama": "its text decoder cross-attends to the image (cross_attention_layers)",
    "qwen3_vl": "its decoder adds deepstack visual embeddings at visual_pos_masks per layer",
    "qwen3_vl_moe": "its decoder adds deepstack visual embeddings at visual_pos_masks per layer",
}
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
    "image_sizes",
)
DECODER_PARTS = ("attn_config", "ffn_config")  # sub-configs of a text decoder's layers
KV_STATE_ATTR = "ringattn_kv_state"  # generate.py's per-call state (the decoder reads it)


def is_multimodal(model: torch.nn.Module) -> bool:
    """True for a model whose config has a non-text part (`has_other_modality`)."""
    return has_other_modality(model.config)


def has_other_modality(config: object) -> bool:
    """True for a composite config with a non-text part (vision_config, audio_config, ...).

    Sub-configs that configure the text decoder's own layers (`DECODER_PARTS`: DBRX's attn_config
    and ffn_config, MPT's attn_config) are no other modality: such a model is a text model, and
    its family is checked by families.py (which names its real reason when it refuses one)."""
    sub_configs = getattr(config, "sub_configs", {}) or {}
    return any(key != "text_config" and key not in DECODER_PARTS for key in sub_configs)


def check_family(model: torch.nn.Module) -> None:
    """ValueError unless `model` is a VLM family whose merged embeddings ringattn can split."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in FAMILIES:
        for key in model.config.sub_configs:
            implementation = getattr(getattr(model.config, key, None), "_attn_implementation", "")
            if key != "text_config" and "flash" in str(implementation):
                # the tower would get shard_batch's cu_seq_lens_q beside its own (a TypeError)
                raise ValueError(
                    f"{type(model).__name__}: {key} uses attn_implementation="
                    f"{implementation!r}, which takes the text's document bounds as its own; "
                    f"give the vision tower sdpa or eager: model.set_attn_implementation("
                    f"{{{key!r}: 'sdpa'}}) before parallelize"
                )
        return
    reason = _REFUSED.get(model_type, "this family has not been checked against one device")
    raise ValueError(
        f"{type(model).__name__} (config.model_type={model_type!r}): {reason}, so ringattn.hf "
        f"cannot give it the single-device loss; vision-language families supported: "
        f"{list(FAMILIES)}"
    )


def text_attention(model: torch.nn.Module, name: str) -> str | dict:
    """The `set_attn_implementation` argument that gives `name` to the text decoder only."""
    if not is_multimodal(model):
        return name
    text = model.config.get_text_config()
    keys = [k for k in model.config.sub_configs if getattr(model.config, k, None) is text]
    if not keys:
        raise ValueError(
            f"{type(model).__name__}: cannot find its text config among "
            f"{list(model.config.sub_configs)}"
        )
    return {keys[0]: name}


def install(model: torch.nn.Module) -> None:
    """Put the sequence-cutting pre-hook on the text decoder of a VLM (once)."""
    decoder = model.get_decoder()
    if not getattr(decoder, "_ringattn_cut_hooked", False):
        decoder.register_forward_pre_hook(_cut, with_kwargs=True)
        decoder._ringattn_cut_hooked = True


def _take(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x's rows `index` along `dim`, zero where index is -1 (padding)."""
    index = index.to(x.device)
    taken = x.index_select(dim, index.clamp(min=0))
    keep = (index >= 0).view([-1 if d == dim % x.dim() else 1 for d in range(x.dim())])
    return torch.where(keep, taken, torch.zeros((), dtype=x.dtype, device=x.device))


def _cut(module, args, kwargs):
    """Pre-hook: whole-sequence inputs_embeds and position_ids -> this rank's rows."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is None or args:
        return None
    state = getattr(module, KV_STATE_ATTR, None)
    if state is not None:  # ringattn.hf.generate
        if state.real is None:  # decoding: one new token, the same on every rank
            return None
        index = state.positions
    else:
        context, bounds = getattr(module, CONTEXT_ATTR, None), kwargs.get("cu_seq_lens_q")
        if context is None or bounds is None:
            return None
        seq_len = int(bounds[-1])
        if embeds.shape[1] != seq_len:
            return None  # already this rank's tokens (a text-only batch)
        index = ringattn.positions(
            seq_len, group=context.group, layout=context.layout, cu_seqlens=bounds
        )
        identity = torch.arange(seq_len, device=index.device)
        if len(index) == seq_len and not torch.equal(index, identity):
            raise ValueError(
                f"{type(module).__name__}: a {seq_len}-token sequence leaves each rank "
                f"{seq_len} rows (mostly padding), so ringattn.hf cannot tell a whole sequence "
                f"from a shard; use a longer sequence or fewer ranks"
            )
    seq_len = embeds.shape[1]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq_len, device=embeds.device).unsqueeze(0)  # (1, S)
    if state is not None:
        state.next_position = int(positions.max()) + 1  # the first decoded token's position
    kwargs = {
        **kwargs,
        "inputs_embeds": _take(embeds, index, 1),
        "position_ids": _take(positions, index, -1),
    }
    return args, kwargs


__all__ = ["FAMILIES", "MULTIMODAL_KEYS", "check_family", "install", "is_multimodal"]
