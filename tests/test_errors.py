"""Bad input: a clear error with the values and the fix, on every rank, before any communication.

After each error the same pool runs a correct call, which proves that no rank was left inside a
collective (a rank stuck in the transport would make that call hang and fail the test).
"""

from __future__ import annotations

import pytest

FN = "workers:call_attention"
QKV = ((1, 4, 8, 16),) * 3

CASES = {
    "q-3d": (
        {"shapes": ((4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))},
        ValueError,
        r"q must be 4-D .*got shape \(4, 8, 16\)",
    ),
    "heads": (
        {"shapes": ((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))},
        ValueError,
        r"query heads 6 must be a multiple of key/value heads 4",
    ),
    "head-dim": (
        {"shapes": ((1, 4, 8, 16), (1, 4, 8, 8), (1, 4, 8, 8))},
        ValueError,
        r"head dims differ: q has 16, k/v have 8",
    ),
    "kv-shape": (
        {"shapes": ((1, 4, 8, 16), (1, 4, 8, 16), (1, 2, 8, 16))},
        ValueError,
        r"k and v must have the same shape",
    ),
    "local-len": (
        {"shapes": ((1, 4, 8, 16), (1, 4, 6, 16), (1, 4, 6, 16))},
        ValueError,
        r"local sequence lengths differ: q has 8, k/v have 6",
    ),
    "dtype-mix": (
        {"dtypes": ("float32", "bfloat16", "float32")},
        TypeError,
        r"share one dtype.*k torch.bfloat16",
    ),
    "int-dtype": ({"dtypes": ("int64",) * 3}, TypeError, r"q has dtype torch.int64; use one of"),
    "zigzag-odd": (
        {"shapes": ((1, 4, 7, 16),) * 3, "layout": "zigzag"},
        ValueError,
        r"local sequence length 7 must be a multiple of 2 for the zigzag layout",
    ),
    "layout-name": (
        {"layout": "zig"},
        ValueError,
        r"unknown layout 'zig'; choose one of \['contiguous', 'striped', 'zigzag'\]",
    ),
    "strategy-name": (
        {"strategy": "tree"},
        ValueError,
        r"unknown strategy 'tree'; choose one of \['ring', 'allgather'",
    ),
    "backend-name": ({"backend": "fa3"}, ValueError, r"unknown backend 'fa3'; choose one of"),
    "backend-device": (
        {"backend": "cudnn"},
        ValueError,
        r"backend 'cudnn' cannot run this case: needs CUDA tensors",
    ),
    "scale": ({"scale": float("nan")}, ValueError, r"scale must be a finite number"),
    "group-type": ({"group": "world"}, TypeError, r"group must be a torch.distributed"),
}


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_raises_the_same_clear_error(pools, world_size, case):
    kwargs, exc_type, match = CASES[case]
    pool = pools(world_size)
    messages = pool.run_expect_error(FN, match=match, exc_type=exc_type, **kwargs)
    assert len(set(messages)) == 1, messages
    assert pool.run("workers:after_error_still_works") == pytest.approx(
        [0.0] * world_size, abs=1e-12
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_that_disagree_get_an_error_not_a_hang(pools, world_size):
    pool = pools(world_size)
    last = world_size - 1
    # one rank holds a different local length: each rank is valid alone
    messages = pool.run_expect_error(
        FN,
        per_rank={last: {"shapes": ((1, 4, 10, 16),) * 3}},
        match=r"ranks disagree.*q\.shape",
        exc_type=ValueError,
        timeout=60,
    )
    assert f"rank {last}: q.shape=(1, 4, 10, 16)" in messages[0]
    # one rank asks for causal attention, the others do not
    pool.run_expect_error(
        FN,
        per_rank={0: {"causal": True}},
        match=r"ranks disagree.*causal",
        exc_type=ValueError,
        timeout=60,
    )
    pool.run_expect_error(
        FN, per_rank={0: {"layout": "striped"}}, match=r"layout", exc_type=ValueError, timeout=60
    )
    assert max(pool.run("workers:after_error_still_works")) < 1e-12


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_and_unshard_errors(pools, world_size):
    pool = pools(world_size)
    pool.run_expect_error(
        "workers:call_shard",
        seq_len=10,
        layout="zigzag",
        exc_type=ValueError,
        match=rf"sequence length 10 is not divisible by 2\*world_size="
        rf"{2 * world_size} \(zigzag layout\); pad",
    )
    pool.run_expect_error(
        "workers:call_shard",
        seq_len=4 * world_size + 1,
        layout="striped",
        exc_type=ValueError,
        match=r"not divisible by world_size",
    )
    pool.run_expect_error(
        "workers:call_shard",
        seq_len=0,
        layout="zigzag",
        per_rank_len=[2] * (world_size - 1) + [4],
        exc_type=ValueError,
        match=r"ranks disagree.*shape",
    )
