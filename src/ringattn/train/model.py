"""A small Llama-style decoder whose attention is `ringattn.attention`.

    tokens (B, S) -> embedding -> n_layers x Block -> RMSNorm -> output projection -> logits
                                                           or, with labels, a chunked loss

    Block:  x = x + Attention(RMSNorm(x))      RoPE from each token's GLOBAL position, GQA
            x = x + SwiGLU(RMSNorm(x))         w2(silu(w1 x) * w3 x)

The model is plain single-device code: every layer but attention works token by token, so it
runs unchanged on a shard of the sequence. Context parallelism is applied from outside (gpt-fast
style) by `set_context_parallel(model, group, layout, strategy)`, which tells each attention layer
which process group and layout the local tokens belong to; the caller then feeds each rank its
shard of the tokens together with their global positions (`ringattn.shard` / `ringattn.positions`).
Without it, attention runs on one process with the contiguous layout (any sequence length).

RoPE angles are computed per call from the positions passed in, never from a table indexed by
local row: on rank r, local row i holds global token positions[i], and that is the rotation it
must get for attention to equal the single-device model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringattn import attention
from ringattn.train.data import IGNORE

__all__ = ["MODEL_SIZES", "ModelConfig", "Transformer", "model_config", "set_context_parallel"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. Byte-level tokens by default (vocab 256)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    """Key/value heads (GQA): n_heads must be a multiple; K/V travel unrepeated in the ring."""
    ffn_dim: int = 0
    """SwiGLU hidden size; 0 means Llama's 8/3 * dim rounded up to a multiple of 32."""
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim or -(-(8 * self.dim // 3) // 32) * 32

    def check(self) -> None:
        """Raise ValueError naming the fields that do not fit together."""
        if self.dim % self.n_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by {self.n_heads} heads")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.n_heads} heads are not a multiple of {self.n_kv_heads} kv heads; "
                f"pick kv heads among the divisors of {self.n_heads}"
            )


MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "small": ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2),
    "base": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4),
    "large": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4),
}


def model_config(size: str, **overrides: float) -> ModelConfig:
    """The preset `size` with the non-zero `overrides` applied, checked."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(MODEL_SIZES)}")
    cfg = replace(MODEL_SIZES[size], **{k: v for k, v in overrides.items() if v})
    cfg.check()
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_angles(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, head_dim/2) in float32 for integer positions (S,); padding (-1) gets 0."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device) / head_dim)
    angles = positions.clamp(min=0).double()[:, None] * inv_freq.double()[None]  # (S, D/2)
    return angles.cos().float(), angles.sin().float()  # float64 angles: exact at 64k positions


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, H, S, D) by the angles for each row."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (B, H, S, D/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, S, D/2, 2)
    return out.flatten(-2).type_as(x)  # (B, H, S, D)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the projections' width: all of them here, a tp rank's share under TP
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(
            q, k, v, causal=True, group=self.group, layout=self.layout, strategy=self.strategy
        )  # (B, H, S, D)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (B, S, dim)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
        self.loss_chunk = 4096  # tokens per chunk of the output projection + loss; 0 = one chunk
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
        for layer in self.layers:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        x = self.norm(x)
        if labels is None:
            return self.output(x).float()  # (B, S, vocab)
        hidden, labels = x.flatten(0, 1), labels.flatten()  # (B*S, dim), (B*S,)
        return chunked_cross_entropy(hidden, self.output, labels, self.loss_chunk)


def _chunk_loss(
    hidden: torch.Tensor, output: nn.Linear, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = output(hidden).float()  # (n, vocab)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
    return loss, correct


def chunked_cross_entropy(
    hidden: torch.Tensor, output: nn.Linear, labels: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, supervised count, correct count) of hidden (N, dim) against labels (N,).

    With `chunk` > 0 the logits exist for `chunk` rows at a time, in forward and (recomputed) in
    backward, so the full (N, vocab) float32 logits are never held for backward.
    """
    count = (labels != IGNORE).sum()
    if chunk <= 0 or hidden.shape[0] <= chunk:
        loss, correct = _chunk_loss(hidden, output, labels)
        return loss, count, correct
    losses, corrects = [], []
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        if torch.is_grad_enabled():
            loss, correct = checkpoint(
                _chunk_loss, hidden[part], output, labels[part], use_reentrant=False
            )
        else:
            loss, correct = _chunk_loss(hidden[part], output, labels[part])
        losses.append(loss)
        corrects.append(correct)
    return torch.stack(losses).sum(), count, torch.stack(corrects).sum()


def set_context_parallel(
    model: nn.Module, group: object, layout: str = "zigzag", strategy: str = "ring"
) -> None:
    """Make every attention layer of `model` context-parallel over `group` (a process group or
    1-D DeviceMesh; a 2-D one for strategy="hybrid"), for tokens sharded with `layout`."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.group, module.layout, module.strategy = group, layout, strategy
