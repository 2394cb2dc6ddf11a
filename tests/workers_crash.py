"""Worker functions for tests/test_crash_consistency.py, run on every rank of a WorkerPool.

`train_filling` runs the real training loop with a checkpoint directory on a small tmpfs; where a
`fill` is given, one rank fills that file system to the last byte at one point of one save (the
`fault` hook of `Run`, checkpoint.FAULT_POINTS), so the writes that follow meet ENOSPC there.
"""

from __future__ import annotations

import errno
import os

import torch

from ringattn.train.config import TrainConfig
from ringattn.train.loop import train
from ringattn.train.run import build_run

CPU = torch.device("cpu")


def fill_up(mount: str) -> str:
    """Write a file in `mount` until the file system is full; return its path."""
    path = os.path.join(mount, "filler")
    with open(path, "ab", buffering=0) as f:  # unbuffered: nothing left to flush at close
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
    return path


def _filler(rank: int, fill: dict):
    saves = [0]

    def at(point: str) -> None:
        saves[0] += 1 if point == "start" else 0
        if (rank, saves[0], point) == (fill["rank"], fill["save"], fill["point"]):
            fill_up(fill["mount"])

    return at


def train_filling(rank: int, world_size: int, options: dict, fill: dict | None = None) -> dict:
    """Train with TrainConfig(**options) (a fill as above); rank 0's losses, and how it ended."""
    run = build_run(TrainConfig(**options), CPU)
    if fill:
        run.fault = _filler(rank, fill)
    train(run)
    return {
        "losses": [h["loss"] for h in run.history] if rank == 0 else None,
        "start_step": run.start_step,
        "stopped": run.stopped.as_dict() if run.stopped else None,
        "checkpoint": run.checkpoint,
    }
