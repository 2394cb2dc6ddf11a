"""Packed documents, any sequence length, sliding windows: exact across ranks, never NaN.

Each case compares every rank's real rows with an independent float64 reference (per-document
explicit masks) forward and backward, requires padding rows to be exactly zero (out, lse and every
gradient), and checks that `unshard` returns exactly S tokens equal to single-device attention.
"""

from __future__ import annotations

import random

import pytest
import torch

import ringattn
from ringattn.layout import LAYOUTS, get_layout
from ringattn.packing import place, placement_blocks, work_per_rank
from tiers import stride

WORLD_SIZES = [1, 2, 3, 4, 8]
PACKED = "workers_packed:packed_case"


def _random_bounds(count: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    bounds = [0]
    for _ in range(count):
        bounds.append(bounds[-1] + rng.randint(0, max_len))
    return bounds


def _assert_rows(results, context):
    failures = [
        f"rank {rank} {name}: max {mx:.3g} mean {mean:.3g} ({ratio:.3g}x of the allowance)"
        for rank, rows in enumerate(results)
        for name, (passed, mx, mean, ratio) in rows.items()
        if not passed
    ]
    assert not failures, f"{context}:\n" + "\n".join(failures)


def _cases():
    cases = []
    for w in WORLD_SIZES:
        for layout in LAYOUTS:
            # zero-length documents, lengths not divisible by W or 2W, documents of length 1
            cases.append(
                (w, {"bounds": [0, 5, 5, 17, 18, 18, 37], "layout": layout, "causal": True})
            )
            cases.append(
                (w, {"bounds": [0, 13, 30], "layout": layout, "causal": False, "hq": 3, "hkv": 3})
            )
            # a sliding window alone, and with documents
            cases.append(
                (w, {"bounds": [0, 8 * w], "layout": layout, "causal": True, "window": (3, 0)})
            )
            cases.append(
                (
                    w,
                    {
                        "bounds": [0, 9, 40, 41],
                        "layout": layout,
                        "causal": False,
                        "window": (2, 5),
                        "hq": 4,
                        "hkv": 1,
                    },
                )
            )
        # 28 random-length documents, GQA, fp32 and bf16
        bounds = _random_bounds(28, 12, seed=w)
        cases.append(
            (
                w,
                {
                    "bounds": bounds,
                    "layout": "zigzag",
                    "causal": True,
                    "hq": 6,
                    "hkv": 2,
                    "dtype": "float32",
                },
            )
        )
        cases.append(
            (
                w,
                {
                    "bounds": bounds,
                    "layout": "striped",
                    "causal": True,
                    "hq": 4,
                    "hkv": 2,
                    "dtype": "bfloat16",
                    "head_dim": 32,
                },
            )
        )
        cases.append(
            (
                w,
                {
                    "bounds": bounds,
                    "layout": "contiguous",
                    "causal": True,
                    "window": (4, -1),
                    "dtype": "float16",
                    "head_dim": 32,
                },
            )
        )
        # the reference kernel for every block (banded blocks included)
        cases.append(
            (
                w,
                {
                    "bounds": [0, 7, 29],
                    "layout": "zigzag",
                    "causal": True,
                    "window": (5, 0),
                    "backend": "reference",
                },
            )
        )
    # many tiny documents (tiled blocks), alone and around a document longer than a tile
    tiny = _random_bounds(300, 6, seed=9)
    mixed = tiny[:150] + [tiny[149] + 700] + [b + 700 for b in tiny[150:]]
    for w, layout, bounds, extra in (
        (4, "zigzag", tiny, {"dtype": "float32"}),
        (4, "striped", tiny, {"window": (3, 0)}),
        (3, "contiguous", mixed, {"hq": 4, "hkv": 1}),
        (3, "zigzag", mixed, {"window": (40, 2), "causal": False}),
    ):
        cases.append((w, {"bounds": bounds, "layout": layout, "causal": True, **extra}))
    # ring-flash-attention's document test: boundaries [0, 120, 1248, 4232] at W = 8
    cases.append(
        (
            8,
            {
                "bounds": [0, 120, 1248, 4232],
                "layout": "zigzag",
                "causal": True,
                "hq": 2,
                "hkv": 1,
                "head_dim": 16,
            },
        )
    )
    return cases


def _id(case):
    w, kw = case
    bounds = kw["bounds"]
    docs = f"{len(bounds) - 1}docs{bounds[-1]}"
    win = f"-win{kw['window'][0]}_{kw['window'][1]}" if kw.get("window") else ""
    causal = "causal" if kw["causal"] else "full"
    return (
        f"W{w}-{kw['layout']}-{docs}-{causal}{win}-{kw.get('dtype', 'float64')}"
        f"-{kw.get('backend', 'auto')}"
    )


@pytest.mark.parametrize("case", stride(_cases(), 7, _id, fast=lambda case: case[0] < 8))
def test_packed_exact_against_fp64_reference(pools, case):
    w, kwargs = case
    _assert_rows(pools(w).run(PACKED, **kwargs), _id(case))


@pytest.mark.parametrize("world_size", [3, 4])
def test_window_that_hides_remote_blocks_moves_no_data(pools, world_size):
    # contiguous, 8 tokens per rank, window 3 back: only the previous rank's keys are visible
    bounds = [0, 8 * world_size]
    kwargs = {"bounds": bounds, "layout": "contiguous", "causal": True, "window": (3, 0)}
    sends = pools(world_size).run("workers_packed:packed_transfers", **kwargs)
    assert sends == [1] * world_size  # one K/V exchange instead of W - 1
    unlimited = dict(kwargs, window=None)
    assert (
        pools(world_size).run("workers_packed:packed_transfers", **unlimited)
        == [world_size - 1] * world_size
    )
    # the window alone, nothing visible beyond the own shard: no communication at all
    local = dict(kwargs, window=(0, 0))
    assert pools(world_size).run("workers_packed:packed_transfers", **local) == [0] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_deterministic_with_padding(pools, world_size):
    assert all(
        pools(world_size).run(
            "workers_packed:packed_determinism", bounds=[0, 3, 3, 20, 31], layout="zigzag"
        )
    )


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 4), (0, 0), (-1, 2)])
def test_packed_schedule_covers_every_visible_pair_once(layout_name, world_size, causal, window):
    """Pure check, no processes: placement + blocks reproduce the document/window mask."""
    bounds = (0, 1, 1, 9, 26, 27, 40)
    placement = place(get_layout(layout_name), world_size, bounds)
    seq_len = bounds[-1]
    counts = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for rank in range(world_size):
        q_idx = placement.global_indices(rank)
        for src in range(world_size):
            k_idx = placement.global_indices(src)
            for b in placement_blocks(placement, rank, src, causal, window):
                rows, cols = q_idx[b.q_start : b.q_stop], k_idx[b.kv_start : b.kv_stop]
                assert bool((rows >= 0).all() and (cols >= 0).all()), "padding in a block"
                m, n = len(rows), len(cols)
                i, j = torch.arange(m).unsqueeze(1), torch.arange(n).unsqueeze(0)
                if b.causal:
                    assert m == n
                    visible = j <= i
                elif b.band is not None:
                    visible = (j - i >= b.band[0]) & (j - i <= b.band[1])
                    assert bool(visible.any(1).all()), "a band row sees no key"
                else:
                    visible = torch.ones(m, n, dtype=torch.bool)
                qq, kk = torch.meshgrid(rows, cols, indexing="ij")
                counts.index_put_((qq[visible], kk[visible]), torch.tensor(1), accumulate=True)
    doc = torch.bucketize(torch.arange(seq_len), torch.tensor(bounds[1:]), right=True)
    expected = doc.unsqueeze(1) == doc.unsqueeze(0)
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    if causal:
        expected &= j <= i
    if window is not None:
        if window[0] >= 0:
            expected &= j >= i - window[0]
        if window[1] >= 0:
            expected &= j <= i + window[1]
    assert torch.equal(counts, expected.long())


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("layout_name", ["zigzag", "striped"])
def test_causal_work_balanced_for_any_document_mix(world_size, layout_name):
    rng = random.Random(world_size)
    for _ in range(3):
        bounds = [0]
        for _ in range(28):
            long_doc = rng.random() < 0.3
            bounds.append(bounds[-1] + rng.randint(0, 3000 if long_doc else 60))
        placement = place(get_layout(layout_name), world_size, tuple(bounds))
        work = work_per_rank(placement, True, None)
        assert max(work) / (sum(work) / world_size) < 1.05, work


