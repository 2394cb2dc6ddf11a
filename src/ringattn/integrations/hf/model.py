"""`parallelize`: switch a transformers model to context-parallel attention, in place.

    model = AutoModelForCausalLM.from_config(cfg)
    ringattn.hf.parallelize(model, group=None, layout="zigzag", strategy="ring")

Three steps, all through transformers' public API: register the "ringattn" attention and mask
functions (`AttentionInterface.register`, `AttentionMaskInterface.register`), put one `CPContext`
(group, layout, strategy, backend) on every submodule of the model as the attribute
`ringattn_context` (the attention function receives its module and reads it there: the state
belongs to this model, two models can use two different groups), and
`model.set_attn_implementation("ringattn")`. The per-token layers need nothing: they run on the
local tokens as they are.

Two more kinds of model get one hook each (public `register_forward_hook` /
`register_forward_pre_hook`, no patching): a MoE model's router load-balancing loss is recomputed
over the whole sequence (moe.py), and a vision-language model keeps its vision tower's own
attention (only the text config is switched) while a pre-hook on its text decoder cuts the merged
embeddings and positions into this rank's rows (vision.py). With `expert_group`, each MoE layer's
experts module keeps a slice of the experts and two hooks send tokens to them (experts.py).
A hybrid model's recurrent and convolutional mixers (Mamba, gated DeltaNet, short convolutions)
get two hooks each that run them on the whole sequence (mixers/hooks.py); a module that mixes tokens
and is not on mixers/hooks.py's allow-list makes parallelize raise, naming its class and layer.
"""

from __future__ import annotations

from ringattn.api import STRATEGIES
from ringattn.comm import resolve_group
from ringattn.integrations.hf import experts, families, mixers, moe, vision
from ringattn.integrations.hf.attention import ATTENTION_NAME, CONTEXT_ATTR, CPContext, register
from ringattn.integrations.hf.levers import tiled
from ringattn.layout import get_layout
from ringattn.models.tiled import check_tile
from ringattn.validate import check_names


def parallelize(
    model: object,
    group: object = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    *,
    backend: str = "auto",
    router_group: object = None,
    expert_group: object = None,
    mixer_scheme: str = "auto",
    tiled_mlp: int = 0,
) -> object:
    """Make `model`'s attention exact over a sequence sharded across `group`; returns `model`.

    `model` is a transformers PreTrainedModel whose attention goes through transformers'
    AttentionInterface (Llama, Mistral, Qwen2/3, Gemma 3, gpt-oss and most recent decoders).
    `group` is a ProcessGroup, a 1-D DeviceMesh or None (the default group); `layout`, `strategy`
    and `backend` are those of `ringattn.attention`. Feed the model batches from
    `ringattn.hf.shard_batch` with the same group and layout.

    MoE models: with `output_router_logits`, the router load-balancing loss is taken over the
    tokens of `router_group` (default: `group`; a trainer passes its whole dp x cp world to get
    the global batch's) and each rank adds its share (moe.py). Vision-language models (Qwen2-VL,
    LLaVA): the vision tower keeps its attention; the text decoder gets ringattn's (vision.py).

    Expert parallelism: with `expert_group` (a ProcessGroup or 1-D DeviceMesh; default None =
    every rank holds every expert), each MoE layer's experts are split over that group and
    every token goes to the rank holding its expert and back (experts.py). The expert count
    must be divisible by the group's size. Expert weights become this rank's slice (same names).

    Hybrid models: `mixer_scheme` picks how each recurrent or convolutional mixer runs across
    the ranks: "state" (each rank its own tokens, states passed between ranks), "heads" (each
    rank 1/W of the heads on the whole sequence), "whole" (every rank the whole sequence), or
    "auto" (the first of those that the mixer and layout can run exactly). A mixer that cannot
    run the one asked for falls back the same way; `ringattn.integrations.hf.mixers.schemes`
    names what each layer runs.

    Tiled MLP: with `tiled_mlp=T` (tokens), each allow-listed MLP and experts module runs over
    this rank's rows in tiles of T, each recomputed in backward (levers/tiled.py; exact); a
    feed-forward module off that list is refused by name. 0 (the default) leaves them whole.
    """
    get_layout(layout)
    check_names(strategy, STRATEGIES, backend)
    mixers.check_scheme(mixer_scheme)
    resolve_group(group, allow_2d=strategy == "hybrid")
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(
            f"parallelize takes a transformers PreTrainedModel, got {type(model).__name__}"
        )
    text_config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    )
    for config in {id(c): c for c in (model.config, text_config) if c is not None}.values():
        chunk = getattr(config, "attention_chunk_size", None)
        if chunk is not None:
            raise ValueError(
                f"{type(model).__name__}: chunked attention (config.attention_chunk_size={chunk}) "
                f"is not supported by ringattn.hf; transformers applies it only through its masks"
            )
    multimodal = vision.is_multimodal(model)
    if multimodal:
        vision.check_family(model)  # the VLM allow-list
    else:
        families.check_family(model)  # the text allow-list: an unlisted family is refused
        families.install_guards(model)  # a listed family's non-exact mode, refused per forward
    # the text side only: a vision tower keeps its own (whole-image) convolutions and attention
    text_root = model.get_decoder() if multimodal else model
    found_mixers = mixers.find_mixers(text_root)  # refuses an unknown token mixer, changes nothing
    resolve_group(router_group)
    check_tile(tiled_mlp)
    if tiled_mlp:
        tiled.tiled_modules(text_root)  # refuses a feed-forward off the allow-list, changes nothing
    register()
    context = CPContext(group, layout, strategy, backend)
    for module in model.modules():
        setattr(module, CONTEXT_ATTR, context)
    model.set_attn_implementation(vision.text_attention(model, ATTENTION_NAME))
    kept = model.config.get_text_config()._attn_implementation
    if kept != ATTENTION_NAME:
        raise ValueError(
            f"{type(model).__name__} kept attn_implementation={kept!r}: it does not dispatch "
            f"attention through transformers' AttentionInterface, so ringattn.hf cannot "
            f"parallelize it"
        )
    if found_mixers:
        mixers.install(model, text_root, found_mixers, mixer_scheme)
    if expert_group is not None:
        experts.shard_experts(model, expert_group)  # checks every layer before it changes any
    moe.install(model, group if router_group is None else router_group)
    tiled.install_tiled_mlp(text_root, tiled_mlp)
    if multimodal:
        vision.install(model)
    return model


__all__ = ["parallelize"]
