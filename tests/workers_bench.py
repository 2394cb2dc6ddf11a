"""Functions that run on every rank of a WorkerPool (harness.py) for test_overlap.py and
test_bench.py: fn(rank, world_size, ...).

`delayed_transfers(delay_s, log)` wraps `torch.distributed.batch_isend_irecv` (what comm.RingComm
posts with) so that every returned work's `wait()` completes no earlier than post time + delay_s:
a transfer that takes at least `delay_s` on the wire, costing no CPU. Each posted batch is logged
with when it was posted, when the ring first waited on it and when the wait returned.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import ringattn


class _DelayedWork:
    """A posted transfer that completes no earlier than `ready_at` (perf_counter seconds)."""

    def __init__(self, work: dist.Work, ready_at: float, entry: dict):
        self._work, self._ready_at, self._entry = work, ready_at, entry

    def wait(self, *args, **kwargs):
        self._entry.setdefault("wait_called", time.perf_counter())
        result = self._work.wait(*args, **kwargs)
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self._entry["done"] = time.perf_counter()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def delayed_transfers(delay_s: float, log: list[dict]):
    original = dist.batch_isend_irecv

    def delayed(p2p_op_list):
        posted = time.perf_counter()
        works = original(p2p_op_list)
        entry = {"tag": p2p_op_list[0].tag, "posted": posted}
        log.append(entry)
        return [_DelayedWork(work, posted + delay_s, entry) for work in works]

    dist.batch_isend_irecv = delayed
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


def ring_forward_steps(rank, world_size, *, delays, repeats, heads=4, local_len=1024, head_dim=64):
    """Time ring forwards (full attention, contiguous layout: every step is one equal block)
    under each transfer delay, interleaved so machine load hits every delay alike.

    Returns {delay: [per run: (call seconds, first step's window: post -> transfer complete,
    compute inside that window: post -> first wait)]}.
    """
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, local_len, head_dim, generator=gen) for _ in range(3))
    kwargs = {"causal": False, "layout": "contiguous"}
    with torch.no_grad():
        ringattn.attention(q, k, v, **kwargs)  # warm-up, and the one-time agreement check
        runs = {delay: [] for delay in delays}
        for _ in range(repeats):
            for delay in delays:
                log: list[dict] = []
                dist.barrier()  # both ranks start together: no waiting on a late peer
                with delayed_transfers(delay, log):
                    start = time.perf_counter()
                    ringattn.attention(q, k, v, **kwargs)
                    elapsed = time.perf_counter() - start
                assert len(log) == world_size - 1, log  # W - 1 K/V exchanges in a forward
                first = log[0]
                window = first["done"] - first["posted"]
                runs[delay].append((elapsed, window, first["wait_called"] - first["posted"]))
    return runs


def ring_results(rank, world_size, q, k, v, dout, *, layout, causal):
    """This rank's out, lse, dq, dk, dv from the real ring (the emulated ring's yardstick)."""
    local = [ringattn.shard(x, 2, layout=layout).requires_grad_() for x in (q, k, v)]
    out, lse = ringattn.attention(*local, causal=causal, layout=layout, return_lse=True)
    out.backward(ringattn.shard(dout, 2, layout=layout))
    return {"out": out, "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
