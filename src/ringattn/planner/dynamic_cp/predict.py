"""`ringattn plan --lengths`: static and dynamic CP step times for a distribution of lengths.

For steps 0 .. N-1 of a plan's dp x cp (the windows of lengths.py, as train reads them):

    schedule   schedule.py, the trainer's own: static_schedule (every document
               on its dp row's whole cp group) and plan_step (--dynamic-cp), the latter with
               the trainer's DocumentCost, so the groups are the ones `train` would pick
    price      every piece (the documents of one group) on each of its ranks, with the work
               the ring really runs (pieces.py): the rows' linear layers at the plan's
               rate, each ring step's kernel calls at the hardware's attention rate, the hops
               that do not hide behind them, and the fixed terms below
    step       the busiest rank's seconds + what neither arm changes (FSDP's exposed traffic,
               the optimizer, the trainer's per-step floor: the plan's own figures)

Fixed terms, per layer and direction: `piece_s` per attention call, `call_s` per kernel call
(a masked tile or an exact block), `ring_step_s` per ring step (send, receive, merge, the wait
for the peer). They decide small models on CPUs: static CP cuts every document over all cp
ranks (the layouts place each document on every rank), so each of a window's documents costs
kernel calls at every one of the cp ring steps, and a 4-process ring on 2 cores waits for its
peers at each step; documents alone on a rank cost one call each. At scale the traffic and the
imbalance of quadratic work decide. On `--hardware cpu` the three are measured with the job's
process count (ringstep.py, cached in the calibration file); on GPUs a kernel launch
per call and a launch plus the link's latency per ring step. `--ring-step-s`, `--piece-s` and
`--call-s` override them.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass

from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.dynamic_cp.documents import DocumentTask
from ringattn.planner.dynamic_cp.lengths import FileLengths, window_lengths
from ringattn.planner.dynamic_cp.pieces import PieceCosts, piece_seconds
from ringattn.planner.dynamic_cp.ringstep import measure_ring_step
from ringattn.planner.dynamic_cp.schedule import Schedule, plan_step, static_schedule
from ringattn.planner.hardware import Hardware
from ringattn.planner.models import ModelSpec

__all__ = ["FixedCosts", "dynamic_table", "fixed_costs", "piece_costs", "predict_dynamic"]

LAUNCH_S = 5e-6
"""One GPU kernel launch."""


@dataclass(frozen=True)
class FixedCosts:
    ring_step_s: float
    """Fixed seconds of one ring step of one layer, one direction."""
    piece_s: float
    """Fixed seconds of one attention call of one layer, one direction."""
    call_s: float
    """Fixed seconds of one kernel call (a tile or an exact block), one direction."""
    source: str
    """Where the figures come from: measured, preset or given."""


def fixed_costs(
    hw: Hardware,
    nproc: int,
    given: dict[str, float | None] | None = None,
    calibration_path: str | None = None,
) -> FixedCosts:
    """The fixed terms (module docstring); `given` {"ring_step_s", "piece_s", "call_s"}: the
    user's values (None: the default); cpu: measured once per process count and cached."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    for key, value in given.items():
        if value < 0:
            raise ValueError(f"--{key[:-2].replace('_', '-')}-s must be >= 0 seconds, got {value}")
    if len(given) == 3:
        return FixedCosts(**given, source="given")
    if hw.is_cpu:
        found = hw.calibration.get("ring_step", {}).get(str(nproc))
        if found is None:  # measured once (~10 s) and kept beside the other figures
            found = measure_ring_step(max(2, nproc))
            hw.calibration.setdefault("ring_step", {})[str(nproc)] = found
            if calibration_path:
                with open(calibration_path) as f:
                    stored = json.load(f)
                stored.setdefault("ring_step", {})[str(nproc)] = found
                with open(calibration_path, "w") as f:
                    json.dump(stored, f, indent=1)
        base, source = dict(found), "measured"
    else:
        base = {"ring_step_s": LAUNCH_S + hw.intra_latency_s, "piece_s": 4 * LAUNCH_S,
                "call_s": LAUNCH_S}  # fmt: skip
        source = "preset"
    return FixedCosts(**{**base, **given}, source=source if not given else source + " and given")


