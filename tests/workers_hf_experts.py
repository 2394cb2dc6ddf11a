"""Rank functions for expert parallelism (test_hf_experts.py; harness.py conventions).

The tiny MoE models of workers_hf_moe.py (4 experts, top-2, router loss on). The world is dp x cp
ranks, dp-major (the cp group of replica i is ranks [i cp, (i+1) cp)); replica i trains on its own
batch (`_batch`), its router loss over its cp group. Experts are split over blocks of `ep`
consecutive ranks: ep = cp folds EP onto the cp ranks, ep = dp x cp onto the whole world. The
reference is one process running the same weights on each replica's batch in turn: losses and
gradients summed. The parallel side's gradients: replicated tensors summed over the world, each
expert slice put in place in a zero tensor of the whole expert dim and summed over the world.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ringattn.hf
from ringattn.comm import group_cache
from ringattn.integrations.hf.experts import EXPERTS_ATTR
from workers_hf import VOCAB, data
from workers_hf_moe import build

_GROUPS: dict[tuple[int, int], tuple] = {}


def _blocks(size: int) -> object:
    """This rank's group among the blocks of `size` consecutive ranks (every rank creates all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, size):
        group = group_cache.new_group(range(start, start + size))  # once per pool process
        if start <= rank < start + size:
            mine = group
    return mine


def _groups(cp: int, ep: int) -> tuple:
    if (cp, ep) not in _GROUPS:
        _GROUPS[(cp, ep)] = (_blocks(cp), _blocks(ep))
    return _GROUPS[(cp, ep)]


def _batch(kind: str, replica: int) -> dict[str, torch.Tensor]:
    """Replica 0 has workers_hf's batch; replica i its tokens shifted by 7 i (labels alike)."""
    batch = data(kind)
    ids = (batch["input_ids"] + 7 * replica) % VOCAB
    labels = torch.where(
        batch["labels"] < 0, batch["labels"], (batch["labels"] + 7 * replica) % VOCAB
    )
    return {**batch, "input_ids": ids, "labels": labels}


def skew(model: torch.nn.Module) -> torch.nn.Module:
    """Every router sends every token to experts 0 and 1 (its scores kept): with ep 2, all of
    them to rank 0 and none to rank 1."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, f"{type(model).__name__}: no router found to skew"
    for module in routers:
        module.register_forward_hook(_to_first_experts)
    return model


def _to_first_experts(module, args, output):
    logits, scores, index = output
    fixed = torch.arange(index.shape[-1], device=index.device).expand_as(index)
    return logits, scores, fixed


_REFERENCES: dict[tuple, tuple] = {}


def reference(arch: str, kind: str, dp: int, skewed: bool) -> tuple[float, dict]:
    """Loss and gradients of one process over the dp replicas' batches, summed."""
    key = (arch, kind, dp, skewed)
    if key not in _REFERENCES:
        model = copy.deepcopy(build(arch))
        if skewed:
            skew(model)
        loss = 0.0
        for replica in range(dp):
            out = model(**_batch(kind, replica), use_cache=False)
            out.loss.backward()
            loss += out.loss.item()
        _REFERENCES[key] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
    return _REFERENCES[key]


_PARALLEL: dict[tuple, torch.nn.Module] = {}


def _parallel(arch, layout, strategy, cp, ep, skewed) -> torch.nn.Module:
    key = (arch, layout, strategy, cp, ep, skewed)
    if key not in _PARALLEL:
        cp_group, ep_group = _groups(cp, ep)
        model = copy.deepcopy(build(arch))
        if skewed:
            skew(model)
        _PARALLEL[key] = ringattn.hf.parallelize(
            model, cp_group, layout, strategy, expert_group=ep_group
        )
    return _PARALLEL[key]


