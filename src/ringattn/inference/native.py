"""ringattn's decoder (models/decoder.py `Transformer`) as a model `KVEngine` can drive.

KVEngine (hf/engine.py) plans each forward as segments of rows (kv_attention.py: Fresh prompts,
Decode tokens, Extend turns) and calls the model with transformers' keywords. A transformers
model reaches the cache through its attention-function hook ("ringattn-kv"); our decoder has
no hook to switch, so this module is its forward instead, with the engine's state passed in:

    forward(model, state, window, input_ids, position_ids, logits_to_keep)
        x = tok_embeddings(input_ids)                               (B, S, dim)
        per layer:  q, k, v = Attention.project(attention_norm(x), RoPE of position_ids)
                    out = kv_attention.attend(state, layer, q, k, v, window, 1/sqrt(D))
                    x = x + Attention.output(out);  x = x + feed_forward(ffn_norm(x))
        logits of the rows in `logits_to_keep` (all without it)     (B, k, vocab) float32

The model's own modules do every per-token step (embedding, norms, projections, RoPE, SwiGLU,
output); only the attend step is the engine's, the same function a transformers layer calls,
so both model kinds share the cache, the partial merges, the turns and the sampling. Positions
may differ per batch row (a decode batch: one token of each of L sequences, each at its own
position), so the RoPE angles are taken per row. `window` (earlier tokens a query sees, the
model's sliding window; None: all) is the same for every layer. `describe` tells the engine
which kind a model is, and our decoder's sizes.
"""

from __future__ import annotations

import math

import torch

from ringattn.inference.hf.kv_attention import KVState, attend
from ringattn.models.decoder import Transformer
from ringattn.models.rope import rope_angles

__all__ = ["describe", "forward"]


def describe(model: torch.nn.Module, window: object) -> tuple | None:
    """For ringattn's decoder: (layers, query heads, K/V heads, vocabulary size, choose_mode's
    head_dim and elem_bytes); None for a transformers model. `window` (earlier tokens each
    query sees, None: all; it also bounds the cache) is checked: an int >= 0, and only for
    ours (a transformers model's sliding windows are its config's)."""
    if not isinstance(model, Transformer):
        if window is not None:
            raise ValueError(
                f"window={window!r} applies to ringattn's decoder; a transformers model's "
                f"sliding windows come from its config: drop the argument"
            )
        return None
    if window is not None and not (isinstance(window, int) and window >= 0):
        raise ValueError(
            f"window must be None or an int >= 0 (earlier tokens seen), got {window!r}"
        )
    cfg = model.cfg
    sizes = {"head_dim": cfg.head_dim, "elem_bytes": model.tok_embeddings.weight.element_size()}
    return cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, sizes


@torch.no_grad()
def forward(
    model: Transformer,
    state: KVState,
    window: int | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
) -> torch.Tensor:
    """Logits (B, k, vocab) float32 of input_ids (B, S) at RoPE positions position_ids (B, S),
    every layer attending through `state`'s segments (module docstring). `logits_to_keep`:
    local row indices (k,) to project (the rows that end a prompt); None: every row. The
    transformers varlen keywords (`cu_seq_lens_*`, `max_length_*`) say what the segments say
    already: accepted so that the engine calls both model kinds alike, and unused."""
    cfg = model.cfg
    cos, sin = rope_angles(position_ids.flatten(), cfg.head_dim, cfg.rope_theta)  # (B*S, D/2)
    cos, sin = (t.view(*position_ids.shape, -1)[:, None] for t in (cos, sin))  # (B, 1, S, D/2)
    scale = 1.0 / math.sqrt(cfg.head_dim)  # the training forward's (resolve.py)
    x = model.tok_embeddings(input_ids)  # (B, S, dim)
    for index, layer in enumerate(model.layers):
        q, k, v = layer.attention.project(layer.attention_norm(x), cos, sin)  # (B, H, S, D)
        out, _ = attend(state, index, q, k, v, window, scale)  # (B, Hq, S, D)
        x = x + layer.attention.output(out, x.dtype)  # merged partials are float32: cast back
        x = x + layer.feed_forward(layer.ffn_norm(x))
    if logits_to_keep is not None:
        x = x[:, logits_to_keep]  # (B, k, dim)
    return model.output(model.norm(x)).float()  # (B, k, vocab)
