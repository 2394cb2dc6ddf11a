"""Expert parallelism on this CPU: per-rank expert memory and step time at ep 1, 2, 4.

    python scripts/bench/moe.py                      # 4 ranks, cp 4, ep 1 2 4, the default model
    python scripts/bench/moe.py --nproc 4 --eps 1,2,4 --experts 8 --tokens 2048 --steps 5

One launch of --nproc gloo ranks (cp = nproc, zigzag, ring) runs every ep side by side: for each,
a fresh copy of one random-init Mixtral (hidden 256, 2 layers, --experts experts of MLP 512, top
2, router loss on) made context-parallel with `ringattn.hf.parallelize(..., expert_group=...)`
(ep 1: expert_group=None), a warm-up step then --steps timed steps of forward, backward and
AdamW on --tokens tokens. Per rank it counts the bytes of the expert weights, their gradients and
AdamW's two moments (tensor sizes: exact, no allocator slack), and the median step time (rank
0's; the ranks wait on each other every layer). Prints a table and writes JSON with the machine,
the versions and the command.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from ringattn.bench import record


def _model(experts: int):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=65536, output_router_logits=True,
        router_aux_loss_coef=0.02, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _expert_bytes(model, optimizer) -> dict:
    params = [p for n, p in model.named_parameters() if ".experts." in n]
    moments = [t for p in params for t in optimizer.state[p].values() if t.dim() > 0]
    size = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return {"weights": size, "gradients": grads,
            "optimizer": sum(t.numel() * t.element_size() for t in moments)}  # fmt: skip


def rank_main(eps: list[int], experts: int, tokens: int, steps: int) -> list[dict]:
    """One rank: every ep in turn on a fresh copy of the same model."""
    import torch.distributed as dist

    import ringattn.hf
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    world = dist.get_world_size()
    base = _model(experts)
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(1))
    batch = ringattn.hf.shard_batch({"input_ids": ids, "labels": ids.clone()})
    rows = []
    for ep in eps:
        group = None
        if ep > 1:  # blocks of ep consecutive ranks (every rank creates every block's group)
            blocks = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
            group = blocks[dist.get_rank() // ep]
        model = ringattn.hf.parallelize(copy.deepcopy(base), expert_group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            model(**batch).loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            if step < steps:
                optimizer.zero_grad(set_to_none=False)
        rows.append({"ep": ep, "step_s": statistics.median(times[1:]),
                     **_expert_bytes(model, optimizer)})  # fmt: skip
        del model, optimizer
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks (cp = nproc)")
    p.add_argument("--eps", default="1,2,4", help="expert-parallel degrees, each dividing nproc")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (one sequence)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--json", default="results/moe_bench_cpu.json", help="where the results go")
    args = p.parse_args(argv)
    eps = [int(e) for e in args.eps.split(",")]

    from ringattn.runtime.launch import launch

    ranks = launch(rank_main, args.nproc, eps, args.experts, args.tokens, args.steps)
    rows = []
    for i, ep in enumerate(eps):
        per_rank = [ranks[r][i] for r in range(args.nproc)]
        first = per_rank[0]
        rows.append({"ep": ep, "step_s": first["step_s"],
                     **{k: [row[k] for row in per_rank] for k in ("weights", "gradients",
                                                                  "optimizer")}})  # fmt: skip
    base = rows[0]
    print(f"{'ep':>3} {'expert weights MB/rank':>23} {'grads MB':>9} {'AdamW MB':>9} "
          f"{'vs ep 1':>8} {'step s':>8} {'vs ep 1':>8}")  # fmt: skip
    for r in rows:
        share = max(r["weights"]) / max(base["weights"])
        mb = {k: max(r[k]) / 2**20 for k in ("weights", "gradients", "optimizer")}
        print(f"{r['ep']:>3} {mb['weights']:>23.2f} {mb['gradients']:>9.2f} "
              f"{mb['optimizer']:>9.2f} {share:>8.3f} {r['step_s']:>8.3f} "
              f"{r['step_s'] / base['step_s']:>8.2f}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "model": f"Mixtral hidden 256, 2 layers, {args.experts} experts of MLP 512, top 2",
        "nproc": args.nproc, "cp": args.nproc, "tokens": args.tokens, "steps": args.steps,
        "bytes": "per rank, expert tensors only", "rows": rows,
    }, packages=["transformers"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
