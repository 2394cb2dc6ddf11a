"""Dynamic context parallelism (train/dynamic/): the scheduler as a pure function, and training
that equals static CP and one process (an independent per-document reference) step by step.

Multi-rank cases run the real trainer in worker pools (workers_dynamic_cp.py) with plain SGD and
no clipping, on windows whose documents straddle every group-size threshold.
"""

from __future__ import annotations

import random

import pytest
import torch
from workers_dynamic_cp import documents_of

from ringattn.planner.models import ModelSpec
from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig, validate
from ringattn.train.decoder import build_decoder
from ringattn.train.dynamic.cost import DocumentCost
from ringattn.train.dynamic.schedule import min_size, plan_step
from ringattn.train.step import learning_rate

SEQ = 64
# documents of lengths around the thresholds of budgets 16 (1 x 4, batch 1) and 32 (2 x 2):
# at and one past b, 2b; tiny ones; one window-long; one long beside many tiny ones
WINDOWS = ((16, 17, 15, 16), (33, 31), (32, 32), (1, 1, 62), (64,), (2, 30, 31, 1),
           (32, *([1] * 32)))  # fmt: skip
OPTIONS = {"model": "tiny", "dim": 32, "seq_len": SEQ, "batch_size": 1, "steps": 5,
           "warmup": 1, "lr": 1.0, "grad_clip": 1e9, "quiet": True, "checkpoint_every": 0,
           "data": "docs:16,1.2,1,64"}  # fmt: skip
TINY = ModelSpec("tiny", 32, 2, 4, 2, 256, 256)
COST = DocumentCost(TINY)


def _options(tmp_path, **overrides) -> dict:
    return {**OPTIONS, "out_dir": str(tmp_path), **overrides}


# ---- the scheduler, a pure function --------------------------------------------------------


def _lognormal(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [min(max(round(rng.lognormvariate(5.8, 1.5)), low), high) for _ in range(n)]


@pytest.mark.parametrize("dp, cp", [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (1, 8), (3, 4)])
def test_schedule_places_every_document_once_and_balances(dp, cp):
    """Fuzzed lognormal lengths: every document on exactly one group of its size; each rank's
    planned cost is the sum of its documents' and at most mean + the largest per-rank document
    cost (schedule.py's bound); the same lengths give the same schedule."""
    rng = random.Random(dp * 100 + cp)
    for trial in range(25):
        lengths = _lognormal(rng, rng.randint(1, 60), 1, 8192)
        budget = max(1, sum(lengths) // (dp * cp))
        plan = plan_step(lengths, dp, cp, budget, COST)
        assert plan == plan_step(lengths, dp, cp, budget, COST)  # deterministic
        seen = []
        load = [0.0] * (dp * cp)
        for g in {1 << k for k in range(cp.bit_length())} & set(range(1, cp + 1)):
            for d in range(dp):
                for j in range(cp // g):
                    docs = plan.documents(d, g, j)
                    seen += docs
                    for i in docs:
                        for r in range(d * cp + j * g, d * cp + j * g + g):
                            load[r] += COST(lengths[i], g)
        assert sorted(seen) == list(range(len(lengths))), trial
        assert all(plan.sizes[i] >= min_size(n, budget, cp) for i, n in enumerate(lengths))
        torch.testing.assert_close(torch.tensor(load), torch.tensor(plan.costs))
        mean = sum(load) / len(load)
        biggest = max(COST(n, g) for n, g in zip(lengths, plan.sizes))
        assert max(load) <= mean + biggest + 1e-12, (trial, lengths, plan)
        assert sum(plan.histogram.values()) == len(lengths)
        assert plan.imbalance >= 1.0


def test_schedule_one_rank_tiny_documents_another_one_long():
    """cp = 2, budget 512: a 512-token document fits one rank and goes there alone; as many
    16-token documents as cost the same go to the other rank; no document communicates."""
    tiny = round(COST(512, 1) / COST(16, 1))
    lengths = [512] + [16] * tiny
    plan = plan_step(lengths, 1, 2, 512, COST)
    assert plan.sizes == (1,) * len(lengths)
    long_rank = plan.blocks[0]
    assert all(plan.blocks[i] == 1 - long_rank for i in range(1, len(lengths)))
    assert plan.histogram == {"1": len(lengths)}
    assert plan.imbalance < 1.05


def test_schedule_splits_what_one_rank_cannot_balance():
    """One long document beside little else: it is grown to a group (cost halves and more)."""
    lengths = [2048, 64, 64]
    plan = plan_step(lengths, 1, 4, 2048, COST)
    assert plan.sizes[0] > 1
    assert plan.imbalance < plan_step(lengths, 1, 4, 2048, lambda n, g: COST(n, 1) * (g == 1)
                                      + 1e9 * (g > 1)).imbalance  # fmt: skip


def test_schedule_refuses_bad_input():
    with pytest.raises(ValueError, match="cp a power of two, got dp=1, cp=3"):
        plan_step([10], 1, 3, 10, COST)
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got \[-1\]"):
        plan_step([5, -1], 1, 2, 10, COST)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data": "key-value"}, "--dynamic-cp places packed documents"),
        ({"strategy": "hybrid", "ulysses": 2}, "--strategy hybrid"),
        ({"tp": 2, "cp": 2}, "not supported with --tp"),
        ({"compile": True}, "not supported with --compile"),
        ({"activation_checkpointing": True}, "--activation-checkpointing"),
        ({"hf": "some/dir"}, "--dynamic-cp with --hf"),
    ],
)
def test_dynamic_cp_refuses_what_it_cannot_make_exact(tmp_path, overrides, message):
    cfg = TrainConfig(**{**_options(tmp_path), "dynamic_cp": True, "cp": 4, **overrides})
    with pytest.raises(ValueError, match=message):
        validate(cfg, 4)


def test_dynamic_cp_needs_a_power_of_two(tmp_path):
    cfg = TrainConfig(**{**_options(tmp_path), "dynamic_cp": True, "cp": 3, "seq_len": 66})
    with pytest.raises(ValueError, match="cp a power of two .* got cp=3; use cp=2 or 4"):
        validate(cfg, 3)
