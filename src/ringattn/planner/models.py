"""Model shapes the planner knows: the trainer's presets, published Llama architectures, and any
Hugging Face `config.json` (read as JSON; transformers is not imported).

Only the shape matters to the cost model: width, depth, heads, K/V heads, head dim, SwiGLU hidden
size and vocabulary. Every model is a Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP),
which is what the trainer builds and what the published models are. A MoE config (Mixtral,
Qwen3-MoE, gpt-oss: `num_local_experts` / `num_experts`, `num_experts_per_tok`) replaces the MLP
by `experts` SwiGLU experts of `expert_hidden` and a router; each token runs `top_k` of them.

Hybrid models replace the attention of some layers by a recurrent sequence mixer (`layer_kinds`,
one `MixerShape` per model): gated_deltanet (Qwen3-Next, Qwen3.5: linear_num_value_heads...;
head-parallel in the library for the model_types of work.HEAD_PARALLEL_FAMILIES),
mamba2 (SSD: Nemotron-H, Falcon-H1 beside attention in every layer, Granite 4.0 hybrid, Bamba,
Zamba2), mamba1 (Jamba's selective scan), short_conv (LFM2's gated convolution, conv_L_cache).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ringattn.models import MODEL_SIZES
from ringattn.planner.work import HEAD_PARALLEL_FAMILIES, MIXER_KINDS, MixerShape

__all__ = ["MIXER_KINDS", "MODELS", "MixerShape", "ModelSpec", "from_hf_dict", "get_model",
           "model_names"]  # fmt: skip

LAYER_KINDS = ("attention", *MIXER_KINDS)


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
    layer_kinds: tuple[str, ...] = ()
    """Per layer, its sequence mixers: "attention", a kind of MIXER_KINDS, or both joined by
    "+" (Falcon-H1 runs attention and Mamba2 side by side); () means attention everywhere."""
    mixer: MixerShape | None = None
    """The shape of the mixer layers (one kind per model)."""

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            return
        if len(self.layer_kinds) != self.n_layers:
            raise ValueError(f"{self.name}: {len(self.layer_kinds)} layer kinds for "
                             f"{self.n_layers} layers")  # fmt: skip
        for kind in {p for k in self.layer_kinds for p in k.split("+")}:
            if kind not in LAYER_KINDS:
                raise ValueError(f"{self.name}: unknown layer kind {kind!r}; choose among "
                                 f"{', '.join(LAYER_KINDS)}")  # fmt: skip
            if kind != "attention" and (self.mixer is None or self.mixer.kind != kind):
                raise ValueError(f"{self.name}: {kind} layers need a MixerShape of that kind, "
                                 f"got {self.mixer}")  # fmt: skip

    @property
    def attention_layers(self) -> int:
        if not self.layer_kinds:
            return self.n_layers
        return sum("attention" in k.split("+") for k in self.layer_kinds)

    @property
    def mixer_layers(self) -> int:
        return sum(k != "attention" for k in self.layer_kinds)

    @property
    def d_head(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.d_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.d_head

    def attention_params(self) -> int:
        """wq, wk, wv, wo of one attention layer."""
        return self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim

    def mixer_params(self) -> float:
        """A mixer's parameters averaged over all layers (0 without mixers)."""
        if not self.mixer_layers:
            return 0
        return self.mixer_layers * self.mixer.params(self.dim) / self.n_layers

    def layer_params(self) -> float:
        """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 (every expert's, and the router,
        for MoE) and two norm weights. Hybrids: the mean over the layers (attention and mixer
        layers differ)."""
        attn = self.attention_params()
        if self.mixer_layers:
            attn = attn * self.attention_layers / self.n_layers + self.mixer_params()
        if self.experts:
            return attn + self.expert_params() + self.dim * self.experts + 2 * self.dim
        return attn + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def expert_params(self) -> int:
        """One layer's expert weights (0 for a dense model)."""
        return self.experts * 3 * self.dim * (self.expert_hidden or self.hidden_dim)

    def active_layer_params(self) -> float:
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

    def params(self) -> float:
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


# a config's names for its layers: attention, the model's mixer, or folded into the layer before
# (Nemotron-H's MLP-only and MoE-only layers: priced as that layer's MLP)
_ATTENTION_NAMES = ("attention", "full_attention", "sliding_attention", "chunked_attention",
                    "global", "local", "*")  # fmt: skip
_MIXER_NAMES = ("linear_attention", "mamba", "mamba2", "conv", "M")
_FOLDED_NAMES = ("mlp", "moe", "-", "E")


