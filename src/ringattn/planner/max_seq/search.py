"""The longest sequence each plan trains: `ringattn plan --max-seq`.

For a model, a GPU type and count, every plan the search allows (degrees, strategy, layout, and
the memory levers given: activation checkpointing, tiled MLP, activation offload, the chunked
loss, the optimizer-offload what-if) is priced at growing lengths. Memory per device grows with
S/W (memory.py), so the longest length that fits is found by bisection, in steps of `unit`
tokens (a multiple of every layout's chunks). A plan fits when its device memory is within the
usable fraction of the GPU's and its host memory (offloaded tensors of all the node's GPUs)
within 90 % of the node's RAM.

`by_technique` answers "what does each lever buy": the best plan's degrees priced with the
levers added one at a time (none; the chunked loss; + checkpointing; + tiled MLP; + offload).
`PUBLISHED` holds the published longest lengths (ALST, FPDT) the planner is checked against.
The benefit of offload exists on a GPU only: on CPU, host memory is the device's.
"""

from __future__ import annotations

from dataclasses import replace

from ringattn.models.loss import auto_chunk as trainer_chunk
from ringattn.planner.cost import PlanSpec
from ringattn.planner.hardware import get_hardware
from ringattn.planner.memory import GIB, host_bytes, memory_bytes
from ringattn.planner.models import get_model
from ringattn.planner.search import Job, _candidates, check_plan, evaluate

__all__ = ["PUBLISHED", "by_technique", "check_published_max_seq", "longest", "max_seq_plans"]

HOST_USABLE = 0.9
LIMIT = 1 << 28
"""The longest length searched (268M tokens)."""


def _unit(spec: PlanSpec) -> int:
    return 2 * spec.cp * 512


def fits(spec: PlanSpec) -> bool:
    """Device memory within the usable fraction, host memory within HOST_USABLE of the node's."""
    usable = spec.hw.memory_gib * spec.hw.usable_fraction * GIB
    if spec.hw.is_cpu:
        usable /= spec.gpus
    if memory_bytes(spec)["total"] > usable:
        return False
    per_node = min(spec.gpus, spec.hw.gpus_per_node)
    return host_bytes(spec) * per_node <= HOST_USABLE * spec.hw.host_memory_gib * GIB


def longest(spec: PlanSpec, limit: int = LIMIT) -> int:
    """The longest multiple of the plan's unit that fits (0: not even one unit)."""
    unit = _unit(spec)
    lo, hi = 0, limit // unit
    while lo < hi:  # memory grows with the length: the last k that fits
        mid = (lo + hi + 1) // 2
        if fits(replace(spec, seq_len=mid * unit)):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def _priced(spec: PlanSpec, seq: int) -> dict:
    """evaluate() at `seq` (at least one unit, so a plan that fits nothing still shows why), the
    max_seq and the host memory beside it."""
    at = replace(spec, seq_len=max(seq, _unit(spec)))
    plan = evaluate(at)
    plan["max_seq"] = seq
    plan["seq_len"] = at.seq_len
    plan["host_gib_per_gpu"] = host_bytes(at) / GIB
    return plan


def max_seq_plans(job: Job, limit: int = LIMIT) -> list[dict]:
    """Every plan of `job` at its longest length, longest first (then fastest)."""
    plans = []
    for spec in _candidates(replace(job, seq_len=_unit_any(job))):
        try:
            spec = check_plan(spec)
        except ValueError:
            continue  # what the library cannot run at any length (heads, hybrid degree...)
        plans.append(_priced(spec, longest(spec, limit)))
    if not plans:
        raise ValueError(f"no plan can run {job.model.name} on {job.gpus} x {job.hw.name}")
    plans.sort(key=lambda p: (-p["max_seq"], -p["tokens_per_s_per_gpu"]))
    return plans


def _unit_any(job: Job) -> int:
    return 2 * job.gpus * 512  # divisible by every cp's chunks


LEVERS = (
    ("none", {"loss_chunk": 0, "activation_checkpointing": False, "tiled_mlp": 0,
              "offload_activations": False}),
    ("chunked loss", {"activation_checkpointing": False, "tiled_mlp": 0,
                      "offload_activations": False}),
    ("+ activation checkpointing", {"tiled_mlp": 0, "offload_activations": False}),
    ("+ tiled MLP", {"offload_activations": False}),
    ("+ activation offload", {}),
)  # fmt: skip


