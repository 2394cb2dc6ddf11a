"""`ringattn plan --max-seq`'s flags and printing (cli/plan.py calls them; the search is search.py).

    ringattn plan --model llama3-8b --hardware h100 --gpus 8 --max-seq \\
        --activation-checkpointing --tiled-mlp --offload-activations [--json]

The flags added to `plan` here: --max-seq, --tiled-mlp [TOKENS], --offload-activations,
--offload-states (the last three price the levers in every plan). `--json` gives one object:
{"max_seq": the best plan's, "plans": [... each with its "max_seq" ...], "by_technique": [...]}.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ringattn.planner.max_seq.search import by_technique, max_seq_plans
from ringattn.planner.search import Job, _candidates, check_plan

__all__ = ["add_max_seq_arguments", "apply_levers", "run_max_seq"]

AUTO_TILE = -1


def add_max_seq_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-seq", action="store_true",
                   help="instead of pricing --seq-len, find the longest sequence each plan "
                   "trains and its memory by kind (--seq-len is then not needed)")  # fmt: skip
    p.add_argument("--tiled-mlp", type=int, nargs="?", const=AUTO_TILE, default=0,
                   metavar="TOKENS", help="price the tiled MLP (the trainer's --tiled-mlp) with "
                   "tiles of TOKENS; alone: tiles of the model's hidden size")  # fmt: skip
    p.add_argument("--offload-activations", action="store_true",
                   help="price the checkpointed layer inputs in host memory (the trainer's "
                   "--offload-activations; with --activation-checkpointing): bounded by the "
                   "node's RAM and the host link's time; the benefit exists on a GPU "
                   "only")  # fmt: skip
    p.add_argument("--offload-states", action="store_true",
                   help="what-if the trainer does not run: weights and optimizer states in host "
                   "memory (DeepSpeed ZeRO-3 offload), as ALST's single-GPU runs")  # fmt: skip


def prepare(args: argparse.Namespace) -> None:
    """--max-seq searches the length: give _job a placeholder for --seq-len."""
    if args.max_seq and args.seq_len is None:
        args.seq_len = 1


def apply_levers(job: Job, args: argparse.Namespace) -> Job:
    """The Job with the memory levers of the flags (ValueError for a bad combination)."""
    tile = job.model.dim if args.tiled_mlp == AUTO_TILE else args.tiled_mlp
    if tile < 0:
        raise ValueError(f"--tiled-mlp {args.tiled_mlp}: give the tokens per tile (>= 1), or "
                         f"no value for the model's hidden size")  # fmt: skip
    if args.offload_activations and not job.activation_checkpointing:
        raise ValueError("--offload-activations moves the checkpointed layer inputs to host "
                         "memory: add --activation-checkpointing")  # fmt: skip
    return replace(job, tiled_mlp=tile, offload_activations=args.offload_activations,
                   offload_states=args.offload_states)  # fmt: skip


def _label(p: dict) -> str:
    degrees = [f"{k}{p[k]}" for k in ("dp", "cp", "tp", "pp") if p[k] > 1] or ["1 gpu"]
    strategy = p["strategy"] + (f" U{p['ulysses']}" if p["ulysses"] else "")
    return " ".join([*degrees, f"{strategy}/{p['layout']}"])


def _kinds(memory: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in memory.items() if k != "total" and v >= 0.05)


def run_max_seq(args: argparse.Namespace, job: Job) -> int:
    plans = max_seq_plans(job)
    best = plans[0]
    spec = check_plan(_spec_of(job, best))
    levers = by_technique(spec, job.tiled_mlp or job.model.dim)
    if args.json:
        print(json.dumps({"max_seq": best["max_seq"], "plans": plans, "by_technique": levers}))
        return 0
    on = [
        name
        for name, flag in (
            ("activation checkpointing", job.activation_checkpointing),
            (f"tiled MLP {job.tiled_mlp}", job.tiled_mlp),
            ("activation offload", job.offload_activations),
            ("model-state offload (what-if)", job.offload_states),
        )
        if flag
    ]
    print(f"{job.model.name} on {job.gpus} x {job.hw.name}, {job.dtype}, "
          f"{', '.join(on) or 'no memory levers'}: the longest sequence of each plan")  # fmt: skip
    print(f"{'plan':<28} {'max seq':>11} {'GiB/gpu':>8} {'host GiB':>9} {'step s':>9} "
          f"{'tok/s/gpu':>10}")  # fmt: skip
    for p in plans[: args.top]:
        print(f"{_label(p):<28} {p['max_seq']:>11,} {p['memory_gib_per_gpu']:>8.1f} "
              f"{p['host_gib_per_gpu']:>9.1f} {p['step_time_s']:>9.3g} "
              f"{p['tokens_per_s_per_gpu']:>10.4g}")  # fmt: skip
    if len(plans) > args.top:
        print(f"... {len(plans) - args.top} more (--top N, or --json for all)")
    print(f"best: {_label(best)} trains {best['max_seq']:,} tokens; memory per GPU by kind "
          f"(GiB): {_kinds(best['breakdown']['memory_gib'])}")  # fmt: skip
    print(f"what each lever buys at {_label(best)}:")
    for row in levers:
        print(
            f"  {row['technique']:<28} {row['max_seq']:>11,} tokens  "
            f"({row['memory_gib']['total']:.1f} GiB/gpu, host {row['host_gib']:.1f})"
        )
    if job.offload_activations and job.hw.is_cpu:
        print("note: on cpu the host memory is the device's: offload saves nothing there")
    return 0


def _spec_of(job: Job, plan: dict):
    for spec in _candidates(replace(job, seq_len=plan["seq_len"], dp=plan["dp"], cp=plan["cp"],
                                    tp=plan["tp"], pp=plan["pp"], strategy=plan["strategy"],
                                    layout=plan["layout"])):  # fmt: skip
        return spec
    raise AssertionError("the best plan has no spec")