def test_positions_and_shard_with_documents_single_process():
    bounds = [0, 3, 3, 10]
    x = torch.arange(10.0).reshape(1, 1, 10, 1)
    for layout in LAYOUTS:
        local = ringattn.shard(x, 2, layout=layout, cu_seqlens=bounds)
        pos = ringattn.positions(10, layout=layout, cu_seqlens=bounds)
        assert torch.equal(local.flatten()[pos >= 0], pos[pos >= 0].float())
        assert bool((local.flatten()[pos < 0] == 0).all())
        assert torch.equal(ringattn.unshard(local, 2, layout=layout, cu_seqlens=bounds), x)
        within = ringattn.positions(10, layout=layout, cu_seqlens=bounds, within_document=True)
        assert within[pos >= 0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
        assert bool((within[pos < 0] == -1).all())


def test_bad_cu_seqlens_and_window_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="non-decreasing, but entry 2 \\(3\\) is below entry 1"):
        ringattn.attention(q, q, q, cu_seqlens=[0, 5, 3, 8])
    with pytest.raises(ValueError, match="must start at 0"):
        ringattn.attention(q, q, q, cu_seqlens=[1, 8])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ringattn.attention(q, q, q, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="batch size 2"):
        ringattn.attention(
            torch.randn(2, 2, 8, 4), *[torch.randn(2, 2, 8, 4)] * 2, cu_seqlens=[0, 8]
        )
    with pytest.raises(ValueError, match="window must be \\(left, right\\)"):
        ringattn.attention(q, q, q, window=(3,))
    with pytest.raises(ValueError, match="local tensor has 8 tokens.*gives 10 per rank"):
        ringattn.attention(q, q, q, cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match=r"or pass cu_seqlens=\[0, 7\]"):
        ringattn.shard(torch.randn(1, 1, 7, 2), 2, layout="zigzag")


def test_layout_command_prints_per_rank_tokens_and_work(capsys, tmp_path):
    from ringattn.cli.main import main

    out_json = tmp_path / "layout.json"
    assert (
        main(
            [
                "layout",
                "--world-size",
                "4",
                "--cu-seqlens",
                "0,120,1248,4231",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layout zigzag, W=4, 3 document(s), S=4231, causal" in text
    assert "max/mean attention work: 1.0" in text
    import json

    report = json.loads(out_json.read_text())
    assert sum(r["tokens"] for r in report["ranks"]) == 4231
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    assert main(["layout", "--world-size", "4", "--seq-len", "4096", "--layout", "contiguous"]) == 0
    assert "max/mean attention work: 1.750" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["layout", "--world-size", "4"])  # neither --seq-len nor --cu-seqlens