def by_technique(spec: PlanSpec, tile: int, limit: int = LIMIT) -> list[dict]:
    """The longest length of `spec`'s degrees as the levers are added one at a time."""
    full = replace(spec, activation_checkpointing=True, tiled_mlp=spec.tiled_mlp or tile,
                   offload_activations=True)  # fmt: skip
    rows = []
    for name, off in LEVERS:
        s = replace(full, **off)
        seq = longest(s, limit)
        at = replace(s, seq_len=max(seq, _unit(s)))
        mem = memory_bytes(at)
        rows.append({"technique": name, "max_seq": seq,
                     "memory_gib": {k: v / GIB for k, v in mem.items()},
                     "host_gib": host_bytes(at) / GIB})  # fmt: skip
    return rows


# (name, model, hardware, memory override GiB, gpus, published longest length, the setting,
#  what the planner does not price: the techniques of that run that ringattn lacks)
ALST_GAP = ("ALST keeps bf16 weights and gradients on the GPU (ZeRO-3; 16 bytes a parameter "
            "of optimizer state on the host), fuses the loss (Liger: no logits) and saves fewer "
            "tensors per layer (flash-attention's q, k, v, out, lse with no float32 merge "
            "accumulators or ring buffers)")  # fmt: skip
PUBLISHED = [
    ("ALST Llama-8B, 1 x H100", "llama3-8b", "h100", None, 1, 500_000,
     ("DeepSpeed ZeRO-3 with optimizer and parameter offload (cpu_adam), Ulysses SP, tiled MLP "
     "(tiles of the hidden size), Liger's fused loss, checkpoint offload "
     "(ArcticTraining run-h100-sp1-llama-8b.yml)"), ALST_GAP),
    ("ALST Llama-8B, 8 x H100", "llama3-8b", "h100", None, 8, 3_700_000,
     ("the same with optimizer offload only: bf16 weights sharded over the 8 GPUs "
     "(run-h100-sp8-llama-8b.yml)"), ALST_GAP),
    ("ALST Llama-8B, 32 x H100", "llama3-8b", "h100", None, 32, 15_000_000,
     "the same on four nodes (run-h100-sp32-llama-8b.yml, max_length 15.5M)", ALST_GAP),
    ("FPDT 8B, 4 x A100-40GB", "llama3-8b", "a100", 40, 4, 2_000_000,
     "FPDT: chunked, offloaded attention pipeline over Ulysses",
     ("FPDT splits each rank's tokens into u chunks inside every layer and keeps only one or two "
     "chunks of q, k, v (and their gradients) on the GPU, the rest in host memory, fetched "
     "chunk by chunk for an online-softmax attention: ringattn has no such lever, so one "
     "layer's working set is priced whole (u times FPDT's)")),
]  # fmt: skip


def check_published_max_seq(offload_states: bool = True) -> list[dict]:
    """Each published point beside the planner's longest length for it: all levers on (tile =
    the model's hidden size, ALST's rule), bf16, the trainer's chunked loss, and (default) the
    model-state offload what-if that a single-GPU run needs (8B x 16 bytes of model states
    exceed one 80 GB GPU)."""
    rows = []
    for name, model, hardware, memory, gpus, published, setting, gap in PUBLISHED:
        hw = get_hardware(hardware)
        if memory:
            hw = replace(hw, memory_gib=memory)
        m = get_model(model)
        job = Job(m, hw, gpus, 1, 1, activation_checkpointing=True, tiled_mlp=m.dim,
                  offload_activations=True, offload_states=offload_states,
                  loss_chunk=trainer_chunk(m.vocab_size))  # fmt: skip
        best = max_seq_plans(job)[0]
        rows.append({"name": name, "published": published, "predicted": best["max_seq"],
                     "error": (best["max_seq"] - published) / published, "setting": setting,
                     "not_priced": gap,
                     "plan": {k: best[k] for k in ("dp", "cp", "tp", "pp", "strategy", "layout")},
                     "memory_gib": best["breakdown"]["memory_gib"],
                     "host_gib_per_gpu": best["host_gib_per_gpu"]})  # fmt: skip
    return rows
