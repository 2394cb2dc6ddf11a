"""Model shapes the planner knows: the trainer's presets, published Llama architectures, and any
Hugging Face `config.json` (read as JSON; transformers is not imported).

Only the shape matters to the cost model: width, depth, heads, K/V heads, head dim, SwiGLU hidden
size and vocabulary. Every model is a Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP),
which is what the trainer builds and what the published models are. A MoE config (Mixtral,
Qwen3-MoE, gpt-oss: `num_local_experts` / `num_experts`, `num_experts_per_tok`) replaces the MLP
by `experts` SwiGLU experts of `expert_hidden` and a router; each token runs `top_k` of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ringattn.models import MODEL_SIZES

__all__ = ["MODELS", "ModelSpec", "get_model", "model_names"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-style decoder."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    """SwiGLU hidden size (w1, w3: dim -> hidden; w2: hidden -> dim)."""
    vocab_size: int
    head_dim: int = 0
    """0 means dim // n_heads."""
    tied_embeddings: bool = False
    source: str = ""
    """"trainer" for the trainer's presets, the config.json path for HF configs, "" otherwise."""
    experts: int = 0
    """MoE: experts per layer (0: a dense MLP)."""
    top_k: int = 0
    """MoE: experts each token runs."""
    expert_hidden: int = 0
    """MoE: one expert's SwiGLU hidden size (0 means hidden_dim)."""

    @property
    def d_head(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.d_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.d_head

    def layer_params(self) -> int:
        """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 (every expert's, and the router,
        for MoE) and two norm weights."""
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        if self.experts:
            return attn + self.expert_params() + self.dim * self.experts + 2 * self.dim
        return attn + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def expert_params(self) -> int:
        """One layer's expert weights (0 for a dense model)."""
        return self.experts * 3 * self.dim * (self.expert_hidden or self.hidden_dim)

    def active_layer_params(self) -> int:
        """The block's parameters one token's matmuls use: its top_k experts, not all of them."""
        if not self.experts:
            return self.layer_params()
        unused = (
            (self.experts - self.top_k) * 3 * self.dim * (self.expert_hidden or self.hidden_dim)
        )
        return self.layer_params() - unused

    def embedding_params(self) -> int:
        """Token embedding, output projection (unless tied) and the final norm."""
        return self.vocab_size * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    def params(self) -> int:
        return self.n_layers * self.layer_params() + self.embedding_params()


def _llama(name, dim, layers, heads, kv, hidden, vocab) -> ModelSpec:
    return ModelSpec(name, dim, layers, heads, kv, hidden, vocab)


# published shapes (the models' config.json files)
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
        _llama("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
        _llama("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
        _llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
        _llama("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
        _llama("llama3-405b", 16384, 126, 128, 8, 53248, 128256),
    )
}


def _trainer_presets() -> dict[str, ModelSpec]:
    """The trainer's MODEL_SIZES, read from the trainer so the two never drift apart."""

    return {
        size: ModelSpec(
            size,
            c.dim,
            c.n_layers,
            c.n_heads,
            c.n_kv_heads,
            c.hidden_dim,
            c.vocab_size,
            source="trainer",
        )
        for size, c in MODEL_SIZES.items()
    }


def model_names() -> list[str]:
    return [*_trainer_presets(), *MODELS]


def from_hf_config(path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (a file, or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the decoder
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        return ModelSpec(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            hidden_dim=int(cfg.get("intermediate_size") or 4 * dim),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            source=path,
            experts=int(experts),
            top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            expert_hidden=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        )
    except KeyError as err:
        raise ValueError(
            f"{path} lacks {err.args[0]!r}; a decoder config.json needs hidden_size, "
            "num_hidden_layers, num_attention_heads and vocab_size"
        ) from None


def get_model(name: str) -> ModelSpec:
    """A preset by name, or the path of a Hugging Face config.json (a file or its directory)."""
    presets = {**_trainer_presets(), **MODELS}
    if name in presets:
        spec = presets[name]
    elif name.endswith(".json") or os.path.isdir(name):
        if not os.path.exists(name):
            raise ValueError(f"model config {name!r} does not exist")
        spec = from_hf_config(name)
    else:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(presets)} "
            "or give the path of a Hugging Face config.json"
        )
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"{spec.n_heads} heads are not a multiple of {spec.n_kv_heads} kv heads")
    return spec
