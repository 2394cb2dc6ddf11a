"""`ringattn serve`'s block-granular prefix reuse (issue 32, item 4): the pool's hashes, index,
lookup and eviction without a model, then the engine's truncated adoption on two ranks (zigzag)
against a plain prefill of the same tokens. The served answers (through the `openai` client)
are checked in test_serve_engine.py, beside the other engine tests' servers."""

from __future__ import annotations

import pytest

from ringattn.serve.pool import BlockPool, prefix_hashes, truncate
from ringattn.serve.shares import Shares


def _hashes(points):
    return [h for _, h in points]


def test_prefix_hashes_mark_every_full_block_and_chain_over_chunks():
    ids = list(range(20))
    a = prefix_hashes(ids, 8, 4)
    assert [[k for k, _ in chunk] for chunk in a] == [[4, 8], [4, 8], [4]]
    # a prefix's points are the same whatever follows (the partial tail of 3 has none)
    assert prefix_hashes(ids[:15], 8, 4) == [a[0], a[1][:1]]
    assert prefix_hashes([*ids[:13], 99, 98], 8, 4) == [a[0], a[1][:1]]
    # chained: changing token 0 changes every point; token 9 every point from (1, 4) on
    other = prefix_hashes([1, *ids[1:]], 8, 4)
    assert not set(_hashes(other[0] + other[1] + other[2])) & set(_hashes(a[0] + a[1] + a[2]))
    late = prefix_hashes([*ids[:9], 0, *ids[10:]], 8, 4)
    assert late[0] == a[0] and late[1][0] != a[1][0] and late[2] != a[2]
    # blocks that do not divide the chunk: its end is a point too, chaining the tail on
    odd = prefix_hashes(ids, 8, 3)
    assert [[k for k, _ in chunk] for chunk in odd] == [[3, 6, 8], [3, 6, 8], [3]]
    assert prefix_hashes(ids[:2], 8, 4) == [[]]


def test_piece_rows_count_the_fullest_ranks_rows_below_a_cut():
    shares = Shares("zigzag", 2)  # 8 tokens: rank 0 keeps 0 1 6 7, rank 1 keeps 2 3 4 5
    assert [shares.piece_rows(8, k) for k in range(9)] == [0, 1, 2, 2, 2, 3, 4, 4, 4]
    assert shares.chunk_rows(8) == 4 and shares.chunk_rows(5) == 3  # pieces of ceil(5 / 4) = 2
    assert shares.tokens(21, 8, 3) == 4 + 4 + 3 + 2  # two chunks, a chunk of 5, 3 decoded
    assert Shares("zigzag", 1).tokens(21, 8, 3) == 24
    # a chunk computed as 3 tokens of an 8-token placement, then 5 placed alone
    pieces = [(0, 8, 3), (3, 5, 5)]
    assert shares.rows(pieces) == 2 + 3
    assert truncate(pieces, 6) == [(0, 8, 3), (3, 5, 3)] and truncate(pieces, 2) == [(0, 8, 2)]


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_piece_rows_and_cut_equal_counting_the_placed_indices(layout):
    """The closed forms (arithmetic runs per rank) against the placement's listed indices."""
    import bisect

    from ringattn.layout import get_layout
    from ringattn.packing import place

    for world_size in (1, 2, 3, 4):
        shares = Shares(layout, world_size)
        for tokens in range(1, 40):
            placement = place(get_layout(layout), world_size, (0, tokens))
            ranks = [sorted(g for g in placement.global_indices(r).tolist() if g >= 0)
                     for r in range(world_size)]  # fmt: skip
            for kept in range(tokens + 2):
                counts = [bisect.bisect_left(g, kept) for g in ranks]
                assert shares.piece_rows(tokens, kept) == max(counts)
                for block in (1, 2, 3, 4):
                    cut = any(c % block for c in counts)
                    assert shares.cut([(0, tokens, kept)], block) == cut


