"""The sharded KV cache: each rank keeps the K/V of its own tokens, per layer.

    prefill (zigzag, W = 2, 10 tokens, chunks of 3, padded to 12):
        rank 0 keeps 0 1 2 | 9          rank 1 keeps 3 4 5 | 6 7 8
    decode token 10 -> rank 0, 11 -> rank 1, 12 -> rank 0, ...  (round-robin: shards stay balanced)

No rank ever holds the whole cache. The engine keeps its K/V in pages (paged.py); this
contiguous cache is the one `--offload-kv` moves to host memory. Within a rank the kept tokens
are in increasing global position (a layout keeps each shard in increasing order, and every
later token comes after every earlier one), so a sliding window of `left` tokens makes the
evictable keys a prefix: a query at position p sees keys with position >= p - left, and keys
older than that are dropped for good.

Buffers grow by doubling, but `reserve` sizes them up front (the generators reserve this
rank's share of max_new_tokens right after the prefill, so a planned generation copies
nothing); `nbytes` counts the kept tokens, `capacity_bytes` what the buffers hold;
`ringattn generate` reports both per rank.

Offload (`ShardedKVCache.offload()`, `ringattn generate --offload-kv`): every layer's shard lives
in host memory (pinned when the model computes on CUDA), rows first (capacity, B, Hkv, D) so that
the live rows are one contiguous block. `kept(i)` returns device copies and starts the copy of
layer i + 1 (i = last: layer 0, the next token's first), on a side CUDA stream, so it moves while
layer i computes; on CPU the same path makes plain copies. A cache of one layer (the HF path
keeps one per (layer, sequence)) never prefetches itself: its owner calls `prefetch` on the next
layer's cache instead. Between the prefetch and its use the layer may gain the token being
decoded or lose evicted rows; both ends are patched with logical row counters (`dropped`,
`added`), so the copy equals the host rows exactly. At most two layers' shards are on the device
at once.

No host sync per layer while decoding: every cache keeps its positions twice, on the device (for
the attention masks) and on the host (`host`, which eviction searches), and a decoded token's
position is written with a device fill, never copied from the host.
"""

from __future__ import annotations

import torch


