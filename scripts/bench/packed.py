"""Packed documents on a CPU ring: time per step against the number of documents.

Reproduces issue 11's measurement: W gloo ranks (ringattn.runtime.launch, one torch thread per
rank), S causal tokens, 8 heads x 64, float32, zigzag ring, forward + backward, new cu_seqlens
(random document boundaries, the same on every rank) every step. Per document count it reports
the median step (the placement is rebuilt inside the timed step: `place`'s cache is cleared
after the inputs are sharded), the host plan on its own (place + ring reach + this rank's step
plans, on a fresh placement), and the visible (query, key) pairs, i.e. the attention FLOPs
actually needed. The dense row (no cu_seqlens) is the same sequence as one document.

    .venv/bin/python scripts/bench/packed.py            # writes results/packed_cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from ringattn.bench import record


def _bounds(seq_len: int, documents: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, seq_len), documents - 1))
    return [0, *cuts, seq_len]


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _host_plan_s(bounds, world_size: int, rank: int, layout: str) -> float:
    """Planning alone on a fresh placement: place, ring reach, this rank's step plans."""
    from ringattn.layout import get_layout
    from ringattn.packing import meeting_pairs, place
    from ringattn.plan import step_blocks

    place.cache_clear()
    start = time.perf_counter()
    placement = place(get_layout(layout), world_size, tuple(bounds))
    meeting_pairs(placement, True, None)
    for src in range(world_size):
        step_blocks(placement, rank, src, True, None)
    return time.perf_counter() - start


def bench_worker(options: dict) -> dict:
    """One rank: for each document count, warm-up steps then timed steps (module docstring)."""
    import ringattn
    from ringattn.layout import get_layout
    from ringattn.packing import place, work_per_rank
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    seq_len, heads, head_dim, layout = (
        options[k] for k in ("seq_len", "heads", "head_dim", "layout")
    )
    counts = options["documents"]
    timed: dict[int, dict[str, list]] = {n: {"step": [], "plan": [], "pairs": []} for n in counts}
    # document counts take turns step by step, so a change in the machine's load (other jobs)
    # falls on all of them alike
    for step in range(options["warmup"] + options["steps"]):
        for documents in counts:
            seed = 1000 * documents + step
            bounds = None if documents == 0 else _bounds(seq_len, documents, seed)
            gen = torch.Generator().manual_seed(seed)
            q, k, v, dout = (
                torch.randn(1, heads, seq_len, head_dim, generator=gen) for _ in range(4)
            )  # (1, H, S, D)
            kw = {"layout": layout, "cu_seqlens": bounds}
            local = [ringattn.shard(x, 2, **kw).requires_grad_() for x in (q, k, v)]
            local_dout = ringattn.shard(dout, 2, **kw)
            place.cache_clear()  # the timed step builds its own placement
            _barrier()
            start = time.perf_counter()
            out = ringattn.attention(*local, causal=True, **kw)
            out.backward(local_dout)
            _barrier()
            elapsed = time.perf_counter() - start
            if step >= options["warmup"]:
                cuts = bounds if bounds is not None else [0, seq_len]
                placement = place(get_layout(layout), world_size, tuple(cuts))
                timed[documents]["step"].append(elapsed)
                timed[documents]["plan"].append(_host_plan_s(cuts, world_size, rank, layout))
                timed[documents]["pairs"].append(sum(work_per_rank(placement, True, None)))
    rows = [
        {
            "documents": n,
            "step_s": statistics.median(timed[n]["step"]),
            "host_plan_s": statistics.median(timed[n]["plan"]),
            "visible_pairs": statistics.median(timed[n]["pairs"]),
            "steps_s": timed[n]["step"],
        }
        for n in counts
    ]
    return {"rows": rows, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks")
    p.add_argument("--seq-len", type=int, default=32768, help="global tokens")
    p.add_argument("--documents", default="0,64,256,2048", help="comma-separated; 0 = dense")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per document count")
    p.add_argument("--steps", type=int, default=3, help="timed steps per document count")
    p.add_argument("--json", default="results/packed_cpu.json", help="where to write results")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from ringattn.runtime.launch import launch

    options = {k: getattr(args, k) for k in ("seq_len", "heads", "head_dim", "layout")}
    options.update(warmup=args.warmup, steps=args.steps)
    options["documents"] = [int(x) for x in args.documents.split(",")]
    ranks = launch(bench_worker, args.world_size, options)
    rows = []
    for index, row in enumerate(ranks[0]["rows"]):
        # a step ends when the slowest rank ends (barriers); the plan share is the worst rank's
        plan = max(ranks[r]["rows"][index]["host_plan_s"] for r in ranks)
        flops = 4 * args.heads * args.head_dim * row["visible_pairs"] * 3.5  # fwd + 2.5x bwd
        rows.append({**row, "host_plan_max_s": plan, "attention_flops": flops})
    base = next((r for r in rows if r["documents"] == 64), rows[0])
    print(
        f"W={args.world_size} gloo ranks, S={args.seq_len} causal, {args.heads}x{args.head_dim} "
        f"fp32, {args.layout} ring, fwd+bwd, new cu_seqlens every step"
    )
    print(" documents | step s | vs 64 docs | host plan s | plan share | needed GFLOP")
    for r in rows:
        name = "dense" if r["documents"] == 0 else str(r["documents"])
        r["over_64_documents"] = r["step_s"] / base["step_s"]
        r["host_plan_share"] = r["host_plan_max_s"] / r["step_s"]
        print(
            f" {name:>9} | {r['step_s']:6.3f} | {r['over_64_documents']:10.2f} | "
            f"{r['host_plan_max_s']:11.4f} | {r['host_plan_share']:10.1%} | "
            f"{r['attention_flops'] / 1e9:12.1f}"
        )
    record.write(
        args.json,
        __file__,
        argv,
        {
            "threads_per_rank": ranks[0]["threads"],
            "config": vars(args),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