def piece_costs(model: ModelSpec, hw: Hardware, plan: dict, dtype: str, fixed: FixedCosts,
                seq_len: int, batch_size: int) -> PieceCosts:  # fmt: skip
    """The rates of pieces.py from `plan` (a plan of planner/search.py) and `fixed`."""
    b = plan["breakdown"]
    tokens = seq_len * batch_size // plan["cp"]  # rows of one rank in the static plan
    linear = (b["compute_s"] - b["attention_s"]) / tokens
    link = hw.calibration["gloo"]["bandwidth_gbs"] if hw.is_cpu else hw.intra_bw_gbs
    nproc = plan["dp"] * plan["cp"]
    hosts = nproc > hw.gpus_per_node and hw.inter_bw_gbs > 0
    return PieceCosts(model, hw, nproc, plan["layout"], dtype, plan["attention_kernel"] or "",
                      linear, link * 1e9, hw.inter_bw_gbs * 1e9 if hosts else 0.0,
                      hw.gpus_per_node if hosts else 0, fixed.ring_step_s, fixed.piece_s,
                      fixed.call_s)  # fmt: skip


def _busiest(s: Schedule, lengths: list[int], costs: PieceCosts) -> float:
    """The busiest rank's seconds under schedule `s`: the pieces of every group it is in."""
    busy = [0.0] * (s.dp * s.cp)
    groups: dict[tuple[int, int, int], list[int]] = {}
    for n, g, d, j in zip(lengths, s.sizes, s.rows, s.blocks):
        groups.setdefault((d, g, j), []).append(n)  # step order, as the loader packs them
    for (d, g, j), docs in groups.items():
        for i, t in enumerate(piece_seconds(costs, docs, g)):
            busy[d * s.cp + j * g + i] += t
    return max(busy)


def predict_dynamic(
    model: ModelSpec,
    hw: Hardware,
    plan: dict,
    source: DocumentTask | FileLengths,
    seq_len: int,
    batch_size: int,
    dtype: str,
    fixed: FixedCosts,
    steps: int = 8,
) -> dict:
    """Static and dynamic CP seconds per step for `steps` steps of `source`'s windows at
    `plan`'s dp x cp (a plan of planner/search.py: its compute seconds give the linear rate, its
    non-compute seconds the shared part); the JSON of `plan --lengths` (docs/plan.md)."""
    dp, cp = plan["dp"], plan["cp"]
    if plan["tp"] != 1 or plan["pp"] != 1 or cp & (cp - 1):
        raise ValueError(f"--lengths prices dynamic CP, which runs tp 1, pp 1 and cp a power of "
                         f"two; the plan has tp {plan['tp']}, pp {plan['pp']}, cp {cp}: give "
                         "--tp 1 --pp 1 and --cp 1, 2, 4, ...")  # fmt: skip
    if steps < 1:
        raise ValueError(f"--lengths-steps must be >= 1, got {steps}")
    trainer_cost = DocumentCost(model, elem_bytes=4 if dtype in ("fp32", "tf32") else 2)
    costs = piece_costs(model, hw, plan, dtype, fixed, seq_len, batch_size)
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
        per_step.append({"static_s": _busiest(static, lengths, costs) + shared,
                         "dynamic_s": _busiest(dynamic, lengths, costs) + shared,
                         "cp_groups": dynamic.histogram,
                         "imbalance": dynamic.imbalance})  # fmt: skip
    static_s = statistics.fmean(s["static_s"] for s in per_step)
    dynamic_s = statistics.fmean(s["dynamic_s"] for s in per_step)
    imbalance = [s["imbalance"] for s in per_step]
    return {"dp": dp, "cp": cp, "steps": steps, "documents": documents,
            "mean_length": steps * dp * batch_size * seq_len / documents,
            "static_step_s": static_s, "dynamic_step_s": dynamic_s,
            "speedup": static_s / dynamic_s,
            "cp_groups": {str(g): histogram[g] for g in sorted(histogram)},
            "imbalance": {"mean": statistics.fmean(imbalance), "max": max(imbalance)},
            "terms": {"linear_s_per_token": costs.linear_s_per_token,
                      "link_bytes_per_s": costs.link_bytes_per_s,
                      "inter_bytes_per_s": costs.inter_bytes_per_s,
                      "ring_step_s": fixed.ring_step_s, "piece_s": fixed.piece_s,
                      "call_s": fixed.call_s, "fixed_source": fixed.source,
                      "shared_s": shared},
            "per_step": per_step}  # fmt: skip


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
            f"fixed terms ({t['fixed_source']}, per layer and direction): "
            f"{t['ring_step_s'] * 1e3:.3g} ms per ring step, {t['call_s'] * 1e3:.3g} ms per "
            f"kernel call, {t['piece_s'] * 1e3:.3g} ms per attention call; shared per step "
            f"{t['shared_s'] * 1e3:.3g} ms"
        ),
    ]
    return "\n".join(lines)
