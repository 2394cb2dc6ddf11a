"""`ringattn serve`'s start-up pool check and rank 0's planning cost, by served context.

    python scripts/bench/serve_startup.py        # results/serve_startup_cpu.json

start-up   `worker.check_pool` for one sequence of the context over W ranks in chunks of
           --chunk tokens (every split into prompt and completion: the pool must hold the
           fullest rank's blocks of each), as a server runs it before it listens
planning   rank 0's real Scheduler and BlockPool (no model, no ranks: each step's logits are
           made up) over --requests requests of random lengths in [context / 2, context),
           half of them sharing a prefix of a quarter of the context: the mean time of one
           `plan()` and `after()`, i.e. what rank 0 spends per step beside the forward

Run it on two checkouts (before and after a change) with --contexts to compare; each case is
timed once (start-up) or over every step of its run (planning). No timeout: pick --contexts
that the code under test finishes.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import time

import torch

from ringattn.bench import record
from ringattn.serve.pool import BlockPool
from ringattn.serve.protocol import Request
from ringattn.serve.scheduler import Scheduler
from ringattn.serve.worker import check_pool

try:
    from ringattn.serve.shares import Shares
except ImportError:  # a checkout from before Shares left pool.py (the "before" runs)
    from ringattn.serve.pool import Shares

VOCAB = 320


class _Job:
    def __init__(self, request: Request):
        self.request, self.cancelled, self.arrived = request, False, 0.0

    def sink(self, *event: object) -> None:
        pass


class _Quiet:
    """A tokenizer that decodes every token to nothing (the text stream has no work)."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


class _Alive:
    @staticmethod
    def is_alive() -> bool:
        return True


def startup(context: int, chunk: int, world_size: int, block: int, layout: str) -> float:
    start = time.perf_counter()
    check_pool(1 << 40, block, Shares(layout, world_size), chunk, context)
    return time.perf_counter() - start


def planning(context: int, args) -> dict:
    """Mean seconds of rank 0's plan() + after() per step over one seeded run."""
    rng = random.Random(0)
    shares = Shares(args.layout, args.nproc)
    blocks = 4 * args.requests * shares.blocks(context, args.chunk, 8, args.block)
    pool = BlockPool(blocks, args.block)
    jobs: queue.Queue = queue.Queue()
    sched = Scheduler(jobs, _Alive(), _Quiet(), [2], pool, shares, args.chunk, 64,
                      make_sink=lambda job: job.sink)  # fmt: skip
    shared = [rng.randrange(3, VOCAB) for _ in range(context // 4)]
    for i in range(args.requests):
        n = rng.randrange(context // 2, context - 8)
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        if i % 2:
            ids[: len(shared)] = shared
        jobs.put(_Job(Request(ids, rng.randint(1, 8))))
    times, steps = [], 0
    while not jobs.empty() or sched.running or sched.waiting:
        start = time.perf_counter()
        plan = sched.plan()
        if plan["op"] == "step":
            row = torch.zeros(VOCAB)
            row[rng.randrange(3, VOCAB)] = 1.0
            n = len(plan["decode"])
            sched.after(row.expand(n, VOCAB) if n else None, [row for _ in plan["chunks"]])
            steps += 1
        times.append(time.perf_counter() - start)
    return {"steps": steps, "mean_step_ms": 1e3 * statistics.mean(times),
            "max_step_ms": 1e3 * max(times)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 131072])
    parser.add_argument("--chunk", type=int, default=8192, help="--max-batch-tokens")
    parser.add_argument("--nproc", type=int, default=4, help="W, the ranks")
    parser.add_argument("--block", type=int, default=16, help="--kv-block-size")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--skip-planning", action="store_true")
    parser.add_argument("--out", default="results/serve_startup_cpu.json")
    args = parser.parse_args(argv)
    rows = []
    print(f"W = {args.nproc}, chunk {args.chunk}, blocks of {args.block}, {args.layout}")
    print(f"{'context':>8} {'start-up s':>11} {'steps':>6} {'plan ms/step':>13} {'max ms':>8}")
    for context in args.contexts:
        row = {
            "context": context,
            "startup_s": startup(context, args.chunk, args.nproc, args.block, args.layout),
        }
        if not args.skip_planning:
            row.update(planning(context, args))
        rows.append(row)
        print(f"{context:8d} {row['startup_s']:11.3f} {row.get('steps', 0):6d} "
              f"{row.get('mean_step_ms', float('nan')):13.3f} "
              f"{row.get('max_step_ms', float('nan')):8.2f}", flush=True)  # fmt: skip
    result = {"config": vars(args), "rows": rows}
    record.write(args.out, __file__, sys.argv[1:] if argv is None else argv, result)
    return result


if __name__ == "__main__":
    main()
