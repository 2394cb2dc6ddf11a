"""`ringattn plan`: predict memory and step time of (dp, cp, tp, pp, strategy, layout) plans for a
model on a hardware, and recommend the fastest that fits. Degrees, strategy and layout left out
are searched. `--hardware cpu` is this machine as `--calibrate` measured it; `--gpus` is then the
number of local processes. The cost model is in ringattn/planner/ (see docs/plan.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ringattn.planner.calibrate import (
    DEFAULT_PATH,
    calibrate,
    is_calibration_file,
    load_calibration,
)
from ringattn.planner.dynamic_cp.lengths import parse_lengths
from ringattn.planner.dynamic_cp.predict import dynamic_table, fixed_costs, predict_dynamic
from ringattn.planner.hardware import get_hardware
from ringattn.planner.max_seq.report import (
    add_max_seq_arguments,
    apply_levers,
    prepare,
    run_max_seq,
)
from ringattn.planner.models import get_model
from ringattn.planner.search import (
    PLAN_MARGIN,
    Job,
    describe_order,
    explain,
    rank_key,
    search,
    tie_groups,
)

__all__ = ["add_parser", "run_plan"]

from ringattn.planner.kernels import KERNEL_NAMES
from ringattn.planner.schedule import PP_SCHEDULES
from ringattn.planner.work import MIXER_CHOICES

_STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
_LAYOUTS = ("zigzag", "striped", "contiguous")


def _tflops_pair(text: str | None) -> tuple[float, float] | None:
    """--attention-tflops FWD[,BWD] (BWD defaults to FWD)."""
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) <= 0:
        raise ValueError(f"--attention-tflops takes FWD or FWD,BWD (positive TFLOP/s), got "
                         f"{text!r}")  # fmt: skip
    return values[0], values[-1]


def add_parser(sub) -> None:
    """The `plan` subcommand on the subparsers `sub`; sets `run` to run_plan."""

    p = sub.add_parser(
        "plan",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="predict memory and step time of parallel plans and recommend one",
        description="Price every (dp, cp, tp, pp, strategy, layout) plan of a training job "
        "(or the ones fixed by flags) with an analytic cost model: compute, the communication "
        "that does not hide behind it, pipeline bubble, and memory per GPU by kind. Prints a "
        'table, fastest first, or with --json one object {"plans": [...]}. Only plans that '
        "fit in memory are listed, unless none does.",
    )
    p.add_argument("--model", help="llama2-7b, llama3-8b, llama3-70b, llama3-405b, the trainer's "
                   "tiny/small/base/large, or the path of a Hugging Face config.json")  # fmt: skip
    p.add_argument("--hardware", help="h100, h800, h200, a100, b200, or cpu (this machine, "
                   "as measured by --calibrate)")  # fmt: skip
    p.add_argument("--gpus", type=int, help="devices in the job (cpu: local processes)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per dp group per step")
    for name in ("dp", "cp", "tp", "pp"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"{name} degree (default: search)")
    p.add_argument("--ep", type=int, default=1, help="MoE configs: expert-parallel degree, a "
                   "multiple of cp dividing dp x cp (the trainer's --ep)")  # fmt: skip
    p.add_argument("--strategy", choices=_STRATEGIES, default=None, help="default: search")
    p.add_argument("--mixer-scheme", choices=MIXER_CHOICES, default="auto",
                   help="hybrid models: how the recurrent mixer layers run under CP: auto (what "
                   "the library runs: state where it has a program, else heads where it can, "
                   "else whole), state / state_passing (each rank its own tokens, fixed-size "
                   "state summaries all-gathered), heads (1/cp of the key heads per rank on the "
                   "whole sequence, outputs summed; cp must divide the key heads) or whole / "
                   "gather (all-gather the layer input, run it whole on every rank); passed on "
                   "to the train command")  # fmt: skip
    p.add_argument("--layout", choices=_LAYOUTS, default=None, help="default: search")
    p.add_argument("--dtype", choices=("bf16", "fp8", "fp32", "tf32"), default=None,
                   help="matmul precision (fp8: attention stays bf16 unless --fp8-attention; "
                   "fp32: torch's default, TF32 off; tf32: TF32 on); default bf16, fp32 on cpu "
                   "(what the trainer runs there)")  # fmt: skip
    p.add_argument("--attention-kernel", choices=KERNEL_NAMES, default=None,
                   help="GPU attention kernel whose published rates price attention; default: "
                   "what backend auto picks (cudnn; efficient for fp32/tf32)")  # fmt: skip
    p.add_argument(
        "--attention-tflops",
        default=None,
        metavar="FWD[,BWD]",
        help="override the kernel's long-block forward (and backward) TFLOP/s",
    )
    p.add_argument(
        "--fp8-attention",
        action="store_true",
        help="with --dtype fp8: fp8 forward attention (flash3, cudnn)",
    )
    p.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="gpipe",
                   help="pipeline schedule (the trainer's default: gpipe; interleaved is "
                   "priced but not run by ringattn train)")  # fmt: skip
    p.add_argument("--microbatches", type=int, default=1,
                   help="pp > 1: microbatches per step, a divisor of --batch-size (the "
                   "trainer's default: 1)")  # fmt: skip
    p.add_argument(
        "--virtual-stages", type=int, default=1, help="interleaved: model chunks per pipeline rank"
    )
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward")  # fmt: skip
    add_max_seq_arguments(p)  # --max-seq and the memory levers (planner/max_seq/report.py)
    p.add_argument("--json", action="store_true", help='print one JSON object {"plans": [...]}')
    p.add_argument("--tflops", type=float, default=None, help="override peak bf16 TFLOP/s")
    p.add_argument("--intra-bw", type=float, default=None, help="override NVLink GB/s")
    p.add_argument("--inter-bw", type=float, default=None, help="override inter-node GB/s per "
                   "GPU (cpu: hosts of --gpus-per-node processes joined by one link of this many "
                   "GB/s, which they share)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="override GPUs per node (cpu: processes per host)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="measure this CPU (kernels by size, gloo, the trainer's step floor) and "
                   "cache it for --hardware cpu (which measures once by itself when the cache "
                   "is missing or from another machine); alone, only calibrates")  # fmt: skip
    p.add_argument("--calibration", default=DEFAULT_PATH, metavar="PATH",
                   help="the calibration cache file")  # fmt: skip
    p.add_argument("--top", type=int, default=12, help="rows of the table (not --json)")
    p.add_argument("--lengths", default=None, metavar="SPEC",
                   help="price dynamic CP (train --dynamic-cp) against static CP for documents "
                   "of these lengths, packed into --seq-len windows as train's docs: data: "
                   "lognormal:MEAN,SIGMA,MIN,MAX or a file (one length per line, or a JSON "
                   "list); at the best ring plan's dp x cp (tp and pp 1)")  # fmt: skip
    p.add_argument("--lengths-steps", type=int, default=8, help="--lengths: steps drawn")
    p.add_argument("--lengths-seed", type=int, default=0,
                   help="--lengths: the seed of the windows (train's --seed)")  # fmt: skip
    p.add_argument("--ring-step-s", type=float, default=None,
                   help="--lengths: fixed seconds of one ring step per layer and direction "
                   "(default: measured on cpu, launches + link latency on GPUs)")  # fmt: skip
    p.add_argument("--piece-s", type=float, default=None,
                   help="--lengths: fixed seconds of one attention call per layer and "
                   "direction (default: as --ring-step-s)")  # fmt: skip
    p.add_argument("--call-s", type=float, default=None,
                   help="--lengths: fixed seconds of one kernel call (a tile or an exact block) "
                   "per direction (default: as --ring-step-s)")  # fmt: skip
    p.set_defaults(run=run_plan)


def _job(args: argparse.Namespace, calibration: dict | None):
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "hardware", "gpus", "seq_len")
               if getattr(args, k) is None]  # fmt: skip
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or run --calibrate alone)")
    if args.hardware == "cpu" and calibration is None:
        path = args.calibration
        if os.path.exists(path) and not is_calibration_file(path):
            raise ValueError(f"--calibration {path} exists and is not a calibration file; "
                             "give a new path (it will be measured and written there)")  # fmt: skip
        try:
            calibration = load_calibration(path)
        except ValueError as why:  # none yet, or another machine's: measure this one (~2 min)
            print(f"[plan] {why}; calibrating now", file=sys.stderr)
            calibration = calibrate(args.calibration, log=lambda t: print(t, file=sys.stderr))
    hw = get_hardware(args.hardware, tflops=args.tflops, intra_bw=args.intra_bw,
                      inter_bw=args.inter_bw, gpus_per_node=args.gpus_per_node,
                      calibration=calibration if args.hardware == "cpu" else None)  # fmt: skip
    dtype = args.dtype or ("fp32" if hw.is_cpu else "bf16")
    return Job(get_model(args.model), hw, args.gpus, args.seq_len, args.batch_size, args.dp,
               args.cp, args.tp, args.pp, args.strategy, args.layout, dtype,
               args.activation_checkpointing, kernel=args.attention_kernel,
               pp_schedule=args.pp_schedule, microbatches=args.microbatches,
               virtual_stages=args.virtual_stages, fp8_attention=args.fp8_attention,
               attention_tflops=_tflops_pair(args.attention_tflops), ep=args.ep,
               mixer_scheme=args.mixer_scheme)  # fmt: skip


def _table(plans: list[dict], top: int) -> str:
    head = (f"{'dp':>4} {'cp':>4} {'tp':>3} {'pp':>3} {'strategy':<10} {'layout':<11} "
            f"{'step s':>9} {'tok/s/gpu':>10} {'GiB/gpu':>8} {'fits':>4} {'exposed':>8} "
            f"{'bubble':>7} {'MFU':>5}")  # fmt: skip
    if plans and plans[0]["breakdown"]["mixer"]:
        head += f" {'mixer':<13} {'mix t':>7} {'mix mem':>7} {'mix B':>7}"
    lines = [head]
    for p in plans[:top]:
        b = p["breakdown"]
        strategy = p["strategy"] + (f" U{p['ulysses']}" if p["ulysses"] else "")
        lines.append(
            f"{p['dp']:>4} {p['cp']:>4} {p['tp']:>3} {p['pp']:>3} {strategy:<10} "
            f"{p['layout']:<11} {p['step_time_s']:>9.4g} {p['tokens_per_s_per_gpu']:>10.4g} "
            f"{p['memory_gib_per_gpu']:>8.3g} {'yes' if p['fits'] else 'NO':>4} "
            f"{b['exposed_comm_s'] / p['step_time_s']:>8.1%} "
            f"{b['pipeline_bubble_s'] / p['step_time_s']:>7.1%} "
            f"{p['mfu'] if p['mfu'] is not None else float('nan'):>5.0%}"
        )
        if b["mixer"]:  # hybrids: the mixer layers' shares
            x = b["mixer"]
            lines[-1] += (f" {x['scheme']:<13} {x['time_share']:>7.1%} "
                          f"{x['memory_share']:>7.1%} {x['traffic_share']:>7.1%}")  # fmt: skip
    if len(plans) > top:
        lines.append(f"... {len(plans) - top} more (--top N, or --json for all)")
    return "\n".join(lines)


def _label(plan: dict) -> str:
    """A plan's short name: its degrees above 1, strategy and layout."""
    degrees = [f"{k}{plan[k]}" for k in ("dp", "cp", "tp", "pp") if plan[k] > 1]
    strategy = plan["strategy"] + (f" U{plan['ulysses']}" if plan["ulysses"] else "")
    return " ".join([*degrees, f"{strategy}/{plan['layout']}"])


