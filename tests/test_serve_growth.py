"""The KV pool's geometric headroom (issue 32): a growing sequence takes up to an eighth more
blocks than it needs, from free blocks only, and every rank's buffers grow to what the pool
holds, so a long sequence's contiguous buffers regrow O(log n) times instead of once per block,
and never hold more than the pool counts."""

from __future__ import annotations

import math
import queue
import threading

import pytest
import torch

from ringattn.serve.pool import HEADROOM, BlockPool


def test_growth_takes_headroom_from_free_blocks_only_and_reports_each_change_once():
    pool = BlockPool(40, 4)
    assert pool.grow(0, 64) and pool.held[0] == 16  # from nothing: no headroom (0 // 8 = 0)
    assert pool.grow(0, 65) and pool.held[0] == 16 + 1 + 16 // HEADROOM  # 19
    assert pool.grow(0, 19 * 4) and pool.held[0] == 19  # within the holding: nothing changes
    assert pool.room() == [[0, 19 * 4]] and pool.room() == []  # each change rides once
    assert pool.grow(1, 80) and pool.held[1] == 20  # 1 free block left
    assert pool.grow(0, 19 * 4 + 1) and pool.held[0] == 20  # the need only: no spare left
    assert not pool.grow(1, 81) and pool.held[1] == 20  # full: refused, nothing changes
    pool.release(0)
    assert pool.room() == [[1, 80]]  # a released sequence's change is dropped


def _loop(new: int, block: int) -> tuple[list[int], int, int]:
    """Rank 0's scheduler and a Runner over the tiny chat model in this process (W = 1): one
    request of `new` tokens, greedy. (tokens, buffer regrowths, most rows a buffer held beyond
    the pool's count (0 when never))."""
    import serve_model
    import workers_serve
    from ringattn.inference.cache import LayerCache
    from ringattn.inference.hf.engine import KVEngine
    from ringattn.serve.pool import Shares
    from ringattn.serve.runner import Runner
    from ringattn.serve.scheduler import Scheduler

    tok, model = workers_serve.tiny_model()
    pool = BlockPool(10_000, block)
    scheduler = Scheduler(queue.Queue(), threading.current_thread(), tok, [], pool,
                          Shares("zigzag", 1), 16, 4, prefix_cache=False,
                          make_sink=lambda job: lambda *event: None)  # fmt: skip
    runner = Runner(KVEngine(model, layout="zigzag"), block_size=block)
    job = serve_model.PlannedJob(list(range(5, 25)), new=new)
    scheduler.jobs.put(job)
    resizes, over = [0], 0
    resize = LayerCache._resize

    def counted(self, capacity):
        resizes[0] += 1
        return resize(self, capacity)

    LayerCache._resize = counted
    try:
        with torch.no_grad(), runner.engine.holding():
            while scheduler.running or scheduler.waiting or not scheduler.jobs.empty():
                plan = scheduler.plan()
                if plan["op"] != "step":
                    continue
                decoded, chunks = runner.step(plan)
                for (_, seq), cache in runner.engine.state.caches.items():
                    rows = cache.layers[0].k.shape[2]
                    over = max(over, rows - pool.held.get(seq, 0) * block)
                seq = (scheduler.running or [None])[0]
                scheduler.after(decoded, chunks)
                tokens = [] if seq is None else seq.out
    finally:
        LayerCache._resize = resize
    return tokens, resizes[0], over


def test_a_long_decode_regrows_its_buffers_logarithmically_within_the_pools_count():
    """160 tokens decoded in blocks of 2 (90 blocks in all): without headroom each of the 2
    layers' buffers regrows once per block (81 times: measured); with it, one block at a time
    up to 8 blocks, then by an eighth (17 times: measured), and no buffer ever holds more rows
    than the pool counts for its sequence."""
    pytest.importorskip("tokenizers")
    tokens, resizes, over = _loop(new=160, block=2)
    assert len(tokens) == 160 and over <= 0
    per_layer = resizes / 2
    assert per_layer <= HEADROOM + math.log(90 / HEADROOM) / math.log(1 + 1 / HEADROOM), resizes
