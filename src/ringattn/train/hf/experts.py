"""`train --hf DIR --ep E`: each MoE layer's experts over blocks of E ranks, FSDP2 over the rest.

    world of W = dp x cp ranks (rank = dp_rank cp + cp_rank), split into W / E expert blocks of E
    consecutive ranks: with E % cp == 0 a block is whole cp rows (torchtitan's rule: EP borrows
    all of cp and part of dp), so each block's tokens dispatch inside it.

              cp 0  cp 1                       expert mesh ("ep", "edp"), rank = edp E + ep:
        dp 0  r0    r1     ep 2: blocks {r0 r1} {r2 r3}, experts [0, E/2) on r0 and r2
        dp 1  r2    r3     ep 4: one block, expert quarter q on rank q

- Expert weights: rank ep_idx of a block keeps experts [ep_idx E_total/E, ...) (integrations/hf/
  experts.py) and FSDP2 shards that slice again over "edp", the ranks holding the same experts;
  its reduce-scatter sums their gradients (divide factor 1, as for the rest). Every element of
  every parameter then lives on exactly one rank: the gradient norm is one all-reduce of the
  local squares over the world (`clip_grad_norm_`).
- Checkpoints stay resharding: an expert tensor is saved as a DTensor of the whole expert dim,
  Shard(0) over ("ep", "edp") (`checkpoint_view`), so a run at any --ep (1 included) resumes it,
  and --export's one-process DCP load gets the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ringattn.comm import group_cache
from ringattn.integrations.hf.experts import experts_modules, shard_experts

__all__ = ["ExpertParallel", "expert_parallel"]


class ExpertParallel:
    """The expert mesh of one run and what the trainer needs from it (see the module docstring)."""

    def __init__(self, ep: int, device: torch.device) -> None:
        world = dist.get_world_size()
        ranks = torch.arange(world, device="cpu").view(world // ep, ep).t()  # (ep, edp)
        self.mesh = group_cache.device_mesh(
            device.type, (ep, world // ep), ("ep", "edp"), ranks=ranks
        )  # made once per process
        self.ep = ep
        self.names: set[str] = set()

    def shard(self, model: nn.Module, policy: object) -> None:
        """Split the experts of `model` (a CausalLMLoss) over "ep", FSDP2 over "edp"."""
        from torch.distributed.fsdp import fully_shard

        shard_experts(model.model, self.mesh["ep"].get_group())
        for name, module in experts_modules(model):
            self.names.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
            fully_shard(module, mesh=self.mesh["edp"], mp_policy=policy)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the norm of the whole gradient: each element is on one rank."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        device = local[0].device if local else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        for g in local:
            squares += g.detach().float().pow(2).sum()
        dist.all_reduce(squares)
        norm = squares.sqrt()[0]
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
        for g in local:
            g.mul_(scale.to(g.dtype))
        return norm

    def checkpoint_view(self, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
        """The state dicts with each expert tensor (and its optimizer states) as a DTensor of the
        whole expert dim over ("ep", "edp"), sharing the storage: DCP saves and loads the global
        tensor, so any --ep reads it."""
        model_view = {k: self._whole(v) if k in self.names else v for k, v in model_state.items()}
        states = dict(optim_state.get("state", {}))
        for name in self.names & states.keys():
            states[name] = {k: self._whole(v) for k, v in states[name].items()}
        return model_view, {**optim_state, "state": states}

    def _whole(self, value: object) -> object:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(value, DTensor) or value.dim() == 0:
            return value
        shape = (value.shape[0] * self.ep, *value.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            value.to_local(), self.mesh, [Shard(0), Shard(0)], run_check=False, shape=shape,
            stride=stride,
        )  # fmt: skip


def expert_parallel(model: nn.Module, ep: int, device: torch.device, policy: object) -> None:
    """--ep > 1: shard `model`'s experts (before the blocks' FSDP2) and give the model the
    trainer's two seams, `clip_grad_norm_` (train/step.py) and `checkpoint_view`
    (runtime/checkpoint/)."""
    parallel = ExpertParallel(ep, device)
    parallel.shard(model, policy)
    model.clip_grad_norm_ = lambda max_norm: parallel.clip_grad_norm_(model, max_norm)
    model.checkpoint_view = parallel.checkpoint_view
