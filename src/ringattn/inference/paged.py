"""A paged KV cache for one rank: fixed-size blocks shared by sequences and prefix entries.

    slots of layer l:  k[l], v[l]  (n_blocks * B, Hkv, D)       one preallocated tensor a layer
    block b:           slots [bB, (b + 1)B)                      the unit of sharing
    a sequence:        Table: blocks [7, 2, 9 | 4 | 12]          rows in increasing position
                                   chunk 0   chunk 1   decoded
    a prefix entry:    references to a table's blocks of one chunk (vLLM's and nano-vllm's
                       reference-counted blocks; the hashes live on rank 0: serve/pool.py)

Each rank holds its own share of a sequence's tokens (the layout places each prefill chunk,
decoded tokens go round-robin), so each rank's table differs; the same attention layers store
the same rows, so one table serves every layer. A table's rows are in *regions*: the prompt's
chunk c = positions [cC, (c + 1)C) is one region, decoded rows another, and every region starts
a new block. So a chunk's rows on a rank are whole blocks plus one partial, and an entry that
keeps chunk c references exactly its region's blocks.

Adopting a prefix of `tokens` tokens from entries (a request whose prompt starts like an
earlier one): the rows of an entry below `tokens` are its first m rows (a rank keeps its rows
in increasing position, and the K/V at position p depend on tokens <= p only, so those rows
are that prefix's cache whatever placement computed them). The adopter shares the first m // B
blocks (reference counts go up: no copy) and copies the m % B rows of the next into a block
of its own (copy on write: that block may hold rows past the cut, and the adopter may write
after them). So every shared block is full and a region fills its blocks B rows at a time:
with chunks of a multiple of B x W tokens no whole chunk needs a copy. A table only
ever writes into the last block of a region that it took itself; shared blocks are full.

A block returns to the free list when no table and no entry references it. Rank 0's pool
(serve/pool.py) counts every rank's blocks with an upper bound per region, so a rank never runs
out; if it did (a bug), `take` raises a clear error and the step fails, not the server.

A sliding window does not free rows here (a region's blocks may be shared): each layer's view
moves a logical start past the keys no later query can see, so sliding-window models reuse
prefixes too. Without a server's pool (generate, Session: an `elastic` store) a windowed layer
keeps its rows in a contiguous cache of its own instead, which drops what the window has passed
(KVState.cache): it holds the window, not the sequence.
"""

from __future__ import annotations

import array
import bisect
import heapq

import torch

__all__ = ["DECODED", "PagedStore", "PagedView", "Table"]

DECODED = -1  # the region of decoded rows (prompt chunks are regions 0, 1, ...)


