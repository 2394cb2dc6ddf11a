"""`ringattn plan --lengths`: static and dynamic CP step times for a distribution of lengths.

For steps 0 .. N-1 of a plan's dp x cp (the windows of planner/lengths.py, as train reads them):

    schedule   train/dynamic/schedule.py, the trainer's own: static_schedule (every document
               on its dp row's whole cp group) and plan_step (--dynamic-cp), the latter with
               the trainer's DocumentCost, so the groups are the ones `train` would pick
    price      each rank's documents with the planner's figures for this model and hardware:
                 compute   the document's training flops / g at the plan's rate (the static
                           plan's model flops per rank / its compute seconds: matmuls,
                           attention, elementwise and the CPU's sharing of cores, as priced)
                 traffic   g > 1: the ring's K/V and dK/dV bytes at the link's rate (the
                           inter-host link for a group wider than a host)
                 fixed     per piece (the documents of one group on a rank) and layer, in each
                           direction: g ring steps of `ring_step_s` each (kernel call, merge,
                           send and the wait for the peer), or one local call, `piece_s`
    step       the busiest rank's priced seconds + what neither arm changes (FSDP's exposed
               traffic, the optimizer, the trainer's per-step floor: the plan's own figures)

The fixed terms decide small models on CPUs: a 4-process ring on 2 cores waits for its peers at
every step; at scale the traffic and the imbalance of quadratic work decide. `ring_step_s` and
`piece_s` on `--hardware cpu` are measured with the job's process count (planner/ringstep.py,
cached in the calibration file); on GPUs two kernel launches plus the link's latency per ring
step and one launch per piece. `--ring-step-s` and `--piece-s` override both.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass

from ringattn.planner.flops import train_step_flops
from ringattn.planner.hardware import Hardware
from ringattn.planner.lengths import window_lengths
from ringattn.planner.models import ModelSpec
from ringattn.planner.ringstep import measure_ring_step
from ringattn.train.dynamic.cost import DocumentCost
from ringattn.train.dynamic.schedule import Schedule, plan_step, static_schedule

__all__ = ["FixedCosts", "dynamic_table", "fixed_costs", "predict_dynamic"]

LAUNCH_S = 5e-6
"""One GPU kernel launch (a ring step launches the attention kernel and the merge)."""


@dataclass(frozen=True)
class FixedCosts:
    ring_step_s: float
    """Fixed seconds of one ring step of one layer, one direction."""
    piece_s: float
    """Fixed seconds of one local (group of one) attention call of one layer, one direction."""
    source: str
    """Where the figures come from: measured, preset or given."""


def fixed_costs(
    hw: Hardware,
    nproc: int,
    ring_step_s: float | None = None,
    piece_s: float | None = None,
    calibration_path: str | None = None,
) -> FixedCosts:
    """The fixed terms (module docstring); cpu: measured once per process count and cached."""
    for flag, value in (("--ring-step-s", ring_step_s), ("--piece-s", piece_s)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
    if ring_step_s is not None and piece_s is not None:
        return FixedCosts(ring_step_s, piece_s, "given")
    if hw.is_cpu:
        cached = hw.calibration.get("ring_step", {}).get(str(nproc))
        if cached is None:  # measured once (~10 s) and kept beside the other figures
            cached = measure_ring_step(max(2, nproc))
            hw.calibration.setdefault("ring_step", {})[str(nproc)] = cached
            if calibration_path:
                with open(calibration_path) as f:
                    stored = json.load(f)
                stored.setdefault("ring_step", {})[str(nproc)] = cached
                with open(calibration_path, "w") as f:
                    json.dump(stored, f, indent=1)
        ring, piece, source = cached["ring_step_s"], cached["piece_s"], "measured"
    else:
        ring, piece, source = 2 * LAUNCH_S + hw.intra_latency_s, LAUNCH_S, "preset"
    return FixedCosts(
        ring if ring_step_s is None else ring_step_s, piece if piece_s is None else piece_s, source
    )


def _priced(
    model: ModelSpec, hw: Hardware, plan: dict, seq_len: int, batch_size: int, elem_bytes: int
) -> DocumentCost:
    """The planner's per-rank price of a document (compute and traffic; latency is in the
    fixed terms)."""
    flops = train_step_flops(model, seq_len, batch_size) / plan["cp"]
    rate = flops / plan["breakdown"]["compute_s"]
    if hw.is_cpu:
        link = hw.calibration["gloo"]["bandwidth_gbs"] * 1e9
    else:
        link = hw.intra_bw_gbs * 1e9
    hosts = plan["dp"] * plan["cp"] > hw.gpus_per_node and hw.inter_bw_gbs > 0
    return DocumentCost(
        model,
        flops_per_s=rate,
        link_bytes_per_s=link,
        hop_latency_s=0.0,
        elem_bytes=elem_bytes,
        ranks_per_host=hw.gpus_per_node if hosts else 0,
        inter_bytes_per_s=hw.inter_bw_gbs * 1e9 if hosts else 0.0,
    )


def _rank_seconds(
    s: Schedule, lengths: list[int], price: DocumentCost, fixed: FixedCosts
) -> list[float]:
    """Each rank's priced seconds under schedule `s`: its documents plus its pieces' fixed terms."""
    busy = [0.0] * (s.dp * s.cp)
    pieces = set()
    for n, g, d, j in zip(lengths, s.sizes, s.rows, s.blocks):
        for r in range(d * s.cp + j * g, d * s.cp + j * g + g):
            busy[r] += price(n, g)
            pieces.add((r, g))
    layers = price.model.attention_layers
    for r, g in pieces:
        busy[r] += layers * (2 * g * fixed.ring_step_s if g > 1 else 2 * fixed.piece_s)
    return busy


def predict_dynamic(
    model: ModelSpec,
    hw: Hardware,
    plan: dict,
    source,
    seq_len: int,
    batch_size: int,
    dtype: str,
    fixed: FixedCosts,
    steps: int = 8,
) -> dict:
    """Static and dynamic CP seconds per step for `steps` steps of `source`'s windows at
    `plan`'s dp x cp (a plan of planner/search.py: its compute seconds give the rate, its
    non-attention seconds the shared part); the JSON of `plan --lengths` (docs/plan.md)."""
    dp, cp = plan["dp"], plan["cp"]
    if plan["tp"] != 1 or plan["pp"] != 1 or cp & (cp - 1):
        raise ValueError(
            f"--lengths prices dynamic CP, which runs tp 1, pp 1 and cp a power of "
            f"two; the plan has tp {plan['tp']}, pp {plan['pp']}, cp {cp}: give "
            "--tp 1 --pp 1 and --cp 1, 2, 4, ..."
        )
    if steps < 1:
        raise ValueError(f"--lengths-steps must be >= 1, got {steps}")
    elem = 4 if dtype in ("fp32", "tf32") else 2
    trainer_cost = DocumentCost(model, elem_bytes=elem)  # what `train --dynamic-cp` schedules by
    price = _priced(model, hw, plan, seq_len, batch_size, elem)
    b = plan["breakdown"]
    shared = plan["step_time_s"] - b["compute_s"] - b["exposed_cp_comm_s"]
    budget = batch_size * seq_len // cp
    per_step, histogram, documents = [], Counter(), 0
    for step in range(steps):
        lengths, window = window_lengths(source, step, dp * batch_size)
        rows = [w // batch_size for w in window]
        static = static_schedule(lengths, rows, dp, cp, trainer_cost)
        dynamic = plan_step(lengths, dp, cp, budget, trainer_cost)
        histogram.update({int(k): v for k, v in dynamic.histogram.items()})
        documents += len(lengths)
        per_step.append(
            {
                "static_s": max(_rank_seconds(static, lengths, price, fixed)) + shared,
                "dynamic_s": max(_rank_seconds(dynamic, lengths, price, fixed)) + shared,
                "cp_groups": dynamic.histogram,
                "imbalance": dynamic.imbalance,
            }
        )
    static_s = statistics.fmean(s["static_s"] for s in per_step)
    dynamic_s = statistics.fmean(s["dynamic_s"] for s in per_step)
    imbalance = [s["imbalance"] for s in per_step]
    return {
        "dp": dp,
        "cp": cp,
        "steps": steps,
        "documents": documents,
        "mean_length": steps * dp * batch_size * seq_len / documents,
        "static_step_s": static_s,
        "dynamic_step_s": dynamic_s,
        "speedup": static_s / dynamic_s,
        "cp_groups": {str(g): histogram[g] for g in sorted(histogram)},
        "imbalance": {"mean": statistics.fmean(imbalance), "max": max(imbalance)},
        "terms": {
            "flops_per_s": price.flops_per_s,
            "link_bytes_per_s": price.link_bytes_per_s,
            "inter_bytes_per_s": price.inter_bytes_per_s,
            "ring_step_s": fixed.ring_step_s,
            "piece_s": fixed.piece_s,
            "fixed_source": fixed.source,
            "shared_s": shared,
        },
        "per_step": per_step,
    }


def dynamic_table(result: dict, spec: str) -> str:
    """The text `plan --lengths` prints."""
    t = result["terms"]
    groups = ", ".join(f"{g}: {n}" for g, n in result["cp_groups"].items())
    lines = [
        (
            f"dynamic CP for --lengths {spec} at dp {result['dp']} x cp {result['cp']}: "
            f"{result['steps']} steps, {result['documents']} documents (mean "
            f"{result['mean_length']:.0f} tokens)"
        ),
        f"{'':>9} {'step s':>9} {'speed-up':>9}",
        f"{'static':>9} {result['static_step_s']:>9.4g} {1.0:>9.2f}",
        f"{'dynamic':>9} {result['dynamic_step_s']:>9.4g} {result['speedup']:>9.2f}",
        (
            f"documents per group size: {groups}; imbalance (max/mean planned cost) mean "
            f"{result['imbalance']['mean']:.3f}, max {result['imbalance']['max']:.3f}"
        ),
        (
            f"fixed terms ({t['fixed_source']}): {t['ring_step_s'] * 1e3:.3g} ms per ring step, "
            f"{t['piece_s'] * 1e3:.3g} ms per local piece (per layer and direction); shared per "
            f"step {t['shared_s'] * 1e3:.3g} ms"
        ),
    ]
    return "\n".join(lines)