def test_piece_rows_and_the_pool_check_do_not_grow_with_the_tokens(monkeypatch):
    """Rank 0's piece arithmetic is O(W) per call: a piece of 10^12 tokens is counted without
    listing its indices (before: an lru_cache of each rank's index lists, O(tokens) per miss).
    The start-up pool check computes a chunk's rows once per size, not once per split of the
    context (before: 4 per split; 290 s for a 131k context at W = 4, chunks of 8k)."""
    from ringattn.serve.worker import check_pool

    shares = Shares("zigzag", 4)  # c = 10^12 / 8 a half-chunk: rank r holds 2c tokens
    assert shares.piece_rows(10**12, 10**12) == 10**12 // 4
    assert shares.piece_rows(10**12, 3 * 10**11) == 10**12 // 8  # ranks 0 and 1: c each
    assert not shares.cut([(0, 10**12, 10**12)], 16)
    calls = []
    chunk_rows = Shares.chunk_rows
    monkeypatch.setattr(
        Shares, "chunk_rows", lambda self, n: calls.append(n) or chunk_rows(self, n)
    )
    _, need = shares.most(4096, 256, 16)
    assert len(calls) <= 256  # each size of a chunk once
    calls.clear()
    check_pool(need, 16, shares, 256, 4096)
    with pytest.raises(ValueError, match=rf"holds {need - 1} blocks of 16 .* needs {need};"):
        check_pool(need - 1, 16, shares, 256, 4096)
    assert len(calls) <= 2 * 256
    # the brute force it replaces, on a small context
    for p in range(1, 301):
        assert shares.blocks(p, 64, 300 - p, 8) <= shares.most(300, 64, 8)[1]
    assert shares.most(300, 64, 8) == (
        max(shares.tokens(p, 64, 300 - p) for p in range(1, 301)),
        max(shares.blocks(p, 64, 300 - p, 8) for p in range(1, 301)),
    )
    check_pool(shares.most(131072, 8192, 16)[1], 16, shares, 8192, 131072)  # 131k: at once


def _entry(pool, ids, chunk, c, block=4, upto=None):
    """Keep chunk `c` of `ids` as computed in one piece (W = 1 rows) by a sequence that held
    its blocks from the free ones (none: None) and has ended since."""
    points = prefix_hashes(ids, chunk, block)[c]
    n = min(chunk, len(ids) - c * chunk) if upto is None else upto
    points = [p for p in points if p[0] <= n]
    seq = 10_000 + pool.next_entry
    if pool.blocks(n) > pool.free:
        return None
    pool.held[seq] = pool.blocks(n)
    entry = pool.keep(c, points, [(0, n, n)], n, seq, pool.blocks(n))
    pool.release(seq)
    return entry


def test_lookup_takes_whole_chunks_then_the_longest_run_of_blocks():
    pool = BlockPool(64, 4)
    first = list(range(30))  # chunks of 8: 0-7, 8-15, 16-23, 24-29 (a partial chunk of 6)
    kept = [_entry(pool, first, 8, c) for c in range(4)]
    assert kept == [0, 1, 2, 3] and pool.cached[3].blocks == 2  # 6 rows: 2 blocks of 4
    assert pool.cached[3].points == prefix_hashes(first, 8, 4)[3]  # the block of 4; no tail
    # a request sharing 21 tokens: chunks 0, 1 whole, then one block of chunk 2 (20 tokens)
    second = [*first[:21], 77, 78, 79, 80]
    assert pool.lookup(prefix_hashes(second, 8, 4), len(second) - 1) == [(0, 8), (1, 8), (2, 4)]
    # shorter than a chunk: one block
    assert pool.lookup(prefix_hashes([*first[:6], 5], 8, 4), 6) == [(0, 4)]
    # at least one token to compute: the same prompt reuses 28 of its 30 (the limit, in blocks)
    assert pool.lookup(prefix_hashes(first, 8, 4), 29) == [(0, 8), (1, 8), (2, 8), (3, 4)]
    assert pool.lookup(prefix_hashes(first[:16], 8, 4), 15) == [(0, 8), (1, 4)]
    assert pool.lookup(prefix_hashes([9, *first[1:]], 8, 4), 29) == []
    # a block held by another entry of the same chunk: the longest run from any entry
    third = [*first[:16], 50, 51, 52, 53, 54, 55, 56, 57, 58]
    assert _entry(pool, third, 8, 2) == 4  # chunk 2 of `third`: 16-23 differ from `first`'s
    assert pool.lookup(prefix_hashes([*third[:22], 1, 2], 8, 4), 23) == [(0, 8), (1, 8), (4, 4)]
    # a chunk whose last point is held already is not kept twice
    assert _entry(pool, [*first[:16], 1], 8, 1) is None and len(pool.cached) == 5


