"""The attention and mask functions registered with transformers under the name "ringattn".

A transformers decoder layer computes q, k, v for its local tokens and calls

    attn_output, _ = attention_function(module, query, key, value, attention_mask,
                                        dropout=..., scaling=..., sliding_window=..., **kwargs)

with query (B, Hq, S_local, D) and key, value (B, Hkv, S_local, D), K/V not repeated for GQA. Here
that call is `ringattn.attention` over the whole sequence: the group, layout, strategy and backend
come from the `CPContext` that `parallelize` put on the module; the global document boundaries
come from the forward kwargs (`cu_seq_lens_q`, set by `shard_batch`); the rest maps one to one.
Dynamic CP (train --hf --dynamic-cp, ContextParallelConfig(dynamic=True)) passes instead the
kwarg `ringattn_segments`: the local rows are pieces end to end, each its own packed documents
sharded over its own sub-group (models/segments.py's Segment), and each piece is one
`ringattn.attention` call over its rows with its group and cu_seqlens (the context's group is
not used). The kwarg travels as `cu_seq_lens_q` does: transformers hands its forward kwargs to
every decoder layer and on to this function.


    transformers                      ringattn.attention
    scaling                           scale
    is_causal (kwarg or module)       causal
    sliding_window = w                window = (w - 1, 0)       key visible when q - k < w
                                      (w - 1, w - 1) when not causal: |q - k| < w
    s_aux (per-head sink logits)      one more log-sum-exp term, see `_with_sinks`
    softcap (Gemma 2's                softcap: scores c * tanh(s / c), exact (the cap is
      attn_logit_softcapping)         elementwise before the softmax; kernels/softcap.py)

Masks. transformers would build a (S_local, S_local) mask from local positions, which is wrong for
a sharded sequence; ringattn masks by global position itself. The registered mask function
therefore returns None, or, when the user passed a 2-D padding mask, that mask unchanged, so that
the attention function can insist (on every rank at once) that it is all ones.

Everything unsupported raises ValueError naming the model's setting, before any communication and
on every rank (the checks depend only on the config and the call, which all ranks share).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ringattn
from ringattn.comm import all_gather_ints, resolve_group

ATTENTION_NAME = "ringattn"
CONTEXT_ATTR = "ringattn_context"
# set on an attention module that runs on the whole sequence on every rank (mixers/
# whole_attention.py: DeepSeek-V4's compressed layers): its family's own attention function,
# which this module's calls go to instead of attending across the ranks
LOCAL_ATTR = "ringattn_local_attention"
SEGMENTS_KWARG = "ringattn_segments"
"""The forward kwarg of dynamic CP: a list of models/segments.Segment covering the local rows."""


@dataclass(frozen=True)
class CPContext:
    """What `parallelize` fixes for one model: passed to every `ringattn.attention` call."""

    group: object
    layout: str
    strategy: str
    backend: str

    def __deepcopy__(self, memo: dict) -> CPContext:
        return self  # a copied model shares the process group (which cannot be copied)


def _where(module: torch.nn.Module) -> str:
    """The module for messages, with its layer index in eager. Not under torch.compile: when the
    trainer compiles each decoder layer, dynamo makes `layer_idx` a symbolic int at the second
    layer, which a traced f-string cannot format (a graph break, an error under fullgraph)."""
    layer = getattr(module, "layer_idx", None)
    if layer is None or torch.compiler.is_compiling():
        return type(module).__name__
    return f"{type(module).__name__} (layer {layer})"


def _check_call(module, query, key, attention_mask, dropout, kwargs) -> None:
    """ValueErrors for what ringattn cannot do, each naming the setting and the fix."""
    where = _where(module)
    if dropout:
        raise ValueError(
            f"{where}: attention dropout {dropout} in training (config.attention_dropout) is not "
            f"supported by ringattn.hf; set config.attention_dropout = 0.0 before parallelize, "
            f"or call model.eval()"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{where}: an additive position_bias is not supported by ringattn.hf")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        raise ValueError(
            f"{where}: got a {attention_mask.dim()}-D attention_mask of shape "
            f"{tuple(attention_mask.shape)}; ringattn.hf masks by global position itself and "
            f"takes no dense mask: pass documents as position_ids or cu_seqlens to "
            f"ringattn.hf.shard_batch"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{where}: {query.shape[2]} queries against {key.shape[2]} keys (a KV cache?); "
            f"ringattn.hf trains and scores whole sequences: call the model with use_cache=False"
        )
    if kwargs.get("cu_seq_lens_q") is None and kwargs.get(SEGMENTS_KWARG) is None:
        raise ValueError(
            f"{where}: the model was parallelized with ringattn.hf.parallelize but the batch has "
            f"no cu_seq_lens_q; build it with ringattn.hf.shard_batch (the same group and layout)"
        )


# the mask the last check passed (a weak reference) and its version then: transformers hands one
# mask object to every layer of a forward, so the layers after the first need not check it again
_LAST_CHECKED: list[tuple[weakref.ref, int]] = []


def _check_padding_mask(mask: torch.Tensor, module: torch.nn.Module, context: CPContext) -> None:
    """A 2-D padding mask must be all ones on every rank; all ranks agree before raising.

    Once per forward, not per layer: layer 0 (the first a forward runs) always checks, on every
    rank, with one host sync and one all-gather; a later layer skips a mask object (unchanged)
    that a check has passed. Every rank takes the same branch, since all run the same layers
    with the same masks. Under torch.compile the check cannot run inside the graph (it reads the
    data and communicates), so a mask there is refused at trace time: `shard_batch` checks it
    once per batch instead.
    """
    where = _where(module)
    if torch.compiler.is_compiling():
        raise ValueError(
            f"{where}: under torch.compile, give the attention_mask to ringattn.hf.shard_batch "
            f"(which checks it once per batch) and do not pass it to the model"
        )
    first = getattr(module, "layer_idx", None) in (None, 0)
    if not first and _LAST_CHECKED:
        ref, version = _LAST_CHECKED[0]
        if ref() is mask and version == mask._version:
            return
    # a 2-D mesh (strategy="hybrid") gathers over its whole flattened world
    info = resolve_group(context.group, allow_2d=True)
    bad = int(not bool(mask.all()))
    if info.world_size > 1:
        bad = max(row[0] for row in all_gather_ints([bad], info, mask.device))
    if bad:
        raise ValueError(
            f"{where}: the attention_mask has zeros (padding) on some rank; ringattn.hf takes no "
            f"dense attention_mask: drop the padding, or pack the sequences as documents "
            f"(position_ids that restart at 0, or cu_seqlens) through ringattn.hf.shard_batch"
        )
    _LAST_CHECKED[:] = [(weakref.ref(mask), mask._version)]


def ringattn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature on top of `ringattn.attention`.

    Returns (out (B, S_local, Hq, D), None); attention weights are never materialised.
    """
    context = getattr(module, CONTEXT_ATTR, None)
    if context is None:
        raise ValueError(
            f"{_where(module)} uses attn_implementation={ATTENTION_NAME!r} but its model was not "
            f"prepared with ringattn.hf.parallelize(model, ...)"
        )
    local = getattr(module, LOCAL_ATTR, None)
    if local is not None:  # the whole sequence is here (its dropout refused by whole_attention.py)
        return local(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, sliding_window=sliding_window, **kwargs)  # fmt: skip
    _check_call(module, query, key, attention_mask, dropout, kwargs)
    if attention_mask is not None:
        _check_padding_mask(attention_mask, module, context)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = None
    if sliding_window is not None and sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    sinks = kwargs.get("s_aux")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # mixed precision (a Trainer's bf16=True): cast
        # as SDPA does under autocast; RoPE in float32 leaves q, k float32 beside a bf16 v
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))

    def attend_over(q, k, v, return_lse, group, cu_seqlens):
        return ringattn.attention(
            q,
            k,
            v,
            causal=causal,
            scale=scaling,
            group=group,
            layout=context.layout,
            strategy=context.strategy,
            backend=context.backend,
            cu_seqlens=cu_seqlens,
            window=window,
            return_lse=return_lse,
            softcap=kwargs.get("softcap"),
        )

    segments = kwargs.get(SEGMENTS_KWARG)

    def attend(q, k, v, return_lse):
        if segments is None:
            return attend_over(q, k, v, return_lse, context.group, kwargs["cu_seq_lens_q"])
        return _by_segments(attend_over, q, k, v, return_lse, segments)

    width = value.shape[-1]
    if key.shape[-1] != width:  # MLA (DeepSeek, Kimi): q/k and v head dims differ; zero columns
        # on the narrower side change no score and no output column, and are cut off after
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        wide = max(key.shape[-1], width)
        query, key, value = (F.pad(t, (0, wide - t.shape[-1])) for t in (query, key, value))
    if sinks is None:
        out = attend(query, key, value, False)
    else:
        out = _with_sinks(attend, query, key, value, sinks, scaling)
    return out[..., :width].transpose(1, 2).contiguous(), None  # (B, S_local, Hq, D)


