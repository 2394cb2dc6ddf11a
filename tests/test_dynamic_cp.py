"""Dynamic context parallelism (train/dynamic/): the scheduler as a pure function, and training
that equals static CP and one process (an independent per-document reference) step by step.

Multi-rank cases run the real trainer in worker pools (workers_dynamic_cp.py) with plain SGD and
no clipping, on windows whose documents straddle every group-size threshold.
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch

from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.schedule import min_size, plan_step
from ringattn.planner.models import ModelSpec
from ringattn.runtime import checkpoint as ckpt
from ringattn.train.config import TrainConfig, validate
from ringattn.train.decoder import build_decoder
from ringattn.train.step import learning_rate
from workers_dynamic_cp import documents_of

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
        ({"hf": "some/dir"}, "with --hf: the copy-task documents are the decoder.s"),
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


# ---- training: dynamic CP == static CP == one process ----------------------------------------


def _reference(options: dict, windows: tuple, dp: int) -> tuple[list[float], dict]:
    """One process, no CP and no packing: every document through the decoder on its own (its
    positions from 0), the step's loss the sum over documents over the global supervised count,
    SGD at the trainer's learning rate. Returns the losses and the final weights."""
    cfg = TrainConfig(**options)
    torch.manual_seed(cfg.seed)
    model = build_decoder(cfg)
    data = documents_of(options, windows)
    per_step = dp * cfg.batch_size
    losses = []
    for step in range(cfg.steps):
        total, count = 0.0, 0
        for w in range(step * per_step, (step + 1) * per_step):
            x, y, bounds = data.sample(w)
            for a, b in pairwise(bounds):
                loss, n, _ = model(x[None, a:b], torch.arange(b - a, device="cpu"), y[None, a:b])
                total = total + loss
                count += int(n)
        (total / count).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= learning_rate(cfg, step) * p.grad
                p.grad = None
        losses.append(float(total.detach()) / count)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _assert_same(got: dict, losses: list[float], params: dict, what: str) -> None:
    """Losses within 1e-6 relative, every weight within 1e-6."""
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), rtol=1e-6, atol=0,
                               msg=lambda m: f"{what} losses: {m}")  # fmt: skip
    for name, value in params.items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")  # fmt: skip


@pytest.mark.parametrize(
    "dp, cp, layout, strategy",
    [
        (1, 4, "zigzag", "ring"),
        (2, 2, "contiguous", "allgather"),
        (1, 4, "striped", "ulysses"),
        (2, 2, "zigzag", "ulysses"),
        (2, 4, "zigzag", "ring"),
    ],
)
@pytest.mark.slow
def test_dynamic_cp_equals_static_cp_and_one_process(pools, tmp_path, dp, cp, layout, strategy):
    """5 SGD steps without clipping on documents straddling every size threshold (WINDOWS):
    dynamic CP's losses and weights equal static CP's on the same mesh, one process's (the
    trainer at cp = 1) and the per-document reference's, to 1e-6."""
    options = _options(tmp_path, dp=dp, cp=cp, layout=layout, strategy=strategy)
    world = dp * cp
    dynamic = pools(world).run("workers_dynamic_cp:train_docs",
                               {**options, "dynamic_cp": True, "out_dir": str(tmp_path / "d")},
                               WINDOWS)  # fmt: skip
    static = pools(world).run("workers_dynamic_cp:train_docs",
                              {**options, "out_dir": str(tmp_path / "s")}, WINDOWS)  # fmt: skip
    single = {**options, "dp": 1, "cp": 1, "batch_size": dp, "strategy": "ring",
              "out_dir": str(tmp_path / "1")}  # fmt: skip
    one = pools(1).run("workers_dynamic_cp:train_docs", single, WINDOWS)[0]
    losses, params = _reference(single, WINDOWS, 1)
    for got, what in ((dynamic[0], "dynamic"), (static[0], "static"), (one, "one process")):
        _assert_same(got, losses, params, what)
    # the schedules differ: dynamic ran documents on groups smaller than cp, static never
    dyn_groups = [r["cp_groups"] for r in dynamic[0]["records"]]
    assert any(set(h) - {str(cp)} for h in dyn_groups), dyn_groups
    assert all(set(r["cp_groups"]) == {str(cp)} for r in static[0]["records"])
    docs = [sum(h.values()) for h in dyn_groups]
    assert docs == [sum(len(WINDOWS[w % len(WINDOWS)]) for w in range(s * dp, (s + 1) * dp))
                    for s in range(5)]  # fmt: skip
    assert all(r["imbalance"] >= 1.0 for r in dynamic[0]["records"])
    # every supervised token on one rank once: the ranks' real rows add up to the step's tokens
    assert sum(r["real"] for r in dynamic) == dp * SEQ
    # training moved the weights far more than the tolerance: the comparison has teeth
    torch.manual_seed(0)
    init = build_decoder(TrainConfig(**single)).output.weight
    assert (params["output.weight"] - init).abs().max() > 1000 * 1e-6


