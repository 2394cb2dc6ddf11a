"""The Strategy protocol: what every context-parallel algorithm provides to the API.

    check(q, k, info)           strategy-specific ValueErrors, raised locally before any
                                communication (head counts that do not split, a missing mesh)
    forward(q, k, v, call)      -> Forward(out, lse, saved): this rank's exact attention output,
                                its float32 lse, and the tensors its backward needs
    backward(dout, saved, call) -> (dq, dk, dv) for this rank's q, k, v

`saved` is what the autograd Function keeps between the two (the compiled path keeps only the
local q, k, v, out, lse and asks `saved_from_local` for the rest). Most strategies keep the local
(q, k, v, out, lse); Ulysses keeps the head-sharded tensors instead, which saves an all-to-all in
the backward at no extra memory. A strategy never branches on a layout's name or a mask's shape:
it asks `call.blocks(rank, src, local_len)` (plan.py) which blocks to compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo
from ringattn.plan import Call


@dataclass(frozen=True)
class Forward:
    """A strategy's forward result: out (B, Hq, S_local, D) in q's dtype, lse (B, Hq, S_local) in
    the accumulator dtype, and the tensors `backward` receives as `saved`."""

    out: torch.Tensor
    lse: torch.Tensor
    saved: tuple[torch.Tensor, ...]


class Strategy:
    """Base of every strategy; subclasses set `name` and implement forward and backward."""

    name: str = ""

    def check(self, q: torch.Tensor, k: torch.Tensor, info: GroupInfo) -> None:
        """Raise ValueError (with the values and the fix) for a case this strategy cannot run."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call) -> Forward:
        raise NotImplementedError

    def backward(
        self, dout: torch.Tensor, saved: tuple[torch.Tensor, ...], call: Call
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def saved_from_local(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: Call,
    ) -> tuple[torch.Tensor, ...]:
        """`forward`'s `saved` rebuilt from the local q, k, v and the returned out, lse: what the
        compiled path's backward op has (ops.py). The local tensors themselves by default."""
        return (q, k, v, out, lse)