def ranking(plans: list[dict]) -> list[list[str]]:
    """The plans' labels in tie groups, fastest first: plans whose seconds per token per GPU
    are within the planner's error margin (search.PLAN_MARGIN) of each other tie."""
    return tie_groups({_label(p): 1 / p["tokens_per_s_per_gpu"] for p in plans})


def run_plan(args: argparse.Namespace) -> int:

    calibration = None
    if args.calibrate:
        log = (lambda text: print(text, file=sys.stderr)) if args.json else print
        calibration = calibrate(args.calibration, log=log)
        if args.model is None and args.hardware is None:
            return 0
    source = None
    if args.lengths is not None:  # every input checked before anything is priced or measured
        source = parse_lengths(args.lengths, args.seq_len or 0, args.lengths_seed)
        if args.lengths_steps < 1:
            raise ValueError(f"--lengths-steps must be >= 1, got {args.lengths_steps}")
        for name in ("tp", "pp"):
            if getattr(args, name) not in (None, 1):
                raise ValueError(f"--lengths prices dynamic CP, which runs without --{name}; "
                                 f"give --{name} 1 or leave it out")  # fmt: skip
            setattr(args, name, 1)
        if args.strategy not in (None, "ring"):  # the pieces are priced as rings (pieces.py)
            raise ValueError(f"--lengths prices dynamic CP's pieces as rings; --strategy "
                             f"{args.strategy} is not priced: give --strategy ring or leave it "
                             "out")  # fmt: skip
        args.strategy = "ring"
    prepare(args)
    job = apply_levers(_job(args, calibration), args)
    if args.max_seq:
        return run_max_seq(args, job)
    plans = search(job)
    fitting = [p for p in plans if p["fits"]]
    shown = sorted(fitting or plans, key=rank_key)
    dynamic = None
    if source is not None:
        given = {"ring_step_s": args.ring_step_s, "piece_s": args.piece_s, "call_s": args.call_s}
        fixed = fixed_costs(job.hw, shown[0]["dp"] * shown[0]["cp"], given,
                            args.calibration if job.hw.is_cpu else None)  # fmt: skip
        dynamic = predict_dynamic(job.model, job.hw, shown[0], source, job.seq_len,
                                  job.batch_size, job.dtype, fixed, args.lengths_steps)  # fmt: skip
        dynamic["lengths"] = args.lengths
    if args.json:
        out = {"plans": shown, "ranking": ranking(shown), "margin": PLAN_MARGIN}
        if dynamic is not None:
            out["dynamic_cp"] = dynamic
        print(json.dumps(out))
        return 0
    ac = ", activation checkpointing" if job.activation_checkpointing else ""
    kernel = "" if job.hw.is_cpu else f", attention {shown[0]['attention_kernel']}"
    pipe = f", pp schedule {job.pp_schedule} x {job.microbatches} microbatches"
    pipe += f", experts over ep {job.ep}" if job.ep > 1 else ""
    m = job.model
    if m.mixer_layers:
        pipe += (f", {m.mixer_layers} of {m.n_layers} layers {m.mixer.kind} (mixer scheme "
                 f"{job.mixer_scheme}; mixer: the scheme priced; mix: their share of time, "
                 f"memory, CP bytes)")  # fmt: skip
    print(f"{job.model.name} on {args.gpus} x {job.hw.name}, {job.seq_len} tokens x batch "
          f"{job.batch_size}, {job.dtype}{ac}{kernel}{pipe}: {len(plans)} plans, "
          f"{len(fitting)} fit")  # fmt: skip
    print(_table(shown, args.top))
    print(f"ranking (plans within the planner's {PLAN_MARGIN:.0%} error margin tie): "
          f"{describe_order(ranking(shown[: args.top]))}")  # fmt: skip
    print(explain(plans))
    best = shown[0]
    print(f"run it: {best['train_command']}")
    if best["train_note"]:
        print(f"  (not run by the trainer: {best['train_note']})")
    if dynamic is not None:
        print(dynamic_table(dynamic, args.lengths))
    return 0
