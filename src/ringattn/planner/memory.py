"""Peak memory per rank of one training step, by kind.

    parameters, gradients   float32, sharded by FSDP2 over dp x cp (and split by tp, pp)
    optimizer               AdamW's two float32 moments, sharded the same way
    fsdp buffers            the all-gathered compute-dtype copy of the current and the prefetched
                            block, their float32 gradients before the reduce-scatter, and the root
                            unit (embeddings, output) unsharded for the whole step; with --ep a
                            block's experts are gathered only for this rank's 1/ep of them
    expert dispatch         --ep: the top_k rows of every token sent and received, forward
                            (hidden in, expert out) and their gradients in backward
    activations             what autograd keeps per block and token (the profiler's live
                            tensors on CPU, scripts/bench/long_seq.py --breakdown):
                              each RMSNorm: its input in float32 (in bf16 a copy: both ours
                              and transformers' norm compute in float32), normed and output
                              rotated q, k, v; attention out and lse; the (B, S, H*D) copy for wo
                              w1 and w3 outputs, silu, their product: 4 x hidden
                            with activation checkpointing only each block's input (dim), plus
                            the block being recomputed
    backward transient      gradients in flight inside the block being differentiated (below)
    attention buffers       attention's backward: per strategy (docs/strategies.md) ring 2 K/V
                            + 2 float32 dK/dV, allgather W K/V + W dK/dV, ulysses ~2 (Q + K/V);
                            the float32 dq accumulator; one block's dq, dk, dv from the kernel
                            (on CPU with GQA the kernel's expanded K/V and dK/dV as well)
    loss                    one chunk of float32 logits (the hand-written backward of
                            models/loss.py changes it in place; whole logits: 3 copies) and the
                            output projection's weight gradient, summed over the chunks
    mixer buffers           hybrids, the mixer layer being run: its chunk states (float32, one
                            per chunk of its rows, and their gradients in backward); state
                            passing adds the W x runs gathered summaries; gather adds the
                            gathered input and its full-length gradient; heads adds those and
                            the full-length output gradient (the summed output's is S x hidden)

Phases: a step's tensors peak at different times, never alive together, so the total is the
largest of them, not their sum (the kinds are those of the largest; the others' are 0):

    loss phase       the kept activations (checkpoints, or every block's without
                     checkpointing), the final norm's float32 input, normed and output, the
                     hidden gradient the loss fills, a chunk of logits, the head's gradient
    MLP's backward   the kept activations, the block being differentiated (recomputed under
                     checkpointing) with three of the MLP's intermediates (the product is freed
                     once w2's backward has run) and three gradients of their width, for the
                     MLP's rows at a time (a tile's under the tiled MLP); the block output's
                     gradient (and the tiled MLP's input gradient, filled tile by tile)
    attention's      the kept activations and the block without its MLP, second norm and wo
    backward         input (freed by then); in flight the residual's gradient and attention's
                     dout; attention's buffers
    (both block moments add expert dispatch and mixer buffers)

Measured on CPU (scripts/bench/long_seq.py --breakdown, SmolLM2-135M's shape, 16k tokens, W = 2,
256-row loss chunk): untiled the MLP's backward is the peak, 500 MiB (498 priced); tiled,
attention's, 319 (312 priced), where attention's buffers are 160 MiB (156 priced). Before, the
model counted two tensors per norm (three are kept), four of the MLP's width in its backward
(six are alive), the second norm's tensors and wo's input in attention's backward (freed by
then), no weight gradient in the loss phase, and three chunks of logits (one, since the
hand-written backward): -20 % untiled at 16k. (The "+51 %" reported at 32k tiled was mostly
the bench's old peak reading, which netted each op's frees against its allocations.)

Hybrid activations: a mixer layer keeps its own tensors (work.MixerShape.activation_elems) in
place of attention's; under the gather scheme it ran on all S rows, so it keeps W times as many,
plus the gathered input; under heads it ran on all S rows for 1/W of the heads, so it keeps as
many as one shard's, plus the gathered input. Attention and mixer parts are weighted by their
layers' shares.

With pp the first stage keeps the activations of schedule.kept(...) microbatches: all m with
GPipe, min(m, pp) with 1F1B, a little more interleaved. Only what each microbatch keeps until
its backward is multiplied: the block being differentiated (recomputed from its checkpoint, or
its tensors freed as its backward runs), the MLP's backward working set and the final norm's
tensors belong to one microbatch at a time.
"""

