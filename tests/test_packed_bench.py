"""`ringattn bench --documents N [--window L]` on CPU: the packed rows sit beside the dense ones,
their FLOPs are the visible pairs of an explicit document/window mask, bad flags fail early."""

from __future__ import annotations

import json

import pytest
import torch

from ringattn.bench.packed import document_bounds
from ringattn.cli import main as cli


def _visible_pairs(bounds, window) -> int:
    seq_len = bounds[-1]
    doc = torch.bucketize(torch.arange(seq_len), torch.tensor(bounds[1:]), right=True)
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    visible = (doc.unsqueeze(1) == doc.unsqueeze(0)) & (j <= i)
    if window is not None:
        visible &= j >= i - window
    return int(visible.sum())


@pytest.mark.parametrize("documents, window", [(9, None), (5, 3)])
def test_bench_packed_rows(tmp_path, capsys, documents, window):
    path = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--heads", "2:1", "--head-dim", "8", "--warmup", "0",
            "--repeats", "1", "--sizes", "2x32", "--masks", "causal", "--ranks", "all",
            "--documents", str(documents), "--json", str(path)]  # fmt: skip
    if window is not None:
        argv += ["--window", str(window)]
    assert cli.main(argv) == 0
    assert "packed case" in capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    bounds = document_bounds(64, documents, 0)
    per_rank_max = rows[0]["packed"]["needed_flops"] / (4 * 2 * 8)
    total = _visible_pairs(bounds, window)
    # the slower rank's share: at least the mean, at most everything
    assert total / 2 <= per_rank_max <= total
    for row in rows:
        packed = row["packed"]
        assert packed["documents"] == documents and packed["window"] == window
        assert packed["ring_ms"] > 0 and 0 < packed["host_plan_share"]
    assert rows[1]["packed"]["needed_flops"] == pytest.approx(3.5 * per_rank_max * 4 * 2 * 8)


@pytest.mark.parametrize(
    "flags, message", [(["--documents", "0"], "at least 1 document"), (["--window", "-2"], "0 or")]
)
def test_bench_packed_bad_flags(capsys, flags, message):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device", "cpu", "--sizes", "2x16", *flags])
    assert message in capsys.readouterr().err
