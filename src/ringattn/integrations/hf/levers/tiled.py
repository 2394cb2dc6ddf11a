"""Tiled MLP for transformers models: each allow-listed MLP and experts module runs over its rows in
tiles, each tile recomputed in backward (models/tiled.py: exact, one tile's intermediates alive).

    ringattn.hf.parallelize(model, tiled_mlp=1024)

    dense MLP   (..., H) -> (..., H)            every token a row: the leading dims flattened
    experts     (T, H), top_k_index (T, k),     the rows after routing: the router ran once on
                top_k_weights (T, k) -> (T, H)  every row (its logits are rows x experts, small,
                                                and seen by the router-loss hook as before); the
                                                tokens are tiled before they are dispatched to
                                                the experts, so one tile's expert intermediates
                                                are alive (with expert_group, the rows each rank
                                                received, after experts.py's exchange)

Only classes on the allow-lists below are tiled, each proven row-wise by
tests/test_tiled_mlp.py (tiled equal to untiled in float64, forward and backward, on a tiny
model of the family named beside it). A decoder layer's feed-forward child (`mlp`,
`feed_forward`, ...) that is neither listed nor an MoE block whose experts are listed is refused
by name: a module that is not row-wise (or that draws random numbers, as dropout does) would not
survive the recompute. Inside a torch.compile graph a tiled module raises, naming itself (its
backward calls torch.autograd.grad, which dynamo does not trace): fullgraph=True fails with that
message; without fullgraph, dynamo breaks the graph there and the tiles run eagerly.
The module's forward is wrapped on the instance (as the Trainer's chunked
loss does), so its class, parameters and names are untouched: checkpoints load and save as before.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ringattn.integrations.hf.experts import experts_modules
from ringattn.models.tiled import check_tile, tiled_rows

__all__ = ["DENSE", "EXPERTS", "TILE_ATTR", "install_tiled_mlp"]

TILE_ATTR = "ringattn_tiled_mlp"
"""The tokens per tile of a tiled module (an attribute on it), so it is never wrapped twice."""

# class name -> a family (config.model_type) whose tiny model holds it: the test builds that one
DENSE: dict[str, str] = {
    "AfmoeMLP": "afmoe", "ApertusMLP": "apertus", "ArceeMLP": "arcee", "CohereMLP": "cohere",
    "Cohere2MLP": "cohere2", "CwmMLP": "cwm", "DeepseekV2MLP": "deepseek_v2",
    "DeepseekV3MLP": "deepseek_v3", "DiffLlamaMLP": "diffllama", "Dots1MLP": "dots1",
    "Emu3MLP": "emu3", "Ernie4_5MLP": "ernie4_5", "Ernie4_5_MoeMLP": "ernie4_5_moe",
    "Exaone4MLP": "exaone4", "ExaoneMoeMLP": "exaone_moe", "FalconH1MLP": "falcon_h1",
    "PersimmonMLP": "persimmon", "GemmaMLP": "gemma", "Gemma2MLP": "gemma2",
    "Gemma3MLP": "gemma3_text", "GlmMLP": "glm", "Glm4MLP": "glm4", "Glm4MoeMLP": "glm4_moe",
    "GPTNeoXMLP": "gpt_neox", "GraniteMLP": "granite", "GraniteMoeSharedMLP": "granitemoeshared",
    "HeliumMLP": "helium", "HunYuanDenseV1MLP": "hunyuan_v1_dense",
    "HunYuanMoEV1MLP": "hunyuan_v1_moe", "JambaMLP": "jamba", "Lfm2MLP": "lfm2",
    "LlamaMLP": "llama", "MiniCPM3MLP": "minicpm3", "MinistralMLP": "ministral",
    "Ministral3MLP": "ministral3", "MistralMLP": "mistral", "NanoChatMLP": "nanochat",
    "NemotronHMLP": "nemotron_h", "OlmoMLP": "olmo", "Olmo2MLP": "olmo2", "Olmo3MLP": "olmo3",
    "OlmoHybridMLP": "olmo_hybrid", "PhiMLP": "phi", "Phi3MLP": "phi3", "Qwen2MLP": "qwen2",
    "Qwen2MoeMLP": "qwen2_moe", "Qwen3MLP": "qwen3", "Qwen3_5MLP": "qwen3_5_text",
    "Qwen3_5MoeMLP": "qwen3_5_moe_text", "Qwen3NextMLP": "qwen3_next", "SeedOssMLP": "seed_oss",
    "SmolLM3MLP": "smollm3", "Starcoder2MLP": "starcoder2", "VaultGemmaMLP": "vaultgemma",
}  # fmt: skip
EXPERTS: dict[str, str] = {
    "AfmoeExperts": "afmoe", "DeepseekV2Experts": "deepseek_v2", "ExaoneMoeExperts": "exaone_moe",
    "DeepseekV3Experts": "deepseek_v3", "Dots1Experts": "dots1",
    "Ernie4_5_MoeExperts": "ernie4_5_moe", "Glm4MoeExperts": "glm4_moe",
    "GptOssExperts": "gpt_oss", "GraniteMoeSharedExperts": "granitemoeshared",
    "HunYuanMoEV1Experts": "hunyuan_v1_moe", "JambaExperts": "jamba",
    "MiniMaxExperts": "minimax", "MixtralExperts": "mixtral", "NemotronHExperts": "nemotron_h",
    "OlmoeExperts": "olmoe",
    "PhimoeExperts": "phimoe", "Qwen2MoeExperts": "qwen2_moe",
    "Qwen3_5MoeExperts": "qwen3_5_moe_text", "Qwen3MoeExperts": "qwen3_moe",
    "Qwen3NextExperts": "qwen3_next",
}  # fmt: skip
# a decoder layer's children by these names are its feed-forward: tiled, or refused
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp", "ffn", "mlps")


def _listed(module: nn.Module) -> str | None:
    """'dense' or 'experts' for a transformers class on the allow-lists, else None."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None  # a user's class of the same name is not trusted
    return "dense" if cls.__name__ in DENSE else "experts" if cls.__name__ in EXPERTS else None


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]