from __future__ import annotations

from ringattn.planner.cost import PlanSpec
from ringattn.planner.schedule import kept as kept_microbatches

__all__ = ["host_bytes", "memory_bytes", "mixer_memory_bytes"]

GIB = 1024**3


def _block_activation_elems(spec: PlanSpec) -> float:
    """Elements autograd keeps per token for one block (see the module docstring)."""
    m, tp = spec.model, spec.tp
    # each of the two norms: its input in float32 (a copy unless float32 already), its normed
    # and output in the compute dtype; sequence-parallel norms: split by tp as well
    width = 2 * (4 / spec.elem_bytes + 2) * m.dim / tp
    attention = (3 * m.q_dim + 2 * m.kv_dim) / tp + (m.n_heads / tp) * 4 / spec.elem_bytes
    mlp = m.top_k * (m.expert_hidden or m.hidden_dim) if m.experts else m.hidden_dim
    mixer = 0.0
    if m.mixer_layers:
        attention *= m.attention_layers / m.n_layers
        mixer = _mixer_elems(spec) * m.mixer_layers / m.n_layers
    return width + attention + mixer + 4 * mlp / tp


def _mlp_elems(spec: PlanSpec) -> float:
    """Of _block_activation_elems, the MLP's intermediates (w1, w3, silu, product)."""
    m = spec.model
    mlp = m.top_k * (m.expert_hidden or m.hidden_dim) if m.experts else m.hidden_dim
    return 4 * mlp / spec.tp


