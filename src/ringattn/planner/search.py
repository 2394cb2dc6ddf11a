"""Enumerate the plans for a job and rank them: every (dp, cp, tp, pp) whose product is the GPU
count, every strategy and layout, unless the caller fixed them; the ones the library cannot run
are left out (with the reason, when the caller asked for exactly that plan).

Ranking: plans that fit in memory first, then the most training tokens per second per GPU (the
step time alone would favour small dp: a step of dp x batch sequences), then the least memory.
The text explanation compares the winner with the best plan of another strategy and the best of
another cp degree.

Ties. A prediction, like a measurement, has an error. Two predicted times closer than the planner's
error margin do not say which plan is faster, and neither do two measured times closer than
the run-to-run noise. So an order here is a list of tie groups, fastest first:

    predicted s:  ring 0.40   hybrid 0.41   all-gather 0.42   Ulysses 0.55
    margin 10 %:  [ring = hybrid = all-gather]  <  [Ulysses]

A group starts at its fastest member and takes every later time within the margin of it (so a
group never spans more than the margin, however many plans it holds).

Measured times are judged by their repeats: a is faster than b only when every repeat of a beat
every repeat of b (their ranges do not overlap); otherwise the difference is inside the noise
and the two tie. Comparing the two orders pair by pair gives three verdicts: `agree` (both order
the pair the same way, or both tie it), `open` (one of the two ties it: not a contradiction, but
not a ranking either) and `contradict` (opposite orders).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ringattn.planner.command import train_command
from ringattn.planner.cost import PlanSpec, mixer_shares, step_time
from ringattn.planner.flops import model_flops_per_token
from ringattn.planner.hardware import Hardware
from ringattn.planner.kernels import check_kernel, default_kernel
from ringattn.planner.max_seq.levers import check_levers
from ringattn.planner.memory import GIB, memory_bytes, mixer_memory_bytes
from ringattn.planner.models import ModelSpec
from ringattn.planner.schedule import check_schedule
from ringattn.planner.work import resolve_mixer_scheme

__all__ = [
    "PLAN_MARGIN",
    "Job",
    "check_plan",
    "compare_orders",
    "describe_order",
    "evaluate",
    "measured_faster",
    "model_flops_per_token",
    "predicted_faster",
    "search",
    "tie_groups",
]

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
LAYOUTS = ("zigzag", "striped", "contiguous")
DTYPES = ("bf16", "fp8", "fp32", "tf32")


@dataclass(frozen=True)
class Job:
    """What the user asked: fixed values, or None for "search"."""

    model: ModelSpec
    hw: Hardware
    gpus: int
    seq_len: int
    batch_size: int
    dp: int | None = None
    cp: int | None = None
    tp: int | None = None
    pp: int | None = None
    strategy: str | None = None
    layout: str | None = None
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    kernel: str | None = None
    """None: what the library's `auto` picks for the dtype (kernels.default_kernel)."""
    pp_schedule: str = "gpipe"
    microbatches: int = 1
    virtual_stages: int = 1
    fp8_attention: bool = False
    attention_tflops: tuple[float, float] | None = None
    ep: int = 1
    """MoE: expert-parallel degree (fixed, not searched)."""
    mixer_scheme: str = "auto"
    """Hybrid models: how mixer layers run under CP (work.MIXER_CHOICES; fixed, not searched)."""
    tiled_mlp: int = 0  # the memory levers: cost.PlanSpec's fields of the same names
    offload_activations: bool = False
    offload_states: bool = False
    loss_chunk: int = 4096
    """Tokens per chunk of the output projection + loss (cost.PlanSpec.loss_chunk)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _hybrid_degree(spec: PlanSpec) -> int:
    """U for hybrid: the largest divisor of cp below cp that fits in a node and splits the heads;
    0 when there is none (then hybrid is not a plan)."""
    heads = spec.model.n_heads // spec.tp
    for u in sorted(_divisors(spec.cp), reverse=True):
        if 1 < u < spec.cp and u * spec.tp <= spec.hw.gpus_per_node and heads % u == 0:
            return u
    return 0


def check_plan(spec: PlanSpec) -> PlanSpec:
    """The spec with the hybrid degree filled in; ValueError with the reason it cannot run."""
    m = spec.model
    if spec.gpus <= 0 or min(spec.dp, spec.cp, spec.tp, spec.pp) < 1:
        raise ValueError(f"degrees must be >= 1, got dp={spec.dp} cp={spec.cp} tp={spec.tp} "
                         f"pp={spec.pp}")  # fmt: skip
    if m.n_heads % spec.tp or m.n_kv_heads % spec.tp:
        raise ValueError(
            f"{m.name}: {m.n_heads} heads / {m.n_kv_heads} kv heads are not divisible by "
            f"tp={spec.tp}; pick tp among the divisors of {m.n_kv_heads}"
        )
    if spec.pp > m.n_layers:
        raise ValueError(f"{m.name} has {m.n_layers} layers, fewer than pp={spec.pp} stages; "
                         f"pick pp <= {m.n_layers}")  # fmt: skip
    chunks = 2 * spec.cp if spec.layout == "zigzag" else spec.cp
    if spec.seq_len % chunks:
        raise ValueError(
            f"sequence length {spec.seq_len} is not divisible by {chunks} "
            f"({spec.layout}, cp={spec.cp}); pad it to a multiple of {chunks}"
        )
    heads = m.n_heads // spec.tp
    if spec.strategy == "ulysses" and heads % spec.cp:
        raise ValueError(f"ulysses needs the {heads} heads per tp rank to be divisible by "
                         f"cp={spec.cp}; use ring, allgather or hybrid")  # fmt: skip
    if spec.strategy == "hybrid" and spec.cp > 1:
        u = _hybrid_degree(spec)
        if not u:
            raise ValueError(
                f"hybrid needs a Ulysses degree 1 < U < cp={spec.cp} dividing cp and the "
                f"{heads} heads, with U x tp <= {spec.hw.gpus_per_node} GPUs per node; "
                "use ring or ulysses"
            )
        spec = replace(spec, ulysses=u)
    if spec.ep > 1:
        if not m.experts or m.experts % spec.ep:
            raise ValueError(
                f"--ep {spec.ep}: {m.name} has {m.experts} experts per layer, not a "
                f"multiple of ep; give a MoE config and an ep dividing its experts"
            )
        shards = spec.dp * spec.cp
        if spec.ep % spec.cp or shards % spec.ep:
            raise ValueError(
                f"--ep {spec.ep} must be a multiple of cp={spec.cp} dividing dp x cp "
                f"= {shards} (experts fold onto whole cp groups and part of dp)"
            )
    check_levers(spec)  # what the trainer refuses with the memory levers
    if m.mixer_layers:  # ValueError for a scheme this cp and tp cannot run
        resolve_mixer_scheme(m.mixer, spec.mixer_scheme, spec.cp, spec.tp)
    if spec.dtype == "fp8" and not spec.hw.fp8_tflops:
        raise ValueError(f"{spec.hw.name} has no fp8 matmuls; use --dtype bf16")
    if spec.hw.is_cpu and spec.dtype in ("fp8", "tf32"):
        raise ValueError(f"--dtype {spec.dtype} is a GPU precision; cpu runs fp32 or bf16")
    if not spec.hw.is_cpu:
        check_kernel(spec.kernel, spec.hw.arch, spec.dtype, spec.fp8_attention)
    check_schedule(spec.pp_schedule, spec.pp, spec.microbatches, spec.virtual_stages,
                   spec.batch_size, m.n_layers)  # fmt: skip
    return spec


def evaluate(spec: PlanSpec) -> dict:
    """One plan as the CLI prints it (the `plans` entries of --json)."""
    time = step_time(spec)
    mem = memory_bytes(spec)
    tokens = spec.dp * spec.batch_size * spec.seq_len
    usable = spec.hw.memory_gib * spec.hw.usable_fraction
    if spec.hw.is_cpu:  # the processes share the machine's memory
        usable /= spec.gpus
    rate = tokens / time["step_time_s"] / spec.gpus
    command, note = train_command(spec)
    model_tflops = rate * model_flops_per_token(spec) / 1e12
    peak = None if spec.hw.is_cpu else spec.hw.matmul_peak(
        "bf16" if spec.dtype == "fp8" else spec.dtype)[0]  # fmt: skip
    return {
        "dp": spec.dp, "cp": spec.cp, "tp": spec.tp, "pp": spec.pp,
        "strategy": spec.strategy, "layout": spec.layout,
        "ulysses": spec.ulysses if spec.strategy == "hybrid" else None, "ep": spec.ep,
        "attention_kernel": None if spec.hw.is_cpu else spec.kernel,
        "pp_schedule": spec.pp_schedule, "microbatches": spec.pipe_microbatches,
        "virtual_stages": spec.virtual,
        "mixer_scheme": spec.mixer_scheme if spec.model.mixer_layers else None,
        "mixer_schemes": {spec.model.mixer.kind: spec.mixer_run} if spec.model.mixer_layers
        else None,
        "step_time_s": time["step_time_s"],
        "tokens_per_s_per_gpu": rate,
        "model_tflops_per_gpu": model_tflops,
        "mfu": model_tflops / peak if peak else None,
        "memory_gib_per_gpu": mem["total"] / GIB,
        "fits": mem["total"] / GIB <= usable,
        "train_command": command,
        "train_note": note,
        "breakdown": {
            "compute_s": time["compute_s"],
            "attention_s": time["attention_s"],
            "exposed_comm_s": time["exposed_comm_s"],
            "exposed_cp_comm_s": time["exposed_cp_comm_s"],
            "pipeline_bubble_s": time["pipeline_bubble_s"],
            "optimizer_s": time["optimizer_s"],
            "overhead_s": time["overhead_s"],
            "cp_bytes_per_layer": time["cp_bytes_per_layer"],
            "ep_dispatch_s": time["ep_dispatch_s"],
            "memory_gib": {k: v / GIB for k, v in mem.items() if k != "total"},
            "mixer": mixer_shares(spec, time, mixer_memory_bytes(spec) / mem["total"]),
        },
    }  # fmt: skip


MAX_SEARCHED_CP = 64
"""Searched cp degrees stop here (a given --cp may be larger, up to MAX_CP)."""
MAX_CP = 256


def _degrees(job: Job):
    """Every (dp, cp, tp, pp) with product --gpus that agrees with the fixed ones."""
    for tp in [job.tp] if job.tp else _divisors(job.gpus):
        for pp in [job.pp] if job.pp else _divisors(job.gpus):
            for cp in [job.cp] if job.cp else _divisors(job.gpus):
                if not job.cp and cp > MAX_SEARCHED_CP:
                    continue
                dp, rest = divmod(job.gpus, tp * pp * cp)
                if rest == 0 and dp >= 1 and (not job.dp or job.dp == dp):
                    yield dp, cp, tp, pp


def _candidates(job: Job):
    for dp, cp, tp, pp in _degrees(job):
        strategies = [job.strategy] if job.strategy else STRATEGIES if cp > 1 else ("ring",)
        for strategy in strategies:
            for layout in [job.layout] if job.layout else LAYOUTS:
                yield PlanSpec(
                    job.model,
                    job.hw,
                    job.seq_len,
                    job.batch_size,
                    dp,
                    cp,
                    tp,
                    pp,
                    strategy,
                    layout,
                    job.dtype,
                    job.activation_checkpointing,
                    kernel=job.kernel or default_kernel(job.hw.arch, job.dtype),
                    pp_schedule=job.pp_schedule,
                    microbatches=job.microbatches,
                    virtual_stages=job.virtual_stages,
                    fp8_attention=job.fp8_attention,
                    attention_tflops=job.attention_tflops,
                    ep=job.ep,
                    mixer_scheme=job.mixer_scheme,
                    tiled_mlp=job.tiled_mlp,
                    offload_activations=job.offload_activations,
                    offload_states=job.offload_states,
                    loss_chunk=job.loss_chunk,
                )


def rank_key(plan: dict) -> tuple[float, float]:
    """Fastest first: the most tokens per second per GPU (with a fixed dp that is the shortest
    step), then the least memory."""
    return -plan["tokens_per_s_per_gpu"], plan["memory_gib_per_gpu"]


def search(job: Job) -> list[dict]:
    """Every plan the job allows, ranked; ValueError when none is possible (with why)."""
    if job.gpus < 1 or job.seq_len < 1 or job.batch_size < 1:
        raise ValueError(f"--gpus, --seq-len and --batch-size must be >= 1, got {job.gpus}, "
                         f"{job.seq_len}, {job.batch_size}")  # fmt: skip
    fixed = [(k, v) for k, v in (("dp", job.dp), ("cp", job.cp), ("tp", job.tp),
                                 ("pp", job.pp)) if v]  # fmt: skip
    product = 1
    for _, v in fixed:
        product *= v
    if len(fixed) == 4 and product != job.gpus or job.gpus % product:
        text = " x ".join(f"{k}={v}" for k, v in fixed)
        raise ValueError(f"{text} = {product} does not divide into --gpus {job.gpus}; the "
                         f"degrees must multiply to {job.gpus}")  # fmt: skip
    if job.cp and job.cp > MAX_CP:
        raise ValueError(f"--cp {job.cp} is beyond what the planner models (at most {MAX_CP})")
    if job.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {job.dtype!r}; choose one of {', '.join(DTYPES)}")
    plans, reasons = [], []
    for spec in _candidates(job):
        try:
            plans.append(evaluate(check_plan(spec)))
        except ValueError as err:
            reasons.append(str(err))
    if not plans:
        why = reasons[0] if reasons else "no degrees multiply to --gpus"
        raise ValueError(f"no plan can run: {why}")
    plans.sort(key=lambda p: (not p["fits"], *rank_key(p)))
    return plans


def explain(plans: list[dict]) -> str:
    """One line: why the first plan wins."""
    best = plans[0]
    name = (f"dp={best['dp']} cp={best['cp']} tp={best['tp']} pp={best['pp']} "
            f"{best['strategy']}/{best['layout']}")  # fmt: skip
    if not best["fits"]:
        return (
            f"no plan fits in memory; the fastest is {name} ({best['memory_gib_per_gpu']:.1f} GiB)"
        )
    parts = [f"{name} wins: {best['tokens_per_s_per_gpu']:.0f} tokens/s per GPU"]
    b = best["breakdown"]
    parts.append(f"{b['exposed_comm_s'] / best['step_time_s']:.0%} of its step is exposed comm")
    for key, label in (("strategy", "strategy"), ("cp", "cp degree")):
        rival = next((p for p in plans if p[key] != best[key] and p["fits"]), None)
        if rival:
            slower = best["tokens_per_s_per_gpu"] / rival["tokens_per_s_per_gpu"]
            tie = " (within the planner's error margin: a tie)" if slower <= 1 + PLAN_MARGIN else ""
            parts.append(f"best other {label} ({rival[key]}) is {slower:.2f}x slower{tie}")
    unfit = sum(not p["fits"] for p in plans)
    if unfit:
        parts.append(f"{unfit} of {len(plans)} plans do not fit")
    return "; ".join(parts)


PLAN_MARGIN = 0.10
"""The planner's relative error between two plans priced on the same hardware: predictions
closer than this are a tie. Measured: over the two-hosts runs at 20 Mbit/s (BENCHMARKS.md,
results/two_hosts_cpu_repeats.json), where repeated runs agree within a few per cent, the ratio
predicted / measured of the five plans spans 8 % (tests/test_two_hosts_ranking.py checks the file
against it). At 1 Gbit/s on that shared machine the repeats themselves spread by up to 80 %."""


def tie_groups(times: Mapping[str, float], margin: float = PLAN_MARGIN) -> list[list[str]]:
    """The names of `times` in tie groups, fastest first (module docstring)."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    groups: list[list[str]] = []
    first = 0.0
    for name in sorted(times, key=lambda n: times[n]):
        if groups and times[name] <= first * (1 + margin):
            groups[-1].append(name)
        else:
            groups.append([name])
            first = times[name]
    return groups


