"""Worker functions for tests/test_train_4d.py, run on every rank of a WorkerPool (harness.py)."""

from __future__ import annotations

import torch

from ringattn.train.loop import train as train_run
from workers_train import build

CPU = torch.device("cpu")


def sharding(rank: int, world_size: int, options: dict) -> dict:
    """How the run's parameters are laid out on this rank: mesh degrees and coordinates, each
    parameter's local shape and its placements (names of the DTensor placements, or None)."""
    run = build(options)
    mesh = run.mesh
    params = {}
    for name, p in run.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        placements = [type(x).__name__ for x in p.placements] if hasattr(p, "placements") else None
        params[name] = (tuple(local.shape), tuple(p.shape), placements)
    return {
        "degrees": (mesh.pp, mesh.dp, mesh.cp, mesh.tp),
        "coords": (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank),
        "mesh_dims": tuple(mesh.device_mesh.mesh_dim_names),
        "params": params,
    }


def train_all_parameters(rank: int, world_size: int, options: dict) -> dict:
    """Train with TrainConfig(**options); rank 0's losses, and from EVERY rank the parameters it
    holds, whole (FSDP and TP shards gathered): under pp each rank holds only its stage's."""
    run = train_run(build(options))  # optimizer="sgd": weights exact by construction
    params = {}
    for name, p in run.model.named_parameters():
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    mesh = run.mesh
    return {"losses": [h["loss"] for h in run.history], "start_step": run.start_step,
            "params": params, "degrees": (mesh.pp, mesh.dp, mesh.cp, mesh.tp)}  # fmt: skip