def _by_segments(attend_over, q, k, v, return_lse, segments):
    """Attention piece by piece (dynamic CP): each segment's rows [start, stop) over its group
    and documents; the outputs (and lse) end to end again. The segments must cover the local rows
    in order: every rank's come from the same schedule, so a gap is a bug, raised on every rank
    of the step alike (the check reads only the segments and the shape, before any exchange)."""
    at = 0
    for seg in segments:
        if seg.start != at or seg.stop < seg.start:
            raise ValueError(f"{SEGMENTS_KWARG}: segments must cover the local rows in order, "
                             f"got {[(s.start, s.stop) for s in segments]}")  # fmt: skip
        at = seg.stop
    if at != q.shape[2]:
        raise ValueError(f"{SEGMENTS_KWARG}: segments cover {at} rows, the batch has {q.shape[2]}")
    outs = [attend_over(q[:, :, s.start : s.stop], k[:, :, s.start : s.stop],
                        v[:, :, s.start : s.stop], return_lse, s.group, list(s.cu_seqlens))
            for s in segments]  # fmt: skip  # each (B, H, stop - start, D), lse (B, H, rows)
    if not return_lse:
        return torch.cat(outs, dim=2)  # (B, Hq, S_local, D)
    return torch.cat([o for o, _ in outs], dim=2), torch.cat([lse for _, lse in outs], dim=2)


