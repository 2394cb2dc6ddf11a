"""The serve scheduler's BlockManager (serve/allocation.py), driven alone, without a scheduler.

One rank (W = 1, zigzag), chunks of 8 tokens, blocks of 4: a chunk's 8 rows are 2 blocks, a
prompt's last partial chunk and the decoded tokens start blocks of their own. After every call
`serve_sim.check_blocks` recounts the manager's state from scratch (ids, holdings, references,
the pool's used / cached / shared / free blocks); the tests also name the counts they expect.
The randomized simulation (test_serve_schedule.py) runs the same check after every plan and
step of 2,100 seeded schedules.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

import serve_model
import serve_sim
from ringattn.serve.allocation import BlockManager
from ringattn.serve.pool import BlockPool
from ringattn.serve.protocol import Request
from ringattn.serve.sequence import Seq
from ringattn.serve.shares import Shares

SYSTEM = list(range(10, 22))  # 12 tokens: chunk 0 and the first block of chunk 1


@pytest.fixture(scope="module")
def tok():
    return serve_model.tokenizer()


def _manager(blocks: int, prefix_cache: bool = True) -> BlockManager:
    return BlockManager(BlockPool(blocks, 4), Shares("zigzag", 1), 8, prefix_cache)


def _seq(tok, ids: list[int], new: int = 4) -> Seq:
    job = serve_sim.SimJob(Request(ids, new))
    return Seq(job, job.sink, tok)


def _admit(blocks: BlockManager, seq: Seq) -> list:
    """Open `seq`, grow it for its first piece, keep that piece's chunk if it completes one,
    admit it and count the piece as computed (what a step does); the prefix it reused."""
    blocks.start_step()
    reuse = blocks.open(seq)
    n = min(blocks.chunk - seq.done % blocks.chunk, seq.target - seq.done)
    assert blocks.grow(seq, blocks.rows(seq, piece=n))
    blocks.keep(seq, n)
    blocks.admit(seq, reuse)
    blocks.computed(seq, n)
    serve_sim.check_blocks(blocks)
    return reuse


def _prefill(blocks: BlockManager, seq: Seq) -> None:
    """The rest of running `seq`'s prompt, a chunk a step."""
    while seq.prefilling:
        blocks.start_step()
        n = min(blocks.chunk - seq.done % blocks.chunk, seq.target - seq.done)
        assert blocks.allocate(seq, blocks.rows(seq, piece=n)).ok
        blocks.keep(seq, n)
        blocks.computed(seq, n)
        serve_sim.check_blocks(blocks)


def _decode(blocks: BlockManager, seq: Seq):
    blocks.start_step()
    grant = blocks.append(seq)
    if grant.ok:
        seq.done += 1
        seq.tokens.append(5)
        seq.out.append(5)
    serve_sim.check_blocks(blocks)
    return grant


def test_allocate_append_share_a_prefix_and_free(tok):
    """A 12-token prompt keeps chunk 0 (2 blocks) and its 4-token tail (1 block) as entries;
    its first decoded token takes a block of its own. A second prompt sharing those 12 tokens
    references both entries (shared: 3 blocks) and keeps its own chunk 1 on top of the tail
    entry. Freed one by one, the entries stay cached (evictable), nothing is held."""
    blocks = _manager(16)
    a = _seq(tok, SYSTEM)
    assert _admit(blocks, a) == [] and a.id == 0 and blocks.running == [a]
    assert blocks.counts() == {"used": 2, "cached": 0, "shared": 0, "free": 14}
    _prefill(blocks, a)
    assert list(blocks.pool.cached) == [0, 1] and blocks.pool.held == {0: 0}
    assert blocks.can_append(a) and _decode(blocks, a).ok
    assert blocks.pool.held == {0: 1} and blocks.counts()["used"] == 4

    b = _seq(tok, SYSTEM + [50, 51, 52, 53])
    assert _admit(blocks, b) == [(0, 8), (1, 4)] and b.done == 16
    assert blocks.pool.users == {0: {0, 1}, 1: {0, 1}, 2: {1}}
    assert blocks.pool.cached[2].base == 1 and blocks.pool.hits == 1
    assert blocks.counts() == {"used": 5, "cached": 0, "shared": 3, "free": 11}

    blocks.free(a)
    serve_sim.check_blocks(blocks)
    assert a.id == -1 and blocks.running == [b] and blocks.pool.users == {0: {1}, 1: {1}, 2: {1}}
    assert blocks.counts() == {"used": 4, "cached": 0, "shared": 0, "free": 12}
    blocks.free(b)
    serve_sim.check_blocks(blocks)
    assert blocks.counts() == {"used": 0, "cached": 4, "shared": 0, "free": 12}
    assert blocks.take_freed() == [0, 1] and blocks.freed == []


