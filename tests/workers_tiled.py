"""Rank functions and helpers for tests/test_tiled_mlp.py: tiled MLP against untiled.

`family_case` builds a family's tiny model (the family survey's, scripts/tools/family_survey.py)
in float64, runs one forward and backward of the whole batch untiled and tiled (tiles that do not
divide the rows), and returns the largest relative differences. `decoder_case` and `hf_cp_case`
do the same for our decoder and a transformers model at CP = W, three SGD steps each.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "tools")
)

import family_survey as survey

from ringattn.integrations.hf.levers.tiled import FEED_FORWARD_NAMES, TILE_ATTR, install_tiled_mlp


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |got - ref| over a tensor's largest |ref| entry, and that tensor's name."""
    assert ref.keys() == got.keys(), sorted(set(ref) ^ set(got))
    worst, name = 0.0, ""
    for key, want in ref.items():
        err = float((got[key] - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if err > worst:
            worst, name = err, key
    return worst, name


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Each decoder layer's feed-forward child (an MLP, or an MoE block with its router): by
    name, or (Nemotron-H's `mixer`) as the child holding a tiled module."""
    names = set(model._no_split_modules)
    return [(f"{n}.{c}", child) for n, layer in model.named_modules()
            if type(layer).__name__ in names
            for c, child in layer.named_children()
            if c in FEED_FORWARD_NAMES
            or any(getattr(m, TILE_ATTR, 0) for m in child.modules())]  # fmt: skip


def family_case(model_type: str, tile: int = 5, rows: int = 37) -> dict:
    """Every feed-forward unit of `model_type`'s tiny model in float64 (eager experts) on random
    rows, untiled and tiled: forward and backward against a random output gradient."""
    model = survey.build(model_type)
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm has no float64
    model = model.double()
    tiled = copy.deepcopy(model)
    install_tiled_mlp(tiled, tile)
    hidden = model.config.get_text_config().hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, rows, hidden, generator=gen, dtype=torch.float64)
    classes, loss_rel, grad_rel, grad_name = set(), 0.0, 0.0, ""
    for name, tiled_unit in _units(tiled):
        unit = model.get_submodule(name)
        classes |= {type(m).__name__ for m in tiled_unit.modules() if getattr(m, TILE_ATTR, 0)}
        outs, grads = [], []
        for m in (unit, tiled_unit):
            xin = x.clone().requires_grad_()
            out = m(xin)
            out = out[0] if isinstance(out, tuple) else out
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                               dtype=out.dtype)  # fmt: skip
            (out * dout).sum().backward()
            outs.append(out.detach())
            grads.append(
                {
                    "input": xin.grad,
                    **{
                        f"{name}.{n}": p.grad for n, p in m.named_parameters() if p.grad is not None
                    },
                }
            )
        loss_rel = max(loss_rel, relative({"out": outs[0]}, {"out": outs[1]})[0])
        err, which = relative(*grads)
        if err >= grad_rel:
            grad_rel, grad_name = err, which
    return {"classes": sorted(classes), "out_rel": loss_rel, "grad_rel": grad_rel,
            "grad_name": grad_name}  # fmt: skip


def _sgd_steps(models: list[torch.nn.Module], loss_of, group, steps: int, lr: float = 0.5):
    """`steps` SGD steps of each model on the same batches: per step, [(loss, grads)] of each
    (the loss and gradients summed over `group`, as the single-device ones)."""
    import torch.distributed as dist

    rows = []
    for _ in range(steps):
        row = []
        for model in models:
            model.zero_grad(set_to_none=True)
            loss = loss_of(model)
            loss.backward()
            grads = _grads(model)
            flat = torch.cat([g.flatten() for g in grads.values()] + [loss.detach().reshape(1)])
            dist.all_reduce(flat, group=group)
            offset = 0
            for name, g in grads.items():
                grads[name] = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in grads:
                        p -= lr * grads[name]
            row.append((float(flat[-1]), grads))
        rows.append(row)
    return rows


def _compare_steps(rows: list) -> list[dict]:
    out = []
    for (ref_loss, ref), (loss, got) in rows:
        grad, name = relative(ref, got)
        out.append({"loss": ref_loss, "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                    "grad_rel": grad, "grad_name": name})  # fmt: skip
    return out


def decoder_case(rank: int, world_size: int, *, tile: int, checkpoint: bool,
                 seq_len: int = 96, steps: int = 3) -> list[dict]:  # fmt: skip
    """Our decoder at CP = world_size (zigzag), float32, untiled and tiled, `steps` SGD steps."""
    import torch.distributed as dist

    import ringattn
    from ringattn.models import IGNORE, Transformer, model_config, set_context_parallel
    from ringattn.models.decoder import set_tiled_mlp

    group = dist.group.WORLD
    torch.manual_seed(0)
    model = Transformer(model_config("tiny"))
    tiled = copy.deepcopy(model)
    set_tiled_mlp(tiled, tile)
    for m in (model, tiled):
        set_context_parallel(m, group, layout="zigzag")
        m.checkpoint_blocks = checkpoint
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, seq_len), generator=gen)
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
    count = int((labels != IGNORE).sum())
    local = ringattn.shard(tokens, 1, group=group)
    local_labels = ringattn.shard(labels, 1, group=group)
    positions = ringattn.positions(seq_len, group=group)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(local, positions, local_labels)[0] / count

    return _compare_steps(_sgd_steps([model, tiled], loss_of, group, steps))


def hf_case(rank: int, world_size: int, *, model_type: str, tile: int, steps: int = 3,
            checkpoint: bool = False) -> list[dict]:  # fmt: skip
    """A transformers family's tiny model at CP = world_size (ringattn.hf, zigzag), float64
    (eager experts: grouped_mm has no float64), untiled and tiled (`tile` tokens), `steps` SGD
    steps on one packed batch."""
    import torch.distributed as dist

    import ringattn.hf

    group = dist.group.WORLD
    model = survey.build(model_type)
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    model = model.double()
    tiled = copy.deepcopy(model)
    ringattn.hf.parallelize(model, group)
    ringattn.hf.parallelize(tiled, group, tiled_mlp=tile)
    if checkpoint:
        for m in (model, tiled):
            m.gradient_checkpointing_enable({"use_reentrant": False})
    batch = ringattn.hf.shard_batch(survey.data(model, "packed"), group=group)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(**batch).loss

    return _compare_steps(_sgd_steps([model, tiled], loss_of, group, steps, lr=0.1))
