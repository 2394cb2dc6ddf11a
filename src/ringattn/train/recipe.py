"""`ModelRecipe`: how a training run makes, parallelizes, feeds and checks its model.

The seam for other models and other parallelisms (gpt-fast and torchtitan style): the model's
code never mentions a process group; the recipe applies parallelism to it from outside. Two
recipes exist: train/decoder.py's `DECODER` (models/decoder.py over the 4-D mesh) and
train/hf/recipe.py's `HF` (a transformers causal LM over dp x cp). This module imports neither,
so the config (config.py) and the run (run.py) can take a recipe without importing one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ringattn.runtime.mesh import Mesh
from ringattn.train.config import TrainConfig
from ringattn.train.data import Loader

__all__ = ["ModelRecipe"]


@dataclass(frozen=True)
class ModelRecipe:
    """How a run makes its model. Each is a module-level function (ranks are spawned).

    `build(cfg)`: the plain single-device model, on CPU, initialised from the global RNG (seeded
    with cfg.seed just before); `model(inputs, positions, labels)` must return (loss sum,
    supervised tokens, right predictions), see step.py.
    `parallelize(model, mesh, cfg)`: the same model made parallel over `mesh` (returns it).
    `loader(cfg, mesh, device)`: the run's data when the model brings its own (a tokenizer:
    train/hf/recipe.HF); None: data.Loader over `--data`.
    `check(cfg, cp)`: every mistake in the flags that only this model can see (its shape against
    --tp/--pp, its data), as a ValueError; config.validate calls it after the generic checks, in
    the parent before any launch and on every rank before its first collective.
    `probe(model, cfg, step, cp_group)`: an evaluation between steps (`--eval-niah-every`), on
    every rank at once; returns the log record rank 0 writes (train/hf/probe.py).
    """

    build: Callable[[TrainConfig], nn.Module]
    parallelize: Callable[[nn.Module, Mesh, TrainConfig], nn.Module]
    loader: Callable[[TrainConfig, Mesh, torch.device], Loader] | None = None
    check: Callable[[TrainConfig, int], None] | None = None
    probe: Callable[[nn.Module, TrainConfig, int, object], dict] | None = None
