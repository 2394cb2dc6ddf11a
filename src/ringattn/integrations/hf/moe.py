"""The MoE router load-balancing loss over the whole sequence, not over one rank's shard.

With `output_router_logits=True`, transformers' MoE causal LMs (Mixtral, Qwen3-MoE, gpt-oss and
their copies) add `coef * aux` to `out.loss`, the Switch-Transformer loss over the router logits
of the tokens the model saw:

    aux = E * sum_e f_e * P_e      f_e = (top-k picks of expert e) / rows
                                   P_e = (sum of the router probabilities p_e) / rows
                                   summed over every MoE layer, rows = layers x tokens

Neither f nor P is a sum of per-rank terms, so under CP each rank's own aux (over its shard,
padding rows included) does not add up to the single-device one. Here the counts, probability
sums and row counts are summed over the group first, padding rows excluded:

    rank r:  stats_r = [counts (E), prob sums (E), rows]     over this rank's real rows
    stats  = all_reduce(stats_r)                              torch.distributed.nn.functional:
                                                              its backward is an all-reduce too
    aux    = E * sum(stats.counts / rows * stats.probs / rows)   the same value on every rank
    loss_r = out.loss - coef * aux_r(transformers) + coef * aux / W

so the losses summed over the W ranks are the single-device `out.loss`, and the summed gradients
its gradients (each rank's aux/W term sends coef/W back through the all-reduce, which sums it).
`out.aux_loss` becomes the global aux on every rank.

All through public seams: a forward hook on the model (`register_forward_hook`, with its
keyword arguments) reads `out.router_logits` and the document bounds `shard_batch` passed; no
transformers function is replaced. The hook also recomputes transformers' local aux from the same
logits; a model whose aux is not this formula (a different router loss) gets a ValueError on
every rank (the mismatch flag rides in the same all-reduce), never a silently wrong loss.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ringattn
from ringattn.comm import resolve_group
from ringattn.integrations.hf.attention import CONTEXT_ATTR

ROUTER_ATTR = "ringattn_router"
_SKIP_ATTR = "ringattn_kv_state"  # generate.py's per-call state: decoding needs no router loss


@dataclass(frozen=True)
class RouterLoss:
    """What the hook needs: the experts, the coefficient, and the group the statistics span."""

    num_experts: int
    top_k: int
    coef: float
    group: object
    """The ranks whose tokens the statistics are taken over (the CP group, or dp x cp)."""

    def __deepcopy__(self, memo: dict) -> RouterLoss:
        return self  # holds a process group, which cannot be copied


def router_settings(model: torch.nn.Module) -> tuple[int, int, float] | None:
    """(experts, experts per token, aux coefficient) of a transformers MoE model, else None."""
    config = model.config.get_text_config()
    experts = getattr(model, "num_experts", None)
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = experts or getattr(config, name, None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", 0)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if not experts or not top_k or coef is None:
        return None
    return int(experts), int(top_k), float(coef)


def install(model: torch.nn.Module, router_group: object) -> bool:
    """Put the router-loss hook on `model` (a MoE causal LM); False when it has no router loss."""
    settings = router_settings(model)
    if settings is None:
        return False
    setattr(model, ROUTER_ATTR, RouterLoss(*settings, router_group))
    if not getattr(model, "_ringattn_router_hooked", False):
        model.register_forward_hook(_hook, with_kwargs=True)
        model._ringattn_router_hooked = True
    return True


def real_rows(bounds: torch.Tensor, context: object, device: torch.device) -> torch.Tensor:
    """(S_local,) bool: the rows of this rank's shard that are tokens, not layout padding."""
    index = ringattn.positions(
        int(bounds[-1]), group=context.group, layout=context.layout, cu_seqlens=bounds
    )
    return (index >= 0).to(device)