def full_gradients(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) with each expert slice in place in zeros of the whole expert dim."""
    shards = {
        f"{name}.{p}" if name else p: getattr(m, EXPERTS_ATTR)
        for name, m in model.named_modules()
        if getattr(m, EXPERTS_ATTR, None) is not None
        for p, _ in m.named_parameters(recurse=False)
    }
    out = []
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        shard = shards.get(name)
        if shard is not None:
            whole = torch.zeros(shard.total, *p.shape[1:], dtype=p.dtype, device=p.device)
            whole[shard.start : shard.start + shard.local] = grad
            grad = whole
        out.append((name, grad))
    return out


def compare(rank, world_size, *, arch, cases, dp, ep, skewed=False):
    """Per (layout, strategy, kind): rank 0 returns (case, loss rel. error, worst gradient error
    / its tensor's max entry, that tensor, expert rows this rank held / the whole)."""
    cp = world_size // dp
    rows = []
    for layout, strategy, kind in cases:
        model = _parallel(arch, layout, strategy, cp, ep, skewed)
        cp_group = _groups(cp, ep)[0]
        model.zero_grad(set_to_none=True)
        batch = ringattn.hf.shard_batch(_batch(kind, rank // cp), cp_group, layout=layout)
        out = model(**batch)
        out.loss.backward()
        grads = full_gradients(model)
        flat = torch.cat([g.flatten() for _, g in grads] + [out.loss.detach().reshape(1)])
        dist.all_reduce(flat)
        if rank != 0:
            continue
        ref_loss, ref_grads = reference(arch, kind, dp, skewed)
        worst, worst_name, offset = 0.0, "", 0
        for name, grad in grads:
            got = flat[offset : offset + grad.numel()].view_as(grad)
            offset += grad.numel()
            ref = ref_grads[name]
            ratio = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if not ratio <= worst:
                worst, worst_name = ratio, name
        held = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
        whole = sum(p.numel() for n, p in build(arch).named_parameters() if "experts" in n)
        rows.append(
            (
                (layout, strategy, kind),
                abs(float(flat[-1]) - ref_loss) / ref_loss,
                worst,
                worst_name,
                held / whole,
            )
        )
    return rows if rank == 0 else None


def indivisible(rank, world_size):
    """4 experts over 3 ranks: a ValueError on every rank, before any communication."""
    ringattn.hf.parallelize(copy.deepcopy(build("mixtral")), expert_group=dist.group.WORLD)


def generate_equal(rank, world_size, *, arch, layout, new_tokens=5):
    """ringattn.hf.generate with the experts split over the world equals model.generate."""
    model = ringattn.hf.parallelize(
        copy.deepcopy(build(arch)), layout=layout, expert_group=dist.group.WORLD
    ).eval()
    prompt = data("dense")["input_ids"][:, :23]
    got = ringattn.hf.generate(model, prompt, new_tokens, layout=layout, eos_token_id=[])
    want = (
        build(arch)
        .eval()
        .generate(prompt, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    )
    build(arch).train()
    return got.tolist(), want.tolist()


def train(rank, world_size, options):
    """`ringattn train --hf` in this pool's world: rank 0's (loss, aux_loss) per step, the final
    checkpoint, and on one process the final parameters."""
    from ringattn.train.loop import train as train_run
    from workers_train import build, full_parameters

    run = train_run(build(options))
    return {
        "history": [(h["loss"], h.get("aux_loss")) for h in run.history],
        "checkpoint": run.checkpoint,
        "params": full_parameters(run.model) if world_size == 1 else None,
    }


def under_ddp(rank, world_size, *, ignore_experts):
    """A forward of an expert-split model wrapped in torch DDP by hand (which has just broadcast
    rank 0's experts over rank 1's); with `ignore_experts` DDP was told to leave the expert
    weights alone (the caller's job then): it runs, returning whether rank 1 kept its own."""
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(build("qwen3_moe"))
    ringattn.hf.parallelize(model, expert_group=dist.group.WORLD)
    experts = [(n, p) for n, p in model.named_parameters() if "experts" in n]
    before = experts[0][1].detach().clone()
    if ignore_experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, _ in experts]
        )
    wrapped = DistributedDataParallel(model)
    wrapped(**ringattn.hf.shard_batch(data("dense")))
    return torch.equal(experts[0][1], before)
