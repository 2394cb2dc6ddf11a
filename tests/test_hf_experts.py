"""Expert parallelism with CP: `parallelize(..., expert_group=...)` splits each MoE layer's experts
over the group and sends every token to its experts' rank; loss and gradients equal one process's.

Tiny Mixtral, Qwen3-MoE and gpt-oss (4 experts, top-2, router loss coefficient 0.5: the router
term is part of the loss compared). Gates: loss relative 1e-5, gradients 1e-4 of each tensor's
largest entry, the expert tensors compared whole (each rank's slice put in place).
Layouts: ep = cp = 2 on 2 ranks; dp 2 x cp 2 with ep 2 (folded onto cp) and ep 4 (the whole world).
A router that sends every token to experts 0 and 1 (all on rank 0) stays exact and does not hang.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _cases(arch: str) -> list[tuple[str, str, str]]:
    kinds = ["dense"] if arch == "gpt_oss" else ["dense", "packed"]  # gpt-oss masks ignore docs
    return [("zigzag", "ring", k) for k in kinds] + [("striped", "allgather", k) for k in kinds]


def _check(rows, cases, ep, what):
    assert [row[0] for row in rows] == cases
    failures = []
    for case, loss_error, grad_error, name, held in rows:
        assert held == pytest.approx(1 / ep), f"{case}: rank 0 holds {held} of the expert weights"
        if not loss_error <= LOSS_RTOL:
            failures.append(f"{case}: loss relative error {loss_error:.3g}")
        if not grad_error <= GRAD_RTOL:
            failures.append(f"{case}: gradient {name} error {grad_error:.3g} of its max entry")
    assert not failures, f"{what}:\n" + "\n".join(failures)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_ep2_cp2_matches_one_process(pools, arch):
    cases = _cases(arch)
    rows = pools(2).run(
        "workers_hf_experts:compare", arch=arch, cases=cases, dp=1, ep=2, timeout=600
    )[0]
    _check(rows, cases, 2, f"{arch}, ep = cp = 2")


@pytest.mark.parametrize("ep", [2, 4])
def test_dp2_cp2_matches_one_process(pools, ep):
    cases = [("zigzag", "ring", "packed"), ("striped", "allgather", "dense")]
    rows = pools(4).run(
        "workers_hf_experts:compare", arch="qwen3_moe", cases=cases, dp=2, ep=ep, timeout=600
    )[0]
    _check(rows, cases, ep, f"dp 2 x cp 2, ep {ep}")


def test_every_token_to_one_rank_is_exact(pools):
    cases = [("zigzag", "ring", "dense")]
    rows = pools(2).run(
        "workers_hf_experts:compare", arch="mixtral", cases=cases, dp=1, ep=2, skewed=True
    )[0]
    _check(rows, cases, 2, "every token routed to rank 0's experts")


def test_indivisible_expert_count_raises_on_every_rank(pools):
    pools(3).run_expect_error(
        "workers_hf_experts:indivisible", match="not divisible", exc_type=ValueError
    )
