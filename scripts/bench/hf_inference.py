"""ringattn.hf.generate over cp x tp ranks: time to first token, decode tokens/s, cache per rank.

    python scripts/bench/hf_inference.py                 # CPU: writes results/hf_inference_cpu.json
    python scripts/bench/hf_inference.py --configs 1x1,2x1,4x1,2x2 --seq-len 4096

Each "NxT" config is a fresh launch of N processes (ringattn.runtime.launch): cp = N / T
context-parallel ranks times T tensor-parallel ranks (the model's own tp plan, integrations/hf/
tensor_parallel.py), the same random Llama-shaped transformers model on every rank (from_config,
seeded; no download). After one untimed warm-up call, --repeats timed calls of
`ringattn.hf.generate(model, prompt, --new-tokens, return_stats=True)`; rank 0 reports the
medians:

    ttft         the call's start to the first new token (the whole prefill of --seq-len tokens)
    decode       tokens/s over the tokens after the first
    cache        each rank's K/V bytes kept, and the bytes its buffers hold (the reserve for the
                 tokens to come included)

Absolute CPU times are noise on a shared machine; the ratios to 1x1 are the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ringattn.bench import record


def bench_worker(options: dict) -> dict:
    """One rank of one launch: warm-up, then the timed calls of the module docstring."""
    import transformers

    import ringattn.hf
    from ringattn.comm import all_gather_ints, resolve_group
    from ringattn.integrations.hf.tensor_parallel import tensor_parallel
    from ringattn.runtime.launch import init_distributed

    world_size, tp = int(os.environ.get("WORLD_SIZE", "1")), options["tp"]
    if world_size > 1:
        init_distributed()
    torch.set_num_threads(options["threads"])
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=options["hidden"], intermediate_size=2 * options["hidden"],
        num_hidden_layers=options["layers"], num_attention_heads=options["heads"],
        num_key_value_heads=options["kv_heads"], max_position_embeddings=1 << 17,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    group = tp_group = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("cp", "tp"))
        tensor_parallel(model, mesh["tp"])
        group, tp_group = mesh["cp"].get_group(), mesh["tp"].get_group()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1024, (1, options["seq_len"]), generator=generator)
    run = {"group": group, "tp_group": tp_group, "eos_token_id": [], "return_stats": True}
    ringattn.hf.generate(model, prompt[:, :256], 2, **run)  # warm-up
    ttft, decode, stats = [], [], None
    for _ in range(options["repeats"]):
        _, stats = ringattn.hf.generate(model, prompt, options["new_tokens"], **run)
        ttft.append(stats.first_token_s)
        decode.append(stats.decode_tokens_per_s)
    world = resolve_group(None)
    cache = all_gather_ints([stats.cache_bytes, stats.cache_capacity_bytes], world,
                            torch.device("cpu"))  # fmt: skip
    return {"ttft_s": statistics.median(ttft), "decode_tokens_per_s": statistics.median(decode),
            "cache_bytes": [row[0] for row in cache],
            "cache_capacity_bytes": [row[1] for row in cache]}  # fmt: skip


def measure(nproc: int, tp: int, options: dict) -> dict:
    from ringattn.runtime.launch import launch

    options = {**options, "tp": tp}
    if nproc == 1:
        return bench_worker(options)
    return launch(bench_worker, nproc, options)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="1x1,2x1,4x1,2x2,4x2", help="comma-separated NxT")
    p.add_argument("--seq-len", type=int, default=2048, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per call")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="K/V heads")
    p.add_argument("--repeats", type=int, default=3, help="timed calls")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="results/hf_inference_cpu.json", help="where to write")
    args = p.parse_args(argv)
    options = {"seq_len": args.seq_len, "new_tokens": args.new_tokens, "hidden": args.hidden,
               "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
               "repeats": args.repeats, "threads": args.threads}  # fmt: skip
    rows = []
    for item in args.configs.split(","):
        nproc, tp = (int(x) for x in item.split("x"))
        start = time.perf_counter()
        result = measure(nproc, tp, options)
        rows.append({"nproc": nproc, "cp": nproc // tp, "tp": tp, **result,
                     "wall_s": time.perf_counter() - start})  # fmt: skip
    base = rows[0]
    print(f"{'N':>3} {'cp':>3} {'tp':>3} {'ttft s':>8} {'x 1x1':>6} {'decode tok/s':>13} "
          f"{'x 1x1':>6} {'cache MB/rank (max)':>20} {'buffers MB':>11}")  # fmt: skip
    for row in rows:
        row["ttft_vs_first"] = row["ttft_s"] / base["ttft_s"]
        row["decode_vs_first"] = row["decode_tokens_per_s"] / max(base["decode_tokens_per_s"], 1e-9)
        print(f"{row['nproc']:>3} {row['cp']:>3} {row['tp']:>3} {row['ttft_s']:>8.3f} "
              f"{row['ttft_vs_first']:>6.2f} {row['decode_tokens_per_s']:>13.1f} "
              f"{row['decode_vs_first']:>6.2f} {max(row['cache_bytes']) / 2**20:>20.3f} "
              f"{max(row['cache_capacity_bytes']) / 2**20:>11.3f}")  # fmt: skip

    record.write(args.json, __file__, argv, {"options": options, "rows": rows},
                 packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
