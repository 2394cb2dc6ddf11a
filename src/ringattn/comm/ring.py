"""Point-to-point ring messages: `RingComm`, and the ring strategy's transport seam on it.

Ring exchanges are posted with `batch_isend_irecv` and waited on only when the data is needed, so
the transfer overlaps the compute in between. On NCCL `wait()` only orders the current CUDA stream
after the transfer; it does not block the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringattn.comm.groups import GroupInfo, single_group
from ringattn.merge import accumulator_dtype


class RingComm:
    """Point-to-point ring: every rank sends to rank+1 and receives from rank-1 at once."""

    def __init__(self, info: GroupInfo):
        assert info.world_size > 1, "a ring of one rank has nothing to exchange"
        single_group(info, "a ring")
        self.group = info.group
        self.rank, self.world_size = info.rank, info.world_size
        self.next = dist.get_global_rank(info.group, (info.rank + 1) % info.world_size)
        self.prev = dist.get_global_rank(info.group, (info.rank - 1) % info.world_size)

    def exchange(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], tag: int = 0, hop: int = 1
    ) -> list[dist.Work]:
        """Post, for each (send, recv) pair, send to the next rank and receive from the previous.

        Returns the pending works; call `wait(works)` before reading any recv buffer or writing
        any send buffer. Every rank posts the same pairs in the same order, which is what lets the
        transport match them; `tag` keeps two streams of messages (K/V and dK/dV) apart on
        transports that honour tags (gloo; NCCL matches by order, which is the same). `hop`
        sends to rank + hop and receives from rank - hop instead (a ring cut short returns its
        last dK/dV partial straight to the owner).
        """
        send_to, recv_from = self.next, self.prev
        if hop != 1:
            send_to = dist.get_global_rank(self.group, (self.rank + hop) % self.world_size)
            recv_from = dist.get_global_rank(self.group, (self.rank - hop) % self.world_size)
        ops = []
        for send, recv in pairs:
            ops.append(dist.P2POp(dist.isend, send, send_to, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, recv, recv_from, self.group, tag))
        return dist.batch_isend_irecv(ops)


KV_TAG, DKV_TAG = 0, 1  # the ring strategy's two message streams


class RingTransport:
    """The ring loop's transport seam, over real point-to-point messages between ranks.

    The ring strategy (strategies/ring.py) moves two kinds of messages and touches them only
    through these calls, so the same loop runs over `testing.emulated.LocalTransport` (W emulated
    ranks on one device) for benchmarks and single-device tests:

        post_kv(kv, kv_next, step)          send this step's K/V on, receive the next into kv_next
        new_partial(like)                   the float32 dK/dV partial of our own K/V, before any
                                            contribution (zeros)
        post_partial(dkv, step, steps)      send the partial we hold on to whoever needs it next
        receive_partial(pending) -> dkv     wait for the partial that arrives instead
        wait(pending)                       complete a posted K/V exchange

    Nothing is set up until the first message, so a ring of one rank (or a one-step ring) costs
    nothing.
    """

    def __init__(self, info: GroupInfo):
        self.info = info
        self._comm: RingComm | None = None
        self._spare: torch.Tensor | None = None  # the partial buffer the next one arrives in

    @property
    def comm(self) -> RingComm:
        if self._comm is None:
            self._comm = RingComm(self.info)
        return self._comm

    def post_kv(self, kv: torch.Tensor, kv_next: torch.Tensor, step: int) -> list[dist.Work]:
        return self.comm.exchange([(kv, kv_next)], KV_TAG)

    def wait(self, pending: list[dist.Work]) -> None:
        wait(pending)

    def new_partial(self, like: torch.Tensor) -> torch.Tensor:
        acc = accumulator_dtype(like.dtype)
        return torch.zeros((2, *like.shape), dtype=acc, device=like.device)

    def post_partial(
        self, dkv: torch.Tensor, step: int, steps: int
    ) -> tuple[list[dist.Work], torch.Tensor]:
        # a ring cut short returns its last partial straight to its owner, steps - 1 ranks behind
        hop = 1 if step + 1 < steps else self.info.world_size - steps + 1
        recv = torch.empty_like(dkv) if self._spare is None else self._spare
        works = self.comm.exchange([(dkv, recv)], DKV_TAG, hop)
        self._spare = dkv  # free again once `works` completed (receive_partial waits on them)
        return works, recv

    def receive_partial(self, pending: tuple[list[dist.Work], torch.Tensor]) -> torch.Tensor:
        works, recv = pending
        wait(works)
        return recv


def wait(works: list[dist.Work]) -> None:
    """Complete posted transfers (on NCCL this orders the stream; it does not block the host)."""
    for work in works:
        work.wait()