def test_lookup_prefers_an_entry_stored_before_the_step_being_planned():
    """Two entries hold the same block; the one this step stores would make its adopter wait
    for a second forward (runner.py's waves), so the older one is taken, newer use or not."""
    pool = BlockPool(64, 4)
    base = list(range(8))
    assert _entry(pool, [*base, 1, 2, 3], 8, 0, upto=8) == 0  # stored by an earlier step
    pool.start_step()
    assert _entry(pool, [*base[:4], 9, 9, 9, 9], 8, 0) == 1  # stored by this step: block 0 too
    asks = prefix_hashes([*base[:4], 5, 6], 8, 4)
    assert pool.lookup(asks, 5) == [(0, 4)]
    pool.start_step()  # a step later both are stored: the most recently used one
    assert pool.lookup(prefix_hashes([*base[:4], 9, 9, 9, 9, 0], 8, 4), 8) == [(1, 8)]
    assert pool.lookup(asks, 5) == [(1, 4)]


def test_eviction_keeps_the_index_and_spares_pinned_entries():
    pool = BlockPool(6, 4)
    ids = list(range(24))
    for c in range(3):
        assert _entry(pool, ids, 8, c) == c  # 2 blocks each: the pool is full
    assert not pool.grow(9, 4) and pool.evicted == []  # kept this step: pinned, not evictable
    pool.pinned = set()  # the next step
    assert _entry(pool, list(range(100, 110)), 8, 0) is None  # no free blocks to compute it
    pool.lookup(prefix_hashes(ids, 8, 4), 23)  # all used now; chunk 2 is the chain's last
    assert pool.grow(0, 3 * 4) and pool.evicted == [2, 1] and pool.free == 1
    assert set(pool.index) == {h for _, h in pool.cached[0].points}
    assert pool.lookup(prefix_hashes(ids, 8, 4), 23) == [(0, 8)]
    pool.pinned = {0}
    assert not pool.grow(0, 6 * 4) and pool.held[0] == 3  # only the pinned entry is left
    pool.forget(0)  # a failed step's entry: out of the index, evicted on every rank
    assert pool.index == {} and pool.pinned == set() and pool.evicted == [2, 1, 0]
    assert pool.grow(0, 6 * 4) and pool.free == 0
    pool.release(0)
    assert pool.free == 6 and pool.used == 0
    # an older entry, a turn's last chunk (6 tokens), then the next turn's chunk holding that
    # and more: the turn's is evicted first, though the other one is older
    turn = list(range(200, 206))
    assert _entry(pool, list(range(300, 308)), 8, 0) == 3
    assert _entry(pool, turn, 8, 0) == 4 and _entry(pool, [*turn, 1, 2], 8, 0) == 5
    assert pool.lookup(prefix_hashes(turn, 8, 4), 5) == [(5, 4)]  # the newer one serves
    pool.pinned = set()
    assert pool.grow(1, 8) and pool.evicted[-1] == 4 and set(pool.cached) == {3, 5}


