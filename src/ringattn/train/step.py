"""One optimisation step: the global token-mean loss, its gradient, clipping, AdamW, the schedule.

    batch (this rank's shard) -> model -> loss_sum, count, correct        (local sums)
    count, loss_sum, correct  <- sum over every rank of the mesh           (global sums)
    (loss_sum / global count).backward()     FSDP2 then SUMS the gradients over all ranks
    clip to --grad-clip, lr = learning_rate(step), AdamW step, zero the gradients

The loss is the mean over every supervised token of the global batch: each rank divides its SUM
of token losses by the global count, and the gradients are summed over all ranks (mesh.py: FSDP2
with divide factor 1). A mean of per-rank means would weight a rank holding 3 supervised tokens
like one holding 3000, and with zigzag CP the key-value task's answers all sit on rank 0.

The model's contract: `model(inputs, positions, labels)` returns (sum of the token losses,
number of supervised tokens, number predicted right), never a mean (model.Transformer does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ringattn.comm.world import sum_over_world
from ringattn.train.config import TrainConfig
from ringattn.train.data import Batch

__all__ = ["StepStats", "build_optimizer", "forward_backward", "learning_rate", "train_step"]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the (sharded) parameters; the learning rate is set before every step."""
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine from lr to lr/10: a pure function of the step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def forward_backward(
    model: torch.nn.Module, batch: Batch, device: torch.device
) -> tuple[float, float, float]:
    """Loss and gradients of the global batch's mean token loss; returns the global (loss sum,
    supervised tokens, right predictions), each summed over every rank of the mesh.

    Each rank backpropagates its SUM of token losses divided by the GLOBAL count; FSDP then sums
    the gradients over all ranks, which gives the gradient of the global mean exactly, however
    unequally the supervised tokens are spread over the ranks.
    """
    if hasattr(model, "forward_backward"):  # a pipeline stage runs its own (pipeline.py)
        return model.forward_backward(batch, device)
    loss_sum, count, correct = model(batch.inputs, batch.positions, batch.labels)
    total_loss, total_count, total_correct = sum_over_world(
        [loss_sum.item(), count.item(), correct.item()], device
    )
    (loss_sum / max(total_count, 1.0)).backward()
    return total_loss, total_count, total_correct


@dataclass(frozen=True)
class StepStats:
    """What one step measured, summed over the whole mesh."""

    loss_sum: float
    supervised: float
    correct: float
    grad_norm: float
    """Norm of the whole (global) gradient before clipping."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.supervised, 1.0)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.supervised, 1.0)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    lr: float,
    grad_clip: float,
    device: torch.device,
) -> StepStats:
    """forward_backward, clip, AdamW at learning rate `lr`; the gradients are zeroed after."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total_loss, total_count, total_correct = forward_backward(model, batch, device)
    if hasattr(model, "clip_grad_norm_"):  # a pipeline stage: the norm of every stage's grads
        grad_norm = model.clip_grad_norm_(grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # FSDP2's gradients are DTensors, and so is their norm: full_tensor() is the global value
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return StepStats(total_loss, total_count, total_correct, float(norm))
