"""Rank functions for the MoE router loss under CP (test_hf_moe.py; harness.py conventions).

Tiny Mixtral, Qwen3-MoE and gpt-oss models (4 experts, top-2, `output_router_logits=True`, a
large router_aux_loss_coef so the router term matters), random weights from seed 0 on every rank.
The reference is the same weights on one process with transformers' eager attention: its
`out.loss` (cross-entropy + coef * aux), `out.aux_loss` and gradients. The CP side is a deep copy,
parallelized, fed by `shard_batch`: the losses and gradients are summed over the group, the
aux_loss must be the reference's on every rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ringattn.hf
from workers_hf import VOCAB, WINDOW, data

COEF = 0.5


def _config(arch: str):
    import transformers as tf

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "attn_implementation": "eager",
        "output_router_logits": True,
        "router_aux_loss_coef": COEF,
        "num_experts_per_tok": 2,
    }
    if arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, intermediate_size=32, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            num_experts=4,
            moe_intermediate_size=16,
            intermediate_size=32,
            head_dim=8,
            norm_topk_prob=True,
            **common,
        )
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            num_local_experts=4,
            intermediate_size=32,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    raise ValueError(f"unknown MoE test architecture {arch!r}")


_MODELS: dict[str, torch.nn.Module] = {}


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if arch not in _MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(arch)).float()
        with torch.no_grad():  # zero-initialised routers (Qwen3-MoE, gpt-oss) route uniformly
            for name, p in model.named_parameters():
                if "router" in name or ".gate." in name or name.endswith("gate.weight"):
                    p.normal_(0.0, 0.5)
        _MODELS[arch] = model
    return _MODELS[arch]


_REFERENCES: dict[tuple, tuple] = {}


def reference(arch: str, kind: str):
    """(loss, aux_loss, gradients) of the whole sequence on this process."""
    if (arch, kind) not in _REFERENCES:
        model = build(arch)
        batch = data("packed" if kind == "cu_seqlens" else kind)
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        _REFERENCES[(arch, kind)] = (out.loss.item(), out.aux_loss.item(), grads)
    return _REFERENCES[(arch, kind)]


_PARALLEL: dict[tuple, torch.nn.Module] = {}


def _parallel(arch: str, layout: str, strategy: str) -> torch.nn.Module:
    if (arch, layout, strategy) not in _PARALLEL:
        model = copy.deepcopy(build(arch))
        _PARALLEL[(arch, layout, strategy)] = ringattn.hf.parallelize(
            model, layout=layout, strategy=strategy
        )
    return _PARALLEL[(arch, layout, strategy)]


def compare(rank, world_size, *, arch, cases):
    """Per (layout, strategy, kind): rank 0 returns (case, loss rel. error, aux rel. error,
    worst gradient error / its tensor's max entry, that tensor, reference coef*aux / loss)."""
    rows = []
    for layout, strategy, kind in cases:
        model = _parallel(arch, layout, strategy)
        model.zero_grad(set_to_none=True)
        out = model(**ringattn.hf.shard_batch(data(kind), layout=layout))
        out.loss.backward()
        params = list(model.named_parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in params]
            + [out.loss.detach().reshape(1)]
        )
        dist.all_reduce(flat)
        auxes = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(auxes, out.aux_loss.detach().reshape(1))
        if rank != 0:
            continue
        ref_loss, ref_aux, ref_grads = reference(arch, kind)
        worst, worst_name, offset = 0.0, "", 0
        for name, p in params:
            got = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            ref = ref_grads[name]
            ratio = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if not ratio <= worst:
                worst, worst_name = ratio, name
        aux_error = max(abs(float(a) - ref_aux) for a in auxes) / ref_aux
        rows.append(
            (
                (layout, strategy, kind),
                abs(float(flat[-1]) - ref_loss) / ref_loss,
                aux_error,
                worst,
                worst_name,
                COEF * ref_aux / ref_loss,
            )
        )
    return rows if rank == 0 else None


def naive_error(rank, world_size, *, arch):
    """The summed loss WITHOUT ringattn's router hook (transformers' per-rank aux), relative to
    the reference: shows what the hook corrects."""
    model = copy.deepcopy(build(arch))
    ringattn.hf.parallelize(model)
    model._forward_hooks.clear()  # the router hook only; the attention needs no hook
    with torch.no_grad():
        loss = model(**ringattn.hf.shard_batch(data("dense"))).loss.reshape(1)
    dist.all_reduce(loss)
    return abs(float(loss) - reference(arch, "dense")[0]) / reference(arch, "dense")[0]


def wrong_formula(rank, world_size):
    """A model whose aux_loss is not the Switch formula must raise on every rank."""
    model = _parallel("mixtral", "zigzag", "ring")
    batch = ringattn.hf.shard_batch(data("dense"))

    def doubled(module, args, kwargs, output):  # a stand-in for a different router loss
        output.aux_loss = output.aux_loss * 2
        return output

    handle = model.register_forward_hook(doubled, with_kwargs=True, prepend=True)
    try:
        model(**batch)
    finally:
        handle.remove()


def generate_equal(rank, world_size, *, arch, layout, new_tokens=5):
    """ringattn.hf.generate's greedy tokens equal model.generate's (rank 0 compares)."""
    model = build(arch).eval()
    prompt = data("dense")["input_ids"][:, :23]
    got = ringattn.hf.generate(model, prompt, new_tokens, layout=layout, eos_token_id=[])
    want = model.generate(
        prompt, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    model.train()
    return got.tolist(), want.tolist()


def train(rank, world_size, options):
    """`ringattn train --hf` in this pool's world: rank 0's logged loss and aux_loss per step, the
    initial and the final full parameters."""
    from ringattn.train.loop import train as train_run
    from workers_train import build, full_parameters

    run = build(options)  # optimizer="sgd": weights exact by construction
    start = full_parameters(run.model)
    run = train_run(run)
    params = full_parameters(run.model)
    history = [(h["loss"], h.get("aux_loss")) for h in run.history]
    return {
        "history": history,
        "params": params if rank == 0 else None,
        "start": start if rank == 0 else None,
    }


def save_config(directory) -> None:
    """The tiny Mixtral's config.json (random init under --hf) with the router loss on."""
    config = _config("mixtral")
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(directory)
