"""One optimisation step: the global token-mean loss, its gradient, clipping, AdamW, the schedule.

    batch (this rank's shard) -> model -> loss_sum, count, correct        (local sums)
    count, loss_sum, correct  <- sum over every rank of the mesh           (global sums)
    (loss_sum / global count).backward()     FSDP2 then SUMS the gradients over all ranks
    clip to --grad-clip
    flags     <- every rank's (stop requested, non-finite local loss, non-finite grad norm)
    no rank's loss or gradient norm non-finite: lr = learning_rate(step), AdamW step
    otherwise the update is skipped on EVERY rank (the decision comes from the shared flags)
    zero the gradients

The loss is the mean over every supervised token of the global batch: each rank divides its SUM
of token losses by the global count, and the gradients are summed over all ranks (mesh.py: FSDP2
with divide factor 1). A mean of per-rank means would weight a rank holding 3 supervised tokens
like one holding 3000, and with zigzag CP the key-value task's answers all sit on rank 0.

The flags travel in one small all-reduce (runtime/consensus.py), which also carries a SIGTERM
request (loop.py): a NaN on one rank never leaves the ranks with different weights, and the step
and the rank are named. The local loss is what tells the ranks apart (FSDP's reduce-scatter
spreads one rank's NaN gradient to every shard, so a non-finite norm is seen everywhere).

The model's contract: `model(inputs, positions, labels)` returns (sum of the token losses,
number of supervised tokens, number predicted right), never a mean (model.Transformer does).
A model may return a fourth value: a term already at its global scale whose sum over the ranks
is added to the objective as is (a MoE router's load-balancing loss, train/hf/recipe.py); it is
logged beside the token loss as `aux_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ringattn.comm.world import sum_over_world
from ringattn.models.segments import set_segments
from ringattn.runtime.consensus import share_flags
from ringattn.train.config import TrainConfig
from ringattn.train.data import Batch

__all__ = ["BAD_GRAD", "BAD_LOSS", "STOP", "StepStats", "build_optimizer", "forward_backward",
           "learning_rate", "train_step"]  # fmt: skip

STOP, BAD_LOSS, BAD_GRAD = 1, 2, 4
"""Bits of a rank's flag word: SIGTERM received, local loss non-finite, grad norm non-finite."""


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
    return _forward_backward(model, batch, device)[1:4]


def _forward_backward(
    model: torch.nn.Module, batch: Batch, device: torch.device
) -> tuple[float, float, float, float, float | None]:
    """forward_backward with this rank's own loss sum first (a pipeline stage: the global one)
    and the global sum of the model's extra loss term last (None without one)."""
    if hasattr(model, "forward_backward"):  # a pipeline stage runs its own (pipeline.py)
        total_loss, total_count, total_correct = model.forward_backward(batch, device)
        return total_loss, total_loss, total_count, total_correct, None
    # packed documents in pieces (train/dynamic/loader.py): the attention layers' segments
    if hasattr(batch, "segments"):
        set_segments(model, batch.segments)
    loss_sum, count, correct, *extra = model(batch.inputs, batch.positions, batch.labels)
    local_loss = loss_sum.item()
    sums = sum_over_world([local_loss, count.item(), correct.item()]
                          + [term.item() for term in extra], device)  # fmt: skip
    objective = loss_sum / max(sums[1], 1.0)
    for term in extra:  # each rank's share; the shares sum to the term (e.g. coef * router aux)
        objective = objective + term
    objective.backward()
    return local_loss, sums[0], sums[1], sums[2], (sums[3] if extra else None)


@dataclass(frozen=True)
class StepStats:
    """What one step measured, summed over the whole mesh."""

    loss_sum: float
    supervised: float
    correct: float
    grad_norm: float
    """Norm of the whole (global) gradient before clipping."""
    flags: tuple[int, ...] = ()
    """Every rank's flag word (STOP | BAD_LOSS | BAD_GRAD), in rank order."""
    aux_loss: float | None = None
    """The model's extra loss term added to the token loss (a MoE router loss), if any."""

    @property
    def applied(self) -> bool:
        """Whether the update was applied (no rank had a non-finite loss or gradient norm)."""
        return not any(f & (BAD_LOSS | BAD_GRAD) for f in self.flags)

    @property
    def stop_requested(self) -> bool:
        """Whether some rank received SIGTERM before this step's flags were shared."""
        return any(f & STOP for f in self.flags)

    def bad_ranks(self) -> dict[int, str]:
        """{rank: what was non-finite there} for this step."""
        out = {}
        for rank, f in enumerate(self.flags):
            what = [name for bit, name in ((BAD_LOSS, "loss"), (BAD_GRAD, "gradient norm"))
                    if f & bit]  # fmt: skip
            if what:
                out[rank] = " and ".join(what)
        return out

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
    stop_requested: bool = False,
) -> StepStats:
    """forward_backward, clip, share the flags, AdamW at learning rate `lr` unless some rank's
    loss or gradient norm is non-finite; the gradients are zeroed after. Collective."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    local_loss, total_loss, total_count, total_correct, aux = _forward_backward(
        model, batch, device
    )
    if hasattr(model, "clip_grad_norm_"):  # a pipeline stage: the norm of every stage's grads
        grad_norm = model.clip_grad_norm_(grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    # FSDP2's gradients are DTensors, and so is their norm: full_tensor() is the global value
    norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    bits = (STOP if stop_requested else 0) | (0 if math.isfinite(local_loss) else BAD_LOSS)
    bits |= 0 if math.isfinite(norm) else BAD_GRAD
    flags = tuple(share_flags(bits, device))
    stats = StepStats(total_loss, total_count, total_correct, norm, flags, aux)
    if stats.applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats
