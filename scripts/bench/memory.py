"""Per-rank peak memory of a training step at a fixed global sequence length, W = 1, 2, 4.

    python scripts/bench/memory.py                      # CPU: writes results/memory_cpu.json
    python scripts/bench/memory.py --seq-len 32768 --world-sizes 1,4 --json results/x.json

Each W is a fresh launch of W processes (`ringattn train --nproc W --cp W`), so no process
carries memory over from another measurement. In each rank:

1. join the process group, run one step of a tiny model through the same code (FSDP, ring
   attention, optimizer), free it: the kernels' code pages and communication buffers are now
   resident and belong to the baseline (`--memory-warmup`);
2. baseline = resident set size (RSS) now; reset the peak (Linux clear_refs);
3. build the model, shard it (FSDP2 over all ranks), create AdamW, train `--steps` steps;
4. peak = highest RSS (VmHWM) since 2, minus the baseline.

So the figure is everything the training added: parameters, gradients, optimizer state,
activations, ring buffers, allocator slack. On a GPU the same command reports
torch.cuda.max_memory_allocated instead. The script prints a table and writes JSON with the
machine, the torch version and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ringattn.bench import record
from ringattn.train.config import TrainConfig
from ringattn.train.main import run_train


def measure(cfg: TrainConfig) -> dict:
    """One launch; the per-rank peak (max over steps) and timings from rank 0's history."""
    start = time.perf_counter()
    summary = run_train(cfg)
    history = summary["history"]
    peaks = [max(h["peak_mb"][r] for h in history) for r in range(cfg.nproc)]
    return {
        "world_size": cfg.nproc, "tokens_per_rank": cfg.seq_len // cfg.nproc,
        "peak_mb_per_rank": peaks, "peak_mb": max(peaks),
        "step_seconds": [h["seconds"] for h in history],
        "wall_seconds": time.perf_counter() - start, "memory_method": summary["memory_method"],
        "baseline_rss_mb_per_rank": summary["baseline_mb"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384, help="global tokens per sequence")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated W (cp = W)")
    p.add_argument("--model", default="small", help="model size preset")
    p.add_argument("--steps", type=int, default=2, help="training steps measured")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--strategy", default="ring")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction,
                   default=False, help="recompute blocks in backward")  # fmt: skip
    p.add_argument("--loss-chunk", type=int, default=4096, help="0 = full logits at once")
    p.add_argument("--json", default="results/memory_cpu.json", help="where the results go")
    args = p.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringattn-memory-") as tmp:
        for w in world_sizes:
            cfg = TrainConfig(
                model=args.model, seq_len=args.seq_len, nproc=w, dp=1, cp=w, steps=args.steps,
                warmup=1, layout=args.layout, strategy=args.strategy, memory_warmup=True,
                activation_checkpointing=args.activation_checkpointing,
                loss_chunk=args.loss_chunk, checkpoint_every=-1, resume=False, quiet=True,
                out_dir=os.path.join(tmp, f"w{w}"),
            )  # fmt: skip
            print(f"[memory] W = {w}: {args.seq_len} tokens, {args.seq_len // w} per rank...",
                  flush=True)  # fmt: skip
            rows.append(measure(cfg))
    base = next((r["peak_mb"] for r in rows if r["world_size"] == 1), None)
    print(f"\n{'W':>3} {'tokens/rank':>12} {'peak MB (max rank)':>19} {'per rank':>28} "
          f"{'vs W=1':>7}")  # fmt: skip
    for r in rows:
        r["ratio_to_w1"] = r["peak_mb"] / base if base else None
        ratio = f"{r['ratio_to_w1']:.3f}" if base else "-"
        per_rank = " ".join(f"{m:.0f}" for m in r["peak_mb_per_rank"])
        print(f"{r['world_size']:>3} {r['tokens_per_rank']:>12} {r['peak_mb']:>19.1f} "
              f"{per_rank:>28} {ratio:>7}")  # fmt: skip
    print(f"memory: {rows[0]['memory_method']}, above a baseline taken after a warm-up step")
    baselines = ", ".join(f"W={r['world_size']}: {max(r['baseline_rss_mb_per_rank']):.0f} MB"
                          for r in rows)  # fmt: skip
    print(
        f"baseline RSS per process (torch, kernels' code, process group; not counted): {baselines}"
    )
    record.write(args.json, __file__, argv, {
        "seq_len": args.seq_len, "model": args.model,
        "steps": args.steps, "layout": args.layout, "strategy": args.strategy,
        "activation_checkpointing": args.activation_checkpointing,
        "loss_chunk": args.loss_chunk, "method": rows[0]["memory_method"] + ", above the RSS "
        "after one warm-up step of a tiny model (fresh processes per W)", "rows": rows,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
