"""Per-rank peak memory and tokens/s of `ringattn.hf.Trainer` (transformers.Trainer with context
parallelism) against the same Trainer without it, at the same sequence length.

    python scripts/bench/trainer.py            # S = 4096, writes results/trainer_cpu.json
    python scripts/bench/trainer.py --seq-len 8192 --steps 4 --out results/trainer_cpu_8k.json

Three launches of the same training (a random-init Llama: hidden 128, 4 layers, 4 heads / 2 KV,
MLP 512, a 512-token vocabulary; one sequence of --seq-len random tokens per step and data-parallel
group; AdamW; float32; SDPA attention for the plain Trainer, which takes its O(S)-memory causal
path on one unpacked sequence):

    plain W=1     transformers.Trainer, one process                      (the reference)
    plain W=2     transformers.Trainer under torchrun, DDP over 2 ranks  (2 sequences a step)
    cp    W=2     ringattn.hf.Trainer, cp=2 under torchrun               (1 sequence a step)

Memory: each rank's peak RSS during `trainer.train()` above its RSS just before (runtime/meter.py);
RSS counts everything a process touches, so it is an upper bound on the tensors. glibc's mmap
threshold is fixed (--mmap-threshold, 64 KiB): its default grows with the largest block freed, after
which freed tensors stay in the heap and the RSS peak varies by tens of MB from run to run; fixed,
every tensor above it is its own mapping, returned when freed, so the RSS follows the live tensors.
The DDP runs set ddp_find_unused_parameters=False (every parameter is used): with the Trainer's
default (True) DDP also copies the logits to find unused ones. Speed: tokens
per second over the steps after the first (median step time). On a CPU shared with other jobs
absolute times are noise: read the ratios. Writes JSON with the machine, the versions and the
command, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ringattn.bench import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(seq_len: int, steps: int, cp: int, out_dir: str, loss_chunk: int = -1):
    import transformers

    import ringattn.hf

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator(device="cpu").manual_seed(1)
    rows = [torch.randint(0, 512, (seq_len,), generator=gen, device="cpu") for _ in range(8)]
    data = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-4,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, ddp_find_unused_parameters=False,
    )  # fmt: skip
    if cp:
        parallel = ringattn.hf.ContextParallelConfig(cp=cp, loss_chunk=loss_chunk)
        return ringattn.hf.Trainer(
            model=model, args=args, train_dataset=data, context_parallel=parallel
        )
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def worker(seq_len: int, steps: int, cp: int, loss_chunk: int, result: str) -> None:
    """One rank: train, measure, and (rank 0) write every rank's figures to `result`."""
    import torch.distributed as dist
    import transformers

    from ringattn.runtime.meter import Meter

    transformers.logging.set_verbosity_error()
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(seq_len, steps, cp, out, loss_chunk)
        trainer.add_callback(Clock())
        start = time.perf_counter()
        with Meter("cpu") as meter:
            trainer.train()
    times = [b - a for a, b in zip([start, *marks], marks)][1:]  # the first step warms up
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    mine = {"peak_mb": meter.peak_mb, "step_seconds": times, "losses": losses}
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = [None] * world
    if world > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(result, "w") as f:
            json.dump(rows, f)


def _launch(
    world: int, seq_len: int, steps: int, cp: int, loss_chunk: int, mmap_threshold: int
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        args = [__file__, "--worker", "--seq-len", str(seq_len), "--steps", str(steps),
                "--cp", str(cp), "--loss-chunk", str(loss_chunk), "--result", result]  # fmt: skip
        if world > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={world}", *args]  # fmt: skip
        else:
            command = [sys.executable, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        with open(result) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per launch")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "trainer_cpu.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument(
        "--loss-chunk",
        type=int,
        default=-1,
        help="the cp run's ContextParallelConfig.loss_chunk (-1: from the vocab)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="glibc's MALLOC_MMAP_THRESHOLD_ in the runs (0: glibc's dynamic one)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.seq_len, args.steps, args.cp, args.loss_chunk, args.result)
        return
    runs = {}
    for name, world, cp, sequences in (("plain W=1", 1, 0, 1), ("plain W=2 (DDP)", 2, 0, 2),
                                       ("cp=2 W=2", 2, 2, 1)):  # fmt: skip
        rows = _launch(world, args.seq_len, args.steps, cp, args.loss_chunk, args.mmap_threshold)
        step = statistics.median(t for row in rows for t in row["step_seconds"])
        runs[name] = {"world_size": world, "cp": cp, "sequences_per_step": sequences,
                      "loss_chunk": args.loss_chunk if cp else None,
                      "peak_mb_per_rank": [row["peak_mb"] for row in rows],
                      "median_step_seconds": step,
                      "tokens_per_second": sequences * args.seq_len / step,
                      "losses": rows[0]["losses"]}  # fmt: skip
    base = runs["plain W=1"]
    for run in runs.values():
        run["peak_mb_vs_plain_w1"] = max(run["peak_mb_per_rank"]) / max(base["peak_mb_per_rank"])
        run["tokens_per_second_vs_plain_w1"] = run["tokens_per_second"] / base["tokens_per_second"]
    report = {
        "model": "Llama hidden 128, 4 layers, MLP 512, 4 heads / 2 KV, vocab 512, random init",
        "seq_len": args.seq_len,
        "steps": args.steps,
        "memory_method": "peak RSS during trainer.train() above the RSS just before",
        "malloc_mmap_threshold": args.mmap_threshold or "glibc dynamic",
        "runs": runs,
    }
    print(f"{'run':<24}{'peak MB/rank':>14}{'vs W=1':>8}{'tokens/s':>10}{'vs W=1':>8}")
    for name, run in runs.items():
        peak, speed = max(run["peak_mb_per_rank"]), run["tokens_per_second"]
        print(f"{name:<24}{peak:>14.0f}{run['peak_mb_vs_plain_w1']:>8.2f}"
              f"{speed:>10.0f}{run['tokens_per_second_vs_plain_w1']:>8.2f}")  # fmt: skip
    record.write(args.out, __file__, None, report, packages=["transformers"])


if __name__ == "__main__":
    main()
