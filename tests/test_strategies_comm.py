"""All-gather, Ulysses and hybrid strategies: communication counted, memory saved for backward,
stale state, determinism and errors (the exactness matrix is test_strategies.py).

Communication is counted by wrapping torch.distributed's entry points (bytes each rank sends), so
a schedule change fails a test.
"""

from __future__ import annotations

import itertools

import pytest

from test_ring import LAYOUTS, WORLD_SIZES


def _by_name(calls):
    names = [name for name, _ in calls]
    return {name: [b for n, b in calls if n == name] for name in names}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allgather_collectives(pools, world_size):
    b, hkv, n, d = 1, 2, 4, 16
    kv_bytes = 2 * b * hkv * n * d * 4  # float32 (k|v) shard
    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        results = pools(world_size).run(
            "workers_strategies:count_collectives",
            strategy="allgather",
            layout=layout,
            causal=causal,
        )
        for forward_calls, backward_calls in results:
            if world_size == 1:
                assert forward_calls == [] and backward_calls == []
                continue
            gather = [c for c in forward_calls if c[0].startswith("all_gather_")]
            assert len(forward_calls) == 1 and gather == [(gather[0][0], kv_bytes)]
            # backward: the same gather again, then a ring reduce-scatter of float32 dK/dV slices
            calls = _by_name(backward_calls)
            assert backward_calls[0] == forward_calls[0]
            assert calls["batch_isend_irecv"] == [kv_bytes] * (world_size - 1)
            assert len(backward_calls) == world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("native", [True, False])
def test_reduce_scatter_matches_all_reduce(pools, world_size, native):
    for error in pools(world_size).run("workers_strategies:reduce_scatter_case", native=native):
        assert error < 1e-6


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_to_all_mixed_dtypes(pools, world_size):
    assert all(pools(world_size).run("workers_strategies:all_to_all_case"))