class Table:
    """One sequence's rows on this rank: their slots and positions, by region (module doc)."""

    def __init__(self, device: torch.device):
        self.blocks: list[int] = []
        self.owned: set[int] = set()  # blocks this table took itself (it may write into them)
        self.slots = array.array("q")  # slot of each row
        self.host = array.array("q")  # position of each row
        self.region = None  # region of the last row
        self.fill = 0  # rows in the last block
        self.adopted = 0  # rows every layer already holds (adopt copies or shares all layers)
        self.runs: list[list[int]] = []  # [first row, first slot, rows]: slots in a row
        self.device = device
        self._index = torch.empty(0, dtype=torch.int64, device=device)  # slots, on the device
        self._synced = 0  # rows of `_index` that are current

    @property
    def rows(self) -> int:
        return len(self.slots)

    def add(self, slot: int, position: int) -> None:
        """One more row, in `slot`, at `position` (after every row)."""
        run = self.runs[-1] if self.runs else None
        if run is not None and run[1] + run[2] == slot:
            run[2] += 1
        else:
            self.runs.append([self.rows, slot, 1])
        self.slots.append(slot)
        self.host.append(position)

    def slices(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Rows [start, stop) as (first row, first slot, rows) runs of consecutive slots."""
        out = []
        for row, slot, n in self.runs:
            lo, hi = max(row, start), min(row + n, stop)
            if lo < hi:
                out.append((lo, slot + lo - row, hi - lo))
        return out

    def index(self, start: int, stop: int) -> torch.Tensor:
        """The slots of rows [start, stop) as a device tensor (grown by doubling)."""
        if self._synced < self.rows:
            if self._index.numel() < self.rows:
                grown = torch.empty(max(2 * self._index.numel(), self.rows, 16),
                                    dtype=torch.int64, device=self.device)  # fmt: skip
                grown[: self._synced] = self._index[: self._synced]
                self._index = grown
            new = torch.tensor(self.slots[self._synced :], dtype=torch.int64, device=self.device)
            self._index[self._synced : self.rows] = new
            self._synced = self.rows
        return self._index[start:stop]

    def first_at(self, position: int) -> int:
        """The first row whose position is >= `position` (rows are in increasing position)."""
        return bisect.bisect_left(self.host, position)


class PagedStore:
    """This rank's blocks, the sequences' tables and the prefix entries (module docstring)."""

    def __init__(self, n_blocks: int, block: int, chunk: int, device: torch.device,
                 elastic: bool = False):  # fmt: skip
        if n_blocks < 1 or block < 1 or chunk < 1:
            raise ValueError(f"a paged store needs n_blocks, block, chunk >= 1, got "
                             f"{n_blocks}, {block}, {chunk}")  # fmt: skip
        self.n_blocks, self.block, self.chunk, self.device = n_blocks, block, chunk, device
        self.elastic = elastic  # out of blocks: double them (generate, Session: no pool)
        self.k: dict[int, torch.Tensor] = {}  # layer -> (n_blocks * block, Hkv, D)
        self.v: dict[int, torch.Tensor] = {}
        self.positions = torch.empty(n_blocks * block, dtype=torch.int64, device=device)
        self.refs = [0] * n_blocks
        self.free = set(range(n_blocks))
        # a heap of free blocks, lazily: `take(after)` leaves its block in; `_heaped` holds what
        # the heap holds, so a block freed again is not pushed twice (the heap stays <= n_blocks)
        self._lowest = list(range(n_blocks))
        self._heaped = set(range(n_blocks))
        self.tables: dict[int, Table] = {}
        self.entries: dict[int, tuple[list[int], array.array, array.array]] = {}

    # ---- blocks ----

    def take(self, after: int | None = None) -> int:
        """A free block: the one right after `after` when free (a table's rows then stay in
        one run of slots, read in place: `Table.slices`), else the lowest."""
        if not self.free and self.elastic:
            self._double()
        if not self.free:
            raise RuntimeError(
                f"the paged KV store is out of blocks ({self.n_blocks} of {self.block} rows): "
                f"the pool's accounting let a step need more than this rank holds (a bug)"
            )
        b = after + 1 if after is not None and after + 1 in self.free else None
        while b is None:
            lowest = heapq.heappop(self._lowest)
            self._heaped.discard(lowest)
            b = lowest if lowest in self.free else None
        self.free.remove(b)
        self.refs[b] = 1
        return b

    def _double(self) -> None:
        """Twice the blocks (copying the pages once: O(log n) copies as a cache grows); every
        slot keeps its number, so tables and entries stay valid."""
        n, rows = self.n_blocks, self.n_blocks * self.block
        for pages in (self.k, self.v):
            for layer, old in pages.items():
                pages[layer] = torch.empty((2 * rows, *old.shape[1:]), dtype=old.dtype,
                                           device=self.device)  # fmt: skip
                pages[layer][:rows] = old
        positions = torch.empty(2 * rows, dtype=torch.int64, device=self.device)
        positions[:rows] = self.positions
        self.positions, self.n_blocks = positions, 2 * n
        self.refs += [0] * n
        self.free.update(range(n, 2 * n))
        for b in range(n, 2 * n):
            self._push(b)

    def _push(self, b: int) -> None:
        if b not in self._heaped:
            heapq.heappush(self._lowest, b)
            self._heaped.add(b)

    def _unref(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.add(b)
                self._push(b)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self.free)

    @property
    def shared(self) -> int:
        """Blocks referenced more than once (by two tables, or a table and an entry)."""
        return sum(1 for r in self.refs if r > 1)

    # ---- sequences ----

    def table(self, seq: int) -> Table:
        if seq not in self.tables:
            self.tables[seq] = Table(self.device)
        return self.tables[seq]

    def release(self, seq: int) -> None:
        table = self.tables.pop(seq, None)
        if table is not None:
            self._unref(table.blocks)

    def assign(self, table: Table, host: list[int], decoded: bool) -> None:
        """Give slots to new rows at positions `host` (increasing), after every row of `table`:
        into the last block while it is the table's own, of the same region, and not full."""
        for position in host:
            # decoded rows go on in the last block (the count gives them blocks of their own:
            # an upper bound); no adopter ever shares a block past an entry's full ones
            region = (table.region if table.blocks else DECODED) if decoded else (
                position // self.chunk)  # fmt: skip
            if (not table.blocks or region != table.region or table.blocks[-1] not in table.owned
                    or table.fill >= self.block):  # fmt: skip
                b = self.take(table.blocks[-1] if table.blocks else None)
                table.blocks.append(b)
                table.owned.add(b)
                table.fill = 0
            table.add(table.blocks[-1] * self.block + table.fill, position)
            table.fill += 1
            table.region = region
        if len(host) == 1:  # a decoded token: a fill from a Python int, no index tensor
            self.positions[table.slots[-1]] = host[0]
        elif host:
            rows = torch.tensor(host, dtype=torch.int64, device=self.device)
            self.positions[table.index(table.rows - len(host), table.rows)] = rows

    def write(self, layer: int, table: Table, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer`'s k, v (1, Hkv, n, D) into the slots of rows [start, start + n)."""
        if layer not in self.k:  # the first store of this layer: its whole slot tensor
            shape = (self.n_blocks * self.block, k.shape[1], k.shape[3])
            self.k[layer] = torch.empty(shape, dtype=k.dtype, device=self.device)
            self.v[layer] = torch.empty(shape, dtype=v.dtype, device=self.device)
        if k.shape[2] == 1:  # a decoded token: one slot, no index tensor (the decode loop)
            slot = table.slots[start]
            self.k[layer][slot] = k[0, :, 0]  # (Hkv, D)
            self.v[layer][slot] = v[0, :, 0]
            return
        index = table.index(start, start + k.shape[2])
        self.k[layer].index_copy_(0, index, k[0].transpose(0, 1))  # (n, Hkv, D)
        self.v[layer].index_copy_(0, index, v[0].transpose(0, 1))

    def read(self, layer: int, table: Table, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """k, v (1, Hkv, n, D) and positions (n,) of rows [start, stop) (gathered copies)."""
        index = table.index(start, stop)
        k = self.k[layer].index_select(0, index).transpose(0, 1)[None]
        v = self.v[layer].index_select(0, index).transpose(0, 1)[None]
        return k, v, self.positions.index_select(0, index)

    # ---- prefix entries ----

    def keep(self, entry: int, seq: int, start: int, stop: int) -> None:
        """Entry `entry` references seq's rows with positions in [start, stop): one chunk's
        region, whole blocks from its start (module docstring)."""
        table = self.table(seq)
        lo, hi = table.first_at(start), table.first_at(stop)
        # a region fills its blocks in order from a block's start: row lo + jB opens block j
        assert lo == hi or table.slots[lo] % self.block == 0, "a chunk's region starts a block"
        blocks = [table.slots[i] // self.block for i in range(lo, hi, self.block)]
        for b in blocks:
            self.refs[b] += 1
        self.entries[entry] = (blocks, table.slots[lo:hi], table.host[lo:hi])

    def evict(self, entry: int) -> None:
        gone = self.entries.pop(entry, None)
        if gone is not None:
            self._unref(gone[0])

    def adopt(self, seq: int, entries: list[int], tokens: int) -> None:
        """Start the empty sequence `seq` with the rows of `entries` (chunks, in order) whose
        position is below `tokens`: whole blocks shared, the rest of a cut block copied."""
        table = self.table(seq)
        assert table.rows == 0, "adopt starts an empty sequence"
        for entry in entries:
            blocks, slots, host = self.entries[entry]
            m = bisect.bisect_left(host, tokens)
            full = m // self.block  # blocks wholly below the cut: shared
            for b in blocks[:full]:
                self.refs[b] += 1
                table.blocks.append(b)
            for slot, position in zip(slots[: full * self.block], host[: full * self.block]):
                table.add(slot, position)
            table.region = host[0] // self.chunk if full else None
            if m % self.block:  # copy on write: the rest into a block of ours
                rest = list(host[full * self.block : m])
                source = torch.tensor(slots[full * self.block : m], dtype=torch.int64,
                                      device=self.device)  # fmt: skip
                at = table.rows
                table.region = None  # a new block for these rows
                self.assign(table, rest, decoded=False)
                target = table.index(at, table.rows)
                for layer in self.k:
                    self.k[layer][target] = self.k[layer][source]
                    self.v[layer][target] = self.v[layer][source]
        table.adopted = table.rows


class PagedView:
    """One layer's view of one sequence's table on this rank: the interface of a one-layer
    ShardedKVCache (`store`, `append_decoded`, `evict`, `kept`, `tokens`) over the pages."""

    def __init__(self, store: PagedStore, layer: int, seq: int, window: int | None, rank: int):
        self.pages, self.layer, self.table = store, layer, store.table(seq)
        self.window, self.rank = window, rank
        self.start = 0  # rows before it are out of the window for every later query
        self.length = self.table.adopted  # rows this layer holds

    def _rows(self, k: torch.Tensor, v: torch.Tensor, positions, decoded: bool) -> None:
        n = k.shape[2]
        if n == 0:
            return
        if self.length + n > self.table.rows:  # the first layer to reach these rows
            host = positions if isinstance(positions, list) else positions.tolist()
            self.pages.assign(self.table, host[self.table.rows - self.length :], decoded)
        self.pages.write(self.layer, self.table, self.length, k, v)
        self.length += n

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              host: torch.Tensor | None = None) -> None:  # fmt: skip
        """A prompt piece's real rows k, v (1, Hkv, n, D) at `positions` (n,)."""
        self._rows(k, v, positions if host is None else host, decoded=False)

    def append_decoded(self, layer: int, k: torch.Tensor, v: torch.Tensor, position: int,
                       owner: int) -> None:  # fmt: skip
        if owner == self.rank:
            self._rows(k, v, [position], decoded=True)

    def evict(self, layer: int, next_query: int) -> None:
        """Keys a query at `next_query` or later cannot see leave the view (not the pages)."""
        if self.window is not None:
            start = self.table.first_at(next_query - self.window)
            self.start = min(max(self.start, start), self.length)

    def kept(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.layer not in self.pages.k:
            return None
        return self.pages.read(self.layer, self.table, self.start, self.length)

    def prefetch(self, layer: int) -> None:
        """Nothing to fetch: the pages stay where they are."""

    def reserve(self, extra: int) -> None:
        """Nothing to size: the pool's blocks are preallocated."""

    @property
    def tokens(self) -> int:
        return self.length - self.start

    @property
    def nbytes(self) -> int:
        """Bytes of the rows this layer holds: every row up to its length, those a window has
        passed too (the pages keep them)."""
        if self.layer not in self.pages.k:
            return 0
        k = self.pages.k[self.layer]
        return 2 * self.length * k[0].numel() * k.element_size()

    capacity_bytes = nbytes  # the pages are the store's


IN_PLACE_ROWS = 1024  # a run this long is read in place; shorter rows are gathered (a copy)


def parts(store: PagedStore, layer: int, view: PagedView) -> list[tuple[torch.Tensor, ...]]:
    """The view's visible rows of `layer` as at most two (k, v) (1, Hkv, n, D): its longest run
    of consecutive slots as a view of the pages (read in place) when it has IN_PLACE_ROWS
    rows, and the other rows gathered into one copy, so a decode makes one kernel call per
    sequence, two for a long one beside a shared prefix ([] when the layer has no rows)."""
    if layer not in store.k or view.tokens == 0:
        return []
    k, v = store.k[layer], store.v[layer]
    table = view.table
    runs = table.slices(view.start, view.length)
    first, s, n = max(runs, key=lambda run: run[2])
    if len(runs) == 1:
        return [(k[s : s + n].transpose(0, 1)[None], v[s : s + n].transpose(0, 1)[None])]
    if n < IN_PLACE_ROWS:
        index = table.index(view.start, view.length)
        return [(k[index].transpose(0, 1)[None], v[index].transpose(0, 1)[None])]
    index = torch.cat([table.index(view.start, first), table.index(first + n, view.length)])
    return [(k[s : s + n].transpose(0, 1)[None], v[s : s + n].transpose(0, 1)[None]),
            (k[index].transpose(0, 1)[None], v[index].transpose(0, 1)[None])]  # fmt: skip
