"""The KV pool: every rank's cache budget in fixed-size blocks, and the prefix cache's index.

    --kv-cache-gb G per rank  ->  blocks = G / (block_size x bytes of one token's K/V on a rank)

Rank 0 keeps this accounting for every rank; each rank's blocks live in its paged store
(inference/paged.py), where a sequence's table starts a new block at each prompt chunk and at
its first decoded token. So what a sequence holds alone is counted per region, each an upper
bound over the ranks: whole blocks of the most rows any rank keeps of the chunk being filled
(`Shares.rows` of its pieces), of every earlier chunk no entry holds, and of its decoded
tokens. A chunk kept as an entry, or adopted whole from one, is counted once, by the entry.
An entry referenced by a running sequence (its `users`: the one that kept it, those that
adopted it) is *used*, not evictable; without users it is *cached*, evicted least recently used.
Then 32 chats sharing a system prompt hold its blocks once, plus each its own.

Prefix cache, block-granular (vLLM's and nano-vllm's chained block hashes, over the chunks of
DESIGN.md §12). A prompt goes in chunks of C tokens; every chunk with at least one full block
of B tokens, full or partial (a prompt's last), is kept in every rank's store as one *entry*.
Its hash points are the ends of its full blocks (and its own end when the chunk is full):

    chunk c:  |B|B|B|B|B|B|.. tail   point (c, k) hashes tokens [0, cC + k), chained from
               ^ ^ ^ ^ ^ ^            the point before it (the previous chunk's last point
                                      for k = B), so one hash names a whole prefix

`index` maps each point's hash to the entries holding it. A lookup walks the request's chunks:
whole chunks while an entry holds the chunk's last point, then, within the next chunk, the
furthest point any entry holds (an entry starts at its chunk's start, so holding point k means
holding every point before it too). The hit is that many tokens, a multiple of B.

Why truncating a stored chunk is exact: every rank keeps its rows in increasing position order,
and the K/V at position p depend on tokens <= p only. So the rows of an entry with position
< cC + k, on every rank, are exactly that prefix's cache, whatever placement the chunk had.

An entry's rows were computed in *pieces*, each placed by the layout over its own tokens (a
chunk that started from a truncated entry has two): `(offset in the chunk, tokens placed, tokens
kept)`. Its fullest rank holds at most the sum over pieces of the most rows any rank holds of
the piece (`Shares.piece_rows`, shares.py), which is what its blocks count (and, truncated, what
a sequence that adopts it counts). Entries take free blocks only (a prefix never evicts
another), are evicted least recently used (a chain's last chunk first; before all, one whose
every point a newer entry holds, e.g. a turn's last chunk that the next turn completed), and
`pinned` ones (read or written by the step being planned) are not evicted. Rank 0 decides what
is kept and evicted and says so in the step's plan, so every rank's store holds the same
entries. A hit shares the entries' blocks on every rank; a cut block is copied (paged.py).
"""

from __future__ import annotations

import array
import hashlib
from dataclasses import dataclass

from ringattn.serve.shares import Piece

__all__ = ["BlockPool", "Entry", "Piece", "Point", "prefix_hashes", "truncate"]

Point = tuple[int, str]  # (tokens into the chunk, hash of the prefix that ends there)


def prefix_hashes(ids: list[int], chunk: int, block: int) -> list[list[Point]]:
    """Each chunk's hash points (module docstring): per `chunk`-token chunk of `ids`, the end of
    each full `block`-token block in it, and the chunk's end when it is full; each hash covers
    every token before its point, chained. A partial tail of < `block` tokens has none."""
    out: list[list[Point]] = []
    data = array.array("q", ids).tobytes()  # 8 bytes a token: no text on rank 0's loop
    previous = b""
    for start in range(0, len(ids), chunk):
        size = min(chunk, len(ids) - start)
        ends = list(range(block, size + 1, block))
        if size == chunk and (not ends or ends[-1] != chunk):
            ends.append(chunk)  # a full chunk's tail still chains into the next chunk
        points, at = [], start
        for end in ends:
            previous = hashlib.sha256(previous + data[8 * at : 8 * (start + end)]).digest()
            points.append((end, previous.hex()[:32]))
            at = start + end
        out.append(points)
    return out


