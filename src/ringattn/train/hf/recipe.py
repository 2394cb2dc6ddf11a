"""The Hugging Face recipe of `ringattn train --hf DIR`: a transformers causal LM as the model.

    --hf DIR           config.json + weights (+ tokenizer)  -> from_pretrained, local files only
    --hf DIR           config.json only (+ tokenizer)       -> from_config: random init (seeded)
    --hf FILE.json     a bare config                         -> from_config; tokenizer beside it

    build(cfg)         CausalLMLoss(model): the trainer's model contract around the HF model
    parallelize        ringattn.hf.parallelize (CP attention through transformers' public
                       AttentionInterface), then models/parallelize.py's FSDP2 over all dp x cp
                       ranks, one unit per decoder layer (the model's _no_split_modules), divide
                       factor 1
    loader             hf/data.DocumentLoader: packed documents through ringattn.hf.shard_batch;
                       --dynamic-cp: hf/dynamic.DynamicLoader (per-step cp groups, exact)

The trainer's contract is `model(inputs, positions, labels)` -> (loss SUM, supervised count,
right predictions), divided by the global count in step.py. `CausalLMLoss` computes these with
integrations/hf/loss.py (--loss-chunk rows of lm_head + cross-entropy at a time, recomputed in
backward: the logits are never whole) rather than taking transformers' own loss, a mean. A MoE
model with `output_router_logits` in its config also returns this rank's share of
`router_aux_loss_coef * aux`, the load-balancing loss over the tokens of every dp x cp rank
(ringattn.hf's router hook): the objective is transformers' `out.loss` of the global batch.
Such a model runs its own forward (whole logits): the router hook reads the causal LM's output.

`check(cfg)` is called by config.validate, in the parent before any process starts and again on
every rank: every error a user can make with --hf (no such directory, no config.json, a model
type without a causal-LM class, settings ringattn cannot do in training, text the tokenizer maps
beyond the vocabulary) is a ValueError there, not W tracebacks after the launch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ringattn.integrations.hf.experts import check_ep
from ringattn.integrations.hf.levers.offload import offload_activations
from ringattn.integrations.hf.levers.tiled import tiled_modules
from ringattn.integrations.hf.loss import logits_loss, loss_sum
from ringattn.integrations.hf.model import parallelize as hf_parallelize
from ringattn.integrations.hf.moe import ROUTER_ATTR, aux_share
from ringattn.integrations.hf.source import load_config, load_model, load_tokenizer, model_source
from ringattn.models.parallelize import parallelize
from ringattn.runtime.extras import require
from ringattn.runtime.flags import check_choice
from ringattn.runtime.mesh import Mesh
from ringattn.train.config import TrainConfig
from ringattn.train.hf.context import extended_config
from ringattn.train.hf.data import (
    DocumentLoader,
    PackedConversations,
    PackedDocuments,
    load_corpus,
)
from ringattn.train.hf.dynamic import DynamicLoader, check_model, dynamic_loader
from ringattn.train.hf.experts import expert_parallel
from ringattn.train.hf.probe import check_probe, probe
from ringattn.train.hf.sources import split_data
from ringattn.train.recipe import ModelRecipe

__all__ = ["EXPORT_DTYPES", "HF", "CausalLMLoss", "check", "dataset"]

EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def check(cfg: TrainConfig, cp: int) -> None:
    """Every --hf mistake as a ValueError before any process starts (see the module docstring)."""
    require("hf", "ringattn train --hf")
    load_config(model_source(cfg.hf))
    extended_config(cfg)  # --rope-scaling, --max-position-embeddings
    split_data(cfg.data)
    check_ep(cfg.ep, load_config(model_source(cfg.hf)))
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
    if cfg.export_dtype:
        check_choice("export-dtype", cfg.export_dtype, EXPORT_DTYPES)
    if cfg.export and os.path.isfile(cfg.export):
        raise ValueError(f"--export {cfg.export} is a file; give a directory to write the model to")
    dataset(cfg)  # tokenized once (corpus.py), enough tokens for one window
    check_probe(cfg)  # --eval-niah-every: a needle prompt fits --seq-len
    if cfg.dynamic_cp:  # hybrid, vision-language, MoE router loss: refused by name (dynamic.py)
        check_model(cfg)
    if cfg.tiled_mlp:  # a feed-forward off the allow-list, refused by name (a weightless build)
        with torch.device("meta"):
            meta = load_model(model_source(cfg.hf), pretrained=False, config=extended_config(cfg))
        tiled_modules(meta)


def dataset(cfg: TrainConfig) -> PackedDocuments | PackedConversations:
    """The windows of --data (text: packed documents, chat: packed conversations) for --hf."""
    kind, path = split_data(cfg.data)
    source = model_source(cfg.hf)
    vocab = load_config(source).get_text_config().vocab_size
    corpus = load_corpus(path, source.tokenizer_dir, vocab, kind=kind, cache_dir=cfg.token_cache)
    if kind == "text":
        return PackedDocuments(corpus, cfg.seq_len, cfg.seed)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PackedConversations(corpus, cfg.seq_len, cfg.seed, pad or 0)


class CausalLMLoss(nn.Module):
    """A transformers causal LM under the trainer's contract (step.py).

    forward(inputs, positions, labels): `inputs` the model's keyword arguments for this rank's
    tokens (hf/data.DocumentBatch), `labels` (1, S_local) already shifted on the global sequence.
    Returns (sum of the token cross-entropies, supervised tokens, right argmax predictions).
    `layers` are the modules FSDP2 shards one by one (models/parallelize.py), the model's decoder
    layers as named by its `_no_split_modules`.
    """

    def __init__(self, model: nn.Module, loss_chunk: int = 0) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk = loss_chunk
        """Tokens per chunk of lm_head + cross-entropy (0: the model's own, whole logits)."""
        names = set(getattr(model, "_no_split_modules", None) or ())
        self._blocks = tuple(m for m in model.modules() if type(m).__name__ in names)

    @property
    def layers(self) -> list[nn.Module]:
        return list(self._blocks)

    def forward(
        self, inputs: dict, positions: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if getattr(self.model, ROUTER_ATTR, None) is None:
            return loss_sum(self.model, inputs, labels, self.loss_chunk)
        out = self.model(**inputs)  # a MoE model: its router hook reads the causal LM's output
        loss, count, correct = logits_loss(out.logits, labels)
        router = aux_share(self.model, out)  # this rank's share of the router loss, or None
        return (loss, count, correct) if router is None else (loss, count, correct, router)


def build(cfg: TrainConfig) -> CausalLMLoss:
    """recipe.build: the model of --hf, plain single-device code."""
    model = load_model(model_source(cfg.hf), config=extended_config(cfg))
    return CausalLMLoss(model, cfg.loss_chunk)


def parallelize_hf(model: nn.Module, mesh: Mesh, cfg: TrainConfig) -> nn.Module:
    """CP attention over mesh.cp (ringattn.hf), then FSDP2 over every rank (models/parallelize.py:
    the same sharding, mixed precision and divide factor 1 as the decoder)."""

    # a MoE router's statistics over the whole global batch: every dp x cp rank's tokens
    world = dist.group.WORLD if dist.is_initialized() else None
    hf_parallelize(model.model, mesh.cp_group, layout=cfg.layout, strategy=cfg.strategy,
                   router_group=world, mixer_scheme=cfg.mixer_scheme,
                   tiled_mlp=cfg.tiled_mlp)  # fmt: skip
    if cfg.activation_checkpointing:
        hf = model.model  # transformers >= 5.x renamed gradient_ to activation_checkpointing_enable
        enable = getattr(hf, "activation_checkpointing_enable", None)
        (enable or hf.gradient_checkpointing_enable)({"use_reentrant": False})
        if cfg.offload_activations:  # the checkpointed layer inputs to host memory
            offload_activations(hf)
    param_dtype = None if cfg.dtype == "float32" else getattr(torch, cfg.dtype)
    if cfg.ep > 1:  # the experts' own FSDP2 units first: the blocks' then leave them out
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        expert_parallel(model, cfg.ep, next(model.parameters()).device, policy)
    # models/parallelize.py's own CP step finds none of its decoder's attention layers here: a no-op
    return parallelize(model, mesh, layout=cfg.layout, strategy=cfg.strategy,
                       param_dtype=param_dtype)  # fmt: skip


def loader(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> DocumentLoader | DynamicLoader:
    """recipe.loader: packed documents of --data, tokenized for the model of --hf; with
    --dynamic-cp, each step's documents scheduled over sub-groups (dynamic.py)."""
    if cfg.dynamic_cp:
        return dynamic_loader(cfg, mesh, device, dataset(cfg))
    return DocumentLoader(dataset(cfg), cfg.batch_size, mesh.dp_rank, mesh.dp, mesh.cp_group,
                          cfg.layout, device)  # fmt: skip


HF = ModelRecipe(build=build, parallelize=parallelize_hf, loader=loader, check=check, probe=probe)
