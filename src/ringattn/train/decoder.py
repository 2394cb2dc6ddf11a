"""`DECODER`: the training recipe of our decoder (models/), over the whole pp x dp x cp x tp mesh.

build         models/decoder.py's Transformer of --model and its overrides, with --loss-chunk
              and --tiled-mlp, --offload-activations
parallelize   models/parallelize.py: CP attention (--layout, --strategy), TP, PP stages
              (--pp-schedule, --microbatches), FSDP2 in --dtype, activation checkpointing
check         the flags only this model can refuse: its heads and tokens against --tp, its
              blocks and micro-batches against --pp, the --data set; --export (an HF flag)
"""

from __future__ import annotations

import torch
from torch import nn

from ringattn.models.config import ModelConfig
from ringattn.models.decoder import Transformer, set_tiled_mlp
from ringattn.models.loss import resolve_chunk
from ringattn.models.parallelize import parallelize
from ringattn.models.pipeline import SCHEDULES
from ringattn.models.tensor_parallel import check_tensor_parallel
from ringattn.runtime.mesh import Mesh
from ringattn.train.config import TrainConfig
from ringattn.train.data import get_dataset
from ringattn.train.recipe import ModelRecipe

__all__ = ["DECODER", "build_decoder", "check_decoder", "decoder_of", "parallelize_decoder"]


def build_decoder(cfg: TrainConfig) -> Transformer:
    """models/decoder.py's Transformer of the --model preset and overrides, with --loss-chunk."""
    return decoder_of(cfg.model_config(), cfg)


def decoder_of(mcfg: ModelConfig, cfg: TrainConfig) -> Transformer:
    model = Transformer(mcfg)
    model.loss_chunk = resolve_chunk(cfg.loss_chunk, mcfg.vocab_size)
    set_tiled_mlp(model, cfg.tiled_mlp)
    model.offload_activations = cfg.offload_activations  # used with checkpoint_blocks
    return model


def parallelize_decoder(model: nn.Module, mesh: Mesh, cfg: TrainConfig) -> nn.Module:
    """CP attention over mesh.cp (--layout, --strategy), FSDP2 over every rank (--dtype)."""
    param_dtype = None if cfg.dtype == "float32" else getattr(torch, cfg.dtype)
    return parallelize(
        model, mesh, layout=cfg.layout, strategy=cfg.strategy,
        checkpoint_blocks=cfg.activation_checkpointing, param_dtype=param_dtype,
        microbatches=cfg.microbatches, pp_schedule=cfg.pp_schedule,
    )  # fmt: skip


def check_decoder(cfg: TrainConfig, cp: int) -> None:
    """ValueErrors for the decoder's --tp and --pp, --data and --export (see the docstring)."""
    check_tensor_parallel(cfg.model_config(), cfg.tp, cfg.seq_len // cp)
    if cfg.pp > 1:
        _check_pipeline(cfg)
    if cfg.export:
        raise ValueError("--export writes a Hugging Face model directory: it needs --hf DIR")
    hf_only = {"rope-scaling": cfg.rope_scaling, "eval-niah-every": cfg.eval_niah_every,
               "max-position-embeddings": cfg.max_position_embeddings}  # fmt: skip
    for flag, value in hf_only.items():
        if value:
            raise ValueError(f"--{flag} applies to a Hugging Face model: it needs --hf DIR")
    get_dataset(cfg.data, cfg.seq_len, cfg.seed, cfg.keys, cfg.copies, cfg.noisy)


def _check_pipeline(cfg: TrainConfig) -> None:
    layers = cfg.model_config().n_layers
    if cfg.pp > layers:
        raise ValueError(f"--pp {cfg.pp} stages need at least {cfg.pp} blocks; the model has "
                         f"{layers}: use --pp <= {layers} or more --layers")  # fmt: skip
    if cfg.pp_schedule not in SCHEDULES:
        raise ValueError(f"unknown --pp-schedule {cfg.pp_schedule!r}; choose from {SCHEDULES}")
    if cfg.microbatches < 1 or cfg.batch_size % cfg.microbatches:
        raise ValueError(
            f"--microbatches {cfg.microbatches} must divide --batch-size {cfg.batch_size} (each "
            f"rank's batch is split into micro-batches); pick a divisor of {cfg.batch_size}"
        )
    if cfg.pp_schedule == "1f1b" and cfg.microbatches < cfg.pp:
        raise ValueError(f"--pp-schedule 1f1b needs --microbatches >= --pp {cfg.pp}, got "
                         f"{cfg.microbatches}; use more micro-batches or gpipe")  # fmt: skip


DECODER = ModelRecipe(build=build_decoder, parallelize=parallelize_decoder, check=check_decoder)