def test_a_chain_loses_its_latest_chunk_first_however_it_was_kept():
    """One sequence keeps chunks 0 then 1 (two steps: chunk 0 is the older entry). Room for a
    block must evict chunk 1, not chunk 0: without chunk 0 no lookup reaches chunk 1, which
    would hold its blocks for nothing."""
    pool = BlockPool(5, 4)
    ids = list(range(16))
    hashes = prefix_hashes(ids, 8, 4)
    pool.held[7] = pool.blocks(8)
    assert pool.keep(0, hashes[0], [(0, 8, 8)], 8, 7, pool.blocks(8)) == 0
    pool.start_step()
    pool.held[7] += pool.blocks(8)
    assert pool.keep(1, hashes[1], [(0, 8, 8)], 8, 7, pool.blocks(8)) == 1
    pool.start_step()
    pool.release(7)
    assert pool.free == 1 and pool.grow(8, 2 * 4)  # 2 blocks: one entry goes
    assert pool.evicted == [1] and pool.lookup(hashes, 16) == [(0, 8)]


class _CountingDict(dict):
    """A dict that counts `get` calls (the pool's per-entry lookups of its users)."""

    gets = 0

    def get(self, *args):
        _CountingDict.gets += 1
        return super().get(*args)


@pytest.mark.slow
def test_the_pools_counts_are_linear_in_its_entries():
    """A chat whose turns stay inside one chunk keeps a chain of entries, each sharing the
    blocks of the one before (its `base`). used / cached / free look each entry's users up a
    bounded number of times, and the chain may be longer than Python's recursion limit.
    Before: each entry walked its whole chain of dependents (quadratic), recursively (a
    RecursionError past ~1,000 entries)."""
    pool = BlockPool(10_000, 4)
    pool.users = _CountingDict()
    base = None
    for i in range(1_200):
        assert pool.grow(i, 4)
        base = pool.keep(0, [(4, f"h{i}")], [(0, 4, 4)], 4, i, 1, base)
        assert base == i
        pool.release(i)
        if i == 200:  # (quadratic: 20,000 lookups here before)
            _CountingDict.gets = 0
            assert pool.free == 10_000 - 201 and _CountingDict.gets <= 4 * 201
    pool.use(5_000, [1_199])  # the last one's user holds the whole chain
    pool.start_step()
    _CountingDict.gets = 0
    counts = pool.counts()
    assert counts == {"used": 1_200, "cached": 0, "shared": 0, "free": 10_000 - 1_200}
    assert pool.used == 1_200 and pool.free == 8_800 and pool.cached_blocks == 0
    assert _CountingDict.gets <= 4 * 1_200 + 10, _CountingDict.gets
    pool.release(5_000)
    assert pool.cached_blocks == 1_200 and pool.grow(1, 4 * 9_000)  # evicts the oldest,
    assert pool.cached == {} and len(pool.evicted) == 1_200  # and every entry sharing its blocks
    assert pool.free == 1_000 and pool.index == {} and pool.dependents == {}


