"""Where a local Hugging Face model comes from, and loading it: config, weights, tokenizer.

    PATH a directory   config.json + weights (+ tokenizer)  -> from_pretrained, local files only
                       config.json only (+ tokenizer)       -> from_config: random init (seeded)
    PATH a .json file  a bare config                         -> from_config; tokenizer beside it

Shared by training (`ringattn train --hf`, train/hf/) and decoding (`ringattn generate --hf`,
inference/generate_hf.py): every mistake (no such path, no config.json, a model type without a
causal-LM class, a setting ringattn cannot run) is a ValueError naming the path and the fix.
Nothing is downloaded. transformers is imported inside the functions (an optional dependency).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from torch import nn

# --dtype's choices; "auto" keeps the checkpoint's dtype (transformers reads it from config.json)
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}  # fmt: skip

__all__ = ["DTYPES", "ModelSource", "load_config", "load_model", "load_tokenizer", "model_source"]

_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where --hf points: the config, whether there are weights, where the tokenizer is."""

    path: str
    config_file: str
    directory: str
    pretrained: bool
    """The directory holds weights (from_pretrained); else random init from the config."""
    tokenizer_dir: str | None

    def describe(self) -> str:
        return "weights from_pretrained" if self.pretrained else "random init from config.json"


def model_source(path: str) -> ModelSource:
    """What --hf PATH holds; ValueError (with the fix) when it is not a model directory/config."""
    if os.path.isdir(path):
        directory, config_file = path, os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(
                f"--hf {path}: the directory has no config.json; give a Hugging Face model "
                f"directory (config.json, weights, tokenizer) or a config.json file"
            )
        pretrained = any(glob.glob(os.path.join(path, p)) for p in _WEIGHTS)
    elif os.path.isfile(path):
        directory, config_file, pretrained = os.path.dirname(path) or ".", path, False
    else:
        raise ValueError(
            f"--hf {path}: no such directory or file; give a local Hugging Face model directory "
            f"(config.json, weights, tokenizer) or a config.json (nothing is downloaded)"
        )
    has_tokenizer = any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER)
    return ModelSource(path, config_file, directory, pretrained,
                       directory if has_tokenizer else None)  # fmt: skip


def load_config(source: ModelSource):
    """The transformers config of `source`, checked to have a causal-LM class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(source.config_file, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--hf {source.path}: cannot read {source.config_file}: {err}") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        raise ValueError(
            f"--hf {source.path}: model_type {model_type!r} ({type(config).__name__}) has no "
            f"causal-LM architecture in transformers {transformers.__version__} "
            f"(AutoModelForCausalLM); ringattn train --hf trains decoders such as llama, "
            f"mistral, qwen2, qwen3, gemma3"
        )
    text = config.get_text_config()
    for name, off in (("attention_dropout", 0.0), ("attention_chunk_size", None)):
        value = getattr(text, name, off)
        if value not in (off, None, 0):
            raise ValueError(
                f"--hf {source.path}: config {name}={value} is not supported by ringattn.hf in "
                f"training; set it to {off} in {source.config_file}"
            )
    return config


def load_model(source: ModelSource, pretrained: bool | None = None,
               dtype: str = "float32", config=None) -> nn.Module:  # fmt: skip
    """The plain transformers model of `source`, in training mode, on the CPU, in `dtype` (a
    DTYPES name; "auto": the checkpoint's, float32 for a random init); `config` replaces the
    directory's (e.g. a longer RoPE: train/hf/context.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # W ranks drawing "Loading weights" bars at once
    pretrained = source.pretrained if pretrained is None else pretrained
    if pretrained:
        extra = {} if config is None else {"config": config}
        model = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=DTYPES[dtype], local_files_only=True, **extra
        )
    else:  # the global RNG was seeded with --seed: the same weights on every rank
        chosen = torch.float32 if dtype == "auto" else DTYPES[dtype]
        config = load_config(source) if config is None else config
        model = AutoModelForCausalLM.from_config(config, dtype=chosen)
    return model.train()  # from_pretrained returns the model in eval mode


def load_tokenizer(directory: str):
    """The tokenizer saved in `directory` (local files only); ValueError when it cannot load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(
            f"{directory} has tokenizer files but they do not load ({err}); fix or remove them "
            f"(without a tokenizer, text is read as bytes mod vocab_size)"
        ) from None
