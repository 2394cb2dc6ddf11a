"""All-gather, Ulysses and hybrid strategies: the ring's exactness matrix, collectives, errors.

Same gates as test_ring.py (DESIGN §5), per rank, forward and backward, against the float64
reference. Ulysses splits query heads over the ranks, so its head counts scale with W (MHA; GQA
with K/V heads partitioned; GQA and MQA with K/V heads replicated). Hybrid runs on 2-D meshes
"ulysses" x "ring" of the pool's world. Communication is counted by wrapping torch.distributed's
entry points (bytes each rank sends), so a schedule change fails a test.
"""

from __future__ import annotations

import itertools

import pytest

from test_ring import LAYOUTS, WORLD_SIZES, _assert_rows

RING_HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def _heads(strategy: str, world_size: int) -> dict[str, tuple[int, int]]:
    if strategy != "ulysses":
        return RING_HEADS
    w = world_size
    return {"mha": (2 * w, 2 * w), "gqa": (2 * w, w), "gqa-rep": (2 * w, 2), "mqa": (2 * w, 1)}


def _matrix(strategy: str) -> list[tuple[int, dict]]:
    """test_ring's exactness matrix for one strategy, ordered by world size."""
    cases = []
    for world_size in WORLD_SIZES:
        heads = _heads(strategy, world_size)
        for layout, causal, name in itertools.product(LAYOUTS, (False, True), heads):
            hq, hkv = heads[name]
            base = {"strategy": strategy, "layout": layout, "causal": causal, "hq": hq, "hkv": hkv}
            for backend in ("reference", "cpu_flash"):
                cases.append(
                    (world_size, {**base, "head_dim": 40, "dtype": "float64", "backend": backend})
                )
            cases.append((world_size, {**base, "head_dim": 24, "dtype": "float32"}))
        hq, hkv = heads["gqa"]
        for layout, dtype in itertools.product(LAYOUTS, ("bfloat16", "float16")):
            cases.append(
                (
                    world_size,
                    {
                        "strategy": strategy,
                        "layout": layout,
                        "causal": True,
                        "hq": hq,
                        "hkv": hkv,
                        "head_dim": 64,
                        "dtype": dtype,
                        "local_len": 16,
                    },
                )
            )
        hq, hkv = heads["mqa"]
        cases.append(
            (
                world_size,
                {
                    "strategy": strategy,
                    "layout": "zigzag",
                    "causal": False,
                    "hq": hq,
                    "hkv": hkv,
                    "head_dim": 64,
                    "dtype": "bfloat16",
                    "local_len": 16,
                },
            )
        )
    return cases


def _id(case):
    world_size, kw = case
    causal = "causal" if kw["causal"] else "full"
    mesh = "x".join(map(str, kw["mesh_shape"])) if "mesh_shape" in kw else f"W{world_size}"
    return (
        f"{kw['strategy']}-{mesh}-{kw['layout']}-{causal}-{kw['hq']}q{kw['hkv']}kv-"
        f"{kw['dtype']}-{kw.get('backend', 'auto')}"
    )


CASES = _matrix("allgather") + _matrix("ulysses")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_exact_against_fp64_reference(pools, case):
    world_size, kwargs = case
    _assert_rows(pools(world_size).run("workers:attention_case", **kwargs), _id(case))


@pytest.mark.parametrize(
    ("world_size", "hq", "hkv"),
    [(4, 12, 3), (3, 12, 4)],
    ids=["W4-12q3kv", "W3-12q4kv"],
)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_ulysses_uneven_kv_heads(pools, world_size, hq, hkv, dtype):
    """A rank's query heads span K/V heads unevenly (12q/3kv on 4 ranks: rank 1 reads 0, 1, 1)."""
    for layout in ("zigzag", "striped"):
        kwargs = {
            "strategy": "ulysses",
            "layout": layout,
            "causal": True,
            "hq": hq,
            "hkv": hkv,
            "head_dim": 32,
            "dtype": dtype,
            "local_len": 16 if dtype != "float64" else 8,
        }
        _assert_rows(pools(world_size).run("workers:attention_case", **kwargs), str(kwargs))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_head_dims(pools, world_size, head_dim, strategy):
    kwargs = {
        "strategy": strategy,
        "layout": "zigzag",
        "causal": True,
        "hq": world_size,
        "hkv": 1,
        "head_dim": head_dim,
        "dtype": "float32",
        "local_len": 4,
        "batch": 1,
    }
    _assert_rows(pools(world_size).run("workers:attention_case", **kwargs), f"D={head_dim}")


