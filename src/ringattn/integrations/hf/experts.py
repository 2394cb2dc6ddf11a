"""Expert parallelism: each MoE layer's experts split over `expert_group`, tokens sent to them.

transformers' MoE blocks (Mixtral, Qwen3-MoE, gpt-oss and their copies) route with their own
router and then call one experts module, `experts(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)`, whose parameters are 3-D tensors with the expert first
(`gate_up_proj`, `down_proj`, gpt-oss's biases). Sharding keeps that module and its parameter
names and cuts the expert dim: rank r of an EP group of size P holds experts [r E/P, (r+1) E/P)
and sets `num_experts = E/P`. Two public hooks do the rest; the router, the block and the
experts' own forward (whichever transformers experts implementation is configured) are untouched:

    pre-hook   the T x k (token, expert) pairs, sorted by expert, so rank d's pairs are one run;
               counts to every rank (exchange_counts), then each pair's hidden row, its router
               weight and its expert's local id (exchange_rows): the module runs on the rows it
               received, each with its one expert (k = 1), the weight applied as in one process
    hook       the results go back the same way (the counts swapped) and each token sums its k
               rows: out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t])

No token is dropped, however unevenly the router sends them. Backward is the same two exchanges
reversed (comm/rows.py). Shared experts (plain MLP modules) are not experts modules here and stay
replicated; the router's load-balancing loss still sees every routing decision (moe.py).

Data parallelism must know which ranks hold the same experts (train --hf: FSDP2 over them,
train/hf/experts.py). DDP takes every rank's weights for copies of one model: it broadcasts rank
0's slice over the others' and averages the gradients of different experts. The pre-hook refuses
to run inside a DDP forward that synchronises this module's weights (`_refuse_ddp`), on every
rank, before any step; ringattn.hf's Trainer refuses such a model in its constructor.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ringattn.comm import GroupInfo, exchange_counts, exchange_rows, group_cache, resolve_group

__all__ = ["EXPERTS_ATTR", "ExpertShard", "check_ep", "experts_modules", "shard_experts",
           "split_experts"]  # fmt: skip

EXPERTS_ATTR = "ringattn_experts"


@dataclass
class ExpertShard:
    """One experts module's part: experts [start, start + local) of `total`, over `info`."""

    info: GroupInfo
    start: int
    local: int
    total: int
    pending: tuple | None = None  # the pre-hook's routing, for the hook of the same call
    ddp_checked: int | None = None  # id of the DDP wrapper found not to synchronise this module

    def __deepcopy__(self, memo: dict) -> ExpertShard:
        return ExpertShard(self.info, self.start, self.local, self.total)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every transformers experts module: an int `num_experts` and only
    parameters whose first dim is that many experts (shared experts and dense MLPs are not)."""
    found = []
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if not isinstance(count, int) or not any(p.dim() == 3 for p in params):
            continue  # a router has num_experts too, but a 2-D weight
        if all(p.dim() >= 2 and p.shape[0] == count for p in params):
            found.append((name, module))
    return found


def shard_experts(model: torch.nn.Module, expert_group: object) -> int:
    """Split every experts module of `model` over `expert_group`, in place; returns how many.

    Every rank checks first (no communication): the model has experts modules, none is already
    sharded, each expert count is divisible by the group's size.
    """
    info = resolve_group(expert_group)
    found = experts_modules(model)
    if not found:
        raise ValueError(
            f"expert_group given but {type(model).__name__} has no MoE experts module (3-D "
            f"expert weights such as Mixtral's, Qwen3-MoE's or gpt-oss's); pass expert_group=None"
        )
    for name, module in found:
        if getattr(module, EXPERTS_ATTR, None) is not None:
            raise ValueError(
                f"{name} is already split over an expert group; parallelize a fresh copy of the "
                f"model to change expert_group"
            )
        if module.num_experts % info.world_size:
            raise ValueError(
                f"{name} has {module.num_experts} experts, not divisible by the expert group's "
                f"{info.world_size} ranks; use an expert-parallel degree that divides "
                f"{module.num_experts}"
            )
    for _, module in found:
        local = module.num_experts // info.world_size
        start = info.rank * local
        for pname, p in list(module.named_parameters(recurse=False)):
            part = torch.nn.Parameter(p.detach()[start : start + local].clone(), p.requires_grad)
            setattr(module, pname, part)
        setattr(module, EXPERTS_ATTR, ExpertShard(info, start, local, module.num_experts))
        module.num_experts = local
        module.register_forward_pre_hook(_dispatch, with_kwargs=True)
        module.register_forward_hook(_combine)
    return len(found)


def check_ep(ep: int, config: object) -> None:
    """--ep > 1 against the model's experts (the flags' own rules are their command's)."""
    if ep == 1:
        return
    experts = _expert_count(config)
    if experts is None:
        raise ValueError(
            f"--ep {ep}: the model ({getattr(config, 'model_type', '?')}) has no MoE experts to "
            f"split; drop --ep"
        )
    if experts % ep:
        raise ValueError(
            f"--ep {ep} does not divide the model's {experts} experts; use a divisor of {experts}"
        )


