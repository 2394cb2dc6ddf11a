"""Build a training run ONCE, on every rank: mesh, model, optimizer, data, checkpoint state.

    build_run(cfg, device, recipe=recipe_for(cfg))                 (one rank; collective)
      validate(cfg, world_size, recipe.check)  config.py: the same ValueError on every rank, first
      mesh     = build_mesh(dp, cp[, ulysses])                     runtime/mesh.py
      [warm-up step of a tiny model]      --memory-warmup: code pages into the baseline
      meter    = Meter(device).start()    every rank's baseline gathered
      model    = recipe.build(cfg)        plain single-device model, seeded: same weights anywhere
      model    = recipe.parallelize(model, mesh, cfg)    CP attention + FSDP2, from outside
      optim    = AdamW(model)             step.py
      resume   <- newest complete checkpoint, if its run is this one (model, optimizer, RNG, step)
      data     = Loader(dataset, dp row, cp group, layout)                             data.py
                 or, --data docs:, DocumentLoader(..., sub-groups made here) train/dynamic/
      -> Run                              what the loop (loop.py) takes, and all it takes

The model comes from a `ModelRecipe` (recipe.py): `DECODER` (decoder.py: models/ over the 4-D
mesh) or, with --hf, `HF` (hf/recipe.py); `recipe_for(cfg)` picks it.

Checkpoints are read here (resume) and written by `Run.save`, so the training state written
beside the model (`train_state.json`: step, config, world size) is defined in one module. A
checkpoint from another run (any field of config.IDENTITY differs) is refused with the
differences listed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ringattn.comm.world import gather_over_world
from ringattn.models.config import ModelConfig
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.documents import DocumentTask
from ringattn.planner.models import ModelSpec
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.mesh import Mesh, build_mesh
from ringattn.runtime.meter import Meter
from ringattn.runtime.outcome import Stopped
from ringattn.runtime.subgroups import build_sub_groups
from ringattn.train.compile import compile_model
from ringattn.train.config import IDENTITY, TrainConfig, validate
from ringattn.train.data import Loader, get_dataset, shard_batch
from ringattn.train.decoder import DECODER, decoder_of, parallelize_decoder
from ringattn.train.dynamic.loader import DocumentLoader
from ringattn.train.hf.recipe import HF
from ringattn.train.recipe import ModelRecipe
from ringattn.train.step import build_optimizer, forward_backward

__all__ = ["DECODER", "ModelRecipe", "Run", "build_run", "recipe_for"]


def recipe_for(cfg: TrainConfig) -> ModelRecipe:
    """The recipe of a run: train/hf/recipe.HF with --hf (transformers, imported only when it
    runs), else train/decoder.DECODER."""
    return HF if cfg.hf else DECODER


@dataclass
class Run:
    """One rank's training run: built by `build_run`, advanced by `loop.train`."""

    cfg: TrainConfig
    device: torch.device
    mesh: Mesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: Loader
    meter: Meter
    """Tracks this rank's peak memory since the model was about to be built."""
    baseline_mb: list[float] = field(default_factory=list)
    """Each rank's resident memory when the tracker started (CPU; 0 on CUDA)."""
    start_step: int = 0
    """Steps already done: the resumed checkpoint's step, or 0."""
    resumed_from: str | None = None
    history: list[dict] = field(default_factory=list)
    """Rank 0: one record per step trained in this invocation (the JSON log's step records)."""
    checkpoint: str | None = None
    """The last checkpoint this invocation wrote."""
    stopped: Stopped | None = None
    """Why the run ended before its last step (preempted, diverged, checkpoint failed), or None."""
    fault: Callable[[str], None] | None = None
    """Testing only: called at each point of every checkpoint save (checkpoint.FAULT_POINTS)."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def memory_method(self) -> str:
        """How the peak memory is measured (RSS on CPU, max_memory_allocated on CUDA)."""
        return self.meter.method

    def save(self, step: int) -> str:
        """Checkpoint the state after `step` steps (collective); the newest `--keep` are kept."""
        state = {"step": step, "config": asdict(self.cfg), "world_size": self.mesh.world_size}
        self.checkpoint = ckpt.save(
            self.cfg.checkpoint_path,
            step,
            self.model,
            self.optimizer,
            state,
            keep=self.cfg.keep,
            fault=self.fault,
        )
        return self.checkpoint

    def summary(self) -> dict:
        """What a rank returns to the launcher (rank 0's is `run_train`'s result)."""
        return {
            "history": self.history, "start_step": self.start_step,
            "checkpoint": self.checkpoint, "memory_method": self.memory_method,
            "baseline_mb": self.baseline_mb,
            "dp": self.mesh.dp, "cp": self.mesh.cp, "tp": self.mesh.tp, "pp": self.mesh.pp,
            "rank": self.rank, "stopped": self.stopped.as_dict() if self.stopped else None,
        }  # fmt: skip


def build_run(cfg: TrainConfig, device: torch.device, recipe: ModelRecipe | None = None) -> Run:
    """Everything the loop needs, built once (see the module docstring). Collective: every rank
    of the default process group calls it (or one process, without a group)."""
    recipe = recipe or recipe_for(cfg)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    validate(cfg, world_size, recipe.check)
    ulysses = cfg.ulysses if cfg.strategy == "hybrid" else 0
    mesh = build_mesh(device, cfg.dp, cfg.cp, ulysses, tp=cfg.tp, pp=cfg.pp)
    if cfg.memory_warmup:
        _warm_up(cfg, mesh, device)
    meter = Meter(device).start()
    baselines = gather_over_world(meter.baseline_mb, device)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every world size
    model = recipe.parallelize(recipe.build(cfg).to(device), mesh, cfg)
    if cfg.compile:  # in place: names, state_dict and checkpoints stay those of eager
        compile_model(model, cfg.compile_backend)
    optimizer = build_optimizer(model, cfg)
    start_step, resumed_from = _resume(cfg, model, optimizer)
    data = recipe.loader(cfg, mesh, device) if recipe.loader is not None else None
    dataset = None if data else get_dataset(cfg.data, cfg.seq_len, cfg.seed, cfg.keys,
                                            cfg.copies, cfg.noisy)  # fmt: skip
    if isinstance(dataset, DocumentTask):
        data = _document_loader(cfg, mesh, device, dataset)
    elif dataset is not None:
        data = Loader(dataset, cfg.batch_size, mesh.dp_rank, mesh.dp, mesh.cp_group, cfg.layout,
                      device)  # fmt: skip
    return Run(cfg, device, mesh, model, optimizer, data, meter, baseline_mb=baselines,
               start_step=start_step, resumed_from=resumed_from)  # fmt: skip


def _document_loader(
    cfg: TrainConfig, mesh: Mesh, device: torch.device, dataset: DocumentTask
) -> DocumentLoader:
    """Packed documents, static or --dynamic-cp; the sub-groups are created here, once, by every
    rank (collective), and reused by every step."""
    c = cfg.model_config()
    spec = ModelSpec(cfg.model, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim,
                     c.vocab_size)  # fmt: skip
    elem = 4 if cfg.dtype == "float32" else 2
    groups = build_sub_groups(mesh.dp, mesh.cp, mesh.cp_group, mesh.cp_rank)
    return DocumentLoader(dataset, cfg.batch_size, mesh.dp_rank, mesh.dp, mesh.cp, groups,
                          cfg.layout, device, DocumentCost(spec, elem_bytes=elem),
                          cfg.dynamic_cp)  # fmt: skip


def _warm_up(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> None:
    """One step of a tiny decoder through the same code paths (CP attention, FSDP2, AdamW), then
    freed: loads kernels' code pages and creates communication buffers before the memory
    baseline is taken."""
    torch.manual_seed(cfg.seed)
    tp = mesh.tp  # heads and tokens that split over tp as the real model's do
    tiny = ModelConfig(dim=16 * tp, n_layers=mesh.pp, n_heads=2 * tp, n_kv_heads=tp,
                       ffn_dim=32 * tp)  # fmt: skip
    model = parallelize_decoder(decoder_of(tiny, cfg).to(device), mesh, cfg)
    optimizer = build_optimizer(model, cfg)
    tokens = torch.zeros(cfg.microbatches, 8 * mesh.cp * tp, dtype=torch.int64, device=device)
    batch = shard_batch(tokens, tokens, mesh.cp_group, cfg.layout, device)
    forward_backward(model, batch, device)
    optimizer.step()
    del model, optimizer
    if dist.is_initialized():
        dist.barrier()


def _resume(
    cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, str | None]:
    """(steps done, checkpoint path) after restoring the newest complete checkpoint, if any;
    rank 0 first removes what a killed run left (a prune cut short after the last save of a
    run is otherwise never removed: no save follows it)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        ckpt.sweep(cfg.checkpoint_path)
    path = ckpt.latest(cfg.checkpoint_path) if cfg.resume else None
    if path is None:
        return 0, None
    _check_compatible(cfg, ckpt.read_state(path), path)
    return ckpt.load(path, model, optimizer)["step"], path


def _check_compatible(cfg: TrainConfig, state: dict, path: str) -> None:
    saved = state.get("config", {})
    diff = [f"{k}: {saved.get(k)!r} there, {getattr(cfg, k)!r} now" for k in IDENTITY
            if k in saved and saved[k] != getattr(cfg, k)]  # fmt: skip
    if diff:
        raise ValueError(
            f"the checkpoint {path} is from a different run ({'; '.join(diff)}); use another "
            f"--checkpoint-dir (or --out-dir) for the new run, or the same flags to continue "
            f"that one"
        )
