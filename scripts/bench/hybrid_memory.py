"""Hybrid families under CP: activation bytes saved per rank, and bytes sent per mixer layer.

    python scripts/bench/hybrid_memory.py                       # every family, S 2048, W 4 and 8
    python scripts/bench/hybrid_memory.py --families bamba,lfm2 --worlds 4 --scheme whole

For each family (transformers' own classes at tiny widths, random weights, one document of S
tokens, zigzag), one process and W gloo ranks run one forward of the loss under
`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for backward:
the bytes of the distinct storages kept, parameters excluded, are the activations the step holds
at its peak (before backward frees them). The ratio is the largest rank's bytes over one
process's (the issue 56 targets: <= 0.35 at W = 4, <= 0.2 at W = 8). The bytes each rank sends
per mixer layer (forward and backward, mixers/hooks.py's `traffic`) are measured at S and, at
W = --bytes-world, at 4S: a state-passing layer sends the same at both (summaries and halos), a
gathering one 4x.

Nothing here is timed: the figures do not depend on the machine's load. Prints a table, writes
JSON (machine, versions, command) to --json.
"""

from __future__ import annotations

import argparse
import copy

import torch

from ringattn.bench import record

VOCAB = 128
# nothing here is timed: a rank starved by a loaded machine is waited for, not killed
STALL_S = 1800.0
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1 << 16,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
          "mamba_d_conv": 4, "mamba_chunk_size": 64, "mamba_expand": 1}  # fmt: skip
GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}  # fmt: skip
HYBRID = ["linear_attention", "full_attention"] * 2


