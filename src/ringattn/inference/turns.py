"""Follow-up turns: T new tokens attending P cached ones plus themselves, pass-KV or pass-Q.

The T new tokens are sharded by the layout like a prompt (`cu_seqlens = [0, T]`, positions
P .. P + T - 1), so each rank holds about T/W new queries and keeps their K/V afterwards. A new
query must see every cached key (all earlier: no mask, but for a window) and the new keys up to
itself (the layout's causal schedule). Two exact ways to get there (Meta, "Context Parallelism for
Scalable Million-Token Inference", 2024):

    pass-KV   K/V travel, queries stay: the new K/V go around the ring (ringattn.attention over the
              new tokens), then the cached K/V shards go around the ring too, one shard held at
              a time (each step's transfer posted before that step's compute), so no rank ever
              holds the whole cache; each rank merges its queries' partials.
              Moves (T + P) * 2 * Hkv * D per rank.
    pass-Q    queries travel, K/V stay: the new queries are gathered, every rank attends all of
              them over its own cache and its own new K/V, and the partial (out, lse) go back to
              the queries' owners in one all-to-all, merged there. Moves T * Hq * (2 D + 1).

`choose_mode` picks the one that moves fewer bytes, counted as above with the real element sizes:
pass-KV moves (T + P_kept) * 2 * Hkv * D * e bytes (P_kept: the cached tokens actually kept, fewer
than P under a sliding window), pass-Q T * Hq * D * e (the queries) + T * Hq * (D + 1) * 4 (the
float32 partials back). With e = 4 the break-even is at T / (T + P_kept) = Hkv / Hq; with bf16 at
2/3 of that. (The paper's rule of thumb, 2 * Hkv / Hq, counts neither the partials nor D.)
Exposure: pass-KV's ring overlaps each step's transfer, a shard of (T + P) / N tokens, with that
step's attention, 4 * (T / N) * ((T + P) / N) * Hq * D FLOPs, so its transfer is hidden when
T >= N * C * Hkv * e / (2 * Hq * BW) for N ranks of C FLOP/s and BW bytes/s; then pass-KV wins
whatever the bytes (only checked when C and BW are given).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ringattn
from ringattn.comm import GroupInfo, RingComm, all_gather_async, all_to_all, wait
from ringattn.inference.partials import attention_options, local_partial, merge_stacked
from ringattn.kernels import KERNELS
from ringattn.kernels.base import Kernel
from ringattn.layout import Block
from ringattn.merge import merge_
from ringattn.packing import Placement, placement_blocks

MODES = ("auto", "pass-kv", "pass-q")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown follow-up mode {mode!r}; choose one of {list(MODES)}")


def choose_mode(
    new_tokens: int,
    cached_tokens: int,
    n_heads: int,
    n_kv_heads: int,
    world_size: int,
    *,
    head_dim: int = 128,
    kept_tokens: int | None = None,
    flops_per_s: float | None = None,
    bytes_per_s: float | None = None,
    elem_bytes: int = 2,
) -> str:
    """ "pass-q" or "pass-kv" for T = new_tokens over P = cached_tokens, of which `kept_tokens`
    are still in the cache (default: all; fewer under a window). See the module docstring."""
    kept = cached_tokens if kept_tokens is None else kept_tokens
    kv_bytes = (new_tokens + kept) * 2 * n_kv_heads * head_dim * elem_bytes
    q_bytes = new_tokens * n_heads * (head_dim * elem_bytes + (head_dim + 1) * 4)
    if q_bytes >= kv_bytes:
        return "pass-kv"
    if flops_per_s and bytes_per_s:
        hides_at = world_size * flops_per_s * n_kv_heads * elem_bytes / (2 * n_heads * bytes_per_s)
        if new_tokens >= hides_at:
            return "pass-kv"
    return "pass-q"


@dataclass
class Turn:
    """What every layer of one follow-up turn shares."""

    info: GroupInfo
    group: object
    layout: str
    placement: Placement  # of the T new tokens, cu_seqlens = [0, T]
    offset: int  # P: position of the first new token
    kernel: Kernel
    scale: float
    window: int | None  # left extent, None: unbounded
    cache_lengths: list[int]  # kept tokens per rank (the same for every layer)
    cache_positions: list[torch.Tensor] | None = None  # per rank, gathered only with a window

    def query_positions(self, rank: int) -> torch.Tensor:
        """Global positions of rank `rank`'s new rows; -1 on padding."""
        index = self.placement.global_indices(rank)
        return torch.where(index >= 0, index + self.offset, index)

    def visible(self, rank: int, key_positions: torch.Tensor) -> torch.Tensor | None:
        """(Sq, Sk) mask of rank `rank`'s new queries over cached keys: None = all (no window)."""
        if self.window is None:
            return None
        q_pos = self.query_positions(rank)
        mask = key_positions[None, :] >= (q_pos[:, None] - self.window)
        return mask & (q_pos[:, None] >= 0)


