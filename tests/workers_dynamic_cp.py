"""Worker functions for tests/test_dynamic_cp.py, run on every rank of a WorkerPool (harness.py).

`train_docs` runs the real trainer (build_run + loop) on packed documents, static or dynamic CP,
optionally on fixed windows of chosen document lengths (`FixedWindows`), with plain SGD.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import torch

from ringattn.planner.dynamic_cp.documents import DocumentTask
from ringattn.planner.dynamic_cp.schedule import Schedule
from ringattn.train.config import TrainConfig
from ringattn.train.data import get_dataset
from ringattn.train.dynamic.loader import DocumentLoader
from ringattn.train.loop import train as train_run
from ringattn.train.run import build_run

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class FixedWindows:
    """Windows of given document lengths (cycled by sample index), copy-task tokens as
    DocumentTask's, so that a test can make documents straddle every group-size threshold."""

    windows: tuple[tuple[int, ...], ...]
    seq_len: int
    seed: int = 0

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        lengths = self.windows[index % len(self.windows)]
        assert sum(lengths) == self.seq_len, (lengths, self.seq_len)
        gen = torch.Generator().manual_seed(self.seed * 7919 + index)
        inputs, labels = [], []
        for n in lengths:
            doc = torch.randint(128, (n + 1,), generator=gen, device="cpu")
            inputs.append(doc[:-1])
            labels.append(doc[1:])
        return torch.cat(inputs), torch.cat(labels), (0, *accumulate(lengths))


class AllOnRankZero(DocumentLoader):
    """Every document alone on rank 0 (group size 1): the other ranks get no row at all."""

    def schedule(self, lengths: list[int], rows: list[int]) -> Schedule:
        n, ranks = len(lengths), self.dp * self.cp
        load = [sum(self.cost(x, 1) for x in lengths)] + [0.0] * (ranks - 1)
        return Schedule(self.dp, self.cp, (1,) * n, (0,) * n, (0,) * n, tuple(load))


def documents_of(options: dict, windows: tuple | None) -> DocumentTask | FixedWindows:
    """The dataset a run of `options` reads (FixedWindows when `windows` is given)."""
    if windows is None:
        return get_dataset(options["data"], options["seq_len"], options.get("seed", 0))
    return FixedWindows(tuple(map(tuple, windows)), options["seq_len"])


def train_docs(
    rank: int,
    world_size: int,
    options: dict,
    windows: tuple | None = None,
    sgd: bool = True,
    all_on_rank_zero: bool = False,
) -> dict:
    """Train TrainConfig(**options), with SGD at its lr unless `sgd` is False (AdamW: what a
    checkpoint holds, for resuming); rank 0's losses, step records and weights."""
    run = build_run(TrainConfig(**options), CPU)
    if sgd:
        run.optimizer = torch.optim.SGD(run.model.parameters(), lr=run.cfg.lr)
    if windows is not None:
        run.data = dataclasses.replace(run.data, dataset=documents_of(options, windows))
    if all_on_rank_zero:
        run.data = AllOnRankZero(**{f.name: getattr(run.data, f.name)
                                    for f in dataclasses.fields(run.data)})  # fmt: skip
    batch = run.data.batch(run.start_step)  # this rank's rows at the first step
    train_run(run)
    params = {}
    for name, p in run.model.named_parameters():
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return {
        "losses": [h["loss"] for h in run.history],
        "records": run.history,
        "start_step": run.start_step,
        "params": params if rank == 0 else None,
        "rows": batch.inputs.shape[1],
        "real": int((batch.labels >= 0).sum()),
        "segments": [(s.start, s.stop, s.cu_seqlens) for s in batch.segments],
    }
