"""`ringattn train` end to end: the parent launches the ranks, each rank builds its run and trains.

    parent (ringattn train)            rank r of W = dp x cp (launched here, or torchrun's ranks)
    -----------------------            ----------------------------------------------------------
    validate(cfg, W, recipe.check)     train_worker(cfg):
    launch(train_worker, W, cfg) --->    device = init_distributed(timeout)
                                         run = build_run(cfg, device)       run.py
                                         train(run)                         loop.py
    rank 0's summary  <--------------    run.summary()

A rank that dies makes the launch fail with LaunchError naming it (runtime/launch.py); the parent
adds where the newest complete checkpoint is. Running the same command again resumes from it,
reading the same samples in the same order, so the resumed run's losses equal the uninterrupted
run's. Under torchrun the parent is itself a rank: it runs `train_worker` in the world it is in.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime import preempt
from ringattn.runtime.launch import (
    LaunchError,
    LaunchInterrupted,
    init_distributed,
    launch,
    running_under_torchrun,
)
from ringattn.runtime.outcome import Stopped
from ringattn.train.config import TrainConfig, validate
from ringattn.train.loop import train
from ringattn.train.run import build_run, recipe_for

__all__ = ["run_train", "train_worker", "world_size"]


def world_size(cfg: TrainConfig) -> int:
    """The processes the run will have: torchrun's world, or `--nproc` local ones."""
    return int(os.environ["WORLD_SIZE"]) if running_under_torchrun() else cfg.nproc


def train_worker(cfg: TrainConfig) -> dict:
    """Entry point of each rank: handle SIGTERM (preempt.py), join the process group, build the
    run, train; the summary."""
    stop = preempt.install(cfg.grace_s)
    device = init_distributed(timeout_s=cfg.timeout_s, stall_s=cfg.stall_s)
    summary = train(build_run(cfg, device), stop).summary()
    dist.destroy_process_group()
    return summary


def run_train(cfg: TrainConfig) -> dict:
    """`ringattn train`: launch the ranks (or join torchrun's world); return rank 0's summary."""
    validate(cfg, world_size(cfg), recipe_for(cfg).check)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if running_under_torchrun():
        return train_worker(cfg)
    try:
        return launch(train_worker, cfg.nproc, cfg, stall_s=cfg.stall_s)[0]
    except LaunchInterrupted as err:  # SIGTERM to the launcher: forwarded to every rank
        return {"rank": 0, "checkpoint": None, "stopped": _interrupted(cfg, err).as_dict()}
    except LaunchError as err:
        last = ckpt.latest(cfg.checkpoint_path)
        hint = (
            f"the newest complete checkpoint is {last}; run the same command again to resume "
            f"from it"
            if last
            else "no checkpoint was completed; a rerun starts afresh"
        )
        raise LaunchError(f"{err}\n{hint}") from None


def _interrupted(cfg: TrainConfig, err: LaunchInterrupted) -> Stopped:
    """What a launch cut short by a signal reports: where to resume (exit 128 + the signal)."""
    last = ckpt.latest(cfg.checkpoint_path)
    step = ckpt.step_of(last) if last else 0
    where = "no checkpoint was completed; a rerun starts afresh"
    if last:
        where = f"the newest complete checkpoint is {last}; run the same command again to resume"
    code = 128 + getattr(signal, err.signal_name, signal.SIGTERM)
    return Stopped("interrupted", step, code, f"{err}; {where}")
