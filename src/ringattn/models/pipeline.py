"""Pipeline parallelism for models/decoder.py's decoder with `torch.distributed.pipelining`: the
blocks are split into pp stages, each rank of a pipeline runs one, and micro-batches flow through
them on a GPipe or 1F1B schedule.

    pp = 2, 4 blocks, M micro-batches of the rank's batch (B, S):

        stage 0 (pp rank 0): tok_embeddings, layers 0-1            -> activations (B/M, S, dim)
        stage 1 (pp rank 1): layers 2-3, norm, output, token loss  <- (send/recv over the pp group)

        GPipe:  F0 F1 .. F(M-1) then B(M-1) .. B0 on every stage (all forwards, then backwards)
        1F1B:   after pp - 1 - stage warm-up forwards, one forward and one backward in turn

`DecoderStage` holds the stage's modules under their names in the whole model (`layers.2`,
`norm`...), so its state dict has the same keys as the whole model's: DCP checkpoints written under
one pp degree load under another (or none), each rank reading its own layers.

The loss is the global token mean, as without pipelining (train/step.py): the last stage returns,
for each micro-batch, its sum of token losses divided by the supervised tokens of the whole global
batch (known before the step: a sum over the world of each last stage's count), the schedule
backpropagates it without scaling (scale_grads=False), and FSDP2 sums the gradients over dp x cp.
The stage runs its own backward, so it offers `forward_backward(batch, device)`, and its own
`clip_grad_norm_`, whose norm covers every stage's parameters (a sum of squares over pp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringattn.comm.world import sum_over_world
from ringattn.models.decoder import Transformer
from ringattn.models.loss import IGNORE, chunked_cross_entropy
from ringattn.models.rope import rope_angles

__all__ = ["SCHEDULES", "DecoderStage", "split_stage", "stage_layers"]

SCHEDULES = ("gpipe", "1f1b")


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The blocks of `stage` of `pp`: contiguous, as even as possible (earlier stages get the
    extra block, the last stage also holds the output projection and the loss)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class DecoderStage(nn.Module):
    """One pipeline stage of a Transformer: a range of its blocks, with the embedding on the first
    stage and the final norm, output projection and loss on the last (see the module docstring).
    """

    def __init__(
        self, model: Transformer, stage: int, pp: int, group: object, tp_share: tuple[int, int]
    ):
        super().__init__()
        self.cfg, self.stage, self.pp, self.group = model.cfg, stage, pp, group
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        self.checkpoint_blocks, self.loss_chunk = model.checkpoint_blocks, model.loss_chunk
        self.tp_share = tp_share  # (tp, tp_rank): the last stage supervises its tp rank's tokens
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
        blocks = stage_layers(len(model.layers), pp, stage)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        if self.is_last:
            self.norm, self.output = model.norm, model.output
        self.schedule_name, self.microbatches = "gpipe", 1
        self._schedule: object = None
        self._positions: torch.Tensor | None = None
        self._total = 1.0  # supervised tokens of the global batch
        self._sums: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch: tokens (b, S) on the first stage, activations (b, S, dim) after; the
        last stage returns its micro-batch's loss sum / the global count (a 0-dim tensor)."""
        cos, sin = rope_angles(self._positions, self.cfg.head_dim, self.cfg.rope_theta)
        if self.is_first:
            x = self.tok_embeddings(x)  # (b, S, dim)
        for layer in self.layers.values():
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        if not self.is_last:
            return x
        hidden, labels = self.norm(x).flatten(0, 1), self._share(labels).flatten()
        loss, count, correct = chunked_cross_entropy(hidden, self.output, labels, self.loss_chunk)
        self._sums.append((loss.detach(), count, correct))
        return loss / self._total

    def _share(self, labels: torch.Tensor) -> torch.Tensor:
        tp, tp_rank = self.tp_share
        return labels.chunk(tp, dim=1)[tp_rank]  # (b, S/tp): the tokens this rank holds

    def _build_schedule(self, device: torch.device) -> object:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self, self.stage, self.pp, device, group=self.group)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule_name]
        return kind(stage, self.microbatches, loss_fn=_the_loss, scale_grads=False)

    def forward_backward(self, batch: object, device: torch.device) -> tuple[float, float, float]:
        """Forward and backward of the global mean token loss through the pipeline (collective
        over the world); the global (loss sum, supervised tokens, right predictions).

        `batch` is the trainer's Batch: `inputs`, `labels` (B, S) and `positions` (S,)."""
        if self._schedule is None:
            self._schedule = self._build_schedule(device)
        self._positions, self._sums = batch.positions, []
        mine = float((self._share(batch.labels) != IGNORE).sum()) if self.is_last else 0.0
        self._total = max(sum_over_world([mine], device)[0], 1.0)
        if self.is_first:
            self._schedule.step(batch.inputs)
        elif self.is_last:
            self._schedule.step(target=batch.labels, labels=batch.labels, return_outputs=False)
        else:
            self._schedule.step()
        # the last M: on its first step the stage may also have run a forward to infer shapes
        sums = [sum(float(s[i]) for s in self._sums[-self.microbatches :]) for i in range(3)]
        total_loss, total_count, total_correct = sum_over_world(sums, device)
        return total_loss, total_count, total_correct

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients of every stage so that their joint norm is at most `max_norm`;
        returns that norm (before clipping), the same on every rank."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        square = norm.double() ** 2
        dist.all_reduce(square, group=self.group)  # the stages' squares add up
        norm = square.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
        for grad in grads:
            grad.mul_(coef.item())
        return norm


def _the_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's output is already its micro-batch's share of the global mean loss."""
    return output


def split_stage(
    model: Transformer,
    pp: int,
    stage: int,
    group: object,
    *,
    microbatches: int,
    schedule: str,
    tp_share: tuple[int, int] = (1, 0),
) -> DecoderStage:
    """This rank's stage of `model` (already context- and tensor-parallel)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {SCHEDULES}")
    part = DecoderStage(model, stage, pp, group, tp_share)
    part.schedule_name, part.microbatches = schedule, microbatches
    return part
