"""`ringattn layout`: how a layout spreads tokens and attention work over the ranks.

For W ranks, a dense length or packed documents (cu_seqlens), causal or not, and an optional
sliding window, print each rank's tokens (real and padding) and its attention work, counted as
visible (query, key) pairs over all the blocks its queries compute, with max/mean. Pure
arithmetic on the placement and block schedule; no process is started.
"""

from __future__ import annotations

import json

from ringattn.layout import get_layout
from ringattn.packing import check_cu_seqlens, check_window, place, work_per_rank


def layout_rows(
    world_size: int,
    bounds: tuple[int, ...],
    layout: str,
    causal: bool,
    window: tuple[int, int] | None,
) -> list[dict]:
    """One dict per rank: rank, real tokens, padding tokens, visible pairs."""
    placement = place(get_layout(layout), world_size, bounds)
    work = work_per_rank(placement, causal, window)
    rows = []
    for rank in range(world_size):
        real = sum(run.length for run in placement.runs[rank])
        rows.append(
            {
                "rank": rank,
                "tokens": real,
                "padding": placement.local_len - real,
                "pairs": work[rank],
            }
        )
    return rows


def layout_report(
    world_size: int,
    seq_len: int | None,
    cu_seqlens: list[int] | None,
    layout: str,
    causal: bool,
    window: list[int] | None,
    json_path: str | None = None,
) -> int:
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    if (seq_len is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of --seq-len or --cu-seqlens")
    bounds = check_cu_seqlens(cu_seqlens if cu_seqlens is not None else [0, seq_len])
    window_pair = check_window(tuple(window) if window is not None else None)
    rows = layout_rows(world_size, bounds, layout, causal, window_pair)
    pairs = [row["pairs"] for row in rows]
    mean = sum(pairs) / world_size
    imbalance = max(pairs) / mean if mean else 1.0
    mask = ("causal" if causal else "full") + (f", window {window_pair}" if window_pair else "")
    print(f"layout {layout}, W={world_size}, {len(bounds) - 1} document(s), S={bounds[-1]}, {mask}")
    print(f"{'rank':>4} {'tokens':>8} {'padding':>8} {'pairs':>14} {'/ mean':>7}")
    for row in rows:
        share = row["pairs"] / mean if mean else 1.0
        print(
            f"{row['rank']:>4} {row['tokens']:>8} {row['padding']:>8} {row['pairs']:>14,} "
            f"{share:>7.3f}"
        )
    print(f"max/mean attention work: {imbalance:.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "layout": layout,
                    "world_size": world_size,
                    "cu_seqlens": list(bounds),
                    "causal": causal,
                    "window": window_pair,
                    "ranks": rows,
                    "max_over_mean": imbalance,
                },
                f,
                indent=2,
            )
    return 0