def describe_order(groups: Sequence[Sequence[str]]) -> str:
    """'a = b < c': tie groups fastest first."""
    return " < ".join(" = ".join(group) for group in groups)


def predicted_faster(a: float, b: float, margin: float = PLAN_MARGIN) -> int:
    """-1 when a is predicted faster than b beyond the margin, 1 when slower, 0 a tie."""
    if b > a * (1 + margin):
        return -1
    if a > b * (1 + margin):
        return 1
    return 0


def measured_faster(a: Sequence[float], b: Sequence[float]) -> int:
    """-1 when every repeat of a beat every repeat of b, 1 the other way round, else 0."""
    if max(a) < min(b):
        return -1
    if max(b) < min(a):
        return 1
    return 0


def compare_orders(
    measured: Mapping[str, Sequence[float]],
    predicted: Mapping[str, float],
    margin: float = PLAN_MARGIN,
) -> dict[str, list[tuple[str, str]]]:
    """Every pair of names, sorted into 'agree', 'open' and 'contradict' (module docstring).

    `measured` maps a name to its repeated times, `predicted` to the planner's time; each pair
    (a, b) is listed with the measured-faster one first (or in name order when tied)."""
    if set(measured) != set(predicted):
        raise ValueError(f"measured {sorted(measured)} and predicted {sorted(predicted)} must "
                         "name the same plans")  # fmt: skip
    verdicts: dict[str, list[tuple[str, str]]] = {"agree": [], "open": [], "contradict": []}
    names = sorted(measured)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            seen = measured_faster(measured[a], measured[b])
            said = predicted_faster(predicted[a], predicted[b], margin)
            pair = (b, a) if seen == 1 else (a, b)
            if seen == said:
                verdicts["agree"].append(pair)
            elif seen == 0 or said == 0:
                verdicts["open"].append(pair)
            else:
                verdicts["contradict"].append(pair)
    return verdicts
