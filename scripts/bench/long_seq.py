"""The memory levers on CPU: peak memory per rank and step time of `ringattn train` with activation
checkpointing, then + tiled MLP, then + activation offload, at W = 2, beside the planner's
prediction of the same runs.

    python scripts/bench/long_seq.py              # writes results/long_seq_cpu.json
    python scripts/bench/long_seq.py --seq-lens 8192 --layers 2

The model is our decoder at SmolLM2-135M's layer shape (dim 576, 9 heads, 3 kv heads, SwiGLU
1536) with --layers blocks (SmolLM2 has 30: the depth is cut so that a run stays within minutes
on a shared 2-core machine) and the byte vocabulary. Each configuration is a fresh launch (so no
process carries memory over); memory is scripts/bench/memory.py's: the peak RSS per rank above the
RSS after a warm-up step of a tiny model. On CPU, offload moves the checkpoints into other CPU
memory, so it saves nothing there (the row shows its cost); the saving is a GPU's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory import measure

from ringattn.bench import record
from ringattn.train.config import TrainConfig

LEVERS = {
    "checkpointing": {"activation_checkpointing": True},
    "+ tiled MLP": {"activation_checkpointing": True, "tiled_mlp": 1024},
    "+ offload": {"activation_checkpointing": True, "tiled_mlp": 1024,
                  "offload_activations": True},
}  # fmt: skip
SHAPE = {"dim": 576, "heads": 9, "kv_heads": 3}


def predicted_mb(seq_len: int, layers: int, levers: dict) -> float:
    """The planner's memory model (planner/memory.py) of the same run: fp32, cp 2 ring/zigzag,
    the trainer's loss chunk, on a CPU "device" (only its GQA K/V expansion differs from a GPU's;
    memory needs no calibration)."""
    from ringattn.models import model_config
    from ringattn.models.loss import auto_chunk
    from ringattn.planner.cost import PlanSpec
    from ringattn.planner.hardware import Hardware
    from ringattn.planner.memory import memory_bytes
    from ringattn.planner.models import ModelSpec

    cfg = model_config("small", dim=SHAPE["dim"], n_layers=layers, n_heads=SHAPE["heads"],
                       n_kv_heads=SHAPE["kv_heads"])  # fmt: skip
    model = ModelSpec("smollm2-135m-shape", cfg.dim, layers, cfg.n_heads, cfg.n_kv_heads,
                      cfg.hidden_dim, cfg.vocab_size)  # fmt: skip
    cpu = Hardware("cpu", 0, 0, 64, 0, 0, 0, 1 << 20, calibration={})
    spec = PlanSpec(model, cpu, seq_len, 1, 1, 2, 1, 1, "ring", "zigzag", "fp32",
                    loss_chunk=auto_chunk(cfg.vocab_size), **levers)  # fmt: skip
    return memory_bytes(spec)["total"] / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="8192,16384", help="global tokens, comma-separated")
    p.add_argument("--layers", type=int, default=2, help="blocks of the SmolLM2-135M shape")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default="results/long_seq_cpu.json")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringattn-long-seq-") as tmp:
        for seq in (int(s) for s in args.seq_lens.split(",")):
            for name, levers in LEVERS.items():
                cfg = TrainConfig(model="small", layers=args.layers, seq_len=seq, nproc=2, dp=1,
                                  cp=2, steps=args.steps, warmup=1, memory_warmup=True,
                                  checkpoint_every=-1, resume=False, quiet=True,
                                  out_dir=os.path.join(tmp, f"{seq}-{len(rows)}"), **SHAPE,
                                  **levers)  # fmt: skip
                print(f"[long-seq] {seq} tokens, {name}...", flush=True)
                row = measure(cfg)
                row.update(seq_len=seq, levers=name, settings=levers,
                           step_s=statistics.median(row["step_seconds"][1:] or
                                                    row["step_seconds"]),
                           predicted_mb=predicted_mb(seq, args.layers, levers))  # fmt: skip
                rows.append(row)
    print(f"\n{'tokens':>7} {'levers':<14} {'peak MB':>8} {'planner MB':>10} {'error':>6} "
          f"{'step s':>7} {'vs ckpt':>7}")  # fmt: skip
    for r in rows:
        base = next(
            b for b in rows if b["seq_len"] == r["seq_len"] and b["levers"] == "checkpointing"
        )
        r["step_vs_checkpointing"] = r["step_s"] / base["step_s"]
        r["memory_vs_checkpointing"] = r["peak_mb"] / base["peak_mb"]
        r["planner_error"] = (r["predicted_mb"] - r["peak_mb"]) / r["peak_mb"]
        print(
            f"{r['seq_len']:>7} {r['levers']:<14} {r['peak_mb']:>8.0f} {r['predicted_mb']:>10.0f} "
            f"{r['planner_error']:>+6.0%} {r['step_s']:>7.2f} {r['step_vs_checkpointing']:>7.3f}"
        )
    load = os.getloadavg()
    print(f"load average after: {load[0]:.1f}")
    record.write(args.json, __file__, argv, {"layers": args.layers, "shape": SHAPE, "rows": rows,
                                             "load_after": load})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