@pytest.mark.parametrize("world_size", [3, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_non_contiguous_inputs_and_custom_scale(pools, world_size, layout, strategy):
    hq, hkv = (2 * world_size, world_size) if strategy == "ulysses" else (6, 3)
    kwargs = {
        "strategy": strategy,
        "layout": layout,
        "causal": True,
        "hq": hq,
        "hkv": hkv,
        "head_dim": 20,
        "dtype": "float64",
        "non_contiguous": True,
        "scale": 0.37,
    }
    _assert_rows(pools(world_size).run("workers:attention_case", **kwargs), layout)


# ---- hybrid on 2-D meshes ----

MESHES = {
    2: [(1, 2), (2, 1)],
    3: [(1, 3), (3, 1)],
    4: [(2, 2), (1, 4), (4, 1)],
    8: [(2, 4), (4, 2), (1, 8), (8, 1)],
}


def _hybrid_cases() -> list[tuple[int, dict]]:
    cases = []
    for world_size, shapes in MESHES.items():
        for shape in shapes:
            u = shape[0]
            heads = {"mha": (2 * u, 2 * u), "gqa": (2 * u, u), "mqa": (2 * u, 1)}
            for layout, causal, name in itertools.product(LAYOUTS, (False, True), heads):
                hq, hkv = heads[name]
                cases.append(
                    (
                        world_size,
                        {
                            "strategy": "hybrid",
                            "mesh_shape": shape,
                            "layout": layout,
                            "causal": causal,
                            "hq": hq,
                            "hkv": hkv,
                            "head_dim": 40,
                            "dtype": "float64",
                            "backend": "reference",
                        },
                    )
                )
            base = {
                "strategy": "hybrid",
                "mesh_shape": shape,
                "layout": "zigzag",
                "causal": True,
                "hq": 2 * u,
                "hkv": u,
                "head_dim": 64,
                "local_len": 16,
            }
            cases.append((world_size, {**base, "dtype": "float32", "head_dim": 24}))
            cases.append((world_size, {**base, "dtype": "bfloat16"}))
    return cases


@pytest.mark.parametrize("case", _hybrid_cases(), ids=_id)
def test_hybrid_exact_against_fp64_reference(pools, case):
    world_size, kwargs = case
    results = pools(world_size).run("workers_strategies:strategy_case", **kwargs)
    _assert_rows(results, _id(case))


@pytest.mark.parametrize("shape", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
def test_hybrid_mesh_dims_in_either_order(pools, shape):
    """("ring", "ulysses") dims: the same flattened positions, exact results."""
    world_size = shape[0] * shape[1]
    for layout, causal in itertools.product(("zigzag", "contiguous"), (False, True)):
        kwargs = {
            "strategy": "hybrid",
            "mesh_shape": shape,
            "names": ("ring", "ulysses"),
            "layout": layout,
            "causal": causal,
            "hq": 2 * shape[1],
            "hkv": 2,
            "head_dim": 16,
            "dtype": "float64",
        }
        results = pools(world_size).run("workers_strategies:strategy_case", **kwargs)
        _assert_rows(results, str(kwargs))


@pytest.mark.parametrize(
    ("mesh_shape", "names"),
    [
        ((2, 2), ("ulysses", "ring")),
        ((2, 2), ("ring", "ulysses")),
        ((2, 4), ("ulysses", "ring")),
        ((4, 2), ("ring", "ulysses")),
    ],
)
def test_mesh_sharding_is_the_ring_major_flattened_world(pools, mesh_shape, names):
    world_size = mesh_shape[0] * mesh_shape[1]
    u_size = mesh_shape[names.index("ulysses")]
    for layout in LAYOUTS:
        results = pools(world_size).run(
            "workers_strategies:mesh_sharding",
            mesh_shape=mesh_shape,
            names=names,
            layout=layout,
            seq_len=4 * world_size,
        )
        by_position = {}
        for pos, flat, position, (u, g), round_trip in results:
            assert position == g * u_size + u
            assert round_trip
            by_position[position] = pos
        # position p holds what rank p holds in a 1-D world of the same size
        flat_by_rank = [flat for _, flat, _, _, _ in results]
        for position, pos in by_position.items():
            assert pos.tolist() == flat_by_rank[position].tolist()


# ---- packed documents and sliding windows ----

PACKED = [
    ({"bounds": [0, 5, 5, 17, 18, 18, 37], "layout": "zigzag", "causal": True}),
    ({"bounds": [0, 13, 30], "layout": "striped", "causal": False}),
    ({"bounds": [0, 9, 40, 41], "layout": "contiguous", "causal": False, "window": (2, 5)}),
    ({"bounds": [0, 7, 29], "layout": "zigzag", "causal": True, "window": (5, 0)}),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_packed_documents_and_windows(pools, world_size, strategy):
    for case in PACKED:
        for hq, hkv in ((2 * world_size, 2), (2 * world_size, 1)):
            kwargs = {**case, "strategy": strategy, "hq": hq, "hkv": hkv}
            results = pools(world_size).run("workers_packed:packed_case", **kwargs)
            _assert_rows(results, str(kwargs))
    bf16 = {
        **PACKED[0],
        "strategy": strategy,
        "hq": 2 * world_size,
        "hkv": 2,
        "dtype": "bfloat16",
        "head_dim": 32,
    }
    _assert_rows(pools(world_size).run("workers_packed:packed_case", **bf16), str(bf16))


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (2, 4)])
def test_hybrid_packed_documents_and_windows(pools, shape):
    world_size = shape[0] * shape[1]
    cases = [
        *PACKED,
        {"bounds": [0, 8 * world_size], "layout": "contiguous", "causal": True, "window": (3, 0)},
    ]
    for case in cases:
        kwargs = {**case, "mesh_shape": shape, "hq": 2 * shape[0], "hkv": 2}
        results = pools(world_size).run("workers_strategies:packed_mesh_case", **kwargs)
        _assert_rows(results, str(kwargs))


@pytest.mark.parametrize("world_size", [3, 4])
def test_window_that_hides_remote_keys_moves_less(pools, world_size):
    """A window that reaches no other rank's keys: the all-gather strategy moves nothing."""
    local = {
        "bounds": [0, 8 * world_size],
        "layout": "contiguous",
        "causal": True,
        "window": (0, 0),
    }
    for fwd, bwd in pools(world_size).run(
        "workers_strategies:count_collectives", strategy="allgather", **local
    ):
        assert fwd == [] and bwd == []


def test_hybrid_ring_stops_when_the_window_ends(pools):
    """Mesh 2 x 4, 16 tokens per rank (32 per ulysses group), window 3 back: only the previous
    group's keys are visible, so the ring takes 1 K/V step instead of 3 (and 2 dK/dV hops)."""
    kwargs = {
        "bounds": [0, 128],
        "layout": "contiguous",
        "causal": True,
        "mesh_shape": (2, 4),
        "hq": 4,
        "hkv": 2,
        "local_len": 16,
    }
    for window, steps in (((3, 0), 2), (None, 4)):
        for fwd, bwd in pools(8).run(
            "workers_strategies:count_collectives", strategy="hybrid", window=window, **kwargs
        ):
            assert [name for name, _ in fwd].count("batch_isend_irecv") == steps - 1
            assert [name for name, _ in bwd].count("batch_isend_irecv") == 2 * steps - 1


# ---- collectives ----


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
