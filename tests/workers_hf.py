"""Rank functions for ringattn.hf (see harness.py): tiny transformers models, CP vs one process.

Each architecture is built once per worker process from a tiny config with random weights (seeded,
so every rank holds the same weights). The reference is the same weights with transformers' own
eager attention on the whole sequence in one process (rank 0, cached per data case): its loss and
gradients. The CP side is a deep copy of the model, parallelized, fed by `shard_batch`; every
rank's loss and gradients are summed over the group and rank 0 compares them with the reference.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist

import ringattn.hf

VOCAB = 100
DOCS = (11, 1, 18, 7)  # packed documents: a one-token document, one longer than every window
SEQ_LEN = sum(DOCS)  # 37: divisible by no 2W
WINDOW = 4  # Mistral's and Gemma 3's sliding window: shorter than most documents
SOFTCAP = 1.0  # Gemma 2's attention logit softcapping: below its scores, so it matters


def _config(arch: str):
    """A tiny config (2 layers, hidden 32, GQA 4/2 heads) exercising the architecture's quirk."""
    import transformers as tf

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "attn_implementation": "eager",
    }
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":  # q/k/v projection bias
        return tf.Qwen2Config(**common)
    if arch == "qwen3":  # q/k RMS norms, explicit head_dim
        return tf.Qwen3Config(head_dim=8, **common)
    if arch == "mistral":  # sliding window on every layer
        return tf.MistralConfig(sliding_window=WINDOW, **common)
    if arch == "gemma3":  # local (sliding) and global layers, query_pre_attn_scalar scaling
        return tf.Gemma3TextConfig(
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=12,
            **common,
        )
    if arch == "gpt_oss":  # attention sinks (s_aux), sliding and full layers, MoE
        return tf.GptOssConfig(
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            **{**common, "intermediate_size": 32},
        )
    if arch == "gemma2":  # attention logit softcapping (small: build() makes scores O(1)),
        # local (sliding) and global layers, final logit softcapping
        return tf.Gemma2Config(
            head_dim=8,
            query_pre_attn_scalar=8,
            attn_logit_softcapping=SOFTCAP,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    raise ValueError(f"unknown test architecture {arch!r}")


_MODELS: dict[str, torch.nn.Module] = {}


def build(arch: str, **overrides) -> torch.nn.Module:
    """The reference model of `arch` (eager attention), built once per process from seed 0."""
    from transformers import AutoModelForCausalLM

    key = arch + repr(sorted(overrides.items()))
    if key not in _MODELS:
        config = _config(arch)
        for name, value in overrides.items():
            setattr(config, name, value)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        if arch == "gpt_oss":  # sinks start at 0 (torch.empty + init); make them matter
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_(0.0, 1.0)
        if arch == "gemma2":  # scores of O(1), not O(1e-3): the cap must change the loss
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_proj.weight.normal_(0.0, 0.3)
                    layer.self_attn.k_proj.weight.normal_(0.0, 0.3)
        _MODELS[key] = model
    return _MODELS[key]


def data(kind: str) -> dict[str, torch.Tensor]:
    """The full batch of one data case (the same on every rank) in the form given to shard_batch.

    dense: one sequence, its first 3 labels unsupervised. packed: DataCollatorWithFlattening's
    form (position_ids restarting at 0, label -100 at each document's first token). cu_seqlens:
    the same documents given as boundaries.
    """
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=gen)
    labels = ids.clone()
    if kind == "dense":
        labels[:, :3] = -100
        return {"input_ids": ids, "labels": labels}
    bounds = [0, *itertools.accumulate(DOCS)]
    labels[:, bounds[:-1]] = -100
    if kind == "cu_seqlens":
        return {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(bounds)}
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


_REFERENCES: dict[tuple, tuple[float, dict[str, torch.Tensor]]] = {}


def reference(arch: str, kind: str, **overrides) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients: the model's own attention on the full sequence."""
    key = (arch, kind, repr(sorted(overrides.items())))
    if key not in _REFERENCES:
        model = build(arch, **overrides)
        batch = data(kind)
        if "cu_seqlens" in batch:  # transformers' packed form: positions restarting at 0
            batch = data("packed")
        if arch == "gpt_oss" and kind != "dense":
            # transformers' gpt-oss builds its masks without position_ids, so it would attend
            # across documents: give it the per-layer-type masks (block-diagonal) explicitly
            batch = {**batch, "attention_mask": packed_masks(WINDOW)}
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        _REFERENCES[key] = (out.loss.item(), grads)
    return _REFERENCES[key]


def packed_masks(window: int) -> dict[str, torch.Tensor]:
    """Eager additive (1, 1, S, S) masks by layer type: causal within each document (+ window)."""
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
    i, j = torch.arange(SEQ_LEN).unsqueeze(1), torch.arange(SEQ_LEN).unsqueeze(0)
    full = (doc.unsqueeze(1) == doc.unsqueeze(0)) & (j <= i)
    hidden = torch.finfo(torch.float32).min
    masks = {"full_attention": full, "sliding_attention": full & (i - j < window)}
    return {
        name: torch.zeros(m.shape).masked_fill(~m, hidden)[None, None] for name, m in masks.items()
    }


