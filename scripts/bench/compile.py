"""Compiled vs eager training step: `ringattn train --compile` against the same run without it.

    python scripts/bench/compile.py                  # CPU: writes results/compile_cpu.json
    python scripts/bench/compile.py --nproc 2 --cp 2 --seq-len 2048 --steps 8
    python scripts/bench/compile.py --nproc 4 --cp 2 --tp 2 --json results/compile_cp2_tp2_cpu.json
    python scripts/bench/compile.py --nproc 4 --cp 1 --pp 2 --tp 2 \
        --json results/compile_pp2_tp2_cpu.json

Each mode is a fresh launch of the same training run (`run_train`, the code behind `ringattn
train`), with the same seed, data and flags except `--compile`. From rank 0's step times:

    step time     median of the steps after the first (the first of a compiled run compiles)
    compile time  the compiled run's first step minus its median step: dynamo + AOTAutograd +
                  inductor for every graph, forward and backward (they compile on first use),
                  with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1) unless
                  --warm-cache: a second run would otherwise reuse the first one's kernels
    losses        every step's loss in both runs (equal up to float32 rounding)

On a shared CPU absolute times are noise; the ratio compiled / eager is the figure to quote. The
script prints a table and writes JSON with the machine, the torch version and the command line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from ringattn.bench import record
from ringattn.train.config import TrainConfig
from ringattn.train.main import run_train


def measure(cfg: TrainConfig) -> dict:
    """One launch: rank 0's step times and losses."""
    start = time.perf_counter()
    history = run_train(cfg)["history"]
    seconds = [h["seconds"] for h in history]
    median = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {
        "compile": cfg.compile, "step_seconds": seconds, "median_step_s": median,
        "first_step_s": seconds[0], "losses": [h["loss"] for h in history],
        "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (dp x cp x tp x pp)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--model", default="tiny", help="model size preset")
    p.add_argument("--seq-len", type=int, default=1024, help="global tokens per sequence")
    p.add_argument("--steps", type=int, default=6, help="training steps per run")
    p.add_argument("--strategy", default="ring")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--json", default="results/compile_cpu.json", help="where the results go")
    p.add_argument(
        "--warm-cache", action="store_true",
        help="let inductor reuse kernels that earlier runs cached (the compile time then reads "
        "low); by default its caches are off, as on a fresh machine",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not args.warm_cache:  # inherited by the launched ranks
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringattn-compile-") as tmp:
        for compiled in (False, True):
            cfg = TrainConfig(
                model=args.model, seq_len=args.seq_len, nproc=args.nproc, dp=args.dp,
                cp=args.cp, tp=args.tp, pp=args.pp, steps=args.steps, warmup=1, layout=args.layout,
                strategy=args.strategy, compile=compiled, checkpoint_every=-1, resume=False,
                quiet=True, out_dir=os.path.join(tmp, "compiled" if compiled else "eager"),
            )  # fmt: skip
            mode = "compiled" if compiled else "eager"
            print(f"[compile] {mode}: {args.steps} steps of {args.seq_len} tokens...", flush=True)
            rows.append(measure(cfg))
    eager, compiled = rows
    ratio = compiled["median_step_s"] / eager["median_step_s"]
    compile_s = compiled["first_step_s"] - compiled["median_step_s"]
    loss_diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
    print(f"\n{'mode':>9} {'median step s':>14} {'first step s':>13}")
    for name, r in (("eager", eager), ("compiled", compiled)):
        print(f"{name:>9} {r['median_step_s']:>14.3f} {r['first_step_s']:>13.2f}")
    print(f"compiled / eager step time: {ratio:.3f}; compile time {compile_s:.1f} s; "
          f"largest loss difference {loss_diff:.2e}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "config": vars(args), "rows": rows,
        "inductor_caches": "reused" if args.warm_cache else "disabled",
        "compiled_over_eager_step": ratio, "compile_seconds": compile_s,
        "max_loss_difference": loss_diff,
    }, packages=["triton"])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
