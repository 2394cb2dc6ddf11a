"""The step loop: from `run.start_step` to the last step, with progress, JSON log and checkpoints.

    train(run)                                          (one rank; run from run.build_run)
      "start" record -> OUT_DIR/train_log.jsonl         rank 0
      for step in start_step .. last_step - 1:
        batch = run.data.batch(step)                    this rank's shard of its dp row's samples
        stats = train_step(model, optimizer, batch)     step.py: global token-mean loss, AdamW
        peaks = every rank's peak memory so far
        record -> history, log, progress line           rank 0
        run.save(step + 1) every --checkpoint-every steps and at the last one
      "end" record

The loop only reads the schedule (steps, stop_at, lr, checkpoint cadence, output) from the run's
config: everything it trains with was built once by `build_run`. Every rank executes the same
collectives in the same order (the step's sums, the memory gather, the checkpoint), so a rank that
dies makes its peers fail in the next collective instead of diverging.
"""

from __future__ import annotations

import os
import platform
import signal
import time
from dataclasses import asdict

import torch

from ringattn.comm.world import gather_over_world
from ringattn.runtime.heartbeat import report_progress
from ringattn.train.config import TrainConfig
from ringattn.train.progress import JsonLog, ProgressBar
from ringattn.train.run import Run
from ringattn.train.step import learning_rate, train_step

__all__ = ["train"]


def _checkpoint_due(cfg: TrainConfig, done: int) -> bool:
    every = cfg.checkpoint_every
    return every >= 0 and (done == cfg.last_step or (every > 0 and done % every == 0))


def _start_record(run: Run) -> dict:
    mesh = run.mesh
    return {
        "event": "start", "step": run.start_step, "resumed_from": run.resumed_from,
        "world_size": mesh.world_size, "dp": mesh.dp, "cp": mesh.cp, "tp": mesh.tp, "pp": mesh.pp,
        "device": str(run.device),
        "torch": torch.__version__, "machine": platform.node(), "memory": run.memory_method,
        "baseline_mb": run.baseline_mb,
        "config": asdict(run.cfg),
    }  # fmt: skip


def train(run: Run) -> Run:
    """Train `run` to its last step (`--stop-at` or `--steps`); returns it, history filled."""
    cfg, device = run.cfg, run.device
    lead = run.rank == 0
    last_step = cfg.last_step
    log = JsonLog(cfg.log_path) if lead else None
    bar = ProgressBar(last_step, cfg.log_every) if lead and not cfg.quiet else None
    tokens_per_step = cfg.seq_len * cfg.batch_size * run.mesh.dp
    if log:
        log.write(_start_record(run))
    if bar and run.resumed_from:
        bar.write(f"resumed from {run.resumed_from} at step {run.start_step}")
    for step in range(run.start_step, last_step):
        if step == cfg.fail_at_step and run.rank == cfg.fail_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, as abrupt as a real one
        t0 = time.perf_counter()
        report_progress(step=step, phase="train step")  # named if this rank freezes here
        batch = run.data.batch(step)
        lr = learning_rate(cfg, step)
        stats = train_step(run.model, run.optimizer, batch, lr, cfg.grad_clip, device)
        seconds = time.perf_counter() - t0
        done = step + 1
        peaks = gather_over_world(run.meter.peak_so_far_mb(), device)
        record = {
            "step": done, "loss": stats.loss, "accuracy": stats.accuracy,
            "tokens": tokens_per_step, "supervised": int(stats.supervised), "lr": lr,
            "grad_norm": stats.grad_norm, "seconds": seconds,
            "tokens_per_s": tokens_per_step / seconds, "peak_mb": peaks,
        }  # fmt: skip
        if lead:
            run.history.append(record)
            log.write(record)
            if bar:
                bar.update(done, stats.loss, stats.accuracy, record["tokens_per_s"], peaks)
        if _checkpoint_due(cfg, done):
            report_progress(step=done, phase="checkpoint")
            run.save(done)
    if log:
        log.write({"event": "end", "step": last_step, "checkpoint": run.checkpoint})
    if bar:
        bar.close()
    return run
