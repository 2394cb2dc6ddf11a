"""Striped rows into runs and back: one all-to-all each way, for the state scheme.

The striped layout gives rank r the tokens r, r + W, r + 2W, ... of each document: runs one token
long, which state passing cannot use (every token's state would cross ranks). A mixer layer
under the state scheme therefore moves its input rows to the zigzag placement of the same
documents (runs of consecutive tokens), runs there, and moves its output rows back:

    striped rows (S_local, H) --all-to-all--> zigzag rows --state.py--> zigzag outputs
                              <--all-to-all--

Both placements are computed alike on every rank, so each rank knows what it sends to and
receives from every other rank without exchanging counts. The exchange is `exchange_rows`
(differentiable: backward sends the gradients the other way). Cost per layer per rank: 2
all-to-alls of (W-1)/W x S_local x H forward and the same backward, growing with S like the
heads scheme's; the state passing itself stays fixed-size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo
from ringattn.comm.rows import exchange_rows
from ringattn.packing import Placement


@dataclass(frozen=True)
class Move:
    """What this rank sends (its rows, grouped by destination) and where what it receives goes."""

    send_rows: torch.Tensor  # (n_send,) local rows of the source placement, by destination
    send: list[int]  # rows to each rank
    recv: list[int]  # rows from each rank
    place: torch.Tensor  # (n_recv,) local row in the destination placement of each received row
    dst_len: int


def _owners(dst: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) the rank holding each global token in `dst`, and its local row there."""
    owner = torch.full((dst.seq_len,), -1, dtype=torch.int64)
    row = torch.full((dst.seq_len,), -1, dtype=torch.int64)
    for d in range(dst.world_size):
        held = dst.global_indices(d)
        real = torch.nonzero(held >= 0).flatten()
        owner[held[real]] = d
        row[held[real]] = real
    return owner, row


def plan_move(src: Placement, dst: Placement, rank: int) -> Move:
    """The move of this rank's rows from `src` to `dst` (memoised on `src`)."""
    key = ("move", dst.bounds, dst.local_len, tuple(map(len, dst.runs)), rank)
    if key in src.memo:
        return src.memo[key]
    owner, row = _owners(dst)
    w = src.world_size
    send_rows, send, recv, place = None, [0] * w, [0] * w, []
    for s in range(w):
        held = src.global_indices(s)
        real = torch.nonzero(held >= 0).flatten()
        dest = owner[held[real]]
        if s == rank:
            order = torch.sort(dest, stable=True).indices
            send_rows = real[order]
            send = torch.bincount(dest, minlength=w).tolist()
        mine = held[real][dest == rank]  # in s's local order: the order s sends them in
        recv[s] = int(mine.numel())
        place.append(row[mine])
    move = Move(send_rows, send, recv, torch.cat(place), dst.local_len)
    src.memo[key] = move
    return move


def move_rows(x: torch.Tensor, move: Move, info: GroupInfo) -> torch.Tensor:
    """(S_local, H) rows of the source placement -> (dst_len, H) rows of the destination
    (padding rows zero)."""
    rows = x.index_select(0, move.send_rows.to(x.device))
    (got,) = exchange_rows([rows], move.send, move.recv, info, anchor=x)
    out = x.new_zeros(move.dst_len, *x.shape[1:])
    return out.index_copy(0, move.place.to(x.device), got)


def moved_bytes(move: Move, row_bytes: int, rank: int) -> int:
    """Bytes this rank sends for one move: its rows forward, the gradients of what it received
    backward."""
    return (sum(move.send) - move.send[rank] + sum(move.recv) - move.recv[rank]) * row_bytes
