"""Worker functions for tests/test_cluster*.py, run on every rank of a WorkerPool (harness.py)."""

from __future__ import annotations

import torch

from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig
from ringattn.train.loop import train
from ringattn.train.run import build_run
from workers_train import full_parameters

CPU = torch.device("cpu")


def train_outcome(rank: int, world_size: int, options: dict) -> dict:
    """Train with TrainConfig(**options): rank 0's step records, how the run ended, the final
    parameters (whole), and what the checkpoint directory holds."""
    cfg = TrainConfig(**options)
    run = train(build_run(cfg, CPU))
    params = full_parameters(run.model)
    return {
        "history": run.history,
        "start_step": run.start_step,
        "stopped": run.stopped.as_dict() if run.stopped else None,
        "params": params if rank == 0 else None,
        "checkpoints": [step for step, _ in ckpt.complete_checkpoints(cfg.checkpoint_path)],
    }
