"""Ulysses strategy: all-to-all from sequence-sharded to head-sharded, attention, and back.

Rank u of U holds n = S/U tokens of every head. One all-to-all gives it every token of its share
of the heads, it runs attention over the whole sequence locally, and a second all-to-all returns
the output to the sequence sharding:

    q, k, v (B, H, n, D)  --all-to-all-->  (B, H/U, U*n, D)  --attention-->  out (B, H/U, U*n, D)
    out, lse  --all-to-all-->  (B, H, n, D), (B, H, n)

The gathered sequence is in layout order (rank 0's shard, then rank 1's, ...), not token order, so
the mask is not plain causal: the blocks are the layout's per-shard schedule for every (query shard,
key shard) pair, offset into the concatenation and coalesced (gathered.py). That is the ring
strategy's loop with a single step, and the hybrid strategy is the same code with more steps: a
ring across ulysses groups. `HeadParallel` holds both; Ulysses is its one-group case.

Heads. Rank u gets query heads [u*Hq/U, (u+1)*Hq/U), so Hq % U == 0 is required. Query head h
reads K/V head h // (Hq/Hkv); rank u receives exactly the K/V heads its query heads read. When
Hkv % U == 0 that is Hkv/U heads, a partition. With fewer K/V heads than ranks (MQA, GQA with
Hkv < U) or Hkv not divisible by U, neighbouring ranks need the same K/V head: it is sent to each
of them ("replicated") and its gradient summed on the way back. If a rank's query heads do not
split evenly over its K/V heads (e.g. Hq=12, Hkv=3, U=4: rank 1 has heads 3,4,5 -> K/V 0,1,1), the
K/V heads are expanded locally to one per query head for the kernels and reduced after (in the
hybrid strategy the ring then carries the expanded heads).

Backward. Autograd keeps the head-sharded q, out, lse and (partitioned heads) k, v: the same bytes
as the local q, k, v, out, lse, and the backward needs only two all-to-alls: dout in, dq, dk, dv
out. With replicated K/V heads the head-sharded k, v would be larger than the local ones, so the
local k, v are kept instead and travel again with dout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo, RingTransport, all_to_all
from ringattn.merge import accumulator_dtype
from ringattn.plan import Call
from ringattn.strategies.base import Forward, Strategy
from ringattn.strategies.grouped import RingSchedule
from ringattn.strategies.ring import ring_backward, ring_forward

SINGLE = GroupInfo(None, 0, 1)


@dataclass(frozen=True)
class HeadPlan:
    """Which query and K/V heads each of `size` ranks holds after the all-to-all."""

    hq: int
    hkv: int
    size: int

    def q_heads(self, rank: int) -> range:
        per_rank = self.hq // self.size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def kv_heads(self, rank: int) -> range:
        group = self.hq // self.hkv
        heads = self.q_heads(rank)
        return range(heads.start // group, (heads.stop - 1) // group + 1)

    @property
    def replicated(self) -> bool:
        """True when some K/V head goes to more than one rank."""
        return sum(len(self.kv_heads(r)) for r in range(self.size)) > self.hkv

    def kv_index(self, rank: int) -> torch.Tensor | None:
        """Local K/V head of each local query head, when the kernels' even grouping (query head
        j reads K/V head j // (Hq_local/Hkv_local)) cannot express it; None when it can."""
        group, heads, kv = self.hq // self.hkv, self.q_heads(rank), self.kv_heads(rank)
        index = [h // group - kv.start for h in heads]
        per_kv = len(heads) // len(kv)
        if len(heads) % len(kv) == 0 and index == [j // per_kv for j in range(len(heads))]:
            return None
        return torch.tensor(index, device="cpu")  # host index; the caller moves it


def check_heads(hq: int, size: int, what: str) -> None:
    """ValueError unless `hq` query heads split evenly over `size` ranks."""
    if hq % size:
        divisors = [d for d in range(1, hq + 1) if hq % d == 0]
        raise ValueError(
            f"{what} splits the {hq} query heads over its {size} ranks, but {hq} is not "
            f"divisible by {size}; use a head count divisible by {size}, a group size that "
            f"divides {hq} ({divisors}), or strategy='ring' or 'allgather' (any head count)"
        )


def _resized(shape: torch.Size, heads: int, seq: int) -> tuple[int, ...]:
    """`shape` (B, H, S, ...) with H and S replaced."""
    return (shape[0], heads, seq, *shape[3:])


def to_heads(
    tensors: list[tuple[torch.Tensor, bool]], plan: HeadPlan, info: GroupInfo
) -> list[torch.Tensor]:
    """Sequence-sharded (B, H, n, ...) -> head-sharded (B, h, U*n, ...), one all-to-all for all.

    Each entry is (tensor, is_kv): K/V tensors split by `plan.kv_heads`, the others by q_heads.
    """
    if info.world_size == 1:
        return [x for x, _ in tensors]
    rank, size = info.rank, info.world_size

    def heads(is_kv: bool, r: int) -> range:
        return plan.kv_heads(r) if is_kv else plan.q_heads(r)

    sends = [
        [x.narrow(1, heads(kv, d).start, len(heads(kv, d))) for x, kv in tensors]
        for d in range(size)
    ]
    specs = [(_resized(x.shape, len(heads(kv, rank)), x.shape[2]), x.dtype) for x, kv in tensors]
    received = all_to_all(sends, [specs] * size, info)
    return [torch.cat([part[i] for part in received], dim=2) for i in range(len(tensors))]


def from_heads(
    tensors: list[tuple[torch.Tensor, bool]], plan: HeadPlan, info: GroupInfo
) -> list[torch.Tensor]:
    """Head-sharded (B, h, U*n, ...) -> sequence-sharded (B, H, n, ...), one all-to-all for all.

    Replicated K/V heads (is_kv, plan.replicated) come back from several ranks and are summed, in
    float32 (float64 for float64), and returned in that dtype; everything else keeps its dtype.
    """
    if info.world_size == 1:
        return [x for x, _ in tensors]
    size = info.world_size
    n = tensors[0][0].shape[2] // size

    def heads(is_kv: bool, r: int) -> range:
        return plan.kv_heads(r) if is_kv else plan.q_heads(r)

    sends = [[x.narrow(2, d * n, n) for x, _ in tensors] for d in range(size)]
    specs = [
        [(_resized(x.shape, len(heads(kv, s)), n), x.dtype) for x, kv in tensors]
        for s in range(size)
    ]
    received = all_to_all(sends, specs, info)
    results = []
    for i, (x, kv) in enumerate(tensors):
        parts = [part[i] for part in received]
        if kv and plan.replicated:
            total = torch.zeros(
                _resized(x.shape, plan.hkv, n), dtype=accumulator_dtype(x.dtype), device=x.device
            )
            for src, part in enumerate(parts):
                h = plan.kv_heads(src)
                total.narrow(1, h.start, len(h)).add_(part)
            results.append(total)
        else:
            results.append(torch.cat(parts, dim=1))
    return results


class HeadParallel(Strategy):
    """All-to-all inside ulysses groups, the ring strategy across them (module docstring)."""

    def groups(self, info: GroupInfo) -> tuple[GroupInfo, GroupInfo]:
        """(ulysses group, ring group) of a resolved group."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call) -> Forward:
        ulysses, ring = self.groups(call.info)
        plan = HeadPlan(q.shape[1], k.shape[1], ulysses.world_size)
        # q_h (B, Hq/U, U*n, D); k_h, v_h (B, h, U*n, D), h = K/V heads this rank's queries read
        q_h, k_h, v_h = to_heads([(q, False), (k, True), (v, True)], plan, ulysses)
        index = plan.kv_index(ulysses.rank)
        schedule = RingSchedule(call, ring, ulysses.world_size)
        out_h, lse_h = ring_forward(  # (B, Hq/U, U*n, D), (B, Hq/U, U*n)
            q_h, _expand(k_h, index), _expand(v_h, index), schedule, RingTransport(ring)
        )
        out, lse = from_heads([(out_h, False), (lse_h, False)], plan, ulysses)  # (B, Hq, n, ...)
        # what backward needs, no larger than the local q, k, v, out, lse (module docstring)
        keep_kv = (k, v) if plan.replicated else (k_h, v_h)
        return Forward(out, lse, (q_h, *keep_kv, out_h, lse_h))

    def backward(
        self, dout: torch.Tensor, saved: tuple[torch.Tensor, ...], call: Call
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_h, k_kept, v_kept, out_h, lse_h = saved
        ulysses, ring = self.groups(call.info)
        size = ulysses.world_size
        # forward kept the local k, v (n rows, Hkv heads) exactly when heads are replicated
        local_kv = k_kept.shape[2] == dout.shape[2]
        hkv = k_kept.shape[1] if local_kv else k_kept.shape[1] * size
        plan = HeadPlan(dout.shape[1], hkv, size)
        incoming = [(dout, False)] + ([(k_kept, True), (v_kept, True)] if local_kv else [])
        dout_h, *kv_h = to_heads(incoming, plan, ulysses)
        k_h, v_h = kv_h if local_kv else (k_kept, v_kept)
        index = plan.kv_index(ulysses.rank)
        schedule = RingSchedule(call, ring, size)
        dq_h, dk_h, dv_h = ring_backward(
            dout_h,
            q_h,
            _expand(k_h, index),
            _expand(v_h, index),
            out_h,
            lse_h,
            schedule,
            RingTransport(ring),
        )
        dk_h, dv_h = _reduce(dk_h, index, k_h.shape[1]), _reduce(dv_h, index, k_h.shape[1])
        dq, dk, dv = from_heads([(dq_h, False), (dk_h, True), (dv_h, True)], plan, ulysses)
        return dq, dk.to(k_kept.dtype), dv.to(v_kept.dtype)

    def saved_from_local(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: Call,
    ) -> tuple[torch.Tensor, ...]:
        """The head-sharded (q_h, k, v or k_h, v_h, out_h, lse_h) of `forward`, by one
        all-to-all of the local tensors (the compiled path: one all-to-all more than eager)."""
        ulysses, _ = self.groups(call.info)
        plan = HeadPlan(q.shape[1], k.shape[1], ulysses.world_size)
        if plan.replicated:  # forward kept the local k, v
            q_h, out_h, lse_h = to_heads([(q, False), (out, False), (lse, False)], plan, ulysses)
            return (q_h, k, v, out_h, lse_h)
        tensors = [(q, False), (k, True), (v, True), (out, False), (lse, False)]
        return tuple(to_heads(tensors, plan, ulysses))


def _expand(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """K/V heads -> one per local query head (uneven grouping only)."""
    return x if index is None else x.index_select(1, index.to(x.device))


def _reduce(dx: torch.Tensor, index: torch.Tensor | None, heads: int) -> torch.Tensor:
    """Gradient of `_expand`: sum the expanded heads back onto their K/V head (in float32), in
    dx's dtype, which every rank must send in (from_heads reads the same dtype from all)."""
    if index is None:
        return dx
    shape = (dx.shape[0], heads, *dx.shape[2:])
    total = torch.zeros(shape, dtype=accumulator_dtype(dx.dtype), device=dx.device)
    return total.index_add_(1, index.to(dx.device), dx.to(total.dtype)).to(dx.dtype)


class UlyssesStrategy(HeadParallel):
    name = "ulysses"

    def groups(self, info: GroupInfo) -> tuple[GroupInfo, GroupInfo]:
        return info, SINGLE

    def check(self, q: torch.Tensor, k: torch.Tensor, info: GroupInfo) -> None:
        check_heads(q.shape[1], info.world_size, f"strategy='ulysses' on {info.world_size} ranks")
