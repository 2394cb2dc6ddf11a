"""The Hugging Face recipe of `ringattn train --hf DIR`: a transformers causal LM as the model.

    --hf DIR           config.json + weights (+ tokenizer)  -> from_pretrained, local files only
    --hf DIR           config.json only (+ tokenizer)       -> from_config: random init (seeded)
    --hf FILE.json     a bare config                         -> from_config; tokenizer beside it

    build(cfg)         CausalLMLoss(model): the trainer's model contract around the HF model
    parallelize        ringattn.hf.parallelize (CP attention through transformers' public
                       AttentionInterface), then mesh.parallelize's FSDP2 over all dp x cp ranks,
                       one unit per decoder layer (the model's _no_split_modules), divide factor 1
    loader             hf_data.DocumentLoader: packed documents through ringattn.hf.shard_batch

The trainer's contract is `model(inputs, positions, labels)` -> (loss SUM, supervised count,
right predictions), divided by the global count in step.py. `CausalLMLoss` computes these from
the model's logits rather than taking transformers' own loss, which is already a mean.

`check(cfg)` is called by config.validate, in the parent before any process starts and again on
every rank: every error a user can make with --hf (no such directory, no config.json, a model
type without a causal-LM class, settings ringattn cannot do in training, text the tokenizer maps
beyond the vocabulary) is a ValueError there, not W tracebacks after the launch.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ringattn.train.config import TrainConfig
from ringattn.train.data import IGNORE
from ringattn.train.hf_data import DocumentLoader, PackedDocuments, load_corpus
from ringattn.train.mesh import Mesh, parallelize
from ringattn.train.run import ModelRecipe

__all__ = ["HF", "CausalLMLoss", "ModelSource", "check", "load_model", "model_source"]

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
    for name, off in (("attention_dropout", 0.0), ("attn_logit_softcapping", None),
                      ("attention_chunk_size", None)):  # fmt: skip
        value = getattr(text, name, off)
        if value not in (off, None, 0):
            raise ValueError(
                f"--hf {source.path}: config {name}={value} is not supported by ringattn.hf in "
                f"training; set it to {off} in {source.config_file}"
            )
    return config


def check(cfg: TrainConfig) -> None:
    """Every --hf mistake as a ValueError before any process starts (see the module docstring)."""
    source = model_source(cfg.hf)
    config = load_config(source)
    if not cfg.data.startswith("text:"):
        raise ValueError(
            f"--hf trains on packed text documents: give --data text:PATH (a directory, one "
            f"document per file, or a file of blank-line-separated documents), not {cfg.data!r}"
        )
    tp, pp = getattr(cfg, "tp", 1), getattr(cfg, "pp", 1)
    if tp != 1 or pp != 1:
        raise ValueError(
            f"--hf trains over dp x cp only; tensor and pipeline parallelism (--tp {tp}, "
            f"--pp {pp}) apply to the built-in decoder: use --tp 1 --pp 1"
        )
    if cfg.export and cfg.checkpoint_every < 0:
        raise ValueError(
            "--export writes the weights of the run's final checkpoint, and --checkpoint-every "
            "-1 writes none; use --checkpoint-every 0 (only at the end) or N"
        )
    if cfg.export and os.path.isfile(cfg.export):
        raise ValueError(f"--export {cfg.export} is a file; give a directory to write the model to")
    corpus = load_corpus(cfg.data[len("text:") :], source.tokenizer_dir,
                         config.get_text_config().vocab_size)  # fmt: skip
    PackedDocuments(corpus, cfg.seq_len, cfg.seed)  # enough tokens for one window


def load_model(source: ModelSource, pretrained: bool | None = None) -> nn.Module:
    """The plain transformers model of `source` in float32, in training mode, on the CPU."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # W ranks drawing "Loading weights" bars at once
    pretrained = source.pretrained if pretrained is None else pretrained
    if pretrained:
        model = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=torch.float32, local_files_only=True
        )
    else:  # the global RNG was seeded with --seed: the same weights on every rank
        model = AutoModelForCausalLM.from_config(load_config(source), dtype=torch.float32)
    return model.train()  # from_pretrained returns the model in eval mode


class CausalLMLoss(nn.Module):
    """A transformers causal LM under the trainer's contract (step.py).

    forward(inputs, positions, labels): `inputs` the model's keyword arguments for this rank's
    tokens (hf_data.DocumentBatch), `labels` (1, S_local) already shifted on the global sequence.
    Returns (sum of the token cross-entropies, supervised tokens, right argmax predictions).
    `layers` are the modules FSDP2 shards one by one (mesh.parallelize), the model's decoder
    layers as named by its `_no_split_modules`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        names = set(getattr(model, "_no_split_modules", None) or ())
        self._blocks = tuple(m for m in model.modules() if type(m).__name__ in names)

    @property
    def layers(self) -> list[nn.Module]:
        return list(self._blocks)

    def forward(
        self, inputs: dict, positions: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(**inputs).logits.float().flatten(0, 1)  # (S_local, vocab)
        labels = labels.flatten()  # (S_local,)
        supervised = labels != IGNORE
        loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & supervised).sum()
        return loss_sum, supervised.sum(), correct


def build(cfg: TrainConfig) -> CausalLMLoss:
    """recipe.build: the model of --hf, plain single-device code."""
    return CausalLMLoss(load_model(model_source(cfg.hf)))


def parallelize_hf(model: nn.Module, mesh: Mesh, cfg: TrainConfig) -> nn.Module:
    """CP attention over mesh.cp (ringattn.hf), then FSDP2 over every rank (mesh.parallelize:
    the same sharding, mixed precision and divide factor 1 as the decoder)."""
    import ringattn.hf

    ringattn.hf.parallelize(model.model, mesh.cp_group, layout=cfg.layout, strategy=cfg.strategy)
    if cfg.activation_checkpointing:
        model.model.gradient_checkpointing_enable({"use_reentrant": False})
    param_dtype = None if cfg.dtype == "float32" else getattr(torch, cfg.dtype)
    # mesh.parallelize's own CP step finds none of its decoder's attention layers here: a no-op
    return parallelize(model, mesh, layout=cfg.layout, strategy=cfg.strategy,
                       param_dtype=param_dtype)  # fmt: skip


def loader(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> DocumentLoader:
    """recipe.loader: packed documents of --data, tokenized for the model of --hf."""
    source = model_source(cfg.hf)
    vocab = load_config(source).get_text_config().vocab_size
    corpus = load_corpus(cfg.data[len("text:") :], source.tokenizer_dir, vocab)
    dataset = PackedDocuments(corpus, cfg.seq_len, cfg.seed)
    return DocumentLoader(dataset, cfg.batch_size, mesh.dp_rank, mesh.dp, mesh.cp_group,
                          cfg.layout, device)  # fmt: skip


HF = ModelRecipe(build=build, parallelize=parallelize_hf, loader=loader)
