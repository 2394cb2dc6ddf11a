"""Dynamic vs static context parallelism on a lognormal mix of document lengths (CPU, ratios).

Megatron-LM's benchmark distribution: document lengths lognormal with mean 1024 and sigma 1.5,
clipped to [128, 8192], fixed seed, packed into --seq-len windows (`--data docs:...`). The same
documents are trained with static CP (every document sharded over the whole cp group) and with
--dynamic-cp, side by side in one run, paired ABBA (static, dynamic, dynamic, static, ...), each
run a fresh `ringattn train` of --steps steps whose first --warmup-steps are not timed.

Reported per pair: tokens/s of both (the trainer's own `tokens_per_s`, median of the timed
steps) and their ratio; overall the median ratio, and the scheduler's prediction beside it:
the sum over steps of the busiest rank's planned cost (planner/dynamic_cp/cost.py), static over
dynamic, on the same windows. On CPU absolute times are noise; the ratio is the figure.

    .venv/bin/python scripts/bench/dynamic_cp.py      # writes results/dynamic_cp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ringattn.bench import record
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.schedule import plan_step, static_schedule
from ringattn.planner.models import ModelSpec
from ringattn.train.config import TrainConfig
from ringattn.train.dynamic.documents import parse_documents


def _run(args: argparse.Namespace, dynamic: bool, out: str) -> dict:
    cmd = [sys.executable, "-m", "ringattn", "train", "--nproc", str(args.dp * args.cp),
           "--dp", str(args.dp), "--cp", str(args.cp), "--model", args.model,
           "--data", args.data, "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--steps", str(args.steps), "--out-dir", out, "--no-resume",
           "--checkpoint-every", "-1", "--quiet", "--layout", args.layout,
           "--strategy", args.strategy]  # fmt: skip
    if dynamic:
        cmd.append("--dynamic-cp")
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "train_log.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    timed = steps[args.warmup_steps :]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "losses": [r["loss"] for r in steps], "cp_groups": [r["cp_groups"] for r in steps],
            "imbalance": [r["imbalance"] for r in steps]}  # fmt: skip


def _predicted(args: argparse.Namespace) -> dict:
    """The scheduler's own figures: busiest rank's planned seconds per step, static and dynamic."""
    task = parse_documents(args.data, args.seq_len, 0)
    c = TrainConfig(model=args.model).model_config()
    cost = DocumentCost(ModelSpec(args.model, c.dim, c.n_layers, c.n_heads, c.n_kv_heads,
                                  c.hidden_dim, c.vocab_size))  # fmt: skip
    per_step = args.dp * args.batch_size
    static_s = dynamic_s = 0.0
    for step in range(args.warmup_steps, args.steps):
        lengths, rows = [], []
        for w in range(step * per_step, (step + 1) * per_step):
            got = task.lengths(w)
            lengths += got
            rows += [(w - step * per_step) // args.batch_size] * len(got)
        static_s += max(static_schedule(lengths, rows, args.dp, args.cp, cost).costs)
        budget = args.batch_size * args.seq_len // args.cp
        dynamic_s += max(plan_step(lengths, args.dp, args.cp, budget, cost).costs)
    return {"static_s": static_s, "dynamic_s": dynamic_s, "ratio": static_s / dynamic_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default="docs:1024,1.5,128,8192")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2, help="ABBA pairs (2 runs each)")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--strategy", default="ring")
    parser.add_argument("--out", default="results/dynamic_cp_cpu.json")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(args.pairs):
            order = (False, True) if p % 2 == 0 else (True, False)  # ABBA
            pair = {}
            for dynamic in order:
                name = "dynamic" if dynamic else "static"
                pair[name] = _run(args, dynamic, os.path.join(tmp, f"{p}-{name}"))
            pair["ratio"] = pair["dynamic"]["tokens_per_s"] / pair["static"]["tokens_per_s"]
            runs.append(pair)
            print(f"pair {p}: static {pair['static']['tokens_per_s']:.0f} tok/s, dynamic "
                  f"{pair['dynamic']['tokens_per_s']:.0f} tok/s, ratio {pair['ratio']:.3f}",
                  flush=True)  # fmt: skip
    predicted = _predicted(args)
    ratio = statistics.median(r["ratio"] for r in runs)
    base = runs[0]["static"]["losses"]  # the same documents: every run's losses agree
    drift = max(abs(a - b) / abs(b) for r in runs for k in ("static", "dynamic")
                for a, b in zip(r[k]["losses"], base))  # fmt: skip
    print(
        f"\n| dp x cp | measured dynamic/static tokens/s | scheduler's prediction |\n"
        f"|---|---|---|\n| {args.dp} x {args.cp} | {ratio:.3f} | {predicted['ratio']:.3f} |"
    )
    result = {"args": vars(args), "pairs": runs, "ratio_median": ratio, "predicted": predicted,
              "max_loss_rel_diff": drift}  # fmt: skip
    print(f"losses of every run within {drift:.1e} (relative) of the first static run's")
    record.write(args.out, __file__, argv, result)


if __name__ == "__main__":
    main()