def _with_sinks(attend, query, key, value, sinks, scaling) -> torch.Tensor:
    """Attention with one sink logit per head (gpt-oss's `s_aux`) as one more log-sum-exp term.

    A sink adds exp(s_h) to every row's softmax denominator and nothing to its numerator:
        out_sink = out * exp(lse) / (exp(lse) + exp(s_h)) = out * sigmoid(lse - s_h).
    ringattn returns lse without a gradient, so lse is made differentiable with a surrogate whose
    gradient is the true one: d lse_i / d q_i = scale * sum_j p_ij k_j and d lse_i / d k_j =
    scale * p_ij q_i, which is the gradient of scale * q_i . a_i where a = attention(q, k, values=k)
    with q and k detached in the scores (p fixed) and k live as the values. It costs one more
    attention call; padding rows have out = 0 and stay 0.
    """
    out, lse = attend(query, key, value, True)  # lse (B, Hq, S) float32, no gradient
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    keys_as_values = attend(query.detach(), key.detach(), key, False)  # (B, Hq, S, D)
    surrogate = (query.float() * keys_as_values.float()).sum(-1) * scale
    lse = lse + (surrogate - surrogate.detach())
    gate = torch.sigmoid(lse - sinks.float().view(1, -1, 1))  # (B, Hq, S)
    return (out.float() * gate.unsqueeze(-1)).to(out.dtype)


def ringattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *args,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask function for "ringattn": no mask (ringattn masks by global position).

    A user's 2-D padding mask is passed through untouched, so that the attention function, which
    knows the process group, can require it to be all ones on every rank. transformers sets
    `use_vmap` exactly when the model adds a mask overlay (`or_mask_function` /
    `and_mask_function`: Gemma 3's bidirectional image tokens, for one), which ringattn cannot
    apply: an error, not a wrong loss.
    """
    if kwargs.get("use_vmap"):
        raise ValueError(
            "the model adds a mask overlay to causal attention (or_mask_function / "
            "and_mask_function, e.g. bidirectional image tokens); ringattn.hf applies only "
            "causality, documents and sliding windows"
        )
    return attention_mask


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, ringattn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ringattn_mask)
