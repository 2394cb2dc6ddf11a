"""The step loop: from `run.start_step` to the last step, with progress, logs and checkpoints, and
the three ways a long run ends early on a cluster (preemption, divergence, a failed write).

    train(run, stop)                                    (one rank; run from run.build_run)
      "start" record -> OUT_DIR/train_log.jsonl         rank 0 (and --tensorboard event files)
      for step in start_step .. last_step - 1:
        batch = run.data.batch(step)                    this rank's shard of its dp row's samples
        stats = train_step(..., stop.requested)         step.py: loss, clip, ONE all-reduce of
                                                        every rank's flags, AdamW unless non-finite
        peaks = every rank's peak memory so far
        record -> history, log, TensorBoard, progress   rank 0: loss, lr, grad norm, tokens/s,
                                                        MFU, per-rank peak MB
        non-finite on any rank    -> update skipped everywhere; --max-bad-steps in a row: stop
        SIGTERM on any rank       -> run.save(step + 1), stop ("preempted")
        run.save(step + 1) every --checkpoint-every steps and at the last one, unless the step
                                     was skipped (the newest checkpoint is the last good state)
      "end" record (with `stopped` when it ended early)

Every decision to stop comes from the flags that every rank received in the same all-reduce, so
all ranks leave the loop after the same step and write the same checkpoint; a run that stops early
returns normally, `run.stopped` saying why (runtime/outcome.py: the exit code and the message).
A checkpoint write that fails raises the same CheckpointError on every rank (checkpoint/) and
ends the run the same way; weights that are not finite are never written.

MFU: the model FLOPs of a step (planner/flops.py: the planner's count for this model shape,
sequence length and global batch) per second, over the peak of every device of the world
(`--peak-tflops`, else the GPU preset or this CPU's calibration; null when unknown).
"""

from __future__ import annotations

import os
import platform
import signal
import time
from dataclasses import asdict

import torch

from ringattn.comm.world import gather_over_world
from ringattn.planner.flops import peak_flops_per_device, train_step_flops
from ringattn.planner.models import ModelSpec, from_hf_config
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.heartbeat import report_progress
from ringattn.runtime.metrics import TensorBoard
from ringattn.runtime.outcome import EXIT_CHECKPOINT, EXIT_DIVERGED, EXIT_PREEMPTED, Stopped
from ringattn.runtime.preempt import StopRequest
from ringattn.train.config import TrainConfig
from ringattn.train.progress import JsonLog, ProgressBar
from ringattn.train.run import Run, recipe_for
from ringattn.train.step import STOP, StepStats, learning_rate, train_step

__all__ = ["train"]

_FAIL_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


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


def _model_spec(cfg: TrainConfig) -> ModelSpec:
    if cfg.hf:
        return from_hf_config(cfg.hf)
    c = cfg.model_config()
    return ModelSpec(cfg.model, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim,
                     c.vocab_size)  # fmt: skip


def _fail_here(cfg: TrainConfig, rank: int, step: int) -> None:
    """Testing only (--fail-at-step): a crash, a SIGTERM, or a freeze, as abrupt as real ones."""
    if step != cfg.fail_at_step or rank != cfg.fail_rank:
        return
    if cfg.fail_signal == "term-launcher":  # the launcher (our agent, or torchrun's) is signalled
        os.kill(os.getppid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), _FAIL_SIGNALS[cfg.fail_signal])


def _probe(run: Run, done: int, log, board, bar) -> None:
    """--eval-niah-every: the recipe's probe on every rank; rank 0 logs it (train/hf/probe.py)."""
    cfg = run.cfg
    every, probe = cfg.eval_niah_every, recipe_for(cfg).probe
    if not (every > 0 and probe is not None and (done % every == 0 or done == cfg.last_step)):
        return
    report_progress(step=done, phase="niah probe")
    record = probe(run.model, cfg, done, run.mesh.cp_group)
    if log:
        log.write(record)
    if board:
        board.write(record)
    if bar:
        scores = ", ".join(f"{k[len('niah_score_'):]} tokens {100 * v:.0f}%"
                           for k, v in record.items() if k.startswith("niah_score_"))  # fmt: skip
        bar.write(f"[niah] step {done}: accuracy {100 * record['niah_accuracy']:.0f}% ({scores})")


def _bad_step_text(done: int, stats: StepStats) -> str:
    ranks = "; ".join(f"rank {r}: {what}" for r, what in stats.bad_ranks().items())
    return f"step {done} non-finite ({ranks})"