def _on_host(positions: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """The positions as a CPU int64 tensor: `host` if given, else a copy (a device sync)."""
    return (positions if host is None else host).to("cpu", torch.int64)


class LayerCache:
    """One layer's K/V on one rank: rows [start, length) of preallocated buffers are live."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 host: torch.Tensor | None = None):  # fmt: skip
        self.k, self.v = k.contiguous(), v.contiguous()  # (B, Hkv, capacity, D)
        self.positions = positions.to(torch.int64).contiguous()  # (capacity,) global positions
        self.host = _on_host(positions, host).clone()  # (capacity,) the same, for eviction
        self.start, self.length = 0, k.shape[2]

    def reserve(self, extra: int) -> None:
        """Make room for exactly `extra` more tokens (a planned generation: no doubling)."""
        if self.length + extra > self.k.shape[2]:
            self._resize(self.length - self.start + extra)

    def _grow(self, extra: int) -> None:
        """Room for `extra` more tokens, doubling when unplanned (amortised appends)."""
        need = self.length + extra
        if need > self.k.shape[2]:
            self._resize(max(need - self.start, 2 * self.k.shape[2]))

    def _resize(self, capacity: int) -> None:
        live = slice(self.start, self.length)
        b, h, _, d = self.k.shape
        k = self.k.new_empty(b, h, capacity, d)
        v = self.v.new_empty(b, h, capacity, d)
        positions, host = self.positions.new_empty(capacity), self.host.new_empty(capacity)
        count = self.length - self.start
        k[:, :, :count], v[:, :, :count] = self.k[:, :, live], self.v[:, :, live]
        positions[:count], host[:count] = self.positions[live], self.host[live]
        self.k, self.v, self.positions, self.host = k, v, positions, host
        self.start, self.length = 0, count

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               host: torch.Tensor | None = None) -> None:  # fmt: skip
        """Add tokens k, v (B, Hkv, n, D) at global `positions` (n,), after every kept one
        (`host`: the positions on the CPU, when the caller has them without a device sync)."""
        n = k.shape[2]
        if n == 0:
            return
        self._grow(n)
        rows = slice(self.length, self.length + n)
        self.k[:, :, rows], self.v[:, :, rows] = k, v
        self.positions[rows] = positions
        self.host[rows] = _on_host(positions, host)
        self.length += n

    def append_one(self, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        """`append` of one token (B, Hkv, 1, D) at `position`: scalar fills, no index tensors."""
        self._grow(1)
        row = self.length
        self.k[:, :, row] = k[:, :, 0]
        self.v[:, :, row] = v[:, :, 0]
        self.positions[row] = position  # a device fill from a Python int: no sync
        self.host[row] = position
        self.length += 1

    def evict_before(self, position: int) -> None:
        """Drop every kept token whose position is below `position` (a prefix, see module doc);
        searched on the host copy of the positions: no device sync in the decode loop."""
        live = self.host[self.start : self.length]
        self.start += int(torch.searchsorted(live, torch.tensor(position, device="cpu")))
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
        return self.tokens * self.token_bytes

    @property
    def token_bytes(self) -> int:
        return 2 * self.k[:, :, :1].numel() * self.k.element_size()

    @property
    def capacity_bytes(self) -> int:
        """Bytes the buffers hold, live or not (what the cache costs in memory)."""
        return self.k.shape[2] * self.token_bytes


class HostLayerCache:
    """One layer's K/V on one rank in host memory, rows first: k, v (capacity, B, Hkv, D).

    Live physical rows are [start, length); logical row j (counting every token ever added) is
    physical row start + j - dropped, so a device copy of logical rows [d, a) can be patched."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, pin: bool,
                 host: torch.Tensor | None = None):  # fmt: skip
        self.pin = pin
        b, h, n, d = k.shape
        # host memory on purpose: the offloaded cache lives on the CPU (pinned with CUDA)
        self.k = torch.empty(n, b, h, d, dtype=k.dtype, device="cpu", pin_memory=pin)
        self.v = torch.empty(n, b, h, d, dtype=v.dtype, device="cpu", pin_memory=pin)
        self.positions = torch.empty(n, dtype=torch.int64, device=positions.device)
        self.host = torch.empty(n, dtype=torch.int64, device="cpu")  # the positions, for eviction
        self.start = self.length = self.dropped = self.added = 0
        self.append(k, v, positions, host)

    def reserve(self, extra: int) -> None:
        if self.length + extra > self.k.shape[0]:
            self._resize(self.length - self.start + extra)

    def _grow(self, extra: int) -> None:
        need = self.length + extra
        if need > self.k.shape[0]:
            self._resize(max(need - self.start, 2 * self.k.shape[0]))

    def _resize(self, capacity: int) -> None:
        live, count = slice(self.start, self.length), self.length - self.start
        k = torch.empty(capacity, *self.k.shape[1:], dtype=self.k.dtype, device="cpu",
                        pin_memory=self.pin)  # fmt: skip
        v = torch.empty(capacity, *self.v.shape[1:], dtype=self.v.dtype, device="cpu",
                        pin_memory=self.pin)  # fmt: skip
        positions, host = self.positions.new_empty(capacity), self.host.new_empty(capacity)
        k[:count], v[:count], positions[:count] = self.k[live], self.v[live], self.positions[live]
        host[:count] = self.host[live]
        self.k, self.v, self.positions, self.host = k, v, positions, host
        self.start, self.length = 0, count

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               host: torch.Tensor | None = None) -> None:  # fmt: skip
        """Add k, v (B, Hkv, n, D) (on any device) at global `positions` (n,)."""
        n = k.shape[2]
        if n == 0:
            return
        self._grow(n)
        rows = slice(self.length, self.length + n)
        self.k[rows].copy_(k.permute(2, 0, 1, 3))
        self.v[rows].copy_(v.permute(2, 0, 1, 3))
        self.host[rows] = _on_host(positions, host)
        self.positions[rows] = positions.to(self.positions.device, torch.int64)
        self.length += n
        self.added += n

    def evict_before(self, position: int) -> None:
        live = self.host[self.start : self.length]
        gone = int(torch.searchsorted(live, torch.tensor(position, device="cpu")))
        self.start += gone
        self.dropped += gone
        if self.start > (self.k.shape[0] // 2):
            self._resize(max(1, self.length - self.start))

    @property
    def tokens(self) -> int:
        return self.length - self.start

    @property
    def nbytes(self) -> int:
        return self.tokens * 2 * self.k[:1].numel() * self.k.element_size()

    @property
    def capacity_bytes(self) -> int:
        return self.k.shape[0] * 2 * self.k[:1].numel() * self.k.element_size()


class _Copy:
    """Device copies of logical rows [dropped, added) of one layer, and the copy's CUDA event."""

    def __init__(self, cache: HostLayerCache, device: torch.device, stream) -> None:
        self.dropped, self.added = cache.dropped, cache.added
        rows = slice(cache.start, cache.length)
        if stream is None:  # CPU: the same path, plain copies
            self.k, self.v = cache.k[rows].clone(), cache.v[rows].clone()
            self.event = None
            return
        with torch.cuda.stream(stream):
            self.k = cache.k[rows].to(device, non_blocking=True)  # pinned: asynchronous
            self.v = cache.v[rows].to(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def finish(self, cache: HostLayerCache, device: torch.device) -> tuple:
        """(k, v) (B, Hkv, n, D) equal to the layer's live host rows now."""
        if self.event is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(self.event)
            self.k.record_stream(current)  # allocated on the side stream, used on this one
            self.v.record_stream(current)
        first = min(max(cache.dropped - self.dropped, 0), self.k.shape[0])
        k, v = self.k[first:], self.v[first:]
        since = max(self.added, cache.dropped)  # rows added after the copy, still live
        if cache.added > since:
            rows = slice(cache.start + since - cache.dropped, cache.length)
            k = torch.cat([k, cache.k[rows].to(device, copy=True)])
            v = torch.cat([v, cache.v[rows].to(device, copy=True)])
        return k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous()


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
        self.offloaded = False
        self._device: torch.device | None = None  # offload: where the model computes
        self._positions_device: torch.device | None = None
        self._copies: dict[int, _Copy] = {}  # offload: prefetched layers
        self._stream = None

    def offload(self) -> None:
        """Keep every layer's shard in host memory from now on (see the module docstring)."""
        if any(layer is not None for layer in self.layers):
            raise ValueError("offload() must be called before the cache holds any tokens")
        self.offloaded = True

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              host: torch.Tensor | None = None) -> None:  # fmt: skip
        """Add this rank's real tokens of a prefill or follow-up turn (padding rows removed);
        `host`: the positions on the CPU if the caller has them (else copied: a sync)."""
        if self.layers[layer] is None and self.offloaded:
            self._device, self._positions_device = k.device, positions.device
            self.layers[layer] = HostLayerCache(k, v, positions, k.device.type == "cuda", host)
        elif self.layers[layer] is None:
            self.layers[layer] = LayerCache(k, v, positions, host)
        else:
            self.layers[layer].append(k, v, positions, host)

    def next_owner(self) -> int:
        """The rank that keeps the next decoded token's K/V (the same answer on every rank)."""
        return self.decoded % self.world_size

    def append_decoded(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position: int, owner: int
    ) -> None:
        """Append one decoded token's k, v (B, Hkv, 1, D) on its owner only. The position is a
        fill on the device and a host tensor: no copy from the host, no sync."""
        if owner != self.rank:
            return
        cache = self.layers[layer]
        if isinstance(cache, LayerCache):  # the common case: one row written in place
            cache.append_one(k, v, position)
            return
        on_device = torch.full((1,), position, dtype=torch.int64, device=k.device)
        on_host = torch.full((1,), position, dtype=torch.int64, device="cpu")
        self.store(layer, k, v, on_device, on_host)

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
        """The live k, v (B, Hkv, n, D) and positions (n,) of `layer`; offloaded: device copies,
        and the next layer's copy starts."""
        cache = self.layers[layer]
        if cache is None or not self.offloaded:
            return None if cache is None else cache.kept()
        copy = self._copies.pop(layer, None) or _Copy(cache, self._device, self._side_stream())
        k, v = copy.finish(cache, self._device)
        positions = cache.positions[cache.start : cache.length].to(
            self._positions_device, copy=True
        )
        following = (layer + 1) % len(self.layers)
        if following != layer:  # one layer per cache (the HF path): its owner prefetches
            self.prefetch(following)
        return k, v, positions

    def prefetch(self, layer: int) -> None:
        """Start the device copy of `layer` (offloaded), unless one is under way."""
        if self.offloaded and self.layers[layer] is not None and layer not in self._copies:
            self._copies[layer] = _Copy(self.layers[layer], self._device, self._side_stream())

    def _side_stream(self):
        if self._device is None or self._device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # host rows written
        return self._stream

    @property
    def tokens(self) -> int:
        """Tokens this rank keeps (per layer: every layer keeps the same ones)."""
        cache = self.layers[0]
        return 0 if cache is None else cache.tokens

    @property
    def nbytes(self) -> int:
        """Bytes of K/V this rank keeps over all layers."""
        return sum(cache.nbytes for cache in self.layers if cache is not None)

    @property
    def capacity_bytes(self) -> int:
        """Bytes this rank's buffers take over all layers (kept tokens plus reserved room)."""
        return sum(cache.capacity_bytes for cache in self.layers if cache is not None)
