"""The memory levers on CPU: each rank's peak tensor memory above the model states, lever by
lever, beside the planner's memory model; and the tiled MLP's step time, interleaved with none.

    python scripts/bench/long_seq.py --seq-len 16384     # writes results/long_seq_memory_cpu.json
    python scripts/bench/long_seq.py --seq-len 32768 --layers 1 --levers ckpt,tiled,offload
    python scripts/bench/long_seq.py --seq-len 16384 --loss-chunk 256 --breakdown  # what is alive
    python scripts/bench/long_seq.py --speed --seq-len 16384 --layers 1 --pairs 3
                                                     # writes results/long_seq_speed_cpu.json

The model is our decoder at SmolLM2-135M's shape (dim 576, 9 heads, 3 kv heads, SwiGLU 1536,
vocabulary 49,152) with --layers blocks (SmolLM2 has 30; the depth is cut so that a run stays
within minutes on a shared 2-core machine), W = 2 gloo ranks of one thread, ring / zigzag.

Memory: in each rank, for each lever set (LEVERS), a fresh model whose gradients are allocated
beforehand (zeros), so that the model states (parameters, gradients) are in place; then one
forward + backward under the profiler (bench.common.PeakMemory: allocation and free events
summed in time order; with --breakdown, bench/breakdown.py also lists the tensors alive at the
peak by the op and autograd node that allocated them). The peak is what the step adds above the
model states: activations, the recompute's working set, ring buffers, logits. "Checkpoints
alone" is layers x S/W x dim x 4 bytes. With checkpointing, what a step adds is the checkpoints
plus one block's working set (the block being recomputed), which does not grow with depth; so
the figure at SmolLM2's 30 layers is extrapolated as 30 x checkpoint + (measured - L x
checkpoint), and labelled so.
On CPU, offload copies the checkpoints into other CPU memory: it saves nothing here (the row
shows that); the saving is a GPU's.

Speed (--speed): one launch, the same model and batch, steps alternating untiled and tiled
(--tile) --pairs times after a warm-up of each, checkpointing on; the ratio of the medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from ringattn.bench import record

SHAPE = {"dim": 576, "n_heads": 9, "n_kv_heads": 3, "vocab_size": 49152}
SMOLLM2_LAYERS = 30
# name -> the levers: activation checkpointing, loss chunk (-1 auto, 0 whole logits), tile,
# offload; each row adds one lever to the row before it ("whole" is checkpointing without the
# chunked loss)
LEVERS = {
    "none": (False, -1, 0, False),
    "whole": (True, 0, 0, False),
    "ckpt": (True, -1, 0, False),
    "tiled": (True, -1, 1024, False),
    "offload": (True, -1, 1024, True),
}
LABELS = {"none": "chunked loss only", "whole": "checkpointing, whole logits",
          "ckpt": "checkpointing + chunked loss", "tiled": "+ tiled MLP 1024",
          "offload": "+ offload"}  # fmt: skip


def _levers(name: str, chunk: int) -> tuple:
    """LEVERS[name] with the chunked loss's rows set to `chunk` (-1: the trainer's auto)."""
    ckpt, own, tile, offload = LEVERS[name]
    return ckpt, own if own == 0 else chunk, tile, offload


def _model(layers: int, levers: tuple, group: object) -> torch.nn.Module:
    from ringattn.models import model_config
    from ringattn.models.decoder import Transformer, set_context_parallel, set_tiled_mlp
    from ringattn.models.loss import resolve_chunk

    ckpt, chunk, tile, offload = levers
    torch.manual_seed(0)
    cfg = model_config("small", n_layers=layers, **SHAPE)
    model = Transformer(cfg)
    set_context_parallel(model, group, "zigzag", "ring")
    model.checkpoint_blocks, model.offload_activations = ckpt, offload
    model.loss_chunk = resolve_chunk(chunk, cfg.vocab_size)
    set_tiled_mlp(model, tile)
    return model


def _batch(seq_len: int, group: object):
    from ringattn.train.data import shard_batch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, seq_len + 1), generator=g)
    return shard_batch(tokens[:, :-1], tokens[:, 1:], group, "zigzag")  # labels: next token


def _step(model: torch.nn.Module, batch, seq_len: int) -> None:
    loss, _, _ = model(batch.inputs, batch.positions, batch.labels)
    (loss / seq_len).backward()


def rank_memory(seq_len: int, layers: int, names: list[str], chunk: int, breakdown: bool) -> dict:
    """Each lever set's peak tensor MiB above the model states, on this rank; with `breakdown`,
    what is alive at the peak (bench/breakdown.py)."""
    from ringattn.bench.breakdown import Breakdown
    from ringattn.bench.common import PeakMemory
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    batch = _batch(seq_len, None)
    out = {}
    for name in names:
        model = _model(layers, _levers(name, chunk), None)
        for p in model.parameters():  # the gradients are model states: in place before the step
            p.grad = torch.zeros_like(p)
        start = time.perf_counter()
        meter = Breakdown(seq_len // 2) if breakdown else PeakMemory(torch.device("cpu"))
        with meter:
            _step(model, batch, seq_len)
        out[name] = {"peak_mb": meter.mb, "seconds": time.perf_counter() - start,
                     "params": sum(p.numel() for p in model.parameters())}  # fmt: skip
        if breakdown:
            out[name]["peak_at"], out[name]["alive_at_peak"] = meter.at, meter.live
        del model
        gc.collect()
    return out


def rank_speed(seq_len: int, layers: int, tile: int, pairs: int) -> dict:
    """Step seconds of the same model untiled and tiled, alternating (rank 0's clock)."""
    import torch.distributed as dist

    from ringattn.models.decoder import set_tiled_mlp
    from ringattn.runtime.launch import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    batch = _batch(seq_len, None)
    model = _model(layers, LEVERS["ckpt"], None)
    times: dict[int, list[float]] = {0: [], tile: []}
    for i in range(pairs + 1):  # the first pair warms up (allocator, kernels' first calls)
        for t in (0, tile) if i % 2 == 0 else (tile, 0):  # alternate which goes first
            set_tiled_mlp(model, t)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            _step(model, batch, seq_len)
            dist.barrier()
            if i:
                times[t].append(time.perf_counter() - start)
    return {"untiled_s": times[0], "tiled_s": times[tile]}


def predicted(seq_len: int, layers: int, name: str, chunk: int = -1) -> dict:
    """The planner's memory model (planner/memory.py) of the same step, by kind, in MiB: fp32,
    cp 2 ring/zigzag on a CPU "device"; the step's part (without parameters, gradients,
    optimizer and FSDP buffers, which this bench does not count) under "step"."""
    from ringattn.models.loss import resolve_chunk
    from ringattn.planner.cost import PlanSpec
    from ringattn.planner.hardware import Hardware
    from ringattn.planner.memory import memory_bytes
    from ringattn.planner.models import ModelSpec

    ckpt, chunk, tile, offload = _levers(name, chunk)
    dim, vocab = SHAPE["dim"], SHAPE["vocab_size"]
    model = ModelSpec("smollm2-135m-shape", dim, layers, SHAPE["n_heads"], SHAPE["n_kv_heads"],
                      8 * dim // 3, vocab)  # fmt: skip
    cpu = Hardware("cpu", 0, 0, 64, 0, 0, 0, 1 << 20, calibration={})
    spec = PlanSpec(model, cpu, seq_len, 1, 1, 2, 1, 1, "ring", "zigzag", "fp32",
                    activation_checkpointing=ckpt, loss_chunk=resolve_chunk(chunk, vocab),
                    tiled_mlp=tile, offload_activations=offload)  # fmt: skip
    kinds = {k: v / 2**20 for k, v in memory_bytes(spec).items()}
    states = ("parameters", "gradients", "optimizer", "fsdp_buffers", "total")
    kinds["step"] = sum(v for k, v in kinds.items() if k not in states)
    return kinds


def repredict(path: str) -> None:
    """The planner's columns of a memory result, recomputed by today's memory model (the
    measured peaks are left as they are); the file says when and what changed."""
    import json

    from ringattn.bench.common import write_json

    with open(path) as f:
        result = json.load(f)
    for row in result["rows"]:
        pred = predicted(result["seq_len"], result["layers"], row["levers"],
                         result.get("loss_chunk", -1))  # fmt: skip
        row["predicted_mb_when_measured"] = row.get("predicted_mb_when_measured",
                                                    row["predicted_mb"])  # fmt: skip
        row.update(predicted_mb=pred["step"], predicted_by_kind_mb=pred,
                   planner_error=(pred["step"] - row["peak_mb"]) / row["peak_mb"])  # fmt: skip
        print(f"{row['label']:<30} measured {row['peak_mb']:.0f} MiB, planner "
              f"{row['predicted_mb']:.0f} ({row['planner_error']:+.0%})")  # fmt: skip
    result["repredicted"] = "planner columns recomputed by scripts/bench/long_seq.py --repredict"
    write_json(path, result)


def memory_table(args: argparse.Namespace, argv: list[str] | None) -> None:
    from ringattn.runtime.launch import launch

    names = args.levers.split(",")
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise ValueError(f"--levers {unknown}: choose from {', '.join(LEVERS)}")
    # stall_s: the profiler's processing at the end of a long step holds the GIL for a while
    per_rank = launch(rank_memory, 2, args.seq_len, args.layers, names, args.loss_chunk,
                      args.breakdown, stall_s=600)  # fmt: skip
    tokens = args.seq_len // 2
    ckpt_mb = tokens * SHAPE["dim"] * 4 / 2**20  # one layer's checkpoint per rank, float32
    rows = []
    for name in names:
        peak = max(per_rank[r][name]["peak_mb"] for r in per_rank)
        pred = predicted(args.seq_len, args.layers, name, args.loss_chunk)
        row = {"levers": name, "label": LABELS[name], "settings": dict(zip(
            ("activation_checkpointing", "loss_chunk", "tiled_mlp", "offload_activations"),
            _levers(name, args.loss_chunk), strict=True)), "peak_mb": peak,
            "peak_mb_per_rank": [per_rank[r][name]["peak_mb"] for r in sorted(per_rank)],
            "seconds": per_rank[0][name]["seconds"], "predicted_mb": pred["step"],
            "predicted_by_kind_mb": pred, "planner_error": (pred["step"] - peak) / peak,
            "checkpoints_mb": args.layers * ckpt_mb}  # fmt: skip
        row["vs_checkpoints"] = peak / row["checkpoints_mb"]
        if LEVERS[name][0]:  # checkpointed: one block's working set, whatever the depth
            work = peak - args.layers * ckpt_mb
            row["extrapolated_30_layers_vs_checkpoints"] = (
                SMOLLM2_LAYERS * ckpt_mb + work) / (SMOLLM2_LAYERS * ckpt_mb)  # fmt: skip
        if args.breakdown:  # the largest rank's
            top = max(per_rank, key=lambda r: per_rank[r][name]["peak_mb"])
            row["peak_at"] = per_rank[top][name]["peak_at"]
            row["alive_at_peak"] = per_rank[top][name]["alive_at_peak"]
        rows.append(row)
    chunk = "auto" if args.loss_chunk < 0 else args.loss_chunk
    print(f"\nS = {args.seq_len}, W = 2, {args.layers} layers of SmolLM2-135M's shape, loss "
          f"chunk {chunk}; MiB per rank above the model states (profiler peak, largest "
          f"rank)")  # fmt: skip
    print(f"{'levers':<30} {'peak':>7} {'planner':>8} {'error':>6} {'x ckpts':>8} "
          f"{'x ckpts at 30 layers':>21}")  # fmt: skip
    for r in rows:
        at30 = r.get("extrapolated_30_layers_vs_checkpoints")
        print(f"{r['label']:<30} {r['peak_mb']:>7.0f} {r['predicted_mb']:>8.0f} "
              f"{r['planner_error']:>+6.0%} {r['vs_checkpoints']:>8.2f} "
              f"{f'{at30:.2f} (extrapolated)' if at30 else '-':>21}")  # fmt: skip
    for r in rows if args.breakdown else ():
        print(f"\n{r['label']}: alive at the peak ({' / '.join(r['peak_at'])}), per token in "
              f"floats of {tokens} local tokens")  # fmt: skip
        for g in r["alive_at_peak"]:
            print(f"  {g['mb']:8.1f} MiB x{g['count']:<3} {g['per_token']:>8} per token  "
                  f"{g['node'] or 'forward'} / {g['op']}")  # fmt: skip
    load = os.getloadavg()
    print(f"checkpoints alone: {args.layers} x {ckpt_mb:.1f} MiB; load average after: "
          f"{load[0]:.1f}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "seq_len": args.seq_len, "world_size": 2, "layers": args.layers, "shape": SHAPE,
        "loss_chunk": args.loss_chunk,
        "method": "profiler peak of tensor bytes over one forward + backward (the raw "
                  "allocation and free events in time order), above the parameters and "
                  "preallocated gradients (bench.common.PeakMemory), largest rank",
        "rows": rows, "load_after": load})  # fmt: skip


def speed_table(args: argparse.Namespace, argv: list[str] | None) -> None:
    from ringattn.runtime.launch import launch

    load_before = os.getloadavg()
    # stall_s: on a loaded machine a rank's heartbeat thread can starve for seconds
    out = launch(rank_speed, 2, args.seq_len, args.layers, args.tile, args.pairs, stall_s=600)[0]
    untiled, tiled = statistics.median(out["untiled_s"]), statistics.median(out["tiled_s"])
    ratios = [t / u for t, u in zip(out["tiled_s"], out["untiled_s"], strict=True)]
    print(f"\nS = {args.seq_len}, W = 2, {args.layers} layers, checkpointing + chunked loss; "
          f"{args.pairs} interleaved pairs after a warm-up pair")  # fmt: skip
    print(f"{'':<16} {'median s':>9} {'steps s':>30}")
    print(f"{'untiled':<16} {untiled:>9.2f} {' '.join(f'{s:.2f}' for s in out['untiled_s']):>30}")
    print(f"{f'tiled {args.tile}':<16} {tiled:>9.2f} "
          f"{' '.join(f'{s:.2f}' for s in out['tiled_s']):>30}")  # fmt: skip
    load = os.getloadavg()
    print(f"tiled / untiled: {tiled / untiled:.3f} (medians); pairwise "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; load before {load_before[0]:.1f}, "
          f"after {load[0]:.1f}")  # fmt: skip
    record.write(args.json, __file__, argv, {
        "seq_len": args.seq_len, "world_size": 2, "layers": args.layers, "tile": args.tile,
        "shape": SHAPE, "steps": out, "ratio_of_medians": tiled / untiled,
        "pairwise_ratios": ratios, "load_before": load_before, "load_after": load})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384, help="global tokens")
    p.add_argument("--layers", type=int, default=2, help="blocks of the SmolLM2-135M shape")
    p.add_argument("--levers", default="none,whole,ckpt,tiled,offload",
                   help=f"comma-separated lever sets: {', '.join(LEVERS)}")  # fmt: skip
    p.add_argument("--loss-chunk", type=int, default=-1,
                   help="rows per chunk of the chunked loss (-1: the trainer's auto)")  # fmt: skip
    p.add_argument("--speed", action="store_true", help="time tiled vs untiled, interleaved")
    p.add_argument("--tile", type=int, default=1024, help="--speed: tokens per MLP tile")
    p.add_argument("--pairs", type=int, default=3, help="--speed: timed pairs after a warm-up")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="memory: list what is alive at each peak, by op (bench/breakdown.py)",
    )
    p.add_argument("--json", default=None, help="default: results/long_seq_memory_cpu.json, "
                   "with --speed results/long_seq_speed_cpu.json")  # fmt: skip
    p.add_argument("--repredict", default=None, metavar="JSON",
                   help="recompute the planner's columns of a memory result, and exit")  # fmt: skip
    args = p.parse_args(argv)
    if args.json is None:
        args.json = f"results/long_seq_{'speed' if args.speed else 'memory'}_cpu.json"
    if args.repredict:
        repredict(args.repredict)
        return 0
    (speed_table if args.speed else memory_table)(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