def _expert_count(config: object) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(text, name, None):
            return int(getattr(text, name))
    return None


def split_experts(model: torch.nn.Module, ep: int, device: torch.device) -> object:
    """`--ep` of generate and serve: the experts of `model` over blocks of `ep` consecutive ranks
    of the default group (a ("edp", "ep") mesh; collective); returns the "ep" mesh, None for 1.
    Every rank runs every decode step's forward, so every block dispatches in step."""
    if ep == 1:
        return None
    import torch.distributed as dist

    world = dist.get_world_size()
    mesh = group_cache.device_mesh(device.type, (world // ep, ep), ("edp", "ep"))
    shard_experts(model, mesh["ep"])
    return mesh["ep"]


def _routing(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """(hidden, top_k_index, top_k_weights) whatever the module names its arguments."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    values = list(bound.arguments.values())
    if len(values) != 3 or any(v is None for v in values):
        raise ValueError(
            f"{type(module).__name__}: expected experts(hidden, top_k_index, top_k_weights), got "
            f"{len(values)} arguments; expert parallelism supports transformers' experts modules"
        )
    return values


def _refuse_ddp(module: torch.nn.Module, shard: ExpertShard) -> None:
    """ValueError when a DDP forward that synchronises this module's weights is running
    (checked once per wrapper; DDP ignores the weights it was told to: `_ddp_ignored`)."""
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if active is None or shard.info.world_size == 1 or shard.ddp_checked == id(active):
        return
    synced = {id(p) for p in getattr(active, "_module_parameters", ())}
    if any(id(p) in synced for p in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} holds experts [{shard.start}, {shard.start + shard.local})"
            f" of {shard.total} (parallelize(expert_group=...) over {shard.info.world_size} "
            f"ranks) but runs inside torch DDP, which broadcast rank 0's experts over every "
            f"rank's and would average the gradients of different experts; wrap the model without "
            f"expert_group (every rank holds every expert), or train expert parallelism with "
            f"`ringattn train --hf DIR --ep E` (FSDP2 over the ranks holding the same experts)"
        )
    shard.ddp_checked = id(active)


def _dispatch(module: torch.nn.Module, args: tuple, kwargs: dict):
    shard: ExpertShard = getattr(module, EXPERTS_ATTR)
    _refuse_ddp(module, shard)
    hidden, index, weights = _routing(module, args, kwargs)
    tokens, k = index.shape
    expert = index.reshape(-1)  # (T k,) pair p = (token p // k, its (p % k)-th expert)
    order = torch.argsort(expert, stable=True)
    token = torch.div(order, k, rounding_mode="floor")  # (T k,) sorted by expert
    owner = expert[order] // shard.local
    send = torch.bincount(owner, minlength=shard.info.world_size).tolist()
    recv = exchange_counts(send, shard.info)
    ids = (expert[order] % shard.local).to(torch.int64)
    rows, pair_weights, local_ids = exchange_rows(
        [hidden[token], weights.reshape(-1)[order], ids], send, recv, shard.info
    )
    shard.pending = (token, tokens, send, recv, rows)
    return (rows, local_ids[:, None], pair_weights[:, None]), {}


def _combine(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    shard: ExpertShard = getattr(module, EXPERTS_ATTR)
    token, tokens, send, recv, rows = shard.pending
    shard.pending = None
    # a rank that received no rows has an expert output without grad: keep the node anyway
    trainable = (p for p in module.parameters() if p.requires_grad)
    anchor = rows if rows.requires_grad else next(trainable, None)
    (back,) = exchange_rows([output], recv, send, shard.info, anchor=anchor)  # (T k, H)
    combined = torch.zeros(tokens, back.shape[-1], dtype=output.dtype, device=output.device)
    return combined.index_add(0, token, back)  # (T, H): each token's k weighted expert rows
