"""Attention layers that run on the whole sequence: DeepSeek-V4's compressed attention.

DeepSeek-V4's compressed layers (layer_types `compressed_sparse_attention`, CSA, and
`heavily_compressed_attention`, HCA) attend, beside a sliding window of each query's recent
tokens, to pooled keys that the layer builds from the sequence itself:

    tokens    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | ...    windows of m = config.compress_rates[type]
    entry w   a softmax-gated sum of window w's tokens (CSA: and window w-1's, overlapping),
              RoPE at position w * m
    query t   sees entry w once its window is complete: (w + 1) * m <= t + 1
    CSA       an indexer scores every complete entry for each query and keeps its top
              config.index_topk: a selection over the whole sequence

A window spans shards and the selection reads every entry, so no rank can build them from its
shard. The module's own forward (`DeepseekV4Attention`: its compressor, indexer and attention)
runs on the whole sequence instead, as hooks.py runs a recurrent mixer: the pre-hook gathers its
input, one batch row per packed document, and the hook keeps this rank's rows of its output.
Unlike a mixer, this module is the attention itself, so what it reads besides hidden_states is
per token too and travels the same way (`document_kwargs`):

    position_ids          gathered: the global positions, restarting at each document (the
                          compressor's causality and the indexer's query RoPE read them; the
                          windows count from each row's first token, as in one process)
    position_embeddings   this layer's (cos, sin), gathered with them (the model computed them
                          from the global positions): one all-gather of S x (rope_dim + 1)
    attention_mask        (n_docs, 1, L, L) causal and sliding window (a key is visible when
                          q - k < window), transformers' eager mask; the module appends its
                          compressed entries' bias (causality, the indexer's picks) to it
    the attention call    the family's own eager_attention_forward (with its sinks):
                          ringattn's attention function hands it over (`LOCAL_ATTR`)

Exact: every token's output is the module's own on its document, and right padding comes after
each document's last token, so no real query sees a padded key or a window that holds one.
Cost: each rank runs the layer on the whole sequence (W times one shard's compute and
activations), plus hooks.py's all-gather of S x hidden forward and reduce-scatter of its gradient.
DeepSeek-V4's sliding-only layers (`sliding_attention`) are not listed and go through ringattn's
attention (sliding window and sinks) like any other family's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from ringattn.comm import GroupInfo
from ringattn.integrations.hf.mixers.comm import gather_rows
from ringattn.packing import Placement

# class name -> which of its instances run whole (the others go through ringattn's attention)
WHOLE_ATTENTION: dict[str, Callable[[nn.Module], bool]] = {
    "DeepseekV4Attention": lambda module: getattr(module, "compressor", None) is not None,
}


def runs_whole(module: nn.Module) -> bool:
    """False for an instance of a listed attention class that ringattn's attention handles."""
    test = WHOLE_ATTENTION.get(type(module).__name__)
    return test is None or test(module)


def local_attention(module: nn.Module) -> Callable:
    """The family's own eager attention function (its modeling file's eager_attention_forward),
    which ringattn's attention function calls for this module instead of attending across ranks."""
    return vars(sys.modules[type(module).__module__])["eager_attention_forward"]


def check_whole(module: nn.Module, where: str) -> None:
    """ValueError, before the gather, for what the run on the documents cannot reproduce: dropout
    in training (each rank would draw its own masks over the whole sequence)."""
    dropout = getattr(module, "attention_dropout", 0.0) if module.training else 0.0
    if dropout:
        raise ValueError(
            f"{where}: attention dropout {dropout} in training (config.attention_dropout) is not "
            f"supported by ringattn.hf; set config.attention_dropout = 0.0 before parallelize, "
            f"or call model.eval()"
        )


def to_documents(full: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(1, S, ...) documents end to end -> (n_docs, L_max, ...), each row right-padded with 0."""
    longest = max(lengths)
    rows = []
    for part in full.split(lengths, dim=1):
        pad = part.new_zeros((1, longest - part.shape[1], *part.shape[2:]))
        rows.append(torch.cat([part, pad], dim=1))
    return torch.cat(rows, dim=0)


def _mask(length: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    """(L, L) additive mask: 0 where a key is visible (k <= q, q - k < window), else the dtype's
    minimum, as transformers' eager masks."""
    q = torch.arange(length, device=like.device)
    distance = q[:, None] - q[None, :]  # (L, L) q - k
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    mask = torch.zeros(length, length, dtype=like.dtype, device=like.device)
    return mask.masked_fill(~visible, torch.finfo(like.dtype).min)


def document_kwargs(
    module: nn.Module,
    arguments: dict,
    x_local: torch.Tensor,
    placement: Placement,
    info: GroupInfo,
    lengths: list[int],
) -> dict:
    """The module's per-token arguments for its run on the documents (module docstring)."""
    rope = module.rope_layer_type
    cos, sin = arguments["position_embeddings"][rope]  # (1, S_local, rope_dim / 2) each
    position_ids = arguments["position_ids"]  # (1, S_local)
    half = cos.shape[-1]
    # one gather: float64 holds the float32 cos/sin and every position exactly
    local = torch.cat([cos[0].double(), sin[0].double(), position_ids[0, :, None].double()], -1)
    full = to_documents(gather_rows(local, placement, info)[None], lengths)  # (n_docs, L, r + 1)
    cos_docs = full[..., :half].to(cos.dtype)
    sin_docs = full[..., half : 2 * half].to(sin.dtype)
    mask = _mask(full.shape[1], getattr(module, "sliding_window", None), x_local)
    return {
        "position_embeddings": {rope: (cos_docs, sin_docs)},
        "position_ids": full[..., -1].long(),  # (n_docs, L)
        "attention_mask": mask.expand(full.shape[0], 1, -1, -1),  # (n_docs, 1, L, L)
    }