def _ulysses_bytes(hq, hkv, world_size, rank, b=1, n=4, d=16, e=4):
    """Bytes rank `rank` sends in the four all-to-alls: (q,k,v in; out,lse out; dout[,k,v] in;
    dq,dk,dv out). Pieces are padded to 8 bytes; nothing of this test's sizes needs padding."""
    from ringattn.strategies.ulysses import HeadPlan

    plan = HeadPlan(hq, hkv, world_size)
    others = [dst for dst in range(world_size) if dst != rank]
    q_piece = b * (hq // world_size) * n * d * e
    kv_sent = sum(2 * b * len(plan.kv_heads(dst)) * n * d * e for dst in others)
    lse_piece = b * (hq // world_size) * n * 4
    kv_back = 2 * b * len(plan.kv_heads(rank)) * n * d * e * len(others)  # in k's dtype
    fwd = [q_piece * len(others) + kv_sent, (q_piece + lse_piece) * len(others)]
    bwd = [
        q_piece * len(others) + (kv_sent if plan.replicated else 0),
        q_piece * len(others) + kv_back,
    ]
    return fwd, bwd


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("heads", ["mha", "mqa"])
def test_ulysses_collectives(pools, world_size, heads):
    hq, hkv = (2 * world_size, 2 * world_size) if heads == "mha" else (2 * world_size, 1)
    results = pools(world_size).run(
        "workers_strategies:count_collectives",
        strategy="ulysses",
        layout="zigzag",
        causal=True,
        hq=hq,
        hkv=hkv,
    )
    for rank, (forward_calls, backward_calls) in enumerate(results):
        if world_size == 1:
            assert forward_calls == [] and backward_calls == []
            continue
        fwd, bwd = _ulysses_bytes(hq, hkv, world_size, rank)
        assert forward_calls == [("all_to_all_single", x) for x in fwd]
        assert backward_calls == [("all_to_all_single", x) for x in bwd]


@pytest.mark.parametrize(
    ("world_size", "shape"), [(4, (2, 2)), (8, (2, 4)), (8, (4, 2)), (4, (1, 4)), (4, (4, 1))]
)
def test_hybrid_collectives(pools, world_size, shape):
    u, r = shape
    b, hq, hkv, n, d = 1, 2 * u, u, 4, 16
    kv_bytes = 2 * b * (hkv // u) * u * n * d * 4  # one group's K/V for this rank's heads
    results = pools(world_size).run(
        "workers_strategies:count_collectives",
        strategy="hybrid",
        layout="zigzag",
        causal=True,
        hq=hq,
        hkv=hkv,
        mesh_shape=shape,
    )
    for forward_calls, backward_calls in results:
        fwd, bwd = _by_name(forward_calls), _by_name(backward_calls)
        a2a = 2 if u > 1 else 0
        assert len(fwd.get("all_to_all_single", [])) == a2a
        assert len(bwd.get("all_to_all_single", [])) == a2a
        assert fwd.get("batch_isend_irecv", []) == [kv_bytes] * (r - 1)
        assert sorted(bwd.get("batch_isend_irecv", [])) == [kv_bytes] * (2 * r - 1 if r > 1 else 0)
        assert set(fwd) | set(bwd) <= {"all_to_all_single", "batch_isend_irecv"}


# ---- memory, stale state, determinism ----


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize(
    ("strategy", "hq", "hkv"),
    [("allgather", 8, 2), ("ulysses", 8, 4), ("ulysses", 8, 1), ("ulysses", 12, 3)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saved_for_backward_is_no_more_than_local_tensors(
    pools, world_size, strategy, hq, hkv, dtype
):
    runs = pools(world_size).run(
        "workers_strategies:saved_bytes", strategy=strategy, hq=hq, hkv=hkv, dtype=dtype
    )
    for saved, budget in runs:
        assert saved <= budget, (saved, budget)


def test_hybrid_saved_for_backward(pools):
    runs = pools(4).run(
        "workers_strategies:saved_bytes",
        strategy="hybrid",
        hq=4,
        hkv=2,
        dtype="float32",
        mesh_shape=(2, 2),
    )
    for saved, budget in runs:
        assert saved <= budget, (saved, budget)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_two_forwards_then_backward_through_first(pools, world_size, strategy):
    hq, hkv = (2 * world_size, 1) if strategy == "ulysses" else (4, 2)
    runs = pools(world_size).run(
        "workers_strategies:stale_state", strategy=strategy, hq=hq, hkv=hkv
    )
    assert max(runs) < 1e-9


def test_hybrid_two_forwards_then_backward_through_first(pools):
    runs = pools(4).run("workers_strategies:stale_state", strategy="hybrid", mesh_shape=(2, 2))
    assert max(runs) < 1e-9


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_deterministic(pools, world_size, strategy, dtype):
    hq, hkv = (2 * world_size, 1) if strategy == "ulysses" else (4, 2)
    runs = pools(world_size).run(
        "workers_strategies:determinism", strategy=strategy, dtype=dtype, hq=hq, hkv=hkv
    )
    assert all(runs)


def test_hybrid_bitwise_deterministic(pools):
    assert all(
        pools(4).run(
            "workers_strategies:determinism", strategy="hybrid", dtype="bfloat16", mesh_shape=(2, 2)
        )
    )


# ---- bad input ----


def _still_works(pool):
    assert max(pool.run("workers:after_error_still_works")) < 1e-12


@pytest.mark.parametrize("world_size", [3])
def test_ulysses_heads_not_divisible(pools, world_size):
    pool = pools(world_size)
    messages = pool.run_expect_error(
        "workers:call_attention",
        strategy="ulysses",
        exc_type=ValueError,
        match=r"strategy='ulysses' on 3 ranks splits the 4 query heads over its 3 ranks, but 4 is "
        r"not divisible by 3; .*\[1, 2, 4\].*strategy='ring' or 'allgather'",
    )
    assert len(set(messages)) == 1
    _still_works(pool)


def test_hybrid_errors(pools):
    pool = pools(4)
    pool.run_expect_error(
        "workers:call_attention",
        strategy="hybrid",
        exc_type=ValueError,
        match=r"strategy='hybrid' needs group=a 2-D DeviceMesh .* got a process group of 4 ranks",
    )
    pool.run_expect_error(
        "workers_strategies:call_with_mesh",
        mesh_shape=(2, 2),
        names=("dp", "cp"),
        exc_type=ValueError,
        match=r"needs dims named 'ulysses' and 'ring', got a 2-D mesh of shape \(2, 2\) with "
        r"dims \('dp', 'cp'\)",
    )
    pool.run_expect_error(
        "workers_strategies:call_with_mesh",
        mesh_shape=(2, 2),
        hq=3,
        hkv=1,
        exc_type=ValueError,
        match=r"'ulysses' mesh dim of size 2 splits the 3 query heads",
    )
    for strategy in ("ring", "allgather", "ulysses"):
        pool.run_expect_error(
            "workers_strategies:call_with_mesh",
            mesh_shape=(2, 2),
            strategy=strategy,
            exc_type=ValueError,
            match=r"needs a 1-D process group, got a 2-D DeviceMesh",
        )
    pool.run_expect_error(
        "workers_strategies:shard_with_mesh",
        mesh_shape=(4, 1),
        names=("cp", "dp"),
        exc_type=ValueError,
        match=r"needs dims named 'ulysses' and 'ring'",
    )
    _still_works(pool)


def test_ranks_that_disagree_on_the_strategy(pools):
    pool = pools(2)
    messages = pool.run_expect_error(
        "workers:call_attention",
        per_rank={1: {"strategy": "allgather"}},
        exc_type=ValueError,
        match=r"ranks disagree.*strategy",
        timeout=60,
    )
    assert "rank 1: strategy='allgather'" in messages[0]
    _still_works(pool)
