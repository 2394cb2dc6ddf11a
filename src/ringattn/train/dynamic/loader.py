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
from itertools import accumulate, pairwise

import torch

from ringattn.layout import get_layout
from ringattn.models.loss import IGNORE
from ringattn.models.segments import Segment
from ringattn.packing import place
from ringattn.train.data import Batch
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.train.dynamic.documents import DocumentTask
from ringattn.runtime.subgroups import SubGroups, sizes_of
from ringattn.planner.dynamic_cp.schedule import Schedule, plan_step, static_schedule

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
        pieces = [(g, plan.documents(self.dp_rank, g, self.groups.block(g)))
                  for g in sizes_of(self.cp)]  # fmt: skip
        pieces = [(g, docs) for g, docs in pieces if docs]  # a group's members all skip it
        if not pieces:  # no document here: an unsupervised one-token document, alone
            inputs.append(torch.zeros(1, dtype=torch.int64, device="cpu"))
            labels.append(torch.full((1,), IGNORE, dtype=torch.int64, device="cpu"))
            pieces = [(1, [len(inputs) - 1])]
        parts, segments, at = [], [], 0
        for g, docs in pieces:
            x, y, pos, bounds = self._piece([inputs[i] for i in docs], [labels[i] for i in docs],
                                            g)  # fmt: skip
            parts.append((x, y, pos))
            segments.append(Segment(at, at + len(x), self.groups.group(g), bounds))
            at += len(x)
        x, y, pos = (torch.cat([p[k] for p in parts]) for k in range(3))
        return DocumentBatch(x[None].to(self.device), y[None].to(self.device),
                             pos.to(self.device), segments, plan.histogram,
                             plan.imbalance)  # fmt: skip

    def _piece(
        self, inputs: list[torch.Tensor], labels: list[torch.Tensor], size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """This rank's rows of documents packed and placed over its group of `size` ranks:
        inputs, labels, RoPE positions (each (local_len,)) and the piece's cu_seqlens."""
        bounds = (0, *accumulate(len(x) for x in inputs))
        index = place(get_layout(self.layout), size, bounds).global_indices(
            self.groups.rank_in(size)
        )  # (local_len,) -1 on padding rows
        real, take = index >= 0, index.clamp(min=0)
        x, y = torch.cat(inputs), torch.cat(labels)
        pos = torch.cat([torch.arange(len(d), device="cpu") for d in inputs])
        return (torch.where(real, x[take], 0), torch.where(real, y[take], IGNORE),
                torch.where(real, pos[take], 0), bounds)  # fmt: skip
