"""Context extension for `train --hf`: a longer RoPE in the model's config, before it is built.

    --rope-scaling TYPE:FACTOR     the model's own RoPE scaling (transformers' rope_parameters):
                                   linear     positions divided by FACTOR (position interpolation)
                                   dynamic    NTK-aware, the base grows past the original length
                                   yarn       NTK-by-parts + attention temperature (YaRN)
                                   llama3     Llama 3.1's band-wise scaling (low 1, high 4)
    --max-position-embeddings N    the new context length (default: the model's x FACTOR)

    config.json before              {"max_position_embeddings": 4096,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    after linear:8                  {"max_position_embeddings": 32768,
                                     "rope_parameters": {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1e4, "original_max_position_embeddings": 4096}}

The training ranks build the model from this config (from_pretrained with `config=`: the same
weights, the new rotary embedding), and `--export` writes it, so the exported directory loads
with the extended context. A model that already scales its RoPE keeps its original length as
the reference. `extended_config(cfg)` is None without either flag (the model as it is).
"""

from __future__ import annotations

import copy

from ringattn.integrations.hf.source import load_config, model_source

__all__ = ["ROPE_TYPES", "extended_config", "parse_rope_scaling"]

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def parse_rope_scaling(text: str) -> tuple[str, float]:
    """ "yarn:4" -> ("yarn", 4.0); ValueError naming the choices otherwise."""
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in ROPE_TYPES or not value >= 1.0:
        raise ValueError(f"--rope-scaling {text!r}: give TYPE:FACTOR with TYPE one of "
                         f"{', '.join(ROPE_TYPES)} and FACTOR >= 1, e.g. linear:4")  # fmt: skip
    return kind, value


def _scaled(rope: dict, kind: str, factor: float, original: int) -> dict:
    """One rope_parameters dict with the scaling `kind` (keeps rope_theta and the like)."""
    keep = {k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor")}
    new = {**keep, "rope_type": kind, "factor": factor}
    if kind in ("yarn", "llama3", "dynamic"):
        new["original_max_position_embeddings"] = original
    if kind == "llama3":
        new.update(low_freq_factor=1.0, high_freq_factor=4.0)  # Llama 3.1's bands
    return new


def extended_config(cfg):
    """The --hf model's config with --rope-scaling and --max-position-embeddings applied, or None
    without them; ValueError when the model has no RoPE to scale."""
    if not (cfg.rope_scaling or cfg.max_position_embeddings):
        return None
    if cfg.max_position_embeddings < 0:
        raise ValueError(f"--max-position-embeddings must be >= 1, got "
                         f"{cfg.max_position_embeddings}")  # fmt: skip
    config = copy.deepcopy(load_config(model_source(cfg.hf)))
    text = config.get_text_config()
    original = getattr(text, "max_position_embeddings", None)
    if cfg.rope_scaling:
        kind, factor = parse_rope_scaling(cfg.rope_scaling)
        rope = getattr(text, "rope_parameters", None)
        if not isinstance(rope, dict):
            raise ValueError(f"--rope-scaling: {type(text).__name__} has no rotary position "
                             f"parameters (rope_parameters) to scale; drop the flag")  # fmt: skip
        old = rope if "rope_type" in rope else next(iter(rope.values()), {})
        original = old.get("original_max_position_embeddings") or original
        if original is None:
            raise ValueError("--rope-scaling needs the model's max_position_embeddings")
        if all(isinstance(v, dict) for v in rope.values()):  # one set per layer type (Gemma 3)
            text.rope_parameters = {t: _scaled(r, kind, factor, original) for t, r in rope.items()}
        else:
            text.rope_parameters = _scaled(rope, kind, factor, original)
        text.max_position_embeddings = int(original * factor)
    if cfg.max_position_embeddings:
        text.max_position_embeddings = cfg.max_position_embeddings
    validate = getattr(text, "validate_rope", None)
    if validate is not None:
        validate()
    return config
