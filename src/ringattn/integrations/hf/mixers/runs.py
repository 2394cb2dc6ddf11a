"""State passing across ranks: each rank's runs, their halos and their entering states.

A recurrent mixer carries a state along the sequence, `S_t = A_t S_(t-1) + B_t`, so a run of
consecutive tokens of one document maps the state entering it affinely:

    S_out = A_run S_in + B_run          (A_run: a scalar per head for Mamba2, a K x K matrix
                                          per head for the delta rule; B_run: the run's final
                                          state from a zero entering state)

Every rank computes (A_run, B_run) for each of its runs (zigzag: two per document piece, packed
documents: one per document piece), all ranks all-gather these fixed-size summaries (bytes
independent of S), and each rank folds the runs before its own, in sequence order, from a zero
state at the document's start:

    doc d:   run (rank 2) -> run (rank 0) -> run (rank 1) -> ...
    S_in(run k) = A_(k-1) (... (A_1 (A_0 0 + B_0) + B_1) ...) + B_(k-1)

A causal convolution of width K reads the K-1 inputs before each run: each run's last K-1 inputs
travel in an all-gather of the same kind (its "tail"), and a run's halo is taken from the tails
of the runs before it in its document (a run shorter than K-1 leaves the rest to the one before).

Everything here but `Exchange.gather` is pure: a `Runs` is derived from the placement, which every
rank computes alike, so no rank waits for another to learn the structure. `Exchange.gather` is an
all-gather whose backward sums each rank's gradient contributions into the owner's slot (a
reduce-scatter): the state gradients go back to the ranks whose runs produced the states.

    rank r's runs in its local rows      (layout order; padding rows belong to no run)
    to_runs(x_local) -> (n_runs, L_max, ...) one batch row per run, right-padded
    from_runs(y)     -> (S_local, ...) back in local order, padding rows zero
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ringattn.comm import GroupInfo, all_gather_cat, reduce_scatter
from ringattn.packing import Placement

# a run longer than a rank's mean run length is cut into pieces of about that length, but never
# below this (the chunked kernels pad every batch row to a multiple of their chunk of 64 tokens)
MIN_PIECE = 64


@dataclass(frozen=True)
class Runs:
    """The runs of every rank (global order) and this rank's, for one placement.

    A "run" here is one batch row: consecutive tokens of one document on one rank, a placement's
    run cut into pieces where it is much longer than the rank's others (`runs_of`), so that one
    long run beside many short ones (packed documents) does not pad every row to its length."""

    rank: int
    world_size: int
    # every run of every rank: (rank, index among that rank's runs, doc, global start, length)
    all: tuple[tuple[int, int, int, int, int], ...]
    # this rank's runs: (local start, length)
    local: tuple[tuple[int, int], ...]
    per_rank: int  # the most runs any rank holds (the gathered tensors' second dimension)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        """Batch rows of `to_runs`: one per local run, and one row of padding on a rank that holds
        no token (it still takes part in every collective)."""
        return max(1, len(self.local))

    @property
    def longest(self) -> int:
        return max((length for _, length in self.local), default=1)

    def documents(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """Document -> its runs in sequence order, (rank, index, start, end)."""
        if "docs" not in self.memo:
            docs: dict[int, list[tuple[int, int, int, int]]] = {}
            for r, k, doc, start, length in self.all:
                docs.setdefault(doc, []).append((r, k, start, start + length))
            self.memo["docs"] = docs
        return self.memo["docs"]

    def _window(self, parts: list, upto: int, width: int) -> list[int]:
        """Indices into the gathered tails (W x per_rank x width, flattened) of the `width`
        tokens before the end of `parts[upto - 1]` (a document's runs in order); -1 before the
        document's start."""
        row, j = [-1] * width, width - 1  # filled from the last slot backwards
        for r, k, start, end in reversed(parts[:upto]):
            for p in range(end - 1, max(start, end - width) - 1, -1):
                if j < 0:
                    return row
                row[j] = (r * self.per_rank + k) * width + p - (end - width)
                j -= 1
        return row

    def halo_index(self, width: int) -> torch.Tensor:
        """(rows, width) indices into the gathered tails flattened to (W x per_rank x width):
        halo slot j of local run i is the token `width - j` before the run's start; -1 where
        that token is before the document's start (the convolution's zero padding)."""
        key = ("halo", width)
        if key not in self.memo:
            rows = [[-1] * width for _ in range(self.rows)]
            for parts in self.documents().values():
                for i, (r, k, _, _) in enumerate(parts):
                    if r == self.rank:
                        rows[k] = self._window(parts, i, width)
            host = torch.tensor(rows, dtype=torch.int64, device="cpu")
            self.memo[key] = host.reshape(self.rows, width)
        return self.memo[key]

    def end_index(self, width: int) -> dict[int, torch.Tensor]:
        """Document -> (width,) indices of its last `width` tokens in the gathered tails."""
        key = ("end", width)
        if key not in self.memo:
            self.memo[key] = {
                doc: torch.tensor(self._window(parts, len(parts), width), device="cpu")
                for doc, parts in self.documents().items()
            }
        return self.memo[key]


def _pieces(runs: tuple, floor: int) -> list[tuple[int, int, int, int]]:
    """A rank's runs as (local start, length, global start, doc), each cut into pieces of about
    the rank's mean run length (at least `floor` tokens)."""
    total = sum(run.length for run in runs)
    cap = max(floor, -(-total // max(1, len(runs))))
    out = []
    for run in runs:
        n = -(-run.length // cap)
        for j in range(n):  # n near-equal pieces
            a, b = run.length * j // n, run.length * (j + 1) // n
            out.append((run.local_start + a, b - a, run.global_start + a, run.doc))
    return out


def runs_of(placement: Placement, rank: int) -> Runs:
    """The runs of `placement` (contiguous or zigzag: stride-1 runs only), cut into pieces."""
    key = ("state_runs", rank, MIN_PIECE)
    if key in placement.memo:
        return placement.memo[key]
    everything, local = [], ()
    for r in range(placement.world_size):
        for run in placement.runs[r]:
            if run.stride != 1 and run.length > 1:
                raise ValueError(
                    f"state passing needs runs of consecutive tokens; rank {r} holds tokens "
                    f"{run.global_start}, {run.global_start + run.stride}, ... (a strided layout)"
                )
        pieces = _pieces(placement.runs[r], MIN_PIECE)
        everything += [(r, i, doc, g, n) for i, (_, n, g, doc) in enumerate(pieces)]
        if r == rank:
            local = tuple((start, n) for start, n, _, _ in pieces)
    everything.sort(key=lambda entry: entry[3])
    counts: dict[int, int] = {}
    for entry in everything:
        counts[entry[0]] = counts.get(entry[0], 0) + 1
    runs = Runs(
        rank=rank,
        world_size=placement.world_size,
        all=tuple(everything),
        local=local,
        per_rank=max([1, *(counts.get(r, 0) for r in range(placement.world_size))]),
    )
    placement.memo[key] = runs
    return runs


def _row_index(runs: Runs) -> torch.Tensor:
    """(rows, L_max) int64 on the host: the local row of each run's token, -1 for padding."""
    if "rows" not in runs.memo:
        index = torch.full((runs.rows, runs.longest), -1, dtype=torch.int64, device="cpu")
        for i, (start, length) in enumerate(runs.local):
            index[i, :length] = torch.arange(start, start + length, device="cpu")
        runs.memo["rows"] = index
    return runs.memo["rows"]


def to_runs(x: torch.Tensor, runs: Runs) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_local, ...) local rows -> (n_runs, L_max, ...) one row per run, right-padded with 0,
    and the (n_runs, L_max) bool mask of real tokens."""
    index = _row_index(runs).to(x.device)
    valid = index >= 0
    rows = x.index_select(0, index.clamp(min=0).flatten()).view(*index.shape, *x.shape[1:])
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(rows.dtype)
    return rows * mask, valid


def from_runs(y: torch.Tensor, runs: Runs, local_len: int) -> torch.Tensor:
    """(n_runs, L_max, ...) -> (S_local, ...): each run's real tokens back in local order,
    padding rows zero."""
    index = _row_index(runs).flatten().to(y.device)
    real = torch.nonzero(index >= 0).flatten()
    flat = y.reshape(-1, *y.shape[2:]).index_select(0, real)
    return y.new_zeros(local_len, *y.shape[2:]).index_copy(0, index[real], flat)


class _GatherRuns(torch.autograd.Function):
    """(per_rank, ...) -> (W, per_rank, ...): every rank's, forward; the gradient of every
    rank's copy summed into the owner's slot, backward (so a state's gradient reaches the rank
    whose run produced it)."""

    @staticmethod
    def forward(ctx, x, info):
        ctx.info = info
        return all_gather_cat(x[None], 0, info)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad.contiguous(), ctx.info), None


@dataclass
class Exchange:
    """One mixer call's runs and group, and the bytes this rank sends for it (forward and the
    backward's reduce-scatter). With `keep` (a prefill whose decoding continues), every rank
    also keeps each document's final recurrent state (`finals`) and its last conv inputs
    (`conv_finals`, (C, K) as transformers' caches hold them), the same on every rank."""

    runs: Runs
    info: GroupInfo
    sent: int = 0
    keep: bool = False
    finals: dict[int, torch.Tensor] = field(default_factory=dict)
    conv_finals: dict[int, torch.Tensor] = field(default_factory=dict)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's (n_local, ...) per-run tensor -> every rank's, (W, per_rank, ...)."""
        pad = self.runs.per_rank - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        if self.info.world_size == 1:
            return x[None]
        w = self.info.world_size
        self.sent += 2 * x.numel() * x.element_size() * (w - 1)  # forward and backward
        return _GatherRuns.apply(x, self.info)


def tails(x: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """(n, L, C) runs -> (n, width, C): each run's last `width` real inputs (zeros before a
    run shorter than `width`; those slots are never read: halo_index points before them)."""
    lengths = valid.sum(1)  # (n,)
    offsets = torch.arange(width, device=x.device) - width  # -width .. -1
    index = lengths[:, None] + offsets[None]  # (n, width)
    good = index >= 0
    picked = x.gather(1, index.clamp(min=0)[..., None].expand(-1, -1, x.shape[-1]))
    return picked * good[..., None].to(x.dtype)


def halos(x: torch.Tensor, valid: torch.Tensor, width: int, ex: Exchange) -> torch.Tensor:
    """(n, L, C) conv inputs of this rank's runs -> (n, width, C): the `width` inputs before each
    run in its document (zeros before the document's start), from every rank's run tails."""
    if width == 0:
        return x.new_zeros(x.shape[0], 0, x.shape[-1])
    gathered = ex.gather(tails(x, valid, width))  # (W, per_rank, width, C)
    flat = gathered.reshape(-1, x.shape[-1])
    index = ex.runs.halo_index(width).to(x.device)  # (n, width)
    rows = flat.index_select(0, index.clamp(min=0).flatten()).view(*index.shape, x.shape[-1])
    return rows * (index >= 0)[..., None].to(rows.dtype)


def keep_conv(x: torch.Tensor, valid: torch.Tensor, width: int, ex: Exchange) -> None:
    """With `ex.keep`: each document's last `width` conv inputs, (C, width) in time order and
    zeros before its start (transformers' conv state), into `ex.conv_finals`."""
    flat = ex.gather(tails(x, valid, width)).reshape(-1, x.shape[-1])
    for doc, index in ex.runs.end_index(width).items():
        index = index.to(x.device)
        rows = flat.index_select(0, index.clamp(min=0)) * (index >= 0)[:, None].to(flat.dtype)
        ex.conv_finals[doc] = rows.transpose(0, 1).contiguous()


def entering_states(
    transition: torch.Tensor, final: torch.Tensor, ex: Exchange, apply: Callable
) -> torch.Tensor:
    """Each local run's entering state, (n, *state): fold the runs before it in its document.

    transition (n, ...), final (n, *state): this rank's runs' summaries; `apply(A, S)` gives
    A S for one run's transition and a state (batched over heads as the caller shapes them)."""
    runs = ex.runs
    a_all = ex.gather(transition)  # (W, per_rank, ...)
    b_all = ex.gather(final)
    zero = torch.zeros_like(final[0])
    states = [zero] * runs.rows
    for doc, parts in runs.documents().items():  # one fold per document, in sequence order
        local = [i for i, (r, *_) in enumerate(parts) if r == runs.rank]
        if not (local or ex.keep):
            continue
        state = zero
        for r, k, _, _ in parts if ex.keep else parts[: local[-1] + 1]:
            if r == runs.rank:
                states[k] = state  # what enters this rank's run
            state = apply(a_all[r, k], state) + b_all[r, k]
        if ex.keep:  # each document's state after its last run
            ex.finals[doc] = state
    # every rank's graph must reach both gathers (their backward is a collective): a rank whose
    # runs all start documents reads no summary, so it is tied in with a zero
    anchor = (a_all.sum() + b_all.sum()) * 0
    return torch.stack(states) + anchor