def family_config(name: str):
    """A tiny config of `name`: its mixer layers and attention layers, 4 layers."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**COMMON, num_hidden_layers=4)
    if name == "qwen3_5":
        return tf.Qwen3_5TextConfig(**COMMON, **GDN, head_dim=16, num_hidden_layers=4,
                                    layer_types=HYBRID)  # fmt: skip
    if name == "qwen3_next":
        return tf.Qwen3NextConfig(**COMMON, **GDN, head_dim=16, num_hidden_layers=4,
                                  layer_types=HYBRID, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)  # fmt: skip
    if name == "nemotron_h":
        return tf.NemotronHConfig(**COMMON, head_dim=16, num_hidden_layers=4,
                                  hybrid_override_pattern="M*M-", mamba_num_heads=4,
                                  mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                                  conv_kernel=4, chunk_size=64, mamba_expand=1)  # fmt: skip
    if name == "falcon_h1":
        return tf.FalconH1Config(**COMMON, **MAMBA2, head_dim=16, num_hidden_layers=4,
                                 mamba_d_ssm=64)  # fmt: skip
    if name == "granite4":
        return tf.GraniteMoeHybridConfig(**COMMON, **MAMBA2, num_hidden_layers=4,
                                         layer_types=["mamba", "attention"] * 2,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         shared_intermediate_size=64)  # fmt: skip
    if name == "bamba":
        return tf.BambaConfig(**COMMON, **MAMBA2, num_hidden_layers=4, attn_layer_indices=[1, 3])
    if name == "jamba":
        return tf.JambaConfig(**COMMON, num_hidden_layers=4, attn_layer_period=2,
                              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                              num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
                              mamba_d_conv=4, mamba_expand=1, mamba_dt_rank=8)  # fmt: skip
    if name == "lfm2":
        return tf.Lfm2Config(**COMMON, num_hidden_layers=4, conv_L_cache=3,
                             layer_types=["conv", "full_attention"] * 2)  # fmt: skip
    if name == "minimax":
        return tf.MiniMaxConfig(**COMMON, head_dim=16, num_hidden_layers=4, layer_types=HYBRID,
                                num_local_experts=4, num_experts_per_tok=2,
                                block_size=64)  # fmt: skip
    raise ValueError(f"unknown family {name!r}")


FAMILIES = ["llama", "qwen3_5", "qwen3_next", "nemotron_h", "falcon_h1", "granite4", "bamba",
            "jamba", "lfm2", "minimax"]  # fmt: skip


def _build(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(name)).float().train()


def _batch(seq_len: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (1, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone(),
            "position_ids": torch.arange(seq_len)[None]}  # fmt: skip


def saved_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of the distinct storages autograd keeps over one forward of the loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(seen.values())


def single(name: str, seq_len: int) -> dict:
    """The one-process baseline, in a process of its own."""
    return {"bytes": saved_bytes(_build(name), _batch(seq_len))}


def ranks(name: str, seq_lens: list[int], scheme: str) -> dict:
    import ringattn.hf
    from ringattn.integrations.hf.mixers import STATE_ATTR, schemes
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    model = ringattn.hf.parallelize(copy.deepcopy(_build(name)), mixer_scheme=scheme)
    out = {"schemes": sorted({s for _, s in schemes(model).values()})}
    for seq_len in seq_lens:
        batch = ringattn.hf.shard_batch(_batch(seq_len))
        state = getattr(model, STATE_ATTR, None)
        if state is not None:
            state.traffic.clear()
        out[f"bytes_{seq_len}"] = saved_bytes(model, batch)
        out[f"sent_{seq_len}"] = max(state.traffic.values()) if state and state.traffic else 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=", ".join(FAMILIES))
    p.add_argument("--seq", type=int, default=2048, help="tokens S (the bytes also at 4S)")
    p.add_argument("--worlds", default="4,8", help="world sizes W")
    p.add_argument("--scheme", default="auto", help="mixer scheme: auto, state, heads, whole")
    p.add_argument(
        "--bytes-world",
        type=int,
        default=4,
        help="the world size at which the bytes are also measured at 4S",
    )
    p.add_argument("--json", default="results/hybrid_memory_cpu.json", help="where results go")
    args = p.parse_args(argv)

    from ringattn.runtime.launch import launch

    rows = []
    for name in args.families.split(","):
        base = launch(single, 1, name, args.seq, stall_s=STALL_S)[0]["bytes"]
        for w in (int(x) for x in args.worlds.split(",")):
            lengths = [args.seq, 4 * args.seq] if w == args.bytes_world else [args.seq]
            got = launch(ranks, w, name, lengths, args.scheme, stall_s=STALL_S)
            worst = max(r[f"bytes_{args.seq}"] for r in got.values())
            sent = [got[0].get(f"sent_{n}", 0) for n in (args.seq, 4 * args.seq)]
            rows.append({"family": name, "world_size": w, "seq_len": args.seq,
                         "schemes": got[0]["schemes"], "one_process_bytes": base,
                         "largest_rank_bytes": worst, "ratio": worst / base,
                         "sent_per_mixer_layer": sent,
                         "sent_ratio_4s": sent[1] / sent[0] if all(sent) else None})  # fmt: skip
            print(rows[-1], flush=True)
    print(f"{'family':>11} {'W':>2} {'scheme':>12} {'1-proc MB':>10} {'rank MB':>8} {'ratio':>6} "
          f"{'KB/layer S':>11} {'4S/S':>5}")  # fmt: skip
    for r in rows:
        ratio_4s = "" if r["sent_ratio_4s"] is None else f"{r['sent_ratio_4s']:.2f}"
        print(f"{r['family']:>11} {r['world_size']:>2} {','.join(r['schemes']) or '-':>12} "
              f"{r['one_process_bytes'] / 2**20:>10.1f} {r['largest_rank_bytes'] / 2**20:>8.1f} "
              f"{r['ratio']:>6.2f} {r['sent_per_mixer_layer'][0] / 2**10:>11.1f} "
              f"{ratio_4s:>5}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "method": "saved_tensors_hooks over one forward of the loss: distinct storages, "
                  "parameters excluded; the largest rank over one process; bytes sent per mixer "
                  "layer per rank (forward + backward) at S and 4S",
        "rows": rows,
    }, packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
