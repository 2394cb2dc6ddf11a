"""The state scheme's bookkeeping on one process (integrations/hf/mixers/runs.py): pieces, halos,
document ends, the fold order and the rows' round trip, against brute force from global token
indices, for random packed documents, both run layouts and W = 1..4.

Each rank's local rows carry their global token index (+1, so that 0 marks padding and zeros);
the gathered tails are built from every rank's `Runs` as the all-gather would, and each halo
slot must then hold exactly the token `width - j` before its run (0 before the document)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ringattn.integrations.hf.mixers import runs as runs_module
from ringattn.integrations.hf.mixers.runs import from_runs, runs_of, tails, to_runs
from ringattn.layout import get_layout
from ringattn.packing import place


def _cases(seed: int = 0, count: int = 40):
    rng = random.Random(seed)
    for _ in range(count):
        w = rng.randint(1, 4)
        lengths = [rng.choice([1, 2, 3, 5, 17, 40, 130]) for _ in range(rng.randint(1, 6))]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        yield rng.choice(["zigzag", "contiguous"]), w, tuple(bounds), rng.randint(1, 3)


def _ids(placement, rank):
    return (placement.global_indices(rank) + 1).float()[:, None]  # (S_local, 1), 0 = padding


@pytest.mark.parametrize("min_piece", [64, 2])
def test_halos_ends_and_fold_order_match_brute_force(monkeypatch, min_piece):
    monkeypatch.setattr(runs_module, "MIN_PIECE", min_piece)
    for layout, w, bounds, width in _cases():
        placement = place(get_layout(layout), w, bounds)
        doc_of = torch.zeros(bounds[-1], dtype=torch.int64)
        for d in range(len(bounds) - 1):
            doc_of[bounds[d] : bounds[d + 1]] = d
        every = [runs_of(placement, r) for r in range(w)]
        per_rank = every[0].per_rank
        gathered = torch.zeros(w, per_rank, width, 1)
        for r, rr in enumerate(every):
            rows, valid = to_runs(_ids(placement, r), rr)
            assert torch.equal(from_runs(rows, rr, placement.local_len), _ids(placement, r))
            t = tails(rows, valid, width)
            gathered[r, : t.shape[0]] = t[: len(rr.local)] if rr.local else 0
        flat = gathered.reshape(-1, 1)
        for r, rr in enumerate(every):
            rows, valid = to_runs(_ids(placement, r), rr)
            index = rr.halo_index(width)
            for i, (start, length) in enumerate(rr.local):
                first = int(rows[i, 0, 0]) - 1  # the run's first global token
                assert length <= max(min_piece, length) and valid[i].sum() == length
                for j in range(width):
                    p = first - width + j
                    want = p + 1 if p >= 0 and doc_of[p] == doc_of[first] else 0
                    got = 0 if index[i, j] < 0 else int(flat[index[i, j], 0])
                    assert got == want, (layout, w, bounds, width, r, i, j)
        for doc, parts in every[0].documents().items():  # the fold's order: by position
            starts = [start for _, _, start, _ in parts]
            assert starts == sorted(starts) and starts[0] == bounds[doc]
            assert parts[-1][3] == bounds[doc + 1]
            assert all(a[3] == b[2] for a, b in itertools.pairwise(parts))  # no gap or overlap
        for doc, index in every[0].end_index(width).items():
            end = bounds[doc + 1]
            got = [0 if i < 0 else int(flat[i, 0]) for i in index.tolist()]
            want = [p + 1 if p >= bounds[doc] else 0 for p in range(end - width, end)]
            assert got == want, (layout, w, bounds, width, doc)


def test_long_runs_are_cut_beside_short_ones(monkeypatch):
    """One 4000-token document beside forty of 50 on 8 ranks (zigzag): without pieces every batch
    row would be as long as the longest run; the pieces keep the padded rows within a few times
    the real tokens, and every piece is more than half of MIN_PIECE long or a whole run."""
    bounds = [0, 4000, *(4000 + 50 * (i + 1) for i in range(40))]
    placement = place(get_layout("zigzag"), 8, tuple(bounds))
    rr = runs_of(placement, 3)
    real = sum(n for _, n in rr.local)
    assert rr.rows * rr.longest <= 8 * real
    assert rr.rows * max(run.length for run in placement.runs[3]) > 20 * real  # uncut
    whole = {r.length for r in placement.runs[3]}
    assert all(n > runs_module.MIN_PIECE // 2 or n in whole for _, n in rr.local)
