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


ONE_RANK_WRONG = {
    # data loaders produce exactly this: one rank's shard is short, one rank read another config
    "short-shard": ({1: {"shapes": ((1, 4, 7, 16),) * 3}}, ValueError, r"length 7 must be"),
    "heads": (
        {2: {"shapes": ((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))}},
        ValueError,
        r"query heads 6 must be a multiple of key/value heads 4",
    ),
    "window": ({1: {"window": (-5, 0)}}, ValueError, r"window"),
    "strategy": ({1: {"strategy": "tree"}}, ValueError, r"unknown strategy 'tree'"),
    "backend": ({3: {"backend": "cudnn"}}, ValueError, r"backend 'cudnn' cannot run"),
    "dtype": ({0: {"dtypes": ("int64",) * 3}}, TypeError, r"q has dtype torch.int64"),
}


@pytest.mark.parametrize("case", sorted(ONE_RANK_WRONG))
def test_one_wrong_rank_gives_every_rank_the_same_error(pools, case):
    """Only one rank's arguments are bad: every rank raises the same error, naming that rank,
    within seconds (not the process-group timeout), and the pool still works afterwards."""
    per_rank, exc_type, match = ONE_RANK_WRONG[case]
    pool = pools(4)
    (bad,) = per_rank
    messages = pool.run_expect_error(
        FN, per_rank=per_rank, match=match, exc_type=exc_type, timeout=20
    )
    assert len(set(messages)) == 1, messages
    valid = ", ".join(str(r) for r in range(4) if r != bad)
    assert messages[0].startswith(f"rank {bad} of 4: "), messages[0]
    assert messages[0].endswith(f"(ranks {valid}: arguments valid)"), messages[0]
    assert max(pool.run("workers:after_error_still_works")) < 1e-12


def test_one_wrong_rank_in_unshard(pools):
    pool = pools(3)
    messages = pool.run_expect_error(
        "workers:call_unshard_one_rank_wrong", match=r"rank 2 of 3: dim 7 is out of range",
        exc_type=ValueError, timeout=20,
    )  # fmt: skip
    assert len(set(messages)) == 1, messages
    assert max(pool.run("workers:after_error_still_works")) < 1e-12


def test_ranks_on_different_kernels_disagree(pools):
    """The kernel `auto` picked is part of the agreement: a probe that fails on one rank only
    must not leave the ranks on different kernels."""
    pool = pools(2)
    messages = pool.run_expect_error(
        "workers:call_with_probe_failing_on", bad_rank=1, match=r"ranks disagree.*kernel",
        exc_type=ValueError, timeout=20,
    )  # fmt: skip
    assert "rank 0: kernel='cpu_flash'; rank 1: kernel='reference'" in messages[0], messages[0]
    assert max(pool.run("workers:after_error_still_works")) < 1e-12


def test_a_mesh_world_is_refused_by_single_group_collectives():
    """MeshInfo.group is the ulysses sub-group, for backend queries only: the ring and the
    collectives that need one process group refuse it instead of talking to the wrong ranks."""
    import torch

    from ringattn.comm import (
        GroupInfo,
        MeshInfo,
        RingComm,
        all_gather_async,
        all_to_all,
        reduce_scatter,
    )

    mesh = MeshInfo(None, 1, 4, GroupInfo(None, 1, 2), GroupInfo(None, 0, 2))
    x = torch.zeros(4, 3)
    for call in (
        lambda: RingComm(mesh),
        lambda: all_gather_async(x, mesh),
        lambda: reduce_scatter(x, mesh),
        lambda: all_to_all([[x]] * 4, [[((4, 3), x.dtype)]] * 4, mesh),
    ):
        with pytest.raises(TypeError, match=r"needs one process group.*2-D mesh"):
            call()


def test_nccl_needs_the_rank_on_its_own_cuda_device(monkeypatch):
    """NCCL with tensors on a GPU other than the current device: a clear error naming both and
    the fix (torch.cuda.set_device), instead of NCCL using the wrong GPU."""
    import torch
    import torch.distributed as dist

    from ringattn import resolve
    from ringattn.comm import GroupInfo

    class Q:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    info = GroupInfo(object(), 0, 2)
    with pytest.raises(ValueError, match=r"q is on cuda:1 but .*current CUDA device is cuda:0.*"
                       r"torch.cuda.set_device\(local_rank\)"):  # fmt: skip
        resolve.check_device(info, Q())

    class OnCpu:
        device = torch.device("cpu")

    with pytest.raises(ValueError, match=r"NCCL, which needs CUDA tensors, but q is on cpu"):
        resolve.check_device(info, OnCpu())