def train(run: Run, stop: StopRequest | None = None) -> Run:
    """Train `run` to its last step (`--stop-at` or `--steps`), or until it must stop early
    (`run.stopped`); returns it, history filled. `stop`: this process's SIGTERM state
    (runtime/preempt.install); None: SIGTERM is not handled here."""
    cfg, device = run.cfg, run.device
    stop = stop or StopRequest()
    lead = run.rank == 0
    last_step = cfg.last_step
    log = JsonLog(cfg.log_path) if lead else None
    board = TensorBoard(cfg.tensorboard_path) if lead and cfg.tensorboard else None
    bar = ProgressBar(last_step, cfg.log_every) if lead and not cfg.quiet else None
    tokens_per_step = cfg.seq_len * cfg.batch_size * run.mesh.dp
    flops = train_step_flops(_model_spec(cfg), cfg.seq_len, cfg.batch_size * run.mesh.dp)
    peak = peak_flops_per_device(device, cfg.peak_tflops)
    bad: list[str] = []  # the non-finite steps in a row, described
    done = run.start_step
    if log:
        log.write(_start_record(run))
    if bar and run.resumed_from:
        bar.write(f"resumed from {run.resumed_from} at step {run.start_step}")
    try:
        for step in range(run.start_step, last_step):
            _fail_here(cfg, run.rank, step)
            t0 = time.perf_counter()
            report_progress(step=step, phase="train step")  # named if this rank freezes here
            batch = run.data.batch(step)
            lr = learning_rate(cfg, step)
            stats = train_step(run.model, run.optimizer, batch, lr, cfg.grad_clip, device,
                               stop.requested)  # fmt: skip
            seconds = time.perf_counter() - t0
            done = step + 1
            peaks = gather_over_world(run.meter.peak_so_far_mb(), device)
            achieved = flops / seconds
            record = {
                "step": done, "loss": stats.loss, "accuracy": stats.accuracy,
                "tokens": tokens_per_step, "supervised": int(stats.supervised), "lr": lr,
                "grad_norm": stats.grad_norm, "seconds": seconds,
                "tokens_per_s": tokens_per_step / seconds, "peak_mb": peaks,
                "flops": flops, "mfu": achieved / (peak * run.mesh.world_size) if peak else None,
                "applied": stats.applied,
            }  # fmt: skip
            if hasattr(batch, "cp_groups"):  # packed documents: where the step ran them
                record["cp_groups"], record["imbalance"] = batch.cp_groups, batch.imbalance
            if stats.aux_loss is not None:  # a MoE router loss: the objective is loss + aux_loss
                record["aux_loss"] = stats.aux_loss
            if not stats.applied:
                record["non_finite"] = {str(r): w for r, w in stats.bad_ranks().items()}
                bad.append(_bad_step_text(done, stats))
            else:
                bad = []
            if lead:
                run.history.append(record)
                log.write(record)
                if board:
                    board.write(record)
                if bar:
                    if not stats.applied:
                        bar.write(f"{bad[-1]}: update skipped ({len(bad)} of --max-bad-steps "
                                  f"{cfg.max_bad_steps} in a row)")  # fmt: skip
                    bar.update(done, stats.loss, stats.accuracy, record["tokens_per_s"], peaks)
            if len(bad) >= cfg.max_bad_steps:
                run.stopped = _diverged(cfg, bad)
                break
            if not stats.stop_requested:
                _probe(run, done, log, board, bar)
            # during a streak of skipped steps the periodic checkpoint waits for an applied one:
            # the newest checkpoint is then the last good state (a preemption still saves)
            if stats.stop_requested or (_checkpoint_due(cfg, done) and not bad):
                report_progress(step=done, phase="checkpoint")
                run.save(done)
            if stats.stop_requested:
                run.stopped = _preempted(run, done, stats)
                break
    except ckpt.NonFiniteWeights as err:
        run.stopped = Stopped("diverged", done, EXIT_DIVERGED, f"diverged: {err}")
    except ckpt.CheckpointError as err:
        run.stopped = Stopped("checkpoint failed", done, EXIT_CHECKPOINT, str(err))
    finally:
        stop.finished()  # the checkpoint (if any) is complete: no grace deadline any more
    if log:
        end = {"event": "end", "step": run.stopped.step if run.stopped else last_step,
               "checkpoint": run.checkpoint}  # fmt: skip
        if run.stopped:
            end["stopped"] = run.stopped.as_dict()
        log.write(end)
    if board:
        board.close()
    if bar:
        bar.close()
    return run


def _diverged(cfg: TrainConfig, bad: list[str]) -> Stopped:
    step = int(bad[-1].split()[1])
    return Stopped(
        "diverged", step, EXIT_DIVERGED,
        f"diverged: {len(bad)} steps in a row with a non-finite loss or gradient norm "
        f"(--max-bad-steps {cfg.max_bad_steps}): {'; '.join(bad)}. No update was applied at "
        f"those steps and no checkpoint was written; the newest complete checkpoint is "
        f"{ckpt.latest(cfg.checkpoint_path)}. Lower --lr (or raise --warmup), then resume",
    )  # fmt: skip


def _preempted(run: Run, done: int, stats: StepStats) -> Stopped:
    asked = [r for r, f in enumerate(stats.flags) if f & STOP]
    who = ", ".join(map(str, asked))
    return Stopped(
        "preempted", done, EXIT_PREEMPTED,
        f"preempted: SIGTERM (rank{'s' if len(asked) > 1 else ''} {who}); every rank finished "
        f"step {done} and saved {run.checkpoint}; run the same command again to resume there",
    )  # fmt: skip
