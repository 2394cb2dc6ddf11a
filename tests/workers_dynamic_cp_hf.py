"""Worker functions for tests/test_dynamic_cp_hf.py, run on every rank of a WorkerPool.

`train_hf` runs the real `train --hf` trainer (build_run + loop) on fixed windows of chosen
document lengths (`FixedTexts`), static or --dynamic-cp, with plain SGD.
"""

from __future__ import annotations

import dataclasses

import torch

from ringattn.train.hf.dynamic import DynamicLoader, Windows
from ringattn.train.loop import train as train_run
from workers_dynamic_cp import AllOnRankZero
from workers_train import build, full_parameters


@dataclasses.dataclass(frozen=True)
class FixedTexts:
    """hf/data.PackedConversations' interface (`sample(i)` -> ids, positions, labels) over
    windows of given document lengths (cycled by index): random tokens, positions restarting at
    every document, every third label -100 (as chat data's unsupervised turns)."""

    windows: tuple[tuple[int, ...], ...]
    seq_len: int
    vocab: int

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lengths = self.windows[index % len(self.windows)]
        assert sum(lengths) == self.seq_len, (lengths, self.seq_len)
        gen = torch.Generator().manual_seed(7919 + index)
        ids = torch.randint(self.vocab, (self.seq_len,), generator=gen, device="cpu")
        positions = torch.cat([torch.arange(n, device="cpu") for n in lengths])
        labels = torch.where(torch.arange(self.seq_len, device="cpu") % 3 == 2, -100, ids)
        return ids, positions, labels


def train_hf(rank: int, world_size: int, options: dict, windows: tuple, vocab: int,
             all_on_rank_zero: bool = False) -> dict:  # fmt: skip
    """Train `options` (workers_train.build: optimizer="sgd" for SGD) on FixedTexts, with
    --dynamic-cp optionally every document on rank 0 (the others get none); rank 0's losses,
    step records and weights, and every rank's supervised rows at step 0."""
    run = build(options)
    fixed = FixedTexts(tuple(map(tuple, windows)), options["seq_len"], vocab)
    if isinstance(run.data, DynamicLoader):
        documents = dataclasses.replace(run.data.documents, dataset=Windows(fixed))
        if all_on_rank_zero:
            fields = dataclasses.fields(documents)
            documents = AllOnRankZero(**{f.name: getattr(documents, f.name) for f in fields})
        run.data = DynamicLoader(documents)
    else:
        run.data = dataclasses.replace(run.data, dataset=fixed)
    batch = run.data.batch(run.start_step)
    init = full_parameters(run.model)
    train_run(run)
    params = full_parameters(run.model)
    return {
        "losses": [h["loss"] for h in run.history],
        "records": run.history,
        "params": params if rank == 0 else None,
        "init": init if rank == 0 else None,
        "real": int((batch.labels >= 0).sum()),
        "rows": batch.labels.shape[1],
    }