def test_truncated_adoption_equals_a_plain_prefill_on_two_ranks(pools):
    """Two ranks, zigzag: a sequence prefilled in chunks of 8 is kept, a second sequence adopts
    its rows cut at 4, 11 and 13 tokens (whole blocks or not) and computes the rest; its logits
    equal a plain prefill's and a cut taking one more row would not (workers_serve.adopted).
    On the paged store, the blocks wholly below the cut are shared, not copied, and what each
    rank's table holds alone stays within the pool's count (blocks of 4, by region)."""
    pytest.importorskip("transformers")
    shares, total = Shares("zigzag", 2), 2 * 8 + 3
    results = pools(2).run("workers_serve:adopted", 8, [4, 11, 13])
    for rank in results:
        for cut, error, wrong, own, shared in rank:
            assert error < 1e-4, (cut, error)
            assert wrong > 100 * max(error, 1e-6), (cut, wrong)  # the test can tell a wrong row
            # the scheduler's count (scheduler.rows): whole chunks are the entries', the cut
            # one's copied block and the rest of its chunk, the later chunks
            c, k = divmod(cut, 8)
            first = min(8 - k, total - cut)
            counted = -(-shares.chunk_rows(first) // 4) + shares.cut([(0, 8, k)], 4)
            counted += shares.blocks(total - cut - first, 8, 0, 4)
            assert own <= counted, (cut, own, counted)
            assert shared >= c * shares.chunk_rows(8) // 4, (cut, shared)  # whole chunks: shared


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_step_runs_in_one_forward_unless_a_piece_needs_another_pieces_rows(pools, world_size):
    """Runner.step: an adopter of an entry that the same step stores, and a second piece of one
    sequence, wait for a second forward; everything else (and a decode step) is one forward,
    and every piece's logits equal a plain prefill's (workers_serve.waves)."""
    pytest.importorskip("transformers")
    for forwards, pieces, decoded in pools(world_size).run("workers_serve:waves"):
        assert forwards == [2, 1]
        assert max(pieces) < 1e-4 and max(decoded) < 1e-4, (pieces, decoded)


def test_the_scheduler_plans_a_cut_entry_and_counts_its_pieces_at_two_ranks():
    """Rank 0's plans without a model (W = 2, zigzag, chunks of 8, blocks of 4): a request
    sharing 13 tokens with an earlier one opens from its chunk 0 and 4 tokens of its chunk 1,
    shares their blocks (but a copied cut block), and keeps its own chunk 1 as two pieces on
    top of entry 1; a pool of just what it needs alone still lets it share the prefix."""
    import queue
    import threading

    pytest.importorskip("tokenizers")
    import serve_model
    from ringattn.serve.scheduler import Scheduler

    tok = serve_model.tokenizer()
    shares, pool = Shares("zigzag", 2), BlockPool(8, 4)

    def scheduler(pool):
        return Scheduler(queue.Queue(), threading.current_thread(), tok, [], pool, shares, 8, 4,
                         make_sink=lambda job: lambda *event: None)  # fmt: skip

    first, second = list(range(20, 39)), [*range(20, 33), 5, 6, 7, 8, 9, 10]  # 19 tokens each
    s = scheduler(pool)
    s.jobs.put(serve_model.PlannedJob(first))
    plans = serve_model.run_plans(s, len(tok))
    assert [chunk[2] for plan in plans for chunk in plan["chunks"]] == [[0, 0], [1, 8], None]
    assert [e.pieces for e in pool.cached.values()] == [[(0, 8, 8)], [(0, 8, 8)]]  # 3: no block
    s.jobs.put(serve_model.PlannedJob(second))
    plan = s.plan()
    assert plan["open"] == [[1, [0, 1], 12]]  # chunk 0 whole, then one block of chunk 1
    assert plan["chunks"] == [[1, second[12:16], [2, 8]]]  # the rest of chunk 1, kept
    # chunk 0's blocks are entry 0's, the first 4 tokens of chunk 1 (2 rows a rank) entry 1's
    # but for the copy of the cut block; the copy and the 4 tokens placed alone (2 rows) are
    # seq 1's until it keeps them: then entry 2's, whose first rows are entry 1's (its base)
    assert pool.held[1] == 0 and pool.cached[2].pieces == [(0, 8, 4), (4, 4, 4)]
    assert pool.cached[2].blocks == 2 and pool.cached[2].base == 1 and pool.hit_tokens == 12
    assert pool.users == {0: {1}, 1: {1}, 2: {1}}
    # the same cache in a pool of 4 blocks, what the request needs alone (each chunk and the
    # decoded tokens start blocks): sharing needs no room for copies beside the originals, so
    # it still starts from the cached prefix (a copying pool computed it all here)
    small = BlockPool(4, 4)
    small.cached, small.index = {0: pool.cached[0], 1: pool.cached[1]}, {}
    for entry, kept in small.cached.items():
        for _, h in kept.points:
            small.index.setdefault(h, {})[entry] = None
    s = scheduler(small)
    s.jobs.put(serve_model.PlannedJob(second))
    plan = s.plan()
    assert plan["open"] == [[0, [0, 1], 12]] and small.hits == 1