_PARALLEL: dict[tuple, torch.nn.Module] = {}


def parallel_model(arch: str, layout: str, strategy: str, **overrides) -> torch.nn.Module:
    key = (arch, layout, strategy, repr(sorted(overrides.items())))
    if key not in _PARALLEL:
        model = copy.deepcopy(build(arch, **overrides))
        _PARALLEL[key] = ringattn.hf.parallelize(model, layout=layout, strategy=strategy)
    return _PARALLEL[key]


def cp_loss_and_grads(arch, kind, layout, strategy, **overrides):
    """This rank's loss and gradients, summed over the group (every rank gets the sums)."""
    model = parallel_model(arch, layout, strategy, **overrides)
    model.zero_grad(set_to_none=True)
    batch = ringattn.hf.shard_batch(data(kind), layout=layout)
    out = model(**batch)
    out.loss.backward()
    names = [name for name, _ in model.named_parameters()]
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for _, p in model.named_parameters()
        ]
        + [out.loss.detach().reshape(1)]
    )
    dist.all_reduce(flat)
    grads, offset = {}, 0
    for name, p in zip(names, model.parameters()):
        grads[name] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return float(flat[-1]), grads, out.logits.shape


def compare_cases(rank, world_size, *, arch, cases, overrides=None):
    """Run (layout, strategy, kind) cases; rank 0 returns one row of errors per case.

    Row: (case, loss relative error, worst gradient error / that tensor's max |entry|, tensor
    name, local logits shape, smallest reference max |gradient| (to show gradients are not 0)).
    """
    overrides = overrides or {}
    rows = []
    for layout, strategy, kind in cases:
        loss, grads, logits_shape = cp_loss_and_grads(arch, kind, layout, strategy, **overrides)
        if rank != 0:
            continue
        ref_loss, ref_grads = reference(arch, kind, **overrides)
        worst, worst_name, smallest = 0.0, "", float("inf")
        for name, ref in ref_grads.items():
            scale = ref.abs().max().item()
            smallest = min(smallest, scale)
            ratio = (grads[name] - ref).abs().max().item() / max(scale, 1e-30)
            if not ratio <= worst:  # NaN counts as worst
                worst, worst_name = ratio, name
        loss_error = abs(loss - ref_loss) / abs(ref_loss)
        rows.append(
            ((layout, strategy, kind), loss_error, worst, worst_name, logits_shape, smallest)
        )
    return rows if rank == 0 else None


def window_matters(rank, world_size):
    """Reference losses of Mistral with and without its sliding window (must differ)."""
    with_window = reference("mistral", "dense")[0]
    without = reference("mistral", "dense", sliding_window=None)[0]
    return with_window, without


def softcap_matters(rank, world_size):
    """Reference losses of Gemma 2 with and without its attention logit softcapping."""
    with_cap = reference("gemma2", "packed")[0]
    without = reference("gemma2", "packed", attn_logit_softcapping=None)[0]
    return with_cap, without


def unsupported(rank, world_size, *, arch, overrides=None, mode="train", batch_extra=None):
    """Run one forward that must raise: an unsupported setting, or a bad mask on rank 0 only."""
    model = parallel_model(arch, "zigzag", "ring", **(overrides or {}))
    model.train(mode == "train")
    batch = ringattn.hf.shard_batch(data("dense"), layout="zigzag")
    if batch_extra == "mask_on_rank0":
        mask = torch.ones_like(batch["input_ids"])
        if rank == 0:
            mask[0, 0] = 0
        batch["attention_mask"] = mask
    elif batch_extra == "no_shard_batch":
        batch = {"input_ids": batch["input_ids"]}
    try:
        model(**batch)
    finally:
        model.train()


def deepcopy_parallelized(rank, world_size):
    """A deep copy of a parallelized model runs on the same group and gives the same loss."""
    model = copy.deepcopy(build("llama"))
    ringattn.hf.parallelize(model, group=dist.group.WORLD)  # an explicit group: copied by reference
    batch = ringattn.hf.shard_batch(data("packed"), layout="zigzag")
    with torch.no_grad():
        return model(**batch).loss.item(), copy.deepcopy(model)(**batch).loss.item()


def different_sequences(rank, world_size, *, differ):
    """shard_batch where the last rank was given another sequence of the same length: `differ`
    names what it changed ("input_ids": two tokens swapped, "labels": one label, "documents":
    other document bounds, "none": nothing). Returns the input_ids it got back."""
    batch = data("packed")
    if rank == world_size - 1:
        if differ == "input_ids":
            ids = batch["input_ids"].clone()
            ids[0, [3, 20]] = ids[0, [20, 3]]
            assert not torch.equal(ids, batch["input_ids"])
            batch["input_ids"] = ids
        elif differ == "labels":
            batch["labels"] = batch["labels"].clone()
            batch["labels"][0, 5] = -100
        elif differ == "documents":  # the same tokens and positions, bounds given another way
            batch = {**data("cu_seqlens"), "cu_seqlens": [0, 12, SEQ_LEN]}
    return ringattn.hf.shard_batch(batch, group=dist.group.WORLD)["input_ids"]
