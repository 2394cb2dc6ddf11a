"""From a step's windows of packed documents to one rank's batch, static or dynamic CP.

    step --> windows step*dp*B .. (step+1)*dp*B - 1      (the samples static CP reads, all rows)
         --> documents, in window order, each with its dp row (window // B)
         --> schedule (schedule.py): static_schedule, or plan_step with --dynamic-cp
         --> for each size g = cp, cp/2, ..., 1: this rank's group of size g holds documents
             D_g: they are packed (cu_seqlens), placed with the layout over the g ranks
             (packing.place) and this rank keeps its rows: one Segment
         --> DocumentBatch: the segments' rows end to end (inputs, labels, RoPE positions
             that restart at every document), the segments, the schedule's histogram and imbalance

Padding rows (each piece is padded to what the layout needs) hold token 0, position 0 and
label IGNORE: never supervised, never attended (packing.py). A rank given no document at all gets
a one-token document of its own (token 0, label IGNORE, attended on the rank alone), so that it
still runs the step's one forward and backward through every parameter: FSDP2 reduce-scatters
only the parameters that have a gradient, and a rank whose attention weights had none would
send buffers of another size than its peers (gloo aborts). Labels are per document (the
data's), so every supervised token of the global batch is on exactly one rank, once: the
loss over the global supervised count (step.py) and FSDP's gradient sum give the same result
whatever the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from ringattn.models.loss import IGNORE
from ringattn.models.segments import Segment, rank_pieces
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.documents import DocumentTask
from ringattn.planner.dynamic_cp.schedule import Schedule, plan_step, static_schedule
from ringattn.runtime.subgroups import SubGroups
from ringattn.train.data import Batch

__all__ = ["DocumentBatch", "DocumentLoader"]


@dataclass
class DocumentBatch(Batch):
    """One rank's rows (inputs, labels (1, S_local), positions (S_local,)) and how they split."""

    segments: list[Segment]
    cp_groups: dict[str, int]
    """The step's histogram of group sizes (schedule.Schedule.histogram)."""
    imbalance: float
    """max / mean of the ranks' planned costs this step."""


@dataclass(frozen=True)
class DocumentLoader:
    """`batch(step)`: this rank's DocumentBatch (the interface of data.Loader)."""

    dataset: DocumentTask
    batch_size: int
    dp_rank: int
    dp: int
    cp: int
    groups: SubGroups
    layout: str
    device: torch.device
    cost: DocumentCost
    dynamic: bool

    def documents(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Every document of the step's global batch: inputs, labels and dp row of each."""
        first, inputs, labels, rows = step * self.dp * self.batch_size, [], [], []
        for w in range(self.dp * self.batch_size):
            x, y, bounds = self.dataset.sample(first + w)
            for a, b in pairwise(bounds):
                inputs.append(x[a:b])
                labels.append(y[a:b])
                rows.append(w // self.batch_size)
        return inputs, labels, rows

    def schedule(self, lengths: list[int], rows: list[int]) -> Schedule:
        if not self.dynamic:
            return static_schedule(lengths, rows, self.dp, self.cp, self.cost)
        budget = self.batch_size * self.dataset.seq_len // self.cp
        return plan_step(lengths, self.dp, self.cp, budget, self.cost)

    def batch(self, step: int) -> DocumentBatch:
        inputs, labels, rows = self.documents(step)
        plan = self.schedule([len(x) for x in inputs], rows)
        positions = [torch.arange(len(x), device="cpu") for x in inputs]  # restart per document
        (x, y, pos), segments = rank_pieces((inputs, labels, positions), (0, IGNORE, 0), plan,
                                            self.dp_rank, self.groups, self.layout)  # fmt: skip
        return DocumentBatch(x[None].to(self.device), y[None].to(self.device),
                             pos.to(self.device), segments, plan.histogram,
                             plan.imbalance)  # fmt: skip