def host_bytes(spec: PlanSpec) -> float:
    """Host memory per GPU: the offloaded checkpoints (layers x tokens x dim) and, with the
    model-state offload what-if, 18 bytes per local parameter (the compute-dtype copy, float32
    master, gradient and moments)."""
    m = spec.model
    layers = -(-m.n_layers // spec.pp)
    tokens = spec.micro_batch * (spec.seq_len // spec.cp)
    host = 0.0
    if spec.offload_activations and spec.activation_checkpointing and not spec.hw.is_cpu:
        in_flight = kept_microbatches(spec.pp_schedule, spec.pp, spec.pipe_microbatches,
                                      spec.virtual)  # fmt: skip
        host += in_flight * layers * tokens * m.dim / spec.tp * spec.elem_bytes
    if spec.offload_states:
        vocab = m.vocab_size * m.dim * (1 if spec.pp > 1 or m.tied_embeddings else 2)
        local = (layers * m.layer_params() + vocab) / spec.tp
        host += 18 * local / (spec.dp * spec.cp)
    return host


def _mixer_elems(spec: PlanSpec) -> float:
    """Elements one mixer layer keeps per local token (the module docstring)."""
    m, w, scheme = spec.model, spec.cp, spec.mixer_run
    elems = m.mixer.activation_elems(m.dim) / spec.tp
    if w > 1 and scheme == "gather":  # all S rows, and the gathered input
        elems = w * (elems + m.dim / spec.tp)
    elif w > 1 and scheme == "heads":  # all S rows of 1/W of the heads, and the gathered input
        elems += w * m.dim / spec.tp
    return elems


def _mixer_buffers(spec: PlanSpec, tokens: int) -> float:
    """Bytes of the mixer layer being run, beyond its activations (the module docstring)."""
    m, w, e = spec.model, spec.cp, spec.elem_bytes
    mx = m.mixer
    scheme = spec.mixer_run if w > 1 else "state_passing"  # W = 1: the shard is the sequence
    rows = tokens * w if scheme in ("gather", "heads") else tokens
    states = 2 * -(-rows // mx.chunk) * mx.state_bytes() / spec.tp
    if scheme == "gather":
        return states + 2 * rows * m.dim / spec.tp * e
    if scheme == "heads":  # 1/W of the states; input, input and output gradients all S rows
        return states / w + 3 * rows * m.dim / spec.tp * e
    runs = 2 if spec.layout == "zigzag" else 1
    return states + w * runs * spec.micro_batch * mx.summary_bytes() / spec.tp


def mixer_memory_bytes(spec: PlanSpec) -> float:
    """Of memory_bytes' total, what the mixer layers hold: their share of the activations
    (without checkpointing) and the mixer buffers."""
    m = spec.model
    if not m.mixer_layers:
        return 0.0
    tokens = spec.micro_batch * (spec.seq_len // spec.cp)
    layers = -(-m.n_layers // spec.pp) * m.mixer_layers / m.n_layers
    in_flight = kept_microbatches(spec.pp_schedule, spec.pp, spec.pipe_microbatches, spec.virtual)
    kept = 0.0 if spec.activation_checkpointing else layers * in_flight
    return (kept * _mixer_elems(spec) * spec.elem_bytes * tokens) + _mixer_buffers(spec, tokens)


def memory_bytes(spec: PlanSpec) -> dict:
    """Peak bytes per rank by kind, and their sum under "total"."""
    m, e = spec.model, spec.elem_bytes
    layers = -(-m.n_layers // spec.pp)  # the heaviest stage
    shards = spec.dp * spec.cp
    # the heaviest stage: its blocks, and the embeddings at both ends when pp == 1
    vocab_params = m.vocab_size * m.dim * (1 if spec.pp > 1 or m.tied_embeddings else 2)
    local = (layers * m.layer_params() + vocab_params) / spec.tp
    layer_local = (m.layer_params() - m.expert_params() * (1 - 1 / spec.ep)) / spec.tp
    params = 4 * local / shards
    grads = 4 * local / shards
    optimizer = 8 * local / shards
    if spec.offload_states:  # what-if: only the layers in use (and the root unit) stay here
        params = grads = (2 * layer_local + vocab_params / spec.tp) * e
        optimizer = 0.0
    fsdp = 0.0
    if shards > 1 and not spec.offload_states:  # offloaded: the layers in use are `params`
        fsdp = 2 * layer_local * (e + 4) + vocab_params / spec.tp * e
    tokens = spec.micro_batch * (spec.seq_len // spec.cp)
    dim = m.dim / spec.tp
    block, mlp = _block_activation_elems(spec), _mlp_elems(spec)
    one = mlp / 4  # one of the MLP's four intermediates, per row
    q_dim = m.n_heads / spec.tp * m.d_head
    # the MLP's rows at a time: a tile's under the tiled MLP (recomputed in its backward)
    tile_rows = min(tokens, spec.tiled_mlp) if spec.tiled_mlp else tokens
    # what each block keeps without checkpointing: tiled, the MLP keeps only its (normed) input
    kept_block = (block - mlp) * e * tokens if spec.tiled_mlp else block * e * tokens
    in_flight = kept_microbatches(spec.pp_schedule, spec.pp, spec.pipe_microbatches, spec.virtual)
    if spec.activation_checkpointing:
        # offloaded: the checkpoint in use and the one being prefetched stay on the device (on
        # cpu the host is the device: the copies live in the same memory, nothing is saved)
        held = min(layers, 2) if spec.offload_activations and not spec.hw.is_cpu else layers
        kept = held * tokens * dim * e
        # the block being differentiated, recomputed from its checkpoint (its input, in `kept`)
        own = (block - mlp - (dim if e == 4 else 0)) * tokens * e  # float32: it is the first
        # norm's input; else the norm keeps a float32 copy of it
        mlp_kept = 0.0  # recomputed below, a tile at a time when tiled
    else:
        kept, own = layers * kept_block, 0.0  # the block's own tensors are among the kept
        mlp_kept = 0.0 if spec.tiled_mlp else mlp * tokens * e
    # moment 1, the MLP's backward: three of its four intermediates (the product is freed once
    # w2's backward has run) and three gradients of that width, for the rows at a time
    # (without checkpointing, untiled, they are among the kept: only the product is freed);
    # in flight: the block output's gradient, and the tiled MLP's input gradient it fills
    mlp_live = -one * tokens * e if mlp_kept else 3 * one * tile_rows * e
    mlp_moment = {
        "activations": in_flight * kept + own + mlp_live,
        "backward_transient": (3 * one * tile_rows + dim * tokens) * e
        + (dim * tokens * e if spec.tiled_mlp else 0.0),
    }
    # moment 2, attention's backward: the MLP's tensors, the second norm's and the output
    # projection's input are freed; the first norm's normed and output, q, k, v, out and lse
    # stay; in flight: the residual's gradient and attention's dout
    freed = ((4 / e + 2) * dim + q_dim) * tokens * e + mlp_kept  # the second norm's; wo's input
    attention_moment = {
        "activations": in_flight * kept + own - freed,
        "backward_transient": (dim + q_dim) * tokens * e,
    }
    # the final norm's float32 input, normed and output, and the gradient the loss fills
    hidden = (4 / e + 3) * tokens * dim * e
    # attention's buffers in its backward: the strategy's (K/V in flight, dK/dV partials), the
    # float32 dq accumulator and one block's dq, dk, dv from the kernel
    hq, hkv, d, w = m.n_heads / spec.tp, m.n_kv_heads / spec.tp, m.d_head, spec.cp
    q_bytes = tokens * hq * d * e
    kv_bytes = 2 * tokens * hkv * d * e
    kv32 = kv_bytes * 4 / e
    if w == 1:
        buffers = 0.0
    elif spec.strategy == "ring":
        buffers = 2 * kv_bytes + 2 * kv32
    elif spec.strategy == "allgather":
        buffers = w * (kv_bytes + kv32)
    elif spec.strategy == "ulysses":
        buffers = 2 * (q_bytes + kv_bytes)
    else:
        u = spec.ulysses
        buffers = 2 * (q_bytes + kv_bytes) + 2 * u * kv_bytes + 2 * u * kv32
    buffers += q_bytes * 4 / e + q_bytes + kv_bytes  # dq (float32), a block's dq, dk, dv
    if spec.hw.is_cpu and hq != hkv:  # cpu_flash expands GQA K/V (and so dK/dV) for its backward
        buffers += 2 * tokens * hq * d * 4 + 2 * (q_bytes - kv_bytes / 2) * 4 / e
    loss_rows = min(tokens, spec.loss_chunk) if spec.loss_chunk > 0 else tokens
    # chunked: one chunk of float32 logits at a time (changed in place by the hand-written
    # backward, models/loss.py); whole: the logits, their log-softmax and its gradient; both:
    # the output projection's weight gradient, summed over the chunks
    logits = (1 if spec.loss_chunk > 0 else 3) * loss_rows * m.vocab_size / spec.tp * 4
    logits += loss_rows * m.vocab_size / spec.tp * e if e != 4 else 0.0  # before the cast
    loss = logits + m.vocab_size * m.dim / spec.tp * e
    dispatch = 4 * tokens * m.top_k * m.dim * e if m.experts and spec.ep > 1 else 0.0
    # the phases of a step (module docstring, "Phases"): the loss, or a block's backward at
    # the larger of its two moments
    loss_phase = {"activations": in_flight * kept + hidden, "loss": loss}
    attention_moment["attention_buffers"] = buffers
    moment = max(mlp_moment, attention_moment, key=lambda phase: sum(phase.values()))
    block_phase = {
        **moment,
        "expert_dispatch": dispatch,
        "mixer_buffers": _mixer_buffers(spec, tokens) if m.mixer_layers else 0.0,
    }
    peak = max(loss_phase, block_phase, key=lambda phase: sum(phase.values()))
    kinds = {"parameters": params, "gradients": grads, "optimizer": optimizer,
             "fsdp_buffers": fsdp}  # fmt: skip
    for kind in ("activations", "backward_transient", "attention_buffers", "loss",
                 "expert_dispatch", "mixer_buffers"):  # fmt: skip
        kinds[kind] = peak.get(kind, 0.0)
    kinds["total"] = sum(kinds.values())
    return kinds