def tiled_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of every module to tile; ValueError naming a feed-forward that is
    neither listed nor an MoE block with listed experts (checked before anything changes)."""
    found = [(n, m, kind) for n, m in model.named_modules() if (kind := _listed(m))]
    covered = {n for n, _, kind in found if kind == "experts"}
    for name, module in experts_modules(model):  # 3-D expert weights: listed, or refused
        if name not in covered:
            raise ValueError(
                f"tiled_mlp: the experts module {type(module).__name__} ({name}) is not on "
                f"ringattn's tiled-MLP allow-list (transformers MLP and experts classes proven "
                f"row-wise, integrations/hf/levers/tiled.py); use tiled_mlp=0 for this model"
            )
    for layer_name, layer in _decoder_layers(model):
        for child_name, child in layer.named_children():
            if child_name not in FEED_FORWARD_NAMES or _listed(child):
                continue
            path = f"{layer_name}.{child_name}"
            inner = [n for n in covered if n.startswith(path + ".")]
            if not inner:
                raise ValueError(
                    f"tiled_mlp: {type(child).__name__} ({path}) is not on ringattn's tiled-MLP "
                    f"allow-list (transformers MLP and experts classes proven row-wise, "
                    f"integrations/hf/levers/tiled.py); use tiled_mlp=0 for this model"
                )
    return found


def _tiled_forward(forward: object, signature: inspect.Signature, tile: int,
                   module: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:  # fmt: skip
    if torch.compiler.is_compiling():
        raise ValueError(
            f"{type(module).__name__}: tiled_mlp={tile} cannot run inside a torch.compile graph "
            f"(each tile is recomputed in backward by torch.autograd.grad, which dynamo does not "
            f"trace, so fullgraph=True fails); compile without fullgraph=True (the tiled MLP "
            f"then runs eagerly between graphs) or use tiled_mlp=0"
        )
    bound = signature.bind(*args, **kwargs)
    names = list(bound.arguments)
    values = list(bound.arguments.values())
    first = values[0]
    lead = first.shape[:-1]  # the row dims: (B, S) of a dense MLP, (T,) of an experts module
    slots = [i for i, v in enumerate(values) if torch.is_tensor(v) and v.shape[: len(lead)] == lead]
    rows = [values[i].reshape(-1, *values[i].shape[len(lead) :]) for i in slots]

    def run(*pieces: torch.Tensor) -> torch.Tensor:
        call = list(values)
        for i, piece in zip(slots, pieces, strict=True):
            call[i] = piece
        return forward(**dict(zip(names, call, strict=True)))

    out = tiled_rows(run, rows, tile, [p for p in module.parameters() if p.requires_grad])
    return out.reshape(*lead, *out.shape[1:])


def install_tiled_mlp(model: nn.Module, tile: int) -> int:
    """Tile every allow-listed MLP and experts module of `model` (tile tokens per tile), in place;
    returns how many. 0 does nothing. Refusals (tiled_modules) come before any change."""
    check_tile(tile)
    if not tile:
        return 0
    found = tiled_modules(model)
    for _, module, _ in found:
        if getattr(module, TILE_ATTR, 0):
            continue  # already tiled (parallelize called twice): keep the first wrapper
        forward = module.forward
        signature = inspect.signature(forward)
        wrapped = functools.partial(_tiled_forward, forward, signature, tile, module)
        wrapped.__signature__ = signature  # hooks that bind the arguments (experts.py) see them
        module.forward = wrapped
        setattr(module, TILE_ATTR, tile)
    return len(found)
