"""All-gather, Ulysses and hybrid strategies: the ring's exactness matrix (collectives, memory,
determinism and errors are test_strategies_comm.py).

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
from tiers import stride

RING_HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def _heads(strategy: str, world_size: int) -> dict[str, tuple[int, int]]:
    if strategy != "ulysses":
        return RING_HEADS
    w = world_size
    return {"mha": (2 * w, 2 * w), "gqa": (2 * w, w), "gqa-rep": (2 * w, 2), "mqa": (2 * w, 1)}


def _layouts(world_size: int) -> list[str]:
    """Every layout up to W = 4; at W = 8 zigzag only. A layout enters these strategies as the
    order of the gathered (all-gather) or exchanged (Ulysses) shards, whose code is the same at
    any W: W = 8 adds the head splits and mesh shapes of 8 ranks, not a layout path, and its
    8-rank cases cost 4x a 4-rank one on 2 cores."""
    return LAYOUTS if world_size < 8 else ["zigzag"]


def _matrix(strategy: str) -> list[tuple[int, dict]]:
    """test_ring's exactness matrix for one strategy, ordered by world size."""
    cases = []
    for world_size in WORLD_SIZES:
        heads = _heads(strategy, world_size)
        layouts = _layouts(world_size)
        for layout, causal, name in itertools.product(layouts, (False, True), heads):
            hq, hkv = heads[name]
            base = {"strategy": strategy, "layout": layout, "causal": causal, "hq": hq, "hkv": hkv}
            # the block kernel is the strategy's choice of nothing: cpu_flash runs with GQA (its
            # general case: repeated K/V heads) in every world size, layout and mask; the
            # kernels themselves are test_kernels.py's, and test_ring.py crosses them whole
            backends = ("reference", "cpu_flash") if name == "gqa" else ("reference",)
            for backend in backends:
                cases.append(
                    (world_size, {**base, "head_dim": 40, "dtype": "float64", "backend": backend})
                )
            cases.append((world_size, {**base, "head_dim": 24, "dtype": "float32"}))
        hq, hkv = heads["gqa"]
        for layout, dtype in itertools.product(layouts, ("bfloat16", "float16")):
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


@pytest.mark.parametrize("case", stride(CASES, 7, _id, fast=lambda case: case[0] < 8))
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
            layouts = _layouts(world_size)
            for layout, causal, name in itertools.product(layouts, (False, True), heads):
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


@pytest.mark.parametrize("case", stride(_hybrid_cases(), 7, _id, fast=lambda case: case[0] < 8))
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