def _stats(router_logits, rows: torch.Tensor, experts: int, top_k: int) -> torch.Tensor:
    """[top-k counts (E), probability sums (E), rows] over the rows where `rows` is True."""
    weight = rows.to(torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    probs = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    for logits in router_logits:
        p = F.softmax(logits.to(weight.device), dim=-1)  # (rows, E), the logits' dtype as in HF
        picks = F.one_hot(torch.topk(p, top_k, dim=-1).indices, experts).sum(1)  # (rows, E)
        counts = counts + (picks.to(torch.float32) * weight[:, None]).sum(0)
        probs = probs + (p.float() * weight[:, None]).sum(0)
    total = weight.sum() * len(router_logits)
    return torch.cat([counts, probs, total.reshape(1)])


def _aux(stats: torch.Tensor, experts: int) -> torch.Tensor:
    counts, probs, rows = stats[:experts], stats[experts : 2 * experts], stats[-1].clamp(min=1)
    return experts * torch.sum((counts / rows) * (probs / rows))


def _hook(module, args, kwargs, output):
    if getattr(module, _SKIP_ATTR, None) is not None:
        return None
    aux_local = getattr(output, "aux_loss", None)
    router_logits = getattr(output, "router_logits", None)
    if aux_local is None or not router_logits:
        wanted = kwargs.get("output_router_logits", module.config.output_router_logits)
        if isinstance(output, tuple) and wanted:
            raise ValueError(
                f"{type(module).__name__}: return_dict=False with the router loss; ringattn.hf "
                f"corrects out.aux_loss on the model's output object: call with return_dict=True"
            )
        return None
    router: RouterLoss = getattr(module, ROUTER_ATTR)
    context = getattr(module, CONTEXT_ATTR)
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise ValueError(
            f"{type(module).__name__}: the batch has no cu_seq_lens_q; build it with "
            f"ringattn.hf.shard_batch (the same group and layout as parallelize)"
        )
    device = router_logits[0].device
    real = real_rows(bounds, context, device)
    mine = _stats(router_logits, real, router.num_experts, router.top_k)
    padding = _stats(router_logits, ~real, router.num_experts, router.top_k).detach()
    as_hf = _aux(mine.detach() + padding, router.num_experts)  # what transformers computed here
    same = torch.isclose(as_hf, aux_local.detach().float(), rtol=1e-3, atol=1e-6)
    flag = (~same).to(torch.float32).reshape(1)
    info = resolve_group(router.group)
    stats = torch.cat([mine, flag])
    if info.world_size > 1:
        from torch.distributed.nn.functional import all_reduce

        with warnings.catch_warnings():  # "deprecated": its replacement has no autograd here
            warnings.simplefilter("ignore", FutureWarning)
            stats = all_reduce(stats, group=info.group)  # backward: all-reduce of the grads
    if float(stats[-1].detach()) > 0:
        raise ValueError(
            f"{type(module).__name__}: its router auxiliary loss (out.aux_loss) is not the "
            f"Switch-Transformer load-balancing loss E * sum_e f_e * P_e over top-"
            f"{router.top_k} routing that ringattn.hf recomputes over the whole sequence, so it "
            f"would be wrong under context parallelism; set config.output_router_logits=False "
            f"(or router_aux_loss_coef=0) and add your own router loss"
        )
    aux = _aux(stats[:-1], router.num_experts)
    if output.loss is not None:
        # transformers added coef * aux_local; replace it by this rank's share of the global aux
        output.loss = output.loss - router.coef * aux_local + router.coef * aux / info.world_size
    output.aux_loss = aux
    return output


def aux_share(model: torch.nn.Module, output: object) -> torch.Tensor | None:
    """This rank's share of `coef * aux` (summed over the router group: the whole term), or None
    when the output carries no router loss. For trainers that compute the token loss themselves.
    """
    router: RouterLoss | None = getattr(model, ROUTER_ATTR, None)
    aux = getattr(output, "aux_loss", None)
    if router is None or aux is None:
        return None
    return router.coef * aux / resolve_group(router.group).world_size


__all__ = ["ROUTER_ATTR", "RouterLoss", "aux_share", "install", "real_rows", "router_settings"]