def _mixer_shape(cfg: dict, dim: int) -> MixerShape | None:
    """The mixer a config describes, by its field names (each family's configuration_*.py)."""
    get = cfg.get
    if "linear_num_value_heads" in cfg:
        heads = int(cfg["linear_num_value_heads"])
        return MixerShape("gated_deltanet", heads, int(get("linear_value_head_dim") or 128),
                          int(get("linear_key_head_dim") or 128),
                          int(get("linear_num_key_heads") or heads),
                          int(get("linear_conv_kernel_dim") or 4), chunk=64,
                          head_parallel=get("model_type") in HEAD_PARALLEL_FAMILIES)  # fmt: skip
    if "conv_L_cache" in cfg or "conv" in (get("layer_types") or ()):
        return MixerShape("short_conv", dim, 1, 0, conv_kernel=int(get("conv_L_cache") or 3))
    heads = get("mamba_num_heads") or get("mamba_n_heads") or get("n_mamba_heads")
    expand = float(get("mamba_expand") or get("expand") or 2)
    state = int(get("ssm_state_size") or get("mamba_d_state") or 0)
    kernel = int(get("conv_kernel") or get("mamba_d_conv") or 4)
    if heads:
        inner = int(get("mamba_d_ssm") or int(expand * dim))
        head_dim = get("mamba_head_dim") or get("mamba_d_head")
        head_dim = inner // int(heads) if head_dim in (None, "auto") else int(head_dim)
        groups = get("n_groups") or get("mamba_n_groups") or get("mamba_ngroups") or 1
        chunk = get("chunk_size") or get("mamba_chunk_size") or 256
        return MixerShape("mamba2", int(heads), head_dim, state or 128, int(groups), kernel,
                          int(chunk),
                          head_parallel=get("model_type") in HEAD_PARALLEL_FAMILIES)  # fmt: skip
    if state:  # Jamba: Mamba1
        rank = get("mamba_dt_rank")
        rank = -(-dim // 16) if rank in (None, "auto") else int(rank)
        return MixerShape("mamba1", int(expand * dim), 1, state, 0, kernel, dt_rank=rank)
    return None


def _layer_names(cfg: dict, n: int) -> list[str] | None:
    """The config's per-layer names, wherever the family keeps them (None: all attention)."""
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        if cfg.get(key):  # Nemotron-H's pattern is a string: M mamba, * attention, - mlp, E moe
            return [str(t) for t in cfg[key]]
    if cfg.get("attn_layer_indices") is not None:  # Bamba
        return ["attention" if i in cfg["attn_layer_indices"] else "mamba" for i in range(n)]
    if "attn_layer_period" in cfg or cfg.get("model_type") == "jamba":
        period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
        return ["attention" if i % period == offset else "mamba" for i in range(n)]
    if "full_attn_idxs" in cfg:  # LFM2
        return ["attention" if i in cfg["full_attn_idxs"] else "conv" for i in range(n)]
    if "linear_num_value_heads" in cfg:  # Qwen3-Next / Qwen3.5's default: every 4th attention
        every = int(cfg.get("full_attention_interval", 4))
        return ["linear_attention" if (i + 1) % every else "attention" for i in range(n)]
    if "mamba_d_ssm" in cfg or cfg.get("model_type") == "falcon_h1":
        return ["hybrid"] * n  # attention and Mamba2 side by side in every layer
    return None


def _hybrid(cfg: dict, dim: int, n_layers: int) -> tuple[int, tuple[str, ...], MixerShape | None]:
    """(layers, layer kinds, mixer shape) of a config; () kinds when every layer is attention.
    ValueError naming a layer name the planner does not know."""
    names = _layer_names(cfg, n_layers)
    mixer = _mixer_shape(cfg, dim)
    if names is None:
        return n_layers, (), None
    kinds: list[str] = []
    for name in names:
        if name in _FOLDED_NAMES:
            if not kinds:
                raise ValueError(f"layer name {name!r} before any attention or mixer layer")
            continue
        if name == "hybrid":
            kind = f"attention+{mixer.kind}" if mixer else ""
        elif name in _ATTENTION_NAMES or name.endswith("_attention") and name != "linear_attention":
            kind = "attention"
        elif name in _MIXER_NAMES and mixer is not None:
            kind = mixer.kind
        else:
            kind = ""
        if not kind:
            raise ValueError(
                f"unknown layer kind {name!r} (with mixer {mixer.kind if mixer else None}); the "
                f"planner knows {', '.join(_ATTENTION_NAMES + _MIXER_NAMES + _FOLDED_NAMES)} "
                "and 'hybrid'"
            )
        kinds.append(kind)
    if all(k == "attention" for k in kinds):
        return len(kinds), (), None
    return len(kinds), tuple(kinds), mixer


def from_hf_config(path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (a file, or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return from_hf_dict(cfg, name, path)


def from_hf_dict(cfg: dict, name: str, path: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face config as a dict (`config.to_dict()`); `path` names it in
    errors and in `source`."""
    cfg = cfg.get("text_config") or cfg  # multimodal configs nest the decoder
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        layers = cfg.get("num_hidden_layers")
        for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
            layers = layers or len(cfg.get(key) or ()) or None  # Nemotron-H may leave it out
        layers, kinds, mixer = _hybrid(cfg, dim, int(layers or cfg["num_hidden_layers"]))
        return ModelSpec(
            name=name,
            dim=dim,
            n_layers=layers,
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
            layer_kinds=kinds,
            mixer=mixer,
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
