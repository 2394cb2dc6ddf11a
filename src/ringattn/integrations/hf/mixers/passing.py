"""The state scheme's entry points: which mixer classes have a program, and running one.

PROGRAMS      class name -> program (state.py: Mamba2, gated DeltaNet, short convolutions;
              state_more.py: Mamba1, lightning attention, KDA)
run_state     this rank's rows -> the layer's outputs by state passing (a striped layout's
              rows through zigzag's runs, relayout.py)
run_segments  dynamic CP: each piece of the rows over its own sub-group
"""

from __future__ import annotations

import torch
from torch import nn

from ringattn.comm import GroupInfo, resolve_group
from ringattn.integrations.hf.mixers import state, state_more
from ringattn.integrations.hf.mixers.relayout import move_rows, moved_bytes, plan_move
from ringattn.integrations.hf.mixers.runs import Exchange, from_runs, runs_of, to_runs
from ringattn.layout import get_layout
from ringattn.packing import Placement, place
from ringattn.sharding import local_placement

__all__ = ["PROGRAMS", "has_state", "run_segments", "run_state"]

PROGRAMS = {**state.PROGRAMS, **state_more.PROGRAMS}


def has_state(module: nn.Module) -> bool:
    """True when `module`'s class runs by state passing."""
    return type(module).__name__ in PROGRAMS


def run_state(
    module: nn.Module, x: torch.Tensor, placement: Placement, info: GroupInfo, keep: bool = False
) -> tuple[torch.Tensor, Exchange]:
    """(S_local, H) this rank's rows -> (S_local, H) the layer's outputs by state passing, and
    the call's Exchange (bytes sent; with `keep`, each document's final states). A striped
    layout's rows go to the zigzag placement of the same documents and back (relayout.py)."""
    runs_placement = placement
    if any(run.stride != 1 for runs in placement.runs for run in runs):
        runs_placement = place(get_layout("zigzag"), info.world_size, placement.bounds)
        there = plan_move(placement, runs_placement, info.rank)
        back = plan_move(runs_placement, placement, info.rank)
        x = move_rows(x, there, info)
    exchange = Exchange(runs_of(runs_placement, info.rank), info, keep=keep)
    rows, valid = to_runs(x, exchange.runs)  # (n_runs, L, H)
    y = PROGRAMS[type(module).__name__](module, rows, valid, exchange)
    out = from_runs(y, exchange.runs, runs_placement.local_len)
    if runs_placement is placement:
        return out, exchange
    row_bytes = x.shape[-1] * x.element_size()
    exchange.sent += moved_bytes(there, row_bytes, info.rank) + moved_bytes(
        back, row_bytes, info.rank
    )
    return move_rows(out, back, info), exchange


def run_segments(module: nn.Module, x: torch.Tensor, segments: list, layout: str) -> torch.Tensor:
    """Dynamic CP: (S_local, H) rows, pieces end to end, each over its own sub-group and
    documents (models/segments.py) -> the layer's outputs, each piece by state passing over its
    group (every member runs the same pieces in the same order, as attention's)."""
    outs = []
    for seg in segments:
        info = resolve_group(seg.group)
        rows = x[seg.start : seg.stop]
        placement = local_placement(get_layout(layout), info, rows.shape[0], list(seg.cu_seqlens))
        outs.append(run_state(module, rows, placement, info)[0])
    if sum(o.shape[0] for o in outs) != x.shape[0]:
        raise ValueError(f"ringattn_segments cover {sum(o.shape[0] for o in outs)} rows, the "
                         f"batch has {x.shape[0]}")  # fmt: skip
    return torch.cat(outs)