def truncate(pieces: list[Piece], tokens: int) -> list[Piece]:
    """The pieces of a chunk cut to its first `tokens` tokens (each keeps its placement)."""
    return [(at, n, min(kept, tokens - at)) for at, n, kept in pieces if at < tokens]


@dataclass
class Entry:
    """One kept chunk: chunk number, hash points, pieces, blocks and last use; `base`: the
    entry whose first blocks it shares (its sequence adopted that one cut inside the chunk),
    kept while this one is."""

    chunk: int
    points: list[Point]
    pieces: list[Piece]
    blocks: int
    last: int
    base: int | None = None


class BlockPool:
    """`n_blocks` blocks of `block_size` tokens (per rank); who holds how many. A hybrid's pool
    (`snapshot_bytes` > 0: the bytes of its mixers' states for one sequence) counts a snapshot
    of those states with each entry, in blocks of the pool, and a hit ends where an entry
    does (the states are known there only: mixer_states.py)."""

    def __init__(self, n_blocks: int, block_size: int, snapshot_bytes: int = 0,
                 block_bytes: int = 1):  # fmt: skip
        self.n_blocks, self.block_size = n_blocks, block_size
        self.snapshot_bytes = snapshot_bytes
        self.snapshot_blocks = -(-snapshot_bytes // block_bytes)  # what one snapshot takes
        self.held: dict[int, int] = {}  # sequence -> blocks it holds alone
        self.cached: dict[int, Entry] = {}  # entry id -> the kept chunk
        self.users: dict[int, set[int]] = {}  # entry id -> running sequences referencing it
        self.dependents: dict[int, set[int]] = {}  # entry id -> entries sharing its blocks
        self.index: dict[str, dict[int, None]] = {}  # point hash -> entries (an ordered set)
        self.pinned: set[int] = set()  # entries the step being planned reads or writes
        self.planned: set[int] = set()  # entries the step being planned stores
        self.clock = 0  # counts lookups and keeps: the "last use" of an entry
        self.next_entry = 0
        self.evicted: list[int] = []  # entries dropped since the last plan (every rank drops them)
        self.hits = self.hit_tokens = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _user_counts(self) -> dict[int, int]:
        """Each entry's running users: its own and its dependents' (which share its first
        blocks), in one pass. A dependent is kept after its base, so its id is larger: going
        down the ids, every dependent's users are known before its base's."""
        users: dict[int, set[int]] = {}
        for i in sorted(self.cached, reverse=True):
            mine = set(self.users.get(i, ()))
            for other in self.dependents.get(i, ()):
                mine |= users.get(other, set())
            users[i] = mine
        return {i: len(u) for i, u in users.items()}

    def counts(self) -> dict[str, int]:
        """{"used", "cached", "shared", "free"} blocks (the properties below) in one pass."""
        by_users = self._user_counts()
        used = sum(self.held.values())
        cached = shared = 0
        for i, n in by_users.items():
            blocks = self.cached[i].blocks
            used += blocks if n else 0
            cached += 0 if n else blocks
            shared += blocks if n > 1 else 0
        return {"used": used, "cached": cached, "shared": shared,
                "free": self.n_blocks - used - cached}  # fmt: skip

    @property
    def used(self) -> int:
        """Blocks of running sequences: their own, and the entries they reference."""
        return self.counts()["used"]

    @property
    def cached_blocks(self) -> int:
        """Blocks of entries no running sequence references (evictable)."""
        return self.counts()["cached"]

    @property
    def shared_blocks(self) -> int:
        """Blocks of entries referenced by more than one running sequence."""
        return self.counts()["shared"]

    @property
    def free(self) -> int:
        return self.counts()["free"]

    def use(self, seq: int, entries) -> None:
        """Running `seq` references `entries` (kept or adopted): they are not evicted."""
        for entry in entries:
            self.users.setdefault(entry, set()).add(seq)

    def _room(self, blocks: int) -> bool:
        """Evict entries (oldest use first, not pinned ones) until `blocks` are free; False when
        even that is not enough (then nothing is evicted)."""
        idle = self._idle()
        free = self.free
        if blocks > free + sum(self.cached[i].blocks for i in idle):
            return False
        # least recently used first; within a chain the last chunk first (the earlier ones
        # still serve every prefix that shares them); an entry goes with its dependents
        order = sorted(idle,
                       key=lambda i: (self.cached[i].last, -self.cached[i].chunk))  # fmt: skip
        for i in order:
            if free >= blocks:
                break
            if i in self.cached:  # (a dependent already gone with its base: nothing happens)
                free += sum(self.cached[j].blocks for j in self._family(i))
                self.forget(i)
        return True

    def _family(self, entry: int) -> list[int]:
        """`entry` and every entry that shares its blocks, transitively (forgotten with it)."""
        out, todo = [], [entry]
        while todo:
            i = todo.pop()
            out.append(i)
            todo += [j for j in self.dependents.get(i, ()) if j in self.cached]
        return out

    def _idle(self) -> list[int]:
        """The evictable entries: no running sequence references one, and neither it nor an
        entry that shares its blocks is pinned (its dependents go with it: `forget`). One pass,
        dependents (larger ids) before their bases."""
        idle: dict[int, bool] = {}
        for i in sorted(self.cached, reverse=True):
            idle[i] = i not in self.pinned and not self.users.get(i) and all(
                idle.get(other, True) for other in self.dependents.get(i, ()))  # fmt: skip
        return [i for i in self.cached if idle[i]]

    def fits(self, seq: int, tokens: int) -> bool:
        """Whether `grow(seq, tokens)` would succeed (evicting idle entries); nothing changes."""
        need = self.blocks(tokens) - self.held.get(seq, 0)
        return need <= 0 or need <= self.free + sum(self.cached[i].blocks for i in self._idle())

    def grow(self, seq: int, tokens: int) -> bool:
        """Let `seq` hold `tokens` tokens per rank alone (a whole number of blocks: the
        scheduler counts by region); False (nothing changes) if the pool is full. A count that
        fell (a chunk now held by an entry) is lowered."""
        need = self.blocks(tokens) - self.held.get(seq, 0)
        if need > 0 and not self._room(need):
            return False
        self.held[seq] = self.blocks(tokens)
        return True

    def release(self, seq: int) -> None:
        self.held.pop(seq, None)
        for entry in [e for e, users in self.users.items() if seq in users]:
            self.users[entry].discard(seq)
            if not self.users[entry]:
                del self.users[entry]

    @property
    def snapshots_held(self) -> int:
        """Bytes of the hybrid states' snapshots the entries hold (per rank)."""
        return self.snapshot_bytes * len(self.cached)

    def _end(self, entry: int) -> int:
        """Tokens of its chunk that `entry` holds (where its snapshot is)."""
        return max(at + kept for at, _, kept in self.cached[entry].pieces)

    def lookup(self, hashes: list[list[Point]], limit: int) -> list[tuple[int, int]]:
        """The longest prefix of a request (`prefix_hashes` of it) of at most `limit` tokens
        that the cache holds: [(entry, tokens of its chunk to take)], whole chunks and then
        one cut at a block (module docstring); with snapshots, one that ends where an entry
        ends. The entries are now the most recently used."""
        found: list[tuple[int, int]] = []
        self.clock += 1
        chunk_start = 0
        for points in hashes:
            best = None
            for k, h in points:
                holders = self.index.get(h)
                if chunk_start + k > limit or not holders:
                    break
                if self.snapshot_bytes:  # a hybrid's states are known at an entry's end only
                    holders = [i for i in holders if self._end(i) == k]
                    if not holders:
                        continue
                # an entry stored before this step first: one this step stores makes the
                # adopting piece wait for a second forward (runner.py); the rows are the same
                best = (max(holders, key=lambda i: (i not in self.planned, self.cached[i].last)),
                        k)  # fmt: skip
            if best is None:
                break
            self.cached[best[0]].last = self.clock
            found.append(best)
            if best[1] != points[-1][0]:
                break  # cut within this chunk: nothing after it can follow
            chunk_start += best[1]
        return found

    def forget(self, entry: int) -> set[int]:
        """Drop `entry` from the cache now (evicted, or a failed step never stored it on every
        rank), with the entries that share its blocks (`_family`); every rank drops them with
        the next plan. Their users, which the caller must send back to recompute: they counted
        its blocks as the entry's."""
        users = self.users.pop(entry, set())
        if entry not in self.cached:
            return users
        family = self._family(entry)
        for i in reversed(family):  # dependents first (no recursion: chains may be long)
            users |= self.users.pop(i, set())
            gone = self.cached.pop(i)
            self.dependents.pop(i, None)
            if gone.base in self.dependents:
                self.dependents[gone.base].discard(i)
            for _, h in gone.points:
                holders = self.index[h]
                del holders[i]
                if not holders:
                    del self.index[h]
            self.pinned.discard(i)
            self.planned.discard(i)
            self.evicted.append(i)
        return users

    def keep(self, chunk: int, points: list[Point], pieces: list[Piece], rows: int,
             seq: int, moved: int, base: int | None = None) -> int | None:  # fmt: skip
        """Keep chunk number `chunk` of sequence `seq` (its hash `points` and `pieces`, `rows` on
        the fullest rank) if it adds a prefix the cache lacks; its entry id (pinned for this
        step, used by `seq`), else None. `moved` of its blocks were seq's count of the chunk
        (grown for it): they move to the entry's. The rest are blocks seq shares with `base`,
        the entry it adopted the chunk's start from: counted by that one, which is then kept as
        long as this one (its `dependents`); without a base the entry counts them again."""
        if base is not None and base not in self.cached:
            base = None  # (forgotten meanwhile: its blocks are counted here instead)
        extra = 0 if base is not None else self.blocks(rows) - moved
        extra += self.snapshot_blocks if self.snapshot_bytes else 0  # its states' snapshot
        if not points or points[-1][1] in self.index or extra > self.free:
            return None
        assert self.held.get(seq, 0) >= moved, "keep follows grow for the chunk"
        self.held[seq] -= moved
        self.clock += 1
        entry, self.next_entry = self.next_entry, self.next_entry + 1
        self.cached[entry] = Entry(chunk, list(points), list(pieces), moved + extra, self.clock,
                                   base)  # fmt: skip
        if base is not None:
            self.dependents.setdefault(base, set()).add(entry)
        # the entries this sequence adopted or kept for its earlier chunks, its chain's head, are
        # as recent as its newest chunk: at equal `last`, eviction takes the latest chunk first,
        # so a chain never loses its head (its tail left unreachable, holding blocks) first
        for other, users in self.users.items():
            if seq in users and other in self.cached:
                self.cached[other].last = self.clock
        for _, h in points:
            for other in self.index.get(h, ()):
                if self.cached[other].points[-1][1] == h:  # all it holds, this one holds too:
                    self.cached[other].last = 0  # evicted first when room is needed
            self.index.setdefault(h, {})[entry] = None
        self.pinned.add(entry)
        self.planned.add(entry)
        self.use(seq, [entry])
        return entry

    def start_step(self) -> None:
        """A new step is being planned: nothing pinned, nothing stored by it yet."""
        self.pinned, self.planned = set(), set()
