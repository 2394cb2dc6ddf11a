"""The decoder's shape: `ModelConfig`, its presets (`MODEL_SIZES`) and `model_config`.

Shared by everything that builds or prices the decoder: the trainer (train/), inference over a
sharded KV cache (inference/) and the planner (planner/models.py), so none of them reaches into
another to learn the model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["MODEL_SIZES", "ModelConfig", "model_config"]


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
