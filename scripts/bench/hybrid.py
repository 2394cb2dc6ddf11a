"""Hybrid models under context parallelism on this CPU: per-rank peak memory, step time, bytes.

    python scripts/bench/hybrid.py                                # both models, S 4k 8k 16k, W 1 2
    python scripts/bench/hybrid.py --models qwen3_5 --seqs 4096 --worlds 1,2,4 --steps 2

Random-init hybrids of tens of millions of parameters (most of them the 16k vocabulary), hidden
384, 8 layers (MODELS):
- qwen3_5: Qwen3.5-style, 3 gated DeltaNet : 1 gated attention, 4 key and 8 value heads of 64;
- nemotron_h: a Mamba2 hybrid, 8 blocks "M-M*M-M-" (Mamba2, MLP, attention), 8 Mamba heads of
  48 in 2 groups, state 64;
- qwen3_next, falcon_h1, granite4, bamba, lfm2, jamba, minimax: the same widths, 3 mixer
  layers : 1 attention (Falcon-H1: both in every layer), MoE where the family has it.
--scheme picks the mixers' scheme (auto: state where the mixer has a program, mixers/state.py).

For each model, S and W, one process with W threads (the baseline for W ranks; a process of its
own) and W gloo ranks of one thread each (zigzag, ring) run the same unpacked sequence: a warm-up
step, then --steps timed forward + backward steps (chunked cross-entropy, ringattn.hf.loss). Step
time is rank 0's median (the ranks wait on each other every layer). Peak memory is each rank's
peak of tensor bytes over one step (the profiler's allocation events: bench.common.PeakMemory),
the largest over ranks. Bytes per mixer layer per rank are those the layer's hooks send
(mixers/hooks.py's traffic: a ring collective's share, forward and backward). Targets (issue 46):
per-rank peak at W = 2 <= 0.55x one process at 16k; step time at W = 2 <= 0.6x one process with
2 threads. Prints a table, writes JSON (machine, versions, command) to --json.

Issue 56's target: at 8k tokens, W = 2 ranks of one thread each <= 1.1x the step time of one
process with 2 threads, for every family.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ringattn.bench import record

VOCAB = 16384


def _config(name: str, seq_len: int):
    import transformers

    common = {"vocab_size": VOCAB, "hidden_size": 384, "intermediate_size": 1024,
              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
              "max_position_embeddings": max(seq_len, 4096), "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if name == "qwen3_5":
        return transformers.Qwen3_5TextConfig(
            **common, num_hidden_layers=8,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4,
        )  # fmt: skip
    if name == "nemotron_h":
        return transformers.NemotronHConfig(
            **common, num_hidden_layers=8, hybrid_override_pattern="M-M*M-M-", mamba_num_heads=8,
            mamba_head_dim=48, ssm_state_size=64, n_groups=2, conv_kernel=4, chunk_size=128,
            mamba_expand=1,
        )  # fmt: skip
    layers = {"num_hidden_layers": 8}
    mamba2 = {"mamba_n_heads": 8, "mamba_d_head": 48, "mamba_d_state": 64, "mamba_n_groups": 2,
              "mamba_d_conv": 4, "mamba_chunk_size": 128, "mamba_expand": 1}  # fmt: skip
    pattern = (["mamba"] * 3 + ["attention"]) * 2
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **common, **layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        )  # fmt: skip
    if name == "falcon_h1":
        return transformers.FalconH1Config(**common, **layers, **mamba2, mamba_d_ssm=384)
    if name == "granite4":
        return transformers.GraniteMoeHybridConfig(
            **common, **layers, **mamba2, layer_types=pattern, num_local_experts=8,
            num_experts_per_tok=2, shared_intermediate_size=512,
        )  # fmt: skip
    if name == "bamba":
        return transformers.BambaConfig(**common, **layers, **mamba2, attn_layer_indices=[3, 7])
    if name == "lfm2":
        return transformers.Lfm2Config(
            **common, **layers, conv_L_cache=3,
            layer_types=(["conv"] * 3 + ["full_attention"]) * 2,
        )  # fmt: skip
    if name == "jamba":
        return transformers.JambaConfig(
            **common, **layers, attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2,
            expert_layer_offset=1, num_experts=8, num_experts_per_tok=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=1, mamba_dt_rank=24,
        )  # fmt: skip
    if name == "minimax":
        return transformers.MiniMaxConfig(
            **common, **layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            num_local_experts=8, num_experts_per_tok=2, block_size=256,
        )  # fmt: skip
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


MODELS = ["qwen3_5", "qwen3_next", "nemotron_h", "falcon_h1", "granite4", "bamba", "lfm2",
          "jamba", "minimax"]  # fmt: skip


def _model(name: str, seq_len: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(name, seq_len)).float()


def _batch(seq_len: int) -> dict:
    ids = torch.randint(3, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def measure(name: str, seq_len: int, steps: int, parallel: bool, scheme: str = "auto") -> dict:
    """One model, one S, on this process (parallel: over the launched group)."""
    import ringattn.hf
    from ringattn.bench.common import PeakMemory
    from ringattn.integrations.hf.loss import AUTO, loss_sum
    from ringattn.integrations.hf.mixers import STATE_ATTR, schemes

    model = _model(name, seq_len)
    full = _batch(seq_len)
    if parallel:
        ringattn.hf.parallelize(model, layout="zigzag", strategy="ring", mixer_scheme=scheme)
        batch = ringattn.hf.shard_batch(full, layout="zigzag")
    else:  # one process: transformers' own attention, the same chunked cross-entropy
        model.set_attn_implementation("sdpa")
        shifted = torch.cat([full["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)

    def step():
        if parallel:
            loss = ringattn.hf.loss(model, batch)
        else:
            inputs = {"input_ids": full["input_ids"], "use_cache": False}
            total, count, _ = loss_sum(model, inputs, shifted, AUTO)
            loss = total / count
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        if parallel:
            import torch.distributed as dist

            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with PeakMemory(torch.device("cpu")) as peak:
        step()
    state = getattr(model, STATE_ATTR, None)
    traffic = dict(state.traffic) if state is not None else {}
    ran = sorted({scheme for _, scheme in schemes(model).values()}) if parallel else []
    return {"step_s": statistics.median(times), "peak_mb": peak.mb, "traffic": traffic,
            "schemes": ran}  # fmt: skip


def rank_main(model: str, seq_len: int, steps: int, scheme: str = "auto") -> dict:
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    return measure(model, seq_len, steps, parallel=True, scheme=scheme)


def single_main(model: str, seq_len: int, steps: int, threads: int) -> dict:
    """The one-process baseline, in a process of its own (its memory goes with it)."""
    torch.set_num_threads(threads)
    return measure(model, seq_len, steps, parallel=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3_5,nemotron_h", help=", ".join(MODELS))
    p.add_argument("--scheme", default="auto", help="mixer scheme: auto, state, heads, whole")
    p.add_argument("--seqs", default="4096,8192,16384", help="sequence lengths")
    p.add_argument("--worlds", default="1,2", help="world sizes W (W = 1: one process only)")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--json", default="results/hybrid_bench_cpu.json", help="where results go")
    args = p.parse_args(argv)
    models = args.models.split(",")
    seqs = [int(s) for s in args.seqs.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]

    from ringattn.runtime.launch import launch

    rows = []
    for m in models:
        for seq_len in seqs:
            for w in worlds:  # the baseline for W ranks: one process with W threads, alone
                base = launch(single_main, 1, m, seq_len, args.steps, w)[0]
                row = {"model": m, "seq_len": seq_len, "world_size": w, "threads": w,
                       "one_process_step_s": base["step_s"],
                       "one_process_peak_mb": base["peak_mb"]}  # fmt: skip
                if w > 1:
                    per_rank = launch(rank_main, w, m, seq_len, args.steps, args.scheme)
                    traffic = per_rank[0]["traffic"]
                    row.update({
                        "step_s": per_rank[0]["step_s"],
                        "peak_mb_per_rank": [per_rank[r]["peak_mb"] for r in range(w)],
                        "bytes_per_mixer_layer": max(traffic.values()) if traffic else 0,
                        "bytes_by_layer": traffic,
                        "schemes": per_rank[0]["schemes"],
                    })  # fmt: skip
                    row["step_ratio"] = row["step_s"] / base["step_s"]
                    row["peak_ratio"] = max(row["peak_mb_per_rank"]) / base["peak_mb"]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "bytes_by_layer"}),
                      flush=True)  # fmt: skip
    print(f"{'model':>11} {'S':>6} {'W':>2} {'1-proc s':>9} {'CP s':>8} {'ratio':>6} "
          f"{'1-proc MB':>10} {'CP MB/rank':>11} {'ratio':>6} {'MB/mixer layer':>15}")  # fmt: skip
    for r in rows:
        if "step_s" not in r:
            print(f"{r['model']:>11} {r['seq_len']:>6} {1:>2} {r['one_process_step_s']:>9.2f} "
                  f"{'':>8} {'':>6} {r['one_process_peak_mb']:>10.0f}")  # fmt: skip
            continue
        print(f"{r['model']:>11} {r['seq_len']:>6} {r['world_size']:>2} "
              f"{r['one_process_step_s']:>9.2f} {r['step_s']:>8.2f} {r['step_ratio']:>6.2f} "
              f"{r['one_process_peak_mb']:>10.0f} {max(r['peak_mb_per_rank']):>11.0f} "
              f"{r['peak_ratio']:>6.2f} {r['bytes_per_mixer_layer'] / 2**20:>15.2f}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "method": "step: rank 0's median of --steps after a warm-up; peak: profiler tensor "
                  "bytes over one step, largest rank; bytes: mixers/hooks.py's per-call traffic",
        "rows": rows,
    }, packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
