"""Inference over a sharded KV cache: decode cost per token, prefill, cache per rank, W = 1, 2, 4.

    python scripts/bench/inference.py                   # CPU: writes results/inference_cpu.json
    python scripts/bench/inference.py --seq-len 16384 --world-sizes 2 --json results/x.json

Each W is a fresh launch of W processes (ringattn.runtime.launch), the same model (seeded) on
every rank, --threads torch threads per rank (default 1, at every W). In each launch, after one
untimed warm-up of each path, with a barrier (one all-reduce) before each timed region and rank
0's wall time after the region's last collective (so the slowest rank's time):

    prefill      KVEngine.prefill of a --seq-len prompt (ring attention, cu_seqlens = [0, S]),
                 each rank keeping its K/V shard; a fresh engine each time
    train fwd    the training forward at the same length (set_context_parallel, dense zigzag
                 shards, logits of every token, no grad), timed alternately with the prefill;
                 medians of --repeats, and the median of the per-pair ratios
    decode       --decode-tokens steps after a prefill, per merge ("allgather", "allreduce");
                 the median step time
    cache        each rank's KV-cache bytes after the prefill (single device: W = 1's)

Targets (issue 13): a decoded token <= 0.05 of the 8k prefill at W = 2; each rank's cache
<= 1/W + 5 % of the single device's; prefill within 1.1x of the training forward. Absolute CPU
times are noise on a shared machine; the ratios are the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from ringattn.bench import record


def _barrier(info) -> None:
    from ringattn.comm import all_reduce

    all_reduce(torch.zeros(1), info)


def bench_worker(options: dict) -> dict:
    """One rank of one launch: the measurements of the module docstring."""
    import ringattn
    from ringattn.comm import resolve_group
    from ringattn.inference.hf.engine import KVEngine
    from ringattn.models import Transformer, model_config, set_context_parallel
    from ringattn.runtime.launch import init_distributed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed()
    info = resolve_group(None)
    torch.manual_seed(0)
    model = Transformer(model_config(options["model"])).eval()
    seq_len, layout = options["seq_len"], options["layout"]
    prompt = torch.randint(
        0, model.cfg.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1)
    )

    def timed(fn) -> float:
        _barrier(info)
        start = time.perf_counter()
        fn()
        _barrier(info)
        return time.perf_counter() - start

    group = None if info.world_size == 1 else torch.distributed.group.WORLD
    local = ringattn.shard(prompt[None], 1, layout=layout)  # (1, S / W)
    positions = ringattn.positions(seq_len, layout=layout)

    def prefill() -> KVEngine:
        engine = KVEngine(model, layout=layout)
        engine.prefill([prompt])
        return engine

    @torch.no_grad()
    def train_forward() -> None:
        set_context_parallel(model, group, layout)
        model(local, positions)  # logits of every local token
        set_context_parallel(model, None, "contiguous")

    cache_bytes = prefill().state.nbytes  # also the warm-up: kernel probe, agreement checks
    train_forward()
    prefill_s, train_s = [], []
    for _ in range(options["repeats"]):  # interleaved, so load from elsewhere hits both alike
        prefill_s.append(timed(prefill))
        train_s.append(timed(train_forward))

    decode = {}
    for merge in ("allgather", "allreduce"):
        engine = KVEngine(model, layout=layout, merge=merge)
        logits = engine.prefill([prompt])[0]
        engine.reserve([0], [options["decode_tokens"]])
        steps = []
        for _ in range(options["decode_tokens"]):
            token = int(logits.argmax())
            _barrier(info)
            start = time.perf_counter()
            logits = engine.decode([0], [token])[0]
            steps.append(time.perf_counter() - start)
        decode[merge] = statistics.median(steps[1:])  # the first step pays one-time setup
    return {
        "rank": info.rank,
        "prefill_s": statistics.median(prefill_s),
        "train_forward_s": statistics.median(train_s),
        "prefill_over_train_forward": statistics.median(
            [p / t for p, t in zip(prefill_s, train_s)]
        ),
        "decode_step_s": decode,
        "cache_bytes": cache_bytes,
        "threads": torch.get_num_threads(),
    }


def measure(world_size: int, options: dict) -> dict:
    from ringattn.runtime.launch import launch

    ranks = launch(bench_worker, world_size, options)  # W = 1 too: a fresh process
    lead = ranks[0]
    decode = lead["decode_step_s"]
    best = min(decode, key=decode.get)
    return {
        "world_size": world_size,
        "threads_per_rank": lead["threads"],
        "prefill_s": lead["prefill_s"],
        "train_forward_s": lead["train_forward_s"],
        "prefill_over_train_forward": lead["prefill_over_train_forward"],
        "decode_step_s": decode,
        "faster_merge": best,
        "decode_step_over_prefill": decode[best] / lead["prefill_s"],
        "cache_bytes_per_rank": [ranks[r]["cache_bytes"] for r in sorted(ranks)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192, help="prompt tokens")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated W")
    p.add_argument("--model", default="base", help="model size preset (models/config.py)")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills / training forwards")
    p.add_argument("--decode-tokens", type=int, default=16, help="timed decode steps per merge")
    p.add_argument("--json", default="results/inference_cpu.json", help="where to write results")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank, every W")
    args = p.parse_args(argv)
    # the same per rank at every W (launch would give W = 1 all the cores): with other jobs on
    # the machine, 2 threads per tiny decode op mostly wait for each other
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    options = {k: getattr(args, k) for k in ("seq_len", "model", "layout", "repeats")}
    options["decode_tokens"] = args.decode_tokens
    options["threads"] = args.threads
    rows = [measure(int(w), options) for w in args.world_sizes.split(",")]
    single = next((r["cache_bytes_per_rank"][0] for r in rows if r["world_size"] == 1), None)
    print(f"{args.seq_len}-token prompt, model {args.model}, layout {args.layout}")
    print(" W | prefill s | train fwd s | ratio | decode ms (allgather / allreduce) | "
          "decode/prefill | cache per rank / single")  # fmt: skip
    for row in rows:
        w = row["world_size"]
        share = None if single is None else max(row["cache_bytes_per_rank"]) / single
        row["cache_share_of_single"] = share
        row["cache_target"] = None if share is None else 1 / w + 0.05
        ag, ar = (row["decode_step_s"][m] * 1e3 for m in ("allgather", "allreduce"))
        cache = "-" if share is None else f"{share:.3f} (target {1 / w + 0.05:.3f})"
        print(f"{w:2d} | {row['prefill_s']:9.3f} | {row['train_forward_s']:11.3f} | "
              f"{row['prefill_over_train_forward']:5.2f} | {ag:8.2f} / {ar:8.2f} "
              f"({row['faster_merge']}) | {row['decode_step_over_prefill']:14.4f} | "
              f"{cache}")  # fmt: skip

    record.write(args.json, __file__, argv, {
        "options": options,
        "single_device_cache_bytes": single,
        "rows": rows,
    }, packages=["ringattn"])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
