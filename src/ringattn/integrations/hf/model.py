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
"""

from __future__ import annotations

from ringattn.api import STRATEGIES
from ringattn.comm import resolve_group
from ringattn.integrations.hf.attention import ATTENTION_NAME, CONTEXT_ATTR, CPContext, register
from ringattn.layout import get_layout
from ringattn.validate import check_names


def parallelize(
    model: object,
    group: object = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    *,
    backend: str = "auto",
) -> object:
    """Make `model`'s attention exact over a sequence sharded across `group`; returns `model`.

    `model` is a transformers PreTrainedModel whose attention goes through transformers'
    AttentionInterface (Llama, Mistral, Qwen2/3, Gemma 3, gpt-oss and most recent decoders).
    `group` is a ProcessGroup, a 1-D DeviceMesh or None (the default group); `layout`, `strategy`
    and `backend` are those of `ringattn.attention`. Feed the model batches from
    `ringattn.hf.shard_batch` with the same group and layout.
    """
    get_layout(layout)
    check_names(strategy, STRATEGIES, backend)
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
    register()
    context = CPContext(group, layout, strategy, backend)
    for module in model.modules():
        setattr(module, CONTEXT_ATTR, context)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"{type(model).__name__} kept attn_implementation="
            f"{model.config._attn_implementation!r}: it does not dispatch attention through "
            f"transformers' AttentionInterface, so ringattn.hf cannot parallelize it"
        )
    return model


__all__ = ["parallelize"]