def test_the_newest_is_preempted_and_comes_back_when_blocks_free(tok):
    """A pool of 4 blocks, two 8-token prompts of 2 blocks each: the older one's first decoded
    token preempts the newer (its blocks freed, its id gone, its progress reset). Reopened, it
    does not fit beside the older until that one ends; then it runs under a new id."""
    blocks = _manager(4, prefix_cache=False)
    a, b = _seq(tok, list(range(10, 18))), _seq(tok, list(range(30, 38)))
    _admit(blocks, a)
    _admit(blocks, b)
    assert blocks.counts()["free"] == 0 and not blocks.can_append(a)
    grant = _decode(blocks, a)
    assert grant.ok and grant.preempted == [(b, 1)] and grant.refusal is None
    assert b.id == -1 and b.done == b.target == 0 and blocks.running == [a]
    assert blocks.pool.held == {0: 3} and blocks.freed == [1]

    rows = blocks.rows(b, piece=8) if blocks.open(b) == [] else None
    assert b.id == 2 and not blocks.can_allocate(b, rows) and not blocks.grow(b, rows)
    blocks.unopen(b)  # it waits at the head of the line
    serve_sim.check_blocks(blocks)
    assert b.id == -1 and blocks.pool.held == {0: 3} and blocks.next_id == 2

    blocks.free(a)
    _admit(blocks, b)
    assert blocks.running == [b] and b.id == 2 and blocks.pool.held == {2: 2}


def test_the_newest_goes_back_itself_and_one_alone_that_never_fits_is_refused(tok):
    """With two running, the newer one's decode that finds no block preempts itself; alone, a
    sequence that cannot grow is neither preempted nor grown: the grant says why, with the
    pool's numbers, and the scheduler fails it."""
    blocks = _manager(4, prefix_cache=False)
    a, b = _seq(tok, list(range(10, 18))), _seq(tok, list(range(30, 38)))
    _admit(blocks, a)
    _admit(blocks, b)
    grant = _decode(blocks, b)
    assert not grant.ok and grant.preempted == [(b, 1)] and blocks.running == [a]
    assert _decode(blocks, a).ok  # the room b left
    grant = blocks.allocate(a, 4 * 5)  # 5 blocks: more than the pool
    serve_sim.check_blocks(blocks)
    assert not grant.ok and grant.preempted == [] and blocks.running == [a]
    assert "more than the pool's 4 blocks of 4 tokens" in grant.refusal, grant.refusal


def test_can_allocate_counts_idle_entries_and_changes_nothing(tok):
    """A freed sequence's kept chunks are cached, not free: `can_allocate` counts them as room
    without evicting them; `grow` evicts them when it needs to."""
    blocks = _manager(6)
    a = _seq(tok, list(range(10, 26)))  # two whole chunks: two entries of 2 blocks
    _admit(blocks, a)
    _prefill(blocks, a)
    blocks.free(a)
    assert blocks.counts() == {"used": 0, "cached": 4, "shared": 0, "free": 2}
    b = _seq(tok, list(range(40, 60)))  # 20 tokens: 5 blocks, nothing in common
    blocks.start_step()  # (the entries kept by the last step are pinned until the next)
    assert blocks.open(b) == []
    assert blocks.can_allocate(b, 4 * 5) and not blocks.can_allocate(b, 4 * 7)
    assert blocks.counts()["cached"] == 4 and blocks.pool.evicted == []
    assert blocks.grow(b, 4 * 5)
    assert sorted(blocks.pool.evicted) == [0, 1] and blocks.counts()["cached"] == 0


def test_a_request_that_could_never_fit_is_named_with_its_numbers(tok):
    blocks = _manager(4)
    assert blocks.never_fits(_seq(tok, list(range(10, 18)), new=4)) is None
    refusal = blocks.never_fits(_seq(tok, list(range(10, 30)), new=9))
    assert "needs 8 KV blocks of 4 tokens" in refusal and "holds 4 blocks" in refusal, refusal


def test_the_check_catches_a_count_that_drifts(tok):
    """serve_sim.check_blocks fails on a held block nobody runs, and on a reference to a
    sequence that has ended: it can tell a leak."""
    blocks = _manager(8)
    a = _seq(tok, SYSTEM)
    _admit(blocks, a)
    blocks.pool.held[7] = 1
    with pytest.raises(AssertionError):
        serve_sim.check_blocks(blocks)
    del blocks.pool.held[7]
    blocks.pool.users[0].add(9)
    with pytest.raises(AssertionError):
        serve_sim.check_blocks(blocks)
