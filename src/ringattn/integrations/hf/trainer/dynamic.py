"""`ContextParallelConfig(dynamic=True)`: dynamic CP inside the Trainer, one training batch at a
time.

A Trainer rank holds only its dp group's batch, and dynamic CP places the documents of every dp
row over all dp x cp ranks, so each training batch goes:

    one_row(inputs)            this dp row's documents as one row (batch.py)
    gather_rows                every rank's row, one all-gather of int64 over the world (token
                               ids, positions, labels, document starts: 4 x S ints per rank,
                               nothing next to the step's activations); each dp row's is taken
                               from its first cp rank
    plan_step                  the decoder's scheduler (planner/dynamic_cp/schedule.py), priced
                               by DocumentCost for this model's shape: a group size and a group
                               per document, the same on every rank (a pure function of lengths)
    rank_pieces                this rank's pieces end to end and their Segments
                               (models/segments.py), labels shifted inside each document first
    -> model kwargs            input_ids, position_ids (the collator's), labels = shift_labels,
                               num_items_in_batch (the Trainer's, the global batch's count),
                               use_cache=False, `ringattn_segments` (attention.py runs each
                               piece over its sub-group)

Exact: every supervised token of the global batch is on one rank once, each rank's loss is its
sum over the Trainer's global count, and the Trainer's DDP (or FSDP) averages the gradients over
the W ranks of losses it multiplied by W (average_tokens_across_devices): the gradients are
summed over every rank, wherever a token ran. A rank given no document trains a one-token
unsupervised document (DDP's all-reduce then still meets every parameter's gradient). The
sub-groups are created once, when the Trainer is built. Eval batches stay static CP (their
loss is reduced over the cp group, prediction_step).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from ringattn.integrations.hf.attention import SEGMENTS_KWARG
from ringattn.integrations.hf.batch import IGNORE, shift_labels
from ringattn.integrations.hf.trainer.config import Split
from ringattn.models.segments import rank_pieces
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.schedule import plan_step
from ringattn.planner.models import from_hf_dict
from ringattn.runtime.subgroups import build_sub_groups

__all__ = ["DynamicSharder"]


def gather_rows(row: dict, split: Split) -> list[torch.Tensor]:
    """Every dp row's (4, S_d) int64 [input_ids, position_ids, labels, document starts], in dp
    order; one all-gather of the lengths, one of the rows padded to the longest."""
    ids = row["input_ids"][0]  # (S,)
    labels = row.get("labels")
    labels = labels[0] if labels is not None else torch.full_like(ids, IGNORE)
    starts = torch.zeros_like(ids)
    starts[torch.tensor(row["cu_seqlens"][:-1], dtype=torch.int64, device=ids.device)] = 1
    mine = torch.stack([ids, row["position_ids"][0].to(ids.device), labels.to(ids.device),
                        starts]).long()  # fmt: skip  # (4, S)
    if split.world_size == 1:
        return [mine]
    world = split.world_size
    sizes = [torch.zeros(1, dtype=torch.int64, device=ids.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.shape[1]], dtype=torch.int64, device=ids.device))
    longest = max(int(s) for s in sizes)
    padded = torch.nn.functional.pad(mine, (0, longest - mine.shape[1]))
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded)
    return [rows[d * split.cp][:, : int(sizes[d * split.cp])] for d in range(split.dp)]


class DynamicSharder:
    """Built once per Trainer (creates the sub-groups: collective); `shard(row, count)` per
    training batch (collective: the row all-gather)."""

    def __init__(self, split: Split, layout: str, model: torch.nn.Module, half: bool) -> None:
        self.split, self.layout = split, layout
        self.groups = build_sub_groups(split.dp, split.cp, split.group, split.cp_rank)
        spec = from_hf_dict(model.config.to_dict(), type(model).__name__)
        self.cost = DocumentCost(spec, elem_bytes=2 if half else 4)
        self.cp_groups: dict[str, int] = {}
        """Documents per group size since the last log (the Trainer's `log` reads and clears)."""
        self.imbalance = 0.0
        """The largest max / mean of the ranks' planned costs since the last log."""

    def shard(self, row: dict, count: object) -> dict:
        """This rank's keyword arguments for the model (see the module docstring)."""
        inputs, positions, labels = [], [], []
        for full in gather_rows(row, self.split):
            bounds = [*torch.nonzero(full[3]).flatten().tolist(), full.shape[1]]
            shifted = shift_labels(full[2][None], bounds)[0]  # inside each document
            for a, b in itertools.pairwise(bounds):
                inputs.append(full[0, a:b])
                positions.append(full[1, a:b])
                labels.append(shifted[a:b])
        split = self.split
        per_rank = math.ceil(sum(len(x) for x in inputs) / split.world_size)
        plan = plan_step([len(x) for x in inputs], split.dp, split.cp, max(per_rank, 1), self.cost)
        for size, n in plan.histogram.items():
            self.cp_groups[size] = self.cp_groups.get(size, 0) + n
        self.imbalance = max(self.imbalance, plan.imbalance)
        (x, pos, y), segments = rank_pieces((inputs, positions, labels), (0, 0, IGNORE), plan,
                                            split.dp_rank, self.groups, self.layout)  # fmt: skip
        local = {"input_ids": x[None], "position_ids": pos[None], "use_cache": False,
                 SEGMENTS_KWARG: segments}  # fmt: skip
        if row.get("labels") is not None:
            local["labels"] = local["shift_labels"] = y[None]
            if count is None:
                count = sum(int((t != IGNORE).sum()) for t in labels)
            local["num_items_in_batch"] = torch.as_tensor(count, device=x.device)
        return local

    def take_log(self) -> dict:
        """{"cp_groups", "imbalance"} since the last call (nothing when no batch ran)."""
        if not self.cp_groups:
            return {}
        out = {"cp_groups": dict(sorted(self.cp_groups.items(), key=lambda kv: int(kv[0]))),
               "imbalance": self.imbalance}  # fmt: skip
        self.cp_groups, self.imbalance = {}, 0.0
        return out