def test_ranks_without_any_document_still_train_exactly(pools, tmp_path):
    """A schedule that puts every document on rank 0 alone: ranks 1-3 run a step on a one-token
    unsupervised document (a forward and backward with zero gradients, so FSDP's collectives
    still meet) and nothing hangs; the
    losses and weights equal the per-document reference's."""
    options = _options(tmp_path, cp=4, steps=3, dynamic_cp=True)
    got = pools(4).run("workers_dynamic_cp:train_docs", options, WINDOWS, True, True)
    assert all(0 < r["rows"] <= 2 for r in got[1:])  # zigzag pads a one-token document to 2
    assert [r["real"] for r in got] == [SEQ, 0, 0, 0]
    single = {**options, "cp": 1, "dynamic_cp": False, "out_dir": str(tmp_path / "1")}
    _assert_same(got[0], *_reference(single, WINDOWS, 1), "all on rank 0")


@pytest.mark.slow
def test_dynamic_cp_resumes_exactly_from_its_own_and_a_static_checkpoint(pools, tmp_path):
    """AdamW (what checkpoints hold), stopped after step 2 and resumed with --dynamic-cp: from a
    dynamic run's checkpoint, bitwise the uninterrupted run's losses and weights; from a static
    run's, its losses within 1e-6 (the first two steps summed the gradients in another order,
    and Adam turns that rounding into up to ~2e-6 on a weight, issue 31: weights within 1e-5)."""
    run = "workers_dynamic_cp:train_docs"
    whole = pools(2).run(run, _options(tmp_path / "a", cp=2, steps=4, lr=1e-2, dynamic_cp=True),
                         WINDOWS, False)[0]  # fmt: skip
    for name, dynamic_first in (("b", True), ("c", False)):
        parts = _options(tmp_path / name, cp=2, steps=4, lr=1e-2, checkpoint_every=2)
        first = pools(2).run(run, {**parts, "stop_at": 2, "dynamic_cp": dynamic_first},
                             WINDOWS, False)[0]  # fmt: skip
        assert ckpt.latest(str(tmp_path / name / "checkpoints")).endswith("step-00000002")
        second = pools(2).run(run, {**parts, "dynamic_cp": True}, WINDOWS, False)[0]
        assert second["start_step"] == 2 and len(first["losses"]) == 2
        losses = first["losses"] + second["losses"]
        if dynamic_first:
            assert losses == whole["losses"]  # bitwise
            assert all(torch.equal(second["params"][k], v) for k, v in whole["params"].items())
            continue
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(whole["losses"], dtype=torch.float64),
                                   rtol=1e-6, atol=0)  # fmt: skip
        for k, v in whole["params"].items():
            torch.testing.assert_close(second["params"][k], v, rtol=0, atol=1e-5)