def blocks_partial(
    kernel: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: tuple[Block, ...] | list[Block],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) float32 of q's rows over k, v restricted to `blocks` (a layout's schedule)."""
    b, h, sq, d = q.shape
    out = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), device=q.device)
    for block in blocks:
        rows = slice(block.q_start, block.q_stop)
        keys = slice(block.kv_start, block.kv_stop)
        qb, kb, vb = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        if block.band is not None:
            band_kernel = kernel if kernel.supports_band else KERNELS["reference"]
            block_out, block_lse = band_kernel.forward_band(qb, kb, vb, block.band, scale)
        else:
            block_out, block_lse = kernel.forward(qb, kb, vb, block.causal, scale)
        merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return out, lse


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (B, H, n, D) zero-padded to `length` rows."""
    pad = x.new_zeros(*x.shape[:2], length - x.shape[2], x.shape[3])
    return torch.cat([x, pad], dim=2)


CACHE_TAG = 3  # pass-KV's cache ring (the attention ring uses 0 and 1, reduce-scatter 2)


def pass_kv(
    turn: Turn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, Hq, T_local, D) float32 of this rank's new queries; K/V travel.
    With `return_lse`, also the merged lse (B, Hq, T_local) (attention sinks need it)."""
    info = turn.info
    cached_k, cached_v, _ = cached
    window = None if turn.window is None else (turn.window, 0)
    new_out, new_lse = ringattn.attention(
        q, k, v, causal=True, scale=turn.scale, group=turn.group, layout=turn.layout,
        return_lse=True, cu_seqlens=list(turn.placement.bounds), window=window,
        **attention_options(turn.kernel),
    )  # fmt: skip
    # the cached shards travel around the ring, padded to one length (one message shape)
    longest = max(turn.cache_lengths)
    shard = torch.stack([_pad_rows(cached_k, longest), _pad_rows(cached_v, longest)])
    ring = RingComm(info) if info.world_size > 1 else None
    spare = torch.empty_like(shard) if ring else None
    partials: list = [None] * info.world_size
    for step in range(info.world_size):
        src = (info.rank - step) % info.world_size  # whose cache shard we hold now
        more = ring is not None and step + 1 < info.world_size
        works = ring.exchange([(shard, spare)], CACHE_TAG) if more else []
        n = turn.cache_lengths[src]
        key_positions = None if turn.cache_positions is None else turn.cache_positions[src]
        visible = None if key_positions is None else turn.visible(info.rank, key_positions)
        partials[src] = local_partial(
            turn.kernel, q, shard[0][:, :, :n], shard[1][:, :, :n], turn.scale, visible
        )
        if more:
            wait(works)
            shard, spare = spare, shard
    # merged in rank order, whatever the ring order: the same sums as before
    outs = [new_out.float()] + [out for out, _ in partials]
    lses = [new_lse.float()] + [lse for _, lse in partials]
    merged, lse = merge_stacked(torch.stack(outs), torch.stack(lses))
    return (merged, lse) if return_lse else merged


def pass_q(
    turn: Turn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, Hq, T_local, D) float32 of this rank's new queries; queries travel.
    With `return_lse`, also the merged lse (B, Hq, T_local)."""
    info = turn.info
    cached_k, cached_v, cached_pos = cached
    gathered, works = all_gather_async(q.contiguous(), info)  # (W, B, Hq, T_local, D)
    wait(works)
    window = None if turn.window is None else (turn.window, 0)
    sends = []
    for owner in range(info.world_size):
        q_owner = gathered[owner]
        old = local_partial(
            turn.kernel, q_owner, cached_k, cached_v, turn.scale, turn.visible(owner, cached_pos)
        )
        blocks = placement_blocks(turn.placement, owner, info.rank, True, window)
        new = blocks_partial(turn.kernel, q_owner, k, v, blocks, turn.scale)
        out, lse = merge_stacked(torch.stack([old[0], new[0]]), torch.stack([old[1], new[1]]))
        sends.append([out.contiguous(), lse.contiguous()])
    specs = [[(tuple(x.shape), x.dtype) for x in sends[0]]] * info.world_size
    received = all_to_all(sends, specs, info)  # partials of OUR queries, one per rank
    merged, lse = merge_stacked(
        torch.stack([part[0] for part in received]), torch.stack([part[1] for part in received])
    )
    return (merged, lse) if return_lse else merged
