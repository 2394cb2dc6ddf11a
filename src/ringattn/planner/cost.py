"""Step time of one plan: compute, the communication it cannot hide, and the pipeline bubble.

Per transformer block and microbatch on one rank (n = S / cp tokens, heads and MLP split by tp):

    forward   matmuls 2 * tokens * block_params / tp          (at the --dtype's peak)
              elementwise passes (norms, RoPE, SwiGLU, residuals) at memory bandwidth
              attention by strategy (below), at the --attention-kernel's published rate
              for each block's length and mask (kernels.py)
              tensor parallel: 2 all-gathers + 2 reduce-scatters of the activations (exposed)
    backward  2x the matmuls and elementwise work, attention backward (2.5x the forward's
              flops), the same TP traffic; + one more forward with activation checkpointing

Attention per strategy (bytes from docs/strategies.md; work from the layouts' schedules, work.py):

    ring       sum over steps of max(step compute, one K/V hop); backward hops carry K/V and
               the float32 dK/dV, and the last dK/dV hop is exposed
    allgather  max(all-gather, local block) + the other blocks; backward adds the reduce-scatter
    ulysses    all-to-alls (exposed) + attention over the whole sequence for heads / cp;
               with fewer K/V heads than ranks each peer gets only the K/V heads its query
               heads read (strategies/ulysses.py's HeadPlan), in forward and again in backward
    hybrid     all-to-alls inside groups of U (exposed) + a ring of R = cp / U group steps

The ring's merge reads and writes the float32 accumulator at every step (~10 bytes per output
element, 20 for half blocks): elementwise work added to each step's compute.

Per step: the pipeline schedule's m microbatch slots plus its bubble (schedule.py); FSDP2
all-gathers (forward and backward) and reduce-scatters overlap the compute, the part longer than
it plus the first all-gather and last reduce-scatter is exposed; AdamW and gradient clipping at
memory speed.

One link per host (cpu hosts, hardware.py): every transfer that crosses it shares it. An
all-to-all of W ranks, g per host, sends g (W - g) of its W (W - 1) messages per host across at
once (`crossing_load`); gloo's all-gather is a ring (W - 1 steps, one message per link each).
What hides behind compute hides once: the compute that covered the CP transfers on the link
cannot also cover FSDP's there, so FSDP hides only behind the rest.

Hybrid models (work.py's MixerShape): a mixer layer replaces attention by its projections (at the
matmul rate), its chunked recurrence (at the matmul rate of C-row calls; mamba1's scan at the
fp32 rate) and its memory-bound passes, backward 2x, 2.5x and 2x; its CP traffic per
--mixer-scheme (work.py's MIXER_SCHEMES; `auto`: what the library runs) is exposed: nothing runs
while the gathered input, the summed outputs or the summaries travel. Per block, attention and
mixer costs are weighted by their layers' shares.

gloo (every cpu plan): its reduce_scatter_tensor, which FSDP2 calls, is an all-reduce underneath:
twice the bytes of a ring reduce-scatter. Measured over the two-hosts link (scripts/
two_hosts_link.py, 4 ranks, in link times of one 128 KiB chunk C per direction): a ring hop 1.0,
all-gather 3.1 (a ring: 3), reduce-scatter 6.3 (an all-reduce: 6), all-to-all 4.4 (G (W - G): 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringattn.planner.hardware import Hardware
from ringattn.planner.max_seq.levers import lever_seconds
from ringattn.planner.models import ModelSpec
from ringattn.planner.schedule import bubble_slots
from ringattn.planner.work import StepWork, allgather_work, group_ring_steps, mixer_work
from ringattn.planner.work import resolve_mixer_scheme as resolve_mixer
from ringattn.strategies.ulysses import HeadPlan

__all__ = ["PlanSpec", "attention_layer_s", "crossing_load", "mixer_shares", "step_time"]


@dataclass(frozen=True)
class PlanSpec:
    """One candidate: a model on a hardware, degrees, strategy, layout and precision."""

    model: ModelSpec
    hw: Hardware
    seq_len: int
    batch_size: int
    """Sequences per data-parallel group per step (the trainer's --batch-size)."""
    dp: int
    cp: int
    tp: int
    pp: int
    strategy: str
    layout: str
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    ulysses: int = 1
    """hybrid: the Ulysses (all-to-all) degree U inside each cp group; the ring has cp / U."""
    ep: int = 1
    """MoE: expert-parallel degree, experts over blocks of ep ranks (the trainer's --ep)."""
    loss_chunk: int = 4096
    """Tokens per chunk of the output projection + loss, recomputed in backward (the trainer's)."""
    kernel: str = "cudnn"
    """GPU attention kernel (kernels.py); ignored on cpu (the measured cpu_flash)."""
    pp_schedule: str = "gpipe"
    microbatches: int = 1
    """pp > 1: microbatches per step (the trainer's --microbatches; ignored without pp)."""
    virtual_stages: int = 1
    """interleaved: model chunks per pipeline rank."""
    fp8_attention: bool = False
    """fp8 forward attention (flash3, cudnn) with --dtype fp8."""
    attention_tflops: tuple[float, float] | None = None
    """Overrides the kernel's plateau rates, forward and backward TFLOP/s."""
    mixer_scheme: str = "auto"
    """Hybrid models: how the mixer layers run under CP (work.MIXER_CHOICES; `mixer_run`)."""
    tiled_mlp: int = 0  # tokens per tile of the tiled MLP (0: untiled; max_seq/levers.py)
    offload_activations: bool = False  # the checkpointed layer inputs in host memory
    offload_states: bool = False  # what-if: weights, optimizer states in host memory (ZeRO-3)

    @property
    def mixer_run(self) -> str:
        """The mixer scheme priced: mixer_scheme, `auto` resolved for this cp and tp."""
        return resolve_mixer(self.model.mixer, self.mixer_scheme, self.cp, self.tp)

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype in ("fp32", "tf32") else 2

    @property
    def pipe_microbatches(self) -> int:
        """Microbatches that go through the pipeline per step (1 without pp)."""
        return self.microbatches if self.pp > 1 else 1

    @property
    def micro_batch(self) -> int:
        """Sequences in one microbatch."""
        return self.batch_size // self.pipe_microbatches

    @property
    def virtual(self) -> int:
        return self.virtual_stages if self.pp_schedule == "interleaved" else 1

    def spans_nodes(self, inner: int) -> bool:
        """Whether a group made of `inner` consecutive ranks crosses a node boundary."""
        return inner > self.hw.gpus_per_node

    @property
    def threads(self) -> int:
        return self.hw.threads_per_process(self.gpus)


def crossing_load(world: int, per_node: int) -> float:
    """How many of a node's ranks' transfers cross its link at once when `world` ranks, `per_node`
    on each node, exchange evenly: of a rank's world - 1 peers, world - g are on other nodes, and
    the node's g ranks send at once: g (world - g) / (world - 1) (1 for a ring across two)."""
    g = min(world, per_node)
    return g * (world - g) / (world - 1) if world > g else 1.0


def kv_share(hq: int, hkv: int, size: int) -> float:
    """Of a rank's local K/V bytes, the share it sends in one Ulysses all-to-all over `size`
    ranks: (size - 1) / size when the K/V heads split evenly; otherwise each peer gets the K/V
    heads its query heads read (HeadPlan), the busiest rank's total."""
    plan = HeadPlan(hq, hkv, size)
    if not plan.replicated:
        return (size - 1) / size
    heads = [len(plan.kv_heads(d)) for d in range(size)]
    return max(sum(heads) - heads[r] for r in range(size)) / hkv


def _attention(spec: PlanSpec, backward: bool) -> tuple[float, float, float, float]:
    """(compute s, exposed comm s, comm bytes, hidden link s) of one attention layer, forward or
    backward; hidden link s: the inter-node transfers that hid behind the compute."""
    m, hw, w = spec.model, spec.hw, spec.cp
    b, e, d = spec.micro_batch, spec.elem_bytes, m.d_head
    hq, hkv = m.n_heads // spec.tp, m.n_kv_heads // spec.tp
    n = spec.seq_len // w
    q_bytes, kv_bytes = b * hq * n * d * e, 2 * b * hkv * n * d * e
    kv32, lse = kv_bytes * 4 // e, b * hq * n * 4
    flop_scale = 2.5 if backward else 1.0
    slow = hw.slowdown(spec.gpus)
    threads = spec.threads

    def compute(work: StepWork, heads: float, rows: int) -> float:
        """Kernels of one step plus its merge, on `rows` query rows per position."""
        unit = 4 * b * heads * d * rows * rows * flop_scale
        block = max(1, int(work.block * rows))
        kw = {"kernel": spec.kernel, "dtype": spec.dtype, "fp8": spec.fp8_attention,
              "override": spec.attention_tflops}  # fmt: skip
        t = hw.attention_s(unit * work.full, block, d, False, backward, threads, **kw)
        t += hw.attention_s(unit * work.causal, block, d, True, backward, threads, **kw)
        merge = 0 if backward else 10 * b * heads * rows * d * work.calls * (2 if work.block < 1
                                                                            else 1)  # fmt: skip
        return (t + hw.elementwise_s(merge, threads)) * slow

    cp_inter = spec.spans_nodes(spec.cp * spec.tp)  # then at least one hop crosses nodes
    if w == 1 or spec.strategy in ("ring", "hybrid"):
        u = spec.ulysses if spec.strategy == "hybrid" else 1
        steps = group_ring_steps(spec.layout, w, u)
        rings = len(steps)
        hop = kv_bytes + (kv32 if backward else 0)  # backward: K/V and a dK/dV partial per hop
        # every rank of a group sends its hop at once: U of a node's ranks cross its link
        hop_s = hw.transfer_s(hop, cp_inter, load=u) if rings > 1 else 0.0
        total = exposed = hidden = 0.0
        for i, work in enumerate(steps):
            c = compute(work, hq / u, n)
            total += c
            if i < rings - 1:  # the next step's K/V travel while this step computes
                exposed += max(0.0, hop_s - c)
                hidden += min(hop_s, c) if cp_inter else 0.0
        sent = hop * (rings - 1)
        if backward and rings > 1:  # the last dK/dV partial returns to its owner after the loop
            exposed += hw.transfer_s(kv32, cp_inter, load=u)
            sent += kv32
        if u > 1:  # the all-to-alls inside each group, nothing to hide them behind
            a2a = (u - 1) / u * (2 * q_bytes + kv_bytes + (0 if backward else lse))
            exposed += hw.transfer_s(a2a, spec.spans_nodes(u * spec.tp), messages=2 * (u - 1))
            sent += a2a
        return total, exposed, sent, hidden
    if spec.strategy == "allgather":
        work = allgather_work(spec.layout, w)
        c = compute(work, hq, n)
        local = compute(StepWork(0.0, 0.5, 1.0, 1), hq, n)
        gather = hw.transfer_s((w - 1) * kv_bytes, cp_inter, messages=w - 1)
        exposed = max(0.0, gather - local)
        hidden = min(gather, local) if cp_inter else 0.0
        sent = (w - 1) * kv_bytes
        if backward:
            scatter = hw.transfer_s((w - 1) * kv32, cp_inter, messages=w - 1)
            exposed, sent = exposed + scatter, sent + (w - 1) * kv32
        return c, exposed, sent, hidden
    # ulysses: forward q, k, v in, out and lse back; backward dout in, dq, dk, dv back, and with
    # replicated K/V heads k, v in again (strategies/ulysses.py keeps the local ones)
    steps = group_ring_steps(spec.layout, w, w)
    c = compute(steps[0], hq / w, n)
    replicated = HeadPlan(hq, hkv, w).replicated
    kv_sends = 2 if backward and replicated else 1
    sent = (w - 1) / w * (2 * q_bytes + (0 if backward else lse))
    sent += kv_sends * kv_share(hq, hkv, w) * kv_bytes
    load = crossing_load(w, hw.gpus_per_node // spec.tp)
    return c, hw.transfer_s(sent, cp_inter, messages=2 * (w - 1), load=load), sent, 0.0


def _mixer(spec: PlanSpec, backward: bool) -> tuple[float, float, float]:
    """(compute s, exposed comm s, comm bytes) of one mixer layer, forward or backward."""
    m, hw = spec.model, spec.hw
    mx = m.mixer
    work = mixer_work(mx, spec.mixer_run, spec.layout, m.dim, spec.seq_len, spec.micro_batch,
                      spec.cp, spec.tp, spec.elem_bytes)  # fmt: skip
    dtype = "bf16" if spec.dtype == "fp8" else spec.dtype
    scan = "fp32" if mx.kind == "mamba1" and not hw.is_cpu else dtype  # CUDA cores, not MMA
    c = hw.matmul_s(work.matmul_flops, work.rows, m.dim, spec.dtype, spec.threads)
    r = hw.matmul_s(work.recurrence_flops, mx.chunk, max(1, mx.state_dim), scan, spec.threads)
    e = hw.elementwise_s(2 * work.elementwise_elems * spec.elem_bytes, spec.threads)
    compute = (2 * c + 2.5 * r + 2 * e if backward else c + r + e) * hw.slowdown(spec.gpus)
    sent, messages = work.sent[backward], work.messages[backward]
    exposed = hw.transfer_s(sent, spec.spans_nodes(spec.cp * spec.tp), messages=max(1, messages))
    return compute, exposed, sent


def mixer_shares(spec: PlanSpec, time: dict, memory_share: float) -> dict | None:
    """Hybrids: the mixer layers' scheme, count, seconds and shares of the step time, of the
    memory per rank (given) and of the CP bytes; None without mixers."""
    m = spec.model
    if not m.mixer_layers:
        return None
    mixer_bytes = m.mixer_layers * time["mixer_bytes_per_layer"]
    total = m.attention_layers * time["cp_bytes_per_layer"] + mixer_bytes
    return {"scheme": spec.mixer_run, "kind": m.mixer.kind, "layers": m.mixer_layers,
            "library_scheme": resolve_mixer(m.mixer, "auto", spec.cp, spec.tp),
            "time_s": time["mixer_s"], "exposed_comm_s": time["mixer_exposed_comm_s"],
            "bytes_per_layer": time["mixer_bytes_per_layer"],
            "time_share": time["mixer_s"] / time["step_time_s"], "memory_share": memory_share,
            "traffic_share": mixer_bytes / total if total else 0.0}  # fmt: skip


def attention_layer_s(spec: PlanSpec, backward: bool) -> float:
    """Seconds of one layer's CP attention (compute + exposed communication), one direction."""
    compute, exposed, _, _ = _attention(spec, backward)
    return compute + exposed


def _elementwise_bytes(spec: PlanSpec, tokens: int) -> float:
    """Forward bytes of the memory-bound ops of one block: passes over each activation (each pass
    reads and writes it): RMSNorm ~6 x 2, RoPE ~8 on q and k, SwiGLU ~4 on the hidden, residual
    adds and layout copies ~4 on the width. Backward is taken as twice this."""
    m, tp = spec.model, spec.tp
    rope = 8 * (m.q_dim + m.kv_dim) / tp  # attention layers only (a mixer prices its own)
    if m.mixer_layers:
        rope *= m.attention_layers / m.n_layers
    passes = 16 * m.dim / tp + rope + 4 * m.hidden_dim / tp
    return 2 * tokens * passes * spec.elem_bytes


def step_time(spec: PlanSpec) -> dict:
    """Seconds of one optimizer step and where they go (see the module docstring)."""
    m, hw = spec.model, spec.hw
    slow, threads = hw.slowdown(spec.gpus), spec.threads
    dtype = spec.dtype
    n = spec.seq_len // spec.cp
    tokens = spec.micro_batch * n  # rows of every matmul on this rank, per microbatch
    # MoE: a token's top_k experts; hybrids: the mixers' weights are priced by _mixer
    mm_params = m.active_layer_params() - 2 * m.dim - m.mixer_params()
    mm_f = hw.matmul_s(2 * tokens * mm_params / spec.tp, tokens, m.dim, dtype, threads) * slow
    ew_f = hw.elementwise_s(_elementwise_bytes(spec, tokens), threads) * slow
    att_f, att_f_exp, att_f_bytes, att_f_hid = _attention(spec, backward=False)
    att_b, att_b_exp, att_b_bytes, att_b_hid = _attention(spec, backward=True)
    mix_f = mix_b = (0.0, 0.0, 0.0)
    mix_bytes = 0.0
    if m.mixer_layers:  # per block: attention and mixer weighted by their layers' shares
        share, mix = m.attention_layers / m.n_layers, m.mixer_layers / m.n_layers
        att_f, att_f_exp, att_f_hid = att_f * share, att_f_exp * share, att_f_hid * share
        att_b, att_b_exp, att_b_hid = att_b * share, att_b_exp * share, att_b_hid * share
        mix_f, mix_b = _mixer(spec, backward=False), _mixer(spec, backward=True)
        mix_bytes = mix_f[2] + mix_b[2]
        mix_f, mix_b = tuple(mix * x for x in mix_f), tuple(mix * x for x in mix_b)
        att_f, att_f_exp = att_f + mix_f[0], att_f_exp + mix_f[1]
        att_b, att_b_exp = att_b + mix_b[0], att_b_exp + mix_b[1]
    tp_bytes = 4 * (spec.tp - 1) / spec.tp * tokens * m.dim * spec.elem_bytes
    tp_s = hw.transfer_s(tp_bytes, spec.spans_nodes(spec.tp), 4) if spec.tp > 1 else 0.0
    fwd = mm_f + ew_f + att_f
    bwd = 2 * mm_f + 2 * ew_f + att_b + (fwd if spec.activation_checkpointing else 0)
    bwd, offload_s = lever_seconds(spec, tokens, fwd, bwd, threads, slow)  # + the tiles' recompute
    ep_s = _dispatch_s(spec, tokens)  # (forward, backward) of one MoE layer, exposed
    exposed_layer = att_f_exp + att_b_exp + 2 * tp_s + sum(ep_s) + offload_s
    if spec.activation_checkpointing:
        exposed_layer += att_f_exp + tp_s + ep_s[0]
    layers = -(-m.n_layers // spec.pp)  # the heaviest stage (uneven splits allowed)
    # output projection + loss (last stage): forward, backward, and the chunk recompute
    head_f = hw.matmul_s(2 * tokens * m.dim * m.vocab_size / spec.tp, tokens, m.dim, dtype, threads)
    head_f += hw.elementwise_s(tokens * m.vocab_size / spec.tp * 4 * 6, threads)
    head = head_f * (4 if tokens > spec.loss_chunk > 0 else 3) * slow
    stage_compute = layers * (fwd + bwd) + head
    stage_exposed = layers * exposed_layer
    pp_s = 0.0
    if spec.pp > 1:  # activations (and their gradients) to the next stage, per microbatch chunk;
        # each tp rank sends its sequence-parallel share
        pp_s = 2 * spec.virtual * hw.transfer_s(tokens * m.dim / spec.tp * spec.elem_bytes,
                                                spec.gpus > hw.gpus_per_node)  # fmt: skip
    mb = spec.pipe_microbatches
    idle = bubble_slots(spec.pp_schedule, spec.pp, spec.virtual)
    slots = mb + idle
    compute = mb * stage_compute
    bubble = idle * (stage_compute + stage_exposed)
    exposed = mb * (stage_exposed + pp_s)
    # FSDP2 over dp x cp: per block and the root, all-gather (fwd, bwd) and reduce-scatter
    shards = spec.dp * spec.cp
    fsdp_exposed = fsdp_s = 0.0
    local_params = (layers * m.layer_params() + m.embedding_params()) / spec.tp
    if shards > 1:
        inter = spec.spans_nodes(shards * spec.tp)
        frac = (shards - 1) / shards
        units = layers + 1
        # --ep: each rank gathers only its 1/ep of the experts, over the shards / ep holding them
        experts = layers * m.expert_params() / spec.tp
        edp = shards // spec.ep
        moved = (local_params - experts) * frac + experts / spec.ep * (edp - 1) / edp
        gather = moved * spec.elem_bytes
        scatter = moved * 4
        msgs = int(units * (shards - 1))
        if hw.is_cpu:  # gloo: an all-reduce underneath (module docstring)
            scatter *= 2
        fsdp_s = 2 * hw.transfer_s(gather, inter, msgs) + hw.transfer_s(scatter, inter, msgs)
        first_last = fsdp_s / units
        cover = slots * stage_compute
        if hw.link_per_node and inter:  # the compute that hid CP transfers on the link
            cover -= mb * layers * (att_f_hid + att_b_hid)
        fsdp_exposed = max(0.0, fsdp_s - cover) + first_last
    # AdamW (param, grad, two moments, fp32) and gradient clipping: ~12 passes of 4 bytes
    optim_s = hw.elementwise_s(local_params / shards * 4 * 12, threads) * slow
    # cpu: what the trainer spends per step outside the kernels, measured (calibrate.py) for the
    # 2-layer tiny model on 2 processes; taken as proportional to the blocks (each brings its
    # autograd ops and FSDP unit) and to the processes sharing a core
    floor_s = 0.0
    if hw.is_cpu and "step_floor_s" in hw.calibration:
        ref = hw.slowdown(hw.calibration["step_floor_nproc"])
        floor_s = hw.calibration["step_floor_s"] * (m.n_layers + 1) / 3 * slow / ref
        floor_s *= slots / spec.pp
    total = compute + bubble + exposed + fsdp_exposed + optim_s + floor_s
    return {
        "step_time_s": total,
        "compute_s": compute,
        "attention_s": mb * layers * (att_f + att_b - mix_f[0] - mix_b[0]),
        "exposed_comm_s": exposed + fsdp_exposed,
        "exposed_cp_comm_s": mb * layers * (att_f_exp + att_b_exp),
        "pipeline_bubble_s": bubble,
        "optimizer_s": optim_s,
        "overhead_s": floor_s,
        "fsdp_comm_s": fsdp_s,
        "cp_bytes_per_layer": att_f_bytes + att_b_bytes,
        "ep_dispatch_s": mb * layers * sum(ep_s),
        "mixer_s": mb * layers * (mix_f[0] + mix_f[1] + mix_b[0] + mix_b[1]),
        "mixer_exposed_comm_s": mb * layers * (mix_f[1] + mix_b[1]),
        "mixer_bytes_per_layer": mix_bytes,
    }


def _dispatch_s(spec: PlanSpec, tokens: int) -> tuple[float, float]:
    """Seconds of one MoE layer's expert-parallel all-to-alls, (forward, backward), exposed.

    Forward: the per-expert counts (ep ints), then each of the tokens x top_k rows to the rank of
    its expert and back; backward: the two row exchanges reversed. A rank keeps 1/ep of its rows
    (uniform routing), the rest cross the ep group."""
    m = spec.model
    if not m.experts or spec.ep == 1:
        return 0.0, 0.0
    inter = spec.spans_nodes(spec.ep * spec.tp)
    rows = tokens * m.top_k * m.dim * spec.elem_bytes * (spec.ep - 1) / spec.ep
    exchange = spec.hw.transfer_s(rows, inter, spec.ep - 1)
    counts = spec.hw.transfer_s(8 * spec.ep, inter, spec.ep - 1)
    return counts + 2 * exchange, 2 * exchange
