"""A small Llama-style decoder whose attention is `ringattn.attention`.

    tokens (B, S) -> embedding -> n_layers x Block -> RMSNorm -> output projection -> logits
                                                           or, with labels, a chunked loss

    Block:  x = x + Attention(RMSNorm(x))      RoPE from each token's GLOBAL position, GQA
            x = x + SwiGLU(RMSNorm(x))         w2(silu(w1 x) * w3 x)

    Attention.forward = output(attend(project(x)))
        project   q, k, v of the normed hidden states, RoPE applied        (B, H, S, D)
        attend    ringattn.attention over the group's tokens (KV-cache decoding,
                  inference/native.py, replaces only this step)
        output    the output projection back to the residual stream        (B, S, dim)

The model is plain single-device code: every layer but attention works token by token, so it
runs unchanged on a shard of the sequence. Context parallelism is applied from outside (gpt-fast
style) by `set_context_parallel(model, group, layout, strategy)`, which tells each attention layer
which process group and layout the local tokens belong to; the caller then feeds each rank its
shard of the tokens together with their global positions (`ringattn.shard` / `ringattn.positions`).
Without it, attention runs on one process with the contiguous layout (any sequence length).
`set_tiled_mlp(model, tokens)` runs each MLP over the rows in tiles, recomputed in backward
(models/tiled.py), so only one tile's intermediates are alive.
`set_segments(model, segments)` (models/segments.py) instead makes attention run piece by piece
over the local rows, each piece its own packed documents and process group (dynamic CP).
The shape is models/config.py's; RoPE, RMSNorm and the chunked loss are models/rope.py, norm.py,
loss.py; the tensor and pipeline plans are models/tensor_parallel.py and pipeline.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringattn import attention
from ringattn.models.config import ModelConfig
from ringattn.models.loss import auto_chunk, chunked_cross_entropy
from ringattn.models.norm import RMSNorm
from ringattn.models.offload import ActivationOffload
from ringattn.models.rope import apply_rope, rope_angles
from ringattn.models.segments import Segment, attend_segments
from ringattn.models.tiled import check_tile, tiled_rows

__all__ = ["Attention", "Block", "Transformer", "set_context_parallel", "set_tiled_mlp"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # where the local tokens come from: see set_context_parallel
        self.group: object = None
        self.layout = "contiguous"
        self.strategy = "ring"
        # packed documents in pieces over sub-groups (models/segments.py: set_segments); None:
        # the local rows are one dense shard of `group`
        self.segments: list[Segment] | None = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, Hq, S, D), k, v (B, Hkv, S, D) of the normed hidden states x (B, S, dim), RoPE
        applied to q and k. The heads come from the projections' width: all of them here, a tp
        rank's share under tensor parallelism."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output projection of out (B, Hq, S, D), cast to `dtype` first when given (the
        KV-cache engine's merged partials are float32)."""
        b, _, s, _ = out.shape
        out = out if dtype is None else out.to(dtype)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if self.segments is not None:
            out = attend_segments(q, k, v, self.segments, self.layout, self.strategy)
            return self.output(out)  # (B, S, dim)
        out = attention(
            q, k, v, causal=True, group=self.group, layout=self.layout, strategy=self.strategy
        )  # (B, H, S, D)
        return self.output(out)  # (B, S, dim)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.tile = 0  # tokens per tile of the tiled MLP (models/tiled.py); 0: untiled

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tile:
            return self.swiglu(x)
        rows = x.reshape(-1, x.shape[-1])  # (B*S, dim): every token a row
        out = tiled_rows(self.swiglu, [rows], self.tile, list(self.parameters()))
        return out.view(x.shape)  # (B, S, dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder: `forward(tokens, positions)` gives logits; `forward(tokens, positions, labels)`
    gives the summed loss (see forward)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # memory levers, set from outside like the context-parallel options
        self.checkpoint_blocks = False  # recompute each block in backward instead of saving it
        # with checkpoint_blocks: keep each block's input in host memory (models/offload.py)
        self.offload_activations = False
        # tokens per chunk of the output projection + loss (0 = one chunk): loss.py's rule
        self.loss_chunk = auto_chunk(cfg.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * n_layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = 0.02
                if name.endswith(("wo.weight", "w2.weight")):
                    std /= (2 * self.cfg.n_layers) ** 0.5
                nn.init.normal_(p, std=std)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (B, S) int64; positions (S,) global index of each column (shared by the batch).

        Without labels: logits (B, S, vocab) in float32. With labels (B, S), IGNORE where not
        supervised: (sum of the token losses, number of supervised tokens, number predicted
        right), summed here, never averaged: the caller divides by the count over all ranks.
        """
        cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)  # (S, D/2)
        x = self.tok_embeddings(tokens)  # (B, S, dim)
        offload = ActivationOffload() if self.offload_activations else nullcontext()
        for layer in self.layers:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                with offload:  # sees the checkpoint's saved inputs only (models/offload.py)
                    x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        x = self.norm(x)
        if labels is None:
            return self.output(x).float()  # (B, S, vocab)
        hidden, labels = x.flatten(0, 1), labels.flatten()  # (B*S, dim), (B*S,)
        return chunked_cross_entropy(hidden, self.output, labels, self.loss_chunk)


def set_context_parallel(
    model: nn.Module, group: object, layout: str = "zigzag", strategy: str = "ring"
) -> None:
    """Make every attention layer of `model` context-parallel over `group` (a process group or
    1-D DeviceMesh; a 2-D one for strategy="hybrid"), for tokens sharded with `layout`."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.group, module.layout, module.strategy = group, layout, strategy


def set_tiled_mlp(model: nn.Module, tile: int) -> None:
    """Run every block's MLP of `model` over its rows in tiles of `tile` tokens, each tile
    recomputed in backward (models/tiled.py; exact); 0 turns it off."""
    check_tile(tile)
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.tile = tile
