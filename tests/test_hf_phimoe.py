"""PhiMoE under CP: exact where its router is deterministic, refused by name where it draws.

PhiMoE's sparsemixer router, in training, samples each token's experts (Gumbel noise among the
experts whose logit is within 2 * router_jitter_noise of the best, plus a random mask in its
gradient), and input_jitter_noise scales the input by random factors: a rank draws other numbers
for its tokens than one process does. With router_jitter_noise = 0 and no input jitter the draws
cannot change the choice (only the best expert passes the threshold, then the second best), and
in eval the router takes the top 2 without drawing: both are exact at W = 2-4 in the three
layouts, dense and packed (loss 1e-5 relative, gradients 1e-4 of each tensor's largest entry).
Training with jitter is refused on every rank, naming the setting.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers")

from ringattn.layout import LAYOUTS
from workers_hf_families import survey

CASES = list(itertools.product(sorted(LAYOUTS), ("dense", "packed")))


def _assert_exact(rows):
    wrong = [row for row in rows if row["status"] != "exact"]
    assert not wrong, wrong
    assert len(rows) > 0


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.slow
def test_training_without_jitter_is_exact(pools, world_size):
    rows = pools(world_size).run(
        "workers_hf_families:phimoe_cases", cases=CASES, training=True,
        router_jitter_noise=0.0, input_jitter_noise=0.0,
    )[0]  # fmt: skip
    _assert_exact(rows)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.slow
def test_eval_with_jitter_is_exact(pools, world_size):
    """The released configuration (router_jitter_noise 0.01) in eval: top-2, no draw."""
    cases = [("zigzag", "packed"), ("striped", "dense"), ("contiguous", "packed")]
    rows = pools(world_size).run(
        "workers_hf_families:phimoe_cases", cases=cases, training=False,
        router_jitter_noise=0.01, input_jitter_noise=0.01,
    )[0]  # fmt: skip
    _assert_exact(rows)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"router_jitter_noise": 0.01},
            r"'phimoe'\) in training routes tokens at random \(config.router_jitter_noise=0.01",
        ),
        (
            {"router_jitter_noise": 0.0, "input_jitter_noise": 0.1},
            r"config.input_jitter_noise=0.1.*config.router_jitter_noise = 0",
        ),
    ],
    ids=["router-jitter", "input-jitter"],
)
def test_training_with_jitter_is_refused_on_every_rank(pools, overrides, match):
    pools(2).run_expect_error(
        "workers_hf_families:phimoe_cases", cases=[("zigzag", "packed")], training=True,
        match=match, exc_type=ValueError, **overrides,
    )  # fmt: skip


def test_what_is_refused_is_random_in_one_process():
    """Training with router jitter: one process, two seeds, two different losses (the draws
    matter), while without jitter the seeds do not change the loss."""

    def loss(seed, **overrides):
        model = survey.build("phimoe", **overrides)
        batch = survey.data(model, "dense")
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(**batch, use_cache=False).loss.item()

    assert loss(1, router_jitter_noise=0.5) != loss(2, router_jitter_noise=0.5)
    assert loss(1, router_jitter_noise=0.0) == loss(2, router_jitter_noise=0.0)
