"""Strategies: ring, all-gather, Ulysses and hybrid, each one algorithm over the core seams.

    base.py       the Strategy protocol (check, forward -> Forward, backward)
    ring.py       K/V around a ring, over a transport seam (real: comm.RingTransport)
    allgather.py  one all-gather of K/V, one reduce-scatter of dK/dV
    ulysses.py    all-to-all from sequence- to head-sharding and back
    hybrid.py     Ulysses inside groups, the ring across them (a 2-D mesh)
    grouped.py    the ring's schedule when each ring rank holds several shards

`STRATEGIES` is the registry by name; `get_strategy` raises ValueError listing the choices.
"""

from __future__ import annotations

from ringattn.strategies.allgather import AllGatherStrategy
from ringattn.strategies.base import Forward, Strategy
from ringattn.strategies.hybrid import HybridStrategy
from ringattn.strategies.ring import RingStrategy
from ringattn.strategies.ulysses import UlyssesStrategy

STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (RingStrategy(), AllGatherStrategy(), UlyssesStrategy(), HybridStrategy())
}


def get_strategy(name: str) -> Strategy:
    """The registered strategy called `name` (ValueError listing the choices otherwise)."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGIES)}")
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "Forward", "Strategy", "get_strategy"]
