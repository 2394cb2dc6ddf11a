"""The fast tier: `pytest -m "not slow"` (docs/testing.md says when to run which).

A test is `slow` when it takes more than about a second and a half on a loaded 2-core machine:
whole jobs (torchrun, Slurm, two hosts, a server), compilation, training runs. The matrices of
many cheap cases (every strategy x layout x world size x dtype, every family) run whole in the
full suite; the fast tier runs every `every`-th case of each. With `every` prime and larger than
each axis of the product, that stride meets every value of every axis, so each strategy, layout,
world size, dtype and family still runs in the fast tier, only not in every combination.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

SLOW = pytest.mark.slow

__all__ = ["SLOW", "stride"]


def stride(
    cases: Iterable[Any],
    every: int,
    ids: Callable[[Any], str] | None = None,
    fast: Callable[[Any], bool] = lambda case: True,
) -> list:
    """`cases` as pytest params, all but every `every`-th (from the first) marked slow, and
    those that `fast(case)` rejects (e.g. world size 8: its 8-rank pool costs the fast tier a
    spawn of its own) marked slow too."""
    return [
        pytest.param(
            case,
            id=None if ids is None else ids(case),
            marks=SLOW if i % every or not fast(case) else (),
        )
        for i, case in enumerate(cases)
    ]
