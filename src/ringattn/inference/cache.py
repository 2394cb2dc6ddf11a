"""The sharded KV cache: each rank keeps the K/V of its own tokens, per layer.

    prefill (zigzag, W = 2, 10 tokens, chunks of 3, padded to 12):
        rank 0 keeps 0 1 2 | 9          rank 1 keeps 3 4 5 | 6 7 8
    decode token 10 -> rank 0, 11 -> rank 1, 12 -> rank 0, ...  (round-robin: shards stay balanced)

No rank ever holds the whole cache. Within a rank the kept tokens are in increasing global
position (a layout keeps each shard in increasing order, and every later token comes after every
earlier one), so a sliding window of `left` tokens makes the evictable keys a prefix: a query at
position p sees keys with position >= p - left, and keys older than that are dropped for good.

Buffers grow by doubling (`reserve` sizes them up front, so a planned generation copies nothing);
`nbytes` counts the kept tokens only, the figure that `ringattn generate` reports per rank.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's K/V on one rank: rows [start, length) of preallocated buffers are live."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.k, self.v = k.contiguous(), v.contiguous()  # (B, Hkv, capacity, D)
        self.positions = positions.to(torch.int64).contiguous()  # (capacity,) global positions
        self.start, self.length = 0, k.shape[2]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens without another copy."""
        need = self.length + extra
        if need <= self.k.shape[2]:
            return
        self._resize(max(need, 2 * self.k.shape[2]))

    def _resize(self, capacity: int) -> None:
        live = slice(self.start, self.length)
        b, h, _, d = self.k.shape
        k = self.k.new_empty(b, h, capacity, d)
        v = self.v.new_empty(b, h, capacity, d)
        positions = self.positions.new_empty(capacity)
        count = self.length - self.start
        k[:, :, :count], v[:, :, :count] = self.k[:, :, live], self.v[:, :, live]
        positions[:count] = self.positions[live]
        self.k, self.v, self.positions = k, v, positions
        self.start, self.length = 0, count

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add tokens k, v (B, Hkv, n, D) at global `positions` (n,), after every kept one."""
        n = k.shape[2]
        if n == 0:
            return
        self.reserve(n)
        rows = slice(self.length, self.length + n)
        self.k[:, :, rows], self.v[:, :, rows] = k, v
        self.positions[rows] = positions
        self.length += n

    def evict_before(self, position: int) -> None:
        """Drop every kept token whose position is below `position` (a prefix, see module doc)."""
        live = self.positions[self.start : self.length]
        self.start += int(torch.searchsorted(live, torch.tensor(position)))
        if self.start > (self.k.shape[2] // 2):  # compact: the dead prefix must not grow forever
            self._resize(max(1, self.length - self.start))

    def kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the live k, v (B, Hkv, n, D) and their positions (n,)."""
        live = slice(self.start, self.length)
        return self.k[:, :, live], self.v[:, :, live], self.positions[live]

    @property
    def tokens(self) -> int:
        return self.length - self.start

    @property
    def nbytes(self) -> int:
        per_token = 2 * self.k[:, :, :1].numel() * self.k.element_size()
        return self.tokens * per_token


class ShardedKVCache:
    """This rank's part of every layer's K/V, and whose turn it is to keep the next decoded token.

    `window = (left, right)` (the model's sliding window; right must be 0 for a decoder) bounds what
    is kept: after each token, keys that no later query can see are evicted. `owner_of(step)` is
    the round-robin rank that keeps decoded token number `step` (0, 1, ... after the prompt).
    """

    def __init__(self, n_layers: int, rank: int, world_size: int, window: int | None = None):
        self.layers: list[LayerCache | None] = [None] * n_layers
        self.rank, self.world_size = rank, world_size
        self.window = window  # left extent in tokens; None: keep everything
        self.decoded = 0  # tokens appended one at a time, for the round-robin

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add this rank's real tokens of a prefill or follow-up turn (padding rows removed)."""
        if self.layers[layer] is None:
            self.layers[layer] = LayerCache(k, v, positions)
        else:
            self.layers[layer].append(k, v, positions)

    def next_owner(self) -> int:
        """The rank that keeps the next decoded token's K/V (the same answer on every rank)."""
        return self.decoded % self.world_size

    def append_decoded(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position: int, owner: int
    ) -> None:
        """Append one decoded token's k, v (B, Hkv, 1, D) on its owner only."""
        if owner == self.rank:
            self.store(layer, k, v, torch.tensor([position]))

    def evict(self, layer: int, next_query: int) -> None:
        """With a window, drop what a query at `next_query` or later can no longer see."""
        cache = self.layers[layer]
        if self.window is not None and cache is not None:
            cache.evict_before(next_query - self.window)

    def reserve(self, extra_decoded: int) -> None:
        """Size every layer for `extra_decoded` more decoded tokens (this rank's share)."""
        share = -(-extra_decoded // self.world_size)
        for cache in self.layers:
            if cache is not None:
                cache.reserve(share)

    def kept(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        cache = self.layers[layer]
        return None if cache is None else cache.kept()

    @property
    def tokens(self) -> int:
        """Tokens this rank keeps (per layer: every layer keeps the same ones)."""
        cache = self.layers[0]
        return 0 if cache is None else cache.tokens

    @property
    def nbytes(self) -> int:
        """Bytes of K/V this rank keeps over all layers."""
        return sum(cache.nbytes for cache in self.layers if cache is not None)
